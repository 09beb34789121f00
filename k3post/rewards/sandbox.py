"""Running untrusted Python (code written by the model) without letting it touch the host.

`run_python(code, limits)` writes the code into a fresh temporary directory and starts

    sys.executable -I -S -B  k3post/rewards/_jail.py  <config>     (the launcher, trusted)
      └─ python -I -S -B -u main.py                                  (the untrusted program)

-I (isolated: ignore PYTHON* variables, no user site, the script's directory not on sys.path)
and -S (no site: no site-packages, so only the standard library is importable) keep the
interpreter from reading anything the host configured; -B writes no bytecode.

What is enforced, and where (docs/rewards.md has the table per attack):

- parent (this module): a scrubbed environment (PATH, LANG, HOME only — no secrets inherited);
  stdin is /dev/null; stdout and stderr captured through pipes and capped at
  `max_output_bytes` each (the job is killed on overflow); a wall-clock deadline; a new session,
  so the whole process group can be SIGKILLed at once; the directory deleted afterwards.
- launcher (_jail.py, as root): network, mount and PID namespaces, read-only host filesystem,
  private tmpfs scratch, hidden /root, /home and /run, a fresh unprivileged uid, no_new_privs,
  parent-death signals.
- rlimits in the program's process (inherited by its children): RLIMIT_CPU (CPU seconds),
  RLIMIT_AS (address space), RLIMIT_NPROC (processes and threads of its uid), RLIMIT_FSIZE
  (largest file it may write), RLIMIT_NOFILE (open descriptors), RLIMIT_CORE = 0.

Not root, or a kernel without namespaces: the job still runs with rlimits, the scrubbed
environment, the session kill and a temporary cwd, and the `isolation` flags of the result
say what was missing (`network_isolated` is one of them).
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

JAIL = Path(__file__).with_name("_jail.py")
PROGRAM = "main.py"
ISOLATION_KEYS = ("network", "filesystem", "pid", "uid", "ipc")
# Each run gets its own uid from this range (not in /etc/passwd): its processes are counted
# against its own RLIMIT_NPROC and it cannot signal, ptrace or read the files of another run.
SANDBOX_UIDS = range(1_000_000, 2_000_000)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run; the defaults suit unit-test-sized programs."""

    timeout_s: float = 5.0  # wall clock, enforced by the parent
    cpu_s: int | None = None  # RLIMIT_CPU; default: the wall timeout rounded up, + 1
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC (processes + threads of the sandbox's uid)
    max_file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 2**10  # per stream; more is killed with reason "output_limit"
    scratch_bytes: int = 32 * 2**20  # size of each private tmpfs (work dir, /tmp, ...)

    def rlimits(self) -> dict[str, int]:
        cpu_s = self.cpu_s if self.cpu_s is not None else int(self.timeout_s) + 2
        return {
            "RLIMIT_CPU": cpu_s,
            "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_FSIZE": self.max_file_bytes,
            "RLIMIT_NOFILE": self.max_open_files,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class SandboxResult:
    """ok: exited 0 by itself in time. exit_code: the program's status (−N: killed by signal N;
    None if it never ran). killed_reason: "timeout" | "output_limit" | None. isolation: which
    jail layers were in force (network, filesystem, pid, uid, ipc)."""

    ok: bool
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    killed_reason: str | None
    network_isolated: bool
    wall_s: float
    isolation: dict[str, bool] = field(default_factory=dict)


def _minimal_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}


def _config(workdir: str, status_fd: int, limits: SandboxLimits, isolate: bool) -> dict:
    python = os.path.realpath(sys.executable)  # the base interpreter, not a venv's symlink
    prefix = os.path.realpath(sys.base_prefix)
    return {
        "workdir": workdir,
        "program": PROGRAM,
        "status_fd": status_fd,
        "parent_pid": os.getpid(),
        "isolate": isolate,
        "python": python,
        "expose": sorted({prefix, os.path.dirname(os.path.dirname(python))}),
        "uid": SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))],
        "limits": limits.rlimits(),
        "scratch_bytes": limits.scratch_bytes,
        "env": _minimal_env(workdir),
    }


def _exited(pid: int) -> bool:
    """True once `pid` has exited, without reaping it (its pid then cannot be reused yet)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, bytes, str | None]:
    """Read both pipes until EOF, the deadline or an overflow; returns (stdout, stderr, reason)."""
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + limits.timeout_s
    selector = selectors.DefaultSelector()
    for stream in buffers:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    reason = None
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = "timeout"
                break
            for key, _ in selector.select(timeout=min(remaining, 0.05)):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer.extend(chunk[: limits.max_output_bytes + 1 - len(buffer)])
                if len(buffer) > limits.max_output_bytes:
                    reason = "output_limit"
            if reason:
                break
            if _exited(proc.pid):
                # A descendant that escaped the group could hold the pipes open forever.
                deadline = min(deadline, time.monotonic() + 0.2)
    finally:
        selector.close()
    cap = limits.max_output_bytes
    return bytes(buffers[proc.stdout][:cap]), bytes(buffers[proc.stderr][:cap]), reason


def _read_status(fd: int) -> dict:
    """The jail's one-line JSON report of the layers it set up (all False if it never wrote)."""
    os.set_blocking(fd, False)
    try:
        line = os.read(fd, 4096).decode(errors="replace").strip()
    except BlockingIOError:
        line = ""
    try:
        status = json.loads(line) if line else {}
    except json.JSONDecodeError:
        status = {}
    return {key: bool(status.get(key)) for key in ISOLATION_KEYS}


def run_python(code: str, limits: SandboxLimits | None = None, isolate: bool = True) -> SandboxResult:
    """Run `code` as a Python program in the sandbox and report what happened; never raises for
    anything the program does. `isolate=False` skips the namespaces and the uid switch (tests)."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="k3post-sandbox-")
    status_read, status_write = os.pipe()
    start = time.monotonic()
    try:
        program = Path(workdir, PROGRAM)
        program.write_text(code, encoding="utf-8")
        program.chmod(0o644)
        config = _config(workdir, status_write, limits, isolate)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(JAIL), json.dumps(config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_minimal_env(workdir), cwd=workdir, start_new_session=True, pass_fds=(status_write,),
        )
        os.close(status_write)  # only the jail writes it; EOF once the jail's copies are gone
        status_write = -1
        stdout, stderr, reason = _supervise(proc, limits, start)
        isolation = _read_status(status_read)
    finally:
        for fd in (status_read, status_write):
            if fd >= 0:
                _close_quietly(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    return SandboxResult(
        ok=reason is None and proc.returncode == 0,
        exit_code=proc.returncode,
        timed_out=reason == "timeout",
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        killed_reason=reason,
        network_isolated=isolation["network"],
        wall_s=time.monotonic() - start,
        isolation=isolation,
    )


def _supervise(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[bytes, bytes, str | None]:
    """Collect the output, then make sure nothing of the job survives; returns (out, err, reason)."""
    try:
        stdout, stderr, reason = _collect(proc, limits)
        if reason is None:
            # Pipes closed; give the launcher a moment to report the program's exit status
            # before the group kill below would overwrite it with SIGKILL.
            grace_end = time.monotonic() + 0.5
            while not _exited(proc.pid) and time.monotonic() < grace_end:
                time.sleep(0.002)
    finally:
        # The session leader is not reaped yet, so its pid (= the group id) is still ours: no
        # risk of signalling an unrelated group that reused the number.
        _kill_group(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return stdout, stderr, reason


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # everybody already gone
