"""Running untrusted Python (code written by the model) without letting it touch the host.

`run_python(code, limits)` runs a program; `run_tests(solution, tests, limits)` runs assert-style
tests against a solution with the verdict computed out of the solution's reach. Both start

    sys.executable -I -S -B  k3post/rewards/_jail.py  <config>    (the launcher, trusted)
      └─ PID 1 of the run's PID namespace (trusted)
           └─ python main.py  |  judge + candidate (_jail_harness.py), each with its own uid

-I (isolated: ignore PYTHON* variables, no user site, the script's directory not on sys.path)
and -S (no site: only the standard library is importable) keep the interpreter from reading
anything the host configured; -B writes no bytecode.

What is enforced, and where (docs/rewards.md has the threat model and the table per attack):

- parent (this module): a per-run cgroup (sandbox_cgroup.py: memory, pids, cgroup.kill) where the
  host allows; a scrubbed environment (PATH, LANG, HOME only); stdin /dev/null; stdout and stderr
  captured through pipes and capped at `max_output_bytes` each; a wall-clock deadline; at the end
  cgroup.kill, SIGKILL through a pidfd of the run's PID 1 (its exit tears the namespace down) and of
  the launcher's process group, then a wait until the run's cgroup is empty.
- launcher + PID 1 (_jail.py, as root): fresh session keyring, network, IPC, mount and PID
  namespaces, an allowlisted read-only view with one size- and inode-capped scratch tmpfs.
- each sandboxed process: rlimits (CPU, address space, processes, file size, descriptors, no
  core), a fresh unprivileged uid, no_new_privs, a seccomp filter (_jail_seccomp.py).

Not root (the shipped image): where the kernel allows unprivileged user namespaces the launcher
builds the same namespaces and view inside one (_jail_userns.py), so the PID-namespace kill, the
view and the capped scratch hold; what is missing is a uid per run (the job runs as the caller's
uid with no capabilities) and, unless the caller's cgroup is delegated to it, the run cgroup (the
seccomp filter then also denies memfds and System V memory, which no rlimit counts). Without user
namespaces too, the job still runs with rlimits, seccomp, the scrubbed environment, the kill of its
process group and a temporary cwd. `SandboxResult.jail` ("root", "userns", "none") names the mode
and the `isolation` flags say what was missing; `require_isolation` refuses to run the job
(SandboxIsolationError) where a layer it names is missing.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import marshal
import os
import py_compile
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3post.rewards.sandbox_cgroup import RunCgroup

log = logging.getLogger(__name__)

JAIL = Path(__file__).with_name("_jail.py")
PROGRAM = "main.py"
ISOLATION_KEYS = ("network", "filesystem", "pid", "uid", "ipc", "keyring", "seccomp", "cgroup")
CGROUP_KEYS = ("cgroup_kill", "cgroup_memory", "cgroup_pids")
# Each run gets its own uids from this range (not in /etc/passwd): its processes are counted
# against their own RLIMIT_NPROC and cannot signal, ptrace or read the files of another run.
SANDBOX_UIDS = range(1_000_000, 2_000_000)
MAX_VERDICT_BYTES = 2**20
LAUNCH = "import sys; sys.path.insert(0, sys.argv[1]); import _jail; _jail.main()"
# `require_isolation=True`: every process of the run dies with it, and it reaches no host file,
# socket, network, IPC object or keyring. Root has these; so has a non-root user where the kernel
# allows unprivileged user namespaces. Name more keys (e.g. "uid", "cgroup_memory") to require more.
STRICT = ("network", "filesystem", "pid", "ipc", "keyring", "seccomp")


class SandboxIsolationError(RuntimeError):
    """require_isolation named a layer this host cannot provide; the job was not started."""


_userns_unusable: str | None = None  # why the user-namespace jail failed here (then never tried again)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run; the defaults suit unit-test-sized programs."""

    timeout_s: float = 5.0  # wall clock, enforced by the parent
    cpu_s: int | None = None  # RLIMIT_CPU; default: the wall timeout rounded up, + 2
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS of each process
    max_processes: int = 16  # RLIMIT_NPROC (processes + threads of a sandbox uid)
    max_file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 64 * 2**10  # per stream; more is killed with reason "output_limit"
    scratch_bytes: int = 32 * 2**20  # the one tmpfs behind /tmp, /var/tmp, /dev/shm and the work dir
    scratch_inodes: int = 4096  # files + directories in that tmpfs
    run_memory_bytes: int | None = None  # cgroup memory of the whole run; default memory + scratch + 64 MiB

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

    def cgroup_memory(self) -> int:
        return self.run_memory_bytes or self.memory_bytes + self.scratch_bytes + 64 * 2**20


@dataclass(frozen=True)
class SandboxResult:
    """ok: exited 0 by itself in time. exit_code: the program's status (−N: killed by signal N;
    None if it never ran). killed_reason: "timeout" | "output_limit" | None. isolation: which
    layers were in force (ISOLATION_KEYS + CGROUP_KEYS). memory_peak_bytes: the run's cgroup
    peak where known. verdicts: run_tests only, the judge's lines. jail: how the namespaces were built."""

    ok: bool
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str
    killed_reason: str | None
    network_isolated: bool
    wall_s: float
    isolation: dict[str, bool] = field(default_factory=dict)
    memory_peak_bytes: int | None = None
    verdicts: tuple[str, ...] = ()
    jail: str = "none"  # "root" | "userns" (unprivileged user namespace) | "none" (rlimits + seccomp only)


def _minimal_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}


def _config(workdir: str, limits: SandboxLimits, isolate: bool, mode: str, control_fd: int,
            cgroup: RunCgroup, fds: dict[str, int], require: tuple[str, ...]) -> dict:
    python = os.path.realpath(sys.executable)  # the base interpreter, not a venv's symlink
    prefix = os.path.realpath(sys.base_prefix)
    uid, judge_uid = (SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))] for _ in range(2))
    if judge_uid == uid:
        judge_uid = SANDBOX_UIDS[(uid - SANDBOX_UIDS.start + 1) % len(SANDBOX_UIDS)]
    return {
        "mode": mode, "workdir": workdir, "root": workdir, "program": PROGRAM, "parent_pid": os.getpid(),
        "isolate": isolate, "python": python, "control_fd": control_fd, "fds": fds,
        "expose": sorted({prefix, os.path.dirname(os.path.dirname(python))}),
        "uid": uid, "judge_uid": judge_uid, "limits": limits.rlimits(), "scratch_bytes": limits.scratch_bytes,
        "scratch_inodes": limits.scratch_inodes, "env": _minimal_env(workdir), "cgroup_procs": cgroup.procs_files,
        "userns": _userns_unusable is None, "deny_uncounted_memory": not cgroup.flags["cgroup_memory"],
        "require": [key for key in require if key in ISOLATION_KEYS],
    }


def _exited(pid: int) -> bool:
    """True once `pid` has exited, without reaping it (its pid then cannot be reused yet)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


class _Run:
    """The parent's view of one run: pipes read until EOF, the deadline or an overflow."""

    def __init__(self, proc: subprocess.Popen, control: socket.socket, verdict_fd: int | None, limits: SandboxLimits):
        self.proc, self.control, self.limits = proc, control, limits
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.streams = {self.out_fd: bytearray(), self.err_fd: bytearray()}
        self.caps = {fd: limits.max_output_bytes for fd in self.streams}
        if verdict_fd is not None:
            self.streams[verdict_fd] = bytearray()
            self.caps[verdict_fd] = MAX_VERDICT_BYTES
        self.verdict_fd = verdict_fd
        self.status: dict = {}
        self.init_pidfd: int | None = None

    def _control(self) -> bool:
        """Status line + pidfd of PID 1 from the launcher; False at EOF."""
        try:
            data, fds, _, _ = socket.recv_fds(self.control, 4096, 1)
        except OSError:
            return False
        for fd in fds:
            if self.init_pidfd is None:
                self.init_pidfd = fd
            else:
                os.close(fd)
        if data:
            try:
                status = marshal.loads(data)  # from the trusted launcher, before any job code ran
            except (EOFError, ValueError, TypeError):
                status = {}
            self.status = status if type(status) is dict else {}
        return bool(data or fds)

    def collect(self) -> str | None:
        """Read everything until EOF; returns the kill reason ("timeout", "output_limit") or None."""
        deadline = time.monotonic() + self.limits.timeout_s
        selector = selectors.DefaultSelector()
        for fd in self.streams:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        selector.register(self.control, selectors.EVENT_READ)
        launcher_done = False
        try:
            while len(selector.get_map()) > (1 if self.control.fileno() in selector.get_map() else 0):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # After the launcher left, pipes still open belong to leftovers the kill ends.
                    return None if launcher_done else "timeout"
                for key, _ in selector.select(timeout=min(remaining, 0.05)):
                    if key.fileobj is self.control:
                        if not self._control():
                            selector.unregister(self.control)
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    buffer, cap = self.streams[key.fd], self.caps[key.fd]
                    buffer.extend(chunk[: cap + 1 - len(buffer)])
                    if len(buffer) > cap and key.fd != self.verdict_fd:
                        return "output_limit"
                if not launcher_done and _exited(self.proc.pid):
                    launcher_done = True
                    deadline = min(deadline, time.monotonic() + 0.2)
            if self.control.fileno() in selector.get_map() and not self.status:
                self._control()
            return None
        finally:
            selector.close()

    def output(self, fd: int) -> bytes:
        return bytes(self.streams[fd][: self.caps[fd]])


_compiled = False


def _compile_launcher() -> None:
    """Write the jail modules' bytecode once (the launcher runs with -B, and hosts often set
    PYTHONDONTWRITEBYTECODE): compiling them on every call would cost ~10 ms. Best effort."""
    global _compiled
    if not _compiled:
        for name in ("_jail.py", "_jail_harness.py", "_jail_seccomp.py", "_jail_userns.py"):
            source = str(JAIL.with_name(name))
            try:
                py_compile.compile(source, cfile=importlib.util.cache_from_source(source), doraise=True)
            except (OSError, py_compile.PyCompileError):
                pass  # read-only install: the launcher compiles in memory
        _compiled = True


class _UsernsUnusable(Exception):
    """The launcher made a user namespace but could not build the jail in it."""


def _required(require: bool | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    keys = STRICT if require is True else () if require is False else tuple(require)
    unknown = sorted(set(keys) - set(ISOLATION_KEYS) - set(CGROUP_KEYS))
    if unknown:
        raise ValueError(f"require_isolation: unknown layer(s) {unknown}; expected True or names from "
                         f"{list(ISOLATION_KEYS + CGROUP_KEYS)}")
    return keys


def _refuse(missing: list[str], status: dict) -> None:
    detail = f" ({status['userns_error']})" if status.get("userns_error") else ""
    raise SandboxIsolationError(
        f"the sandbox cannot provide {', '.join(missing)} on this host (jail: {status.get('jail', 'none')}, "
        f"uid {os.geteuid()}){detail}; the code was not run. Run as root, allow unprivileged user "
        "namespaces (docs/rewards.md, threat model), or drop require_isolation.")


def _with_fallback(attempt):
    """Run `attempt()`; if the user-namespace jail failed on this host, remember it (warn once) and
    run again without it, where the launcher refuses if the caller required what is now missing."""
    global _userns_unusable
    try:
        return attempt()
    except _UsernsUnusable as error:
        _userns_unusable = str(error)
        log.warning("k3post sandbox: the user-namespace jail does not work here (%s); falling back to "
                    "rlimits + seccomp (see SandboxResult.isolation)", error)
        return attempt()


def _launch(mode: str, limits: SandboxLimits, isolate: bool, workdir: str, fds: dict[str, int],
            verdict_fd: int | None, require: tuple[str, ...] = ()) -> SandboxResult:
    """Start the jail, supervise it, and leave nothing of it alive; never raises for the job's doing
    (SandboxIsolationError: a required layer is missing, and the job was never started)."""
    start = time.monotonic()
    _compile_launcher()
    cgroup = RunCgroup.create(limits.cgroup_memory(), limits.max_processes * 2 + 8)
    missing = [key for key in require if key in CGROUP_KEYS and not cgroup.flags[key]]
    if missing:
        cgroup.remove()
        for fd in fds.values():
            os.close(fd)
        _refuse(missing, {})
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = run = None
    try:
        config = _config(workdir, limits, isolate, mode, child_end.fileno(), cgroup, fds, require)
        proc = subprocess.Popen(
            [config["python"], "-I", "-S", "-B", "-c", LAUNCH, str(JAIL.parent), marshal.dumps(config).hex()],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_minimal_env(workdir),
            cwd=workdir, start_new_session=True, pass_fds=(child_end.fileno(), *fds.values()),
        )
        launcher_pidfd = os.pidfd_open(proc.pid)  # not reaped yet, so the pid is still ours
        child_end.close()
        for fd in fds.values():
            os.close(fd)  # only the jail holds them now (EOF on the verdict pipe once the judge is gone)
        fds = {}
        run = _Run(proc, parent_end, verdict_fd, limits)
        reason = None
        try:
            reason = run.collect()
            if reason is None:  # pipes closed; let the launcher report the exit status first
                grace_end = time.monotonic() + 0.5
                while not _exited(proc.pid) and time.monotonic() < grace_end:
                    time.sleep(0.002)
        finally:
            _kill_everything(proc, launcher_pidfd, run.init_pidfd, cgroup)
        status = run.status
    finally:
        for fd in fds.values():
            _close_quietly(fd)
        child_end.close()
        parent_end.close()
        if proc is not None:
            proc.stdout.close()
            proc.stderr.close()
    peak = cgroup.memory_peak()
    cgroup.remove()
    if status.get("userns_error"):
        raise _UsernsUnusable(status["userns_error"])
    if status.get("refused"):
        _refuse(list(status["refused"]), status)
    isolation = {key: bool(status.get(key)) for key in ISOLATION_KEYS} | cgroup.flags
    verdicts = run.output(verdict_fd).decode(errors="replace").splitlines() if verdict_fd is not None else []
    return SandboxResult(
        ok=reason is None and proc.returncode == 0, exit_code=proc.returncode, timed_out=reason == "timeout",
        stdout=run.output(run.out_fd).decode("utf-8", errors="replace"),
        stderr=run.output(run.err_fd).decode("utf-8", errors="replace"),
        killed_reason=reason, network_isolated=isolation["network"], wall_s=time.monotonic() - start,
        isolation=isolation, memory_peak_bytes=peak, verdicts=tuple(verdicts), jail=str(status.get("jail", "none")),
    )


def _kill_everything(proc: subprocess.Popen, launcher_pidfd: int, init_pidfd: int | None, cgroup: RunCgroup) -> None:
    """SIGKILL the whole run and wait until it is gone: the cgroup at once where there is one; PID 1
    through its pidfd (its exit kills its namespace, and its pidfd turns readable only after the
    kernel has reaped every process of that namespace); the launcher's group; then the launcher."""
    cgroup.kill()
    for pidfd in (init_pidfd, launcher_pidfd):
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group id is the unreaped launcher's pid: still ours
    except ProcessLookupError:
        pass
    proc.wait()
    if init_pidfd is not None:
        selector = selectors.DefaultSelector()
        selector.register(init_pidfd, selectors.EVENT_READ)
        selector.select(timeout=2.0)
        selector.close()
    for pidfd in (init_pidfd, launcher_pidfd):
        if pidfd is not None:
            os.close(pidfd)


def run_python(code: str, limits: SandboxLimits | None = None, isolate: bool = True,
               require_isolation: bool | tuple[str, ...] = False) -> SandboxResult:
    """Run `code` as a Python program in the sandbox and report what happened; never raises for
    anything the program does. `isolate=False` skips the namespaces, uid switch and seccomp (tests).
    `require_isolation`: True (the STRICT layers) or names of layers; where one is missing the
    program is not run and SandboxIsolationError is raised (fail closed)."""
    limits, require = limits or SandboxLimits(), _required(require_isolation)

    def attempt() -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="k3post-sandbox-")
        try:
            program = Path(workdir, PROGRAM)
            program.write_text(code, encoding="utf-8")
            program.chmod(0o644)
            return _launch("program", limits, isolate, workdir, {}, None, require)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return _with_fallback(attempt)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_tests(solution: str, tests: list[str], limits: SandboxLimits | None = None, isolate: bool = True,
              require_isolation: bool | tuple[str, ...] = False) -> tuple[list[bool], SandboxResult]:
    """Run each test snippet against `solution` (imported as module `solution`) in the sandbox.

    Returns (passed per test, the run's result). The tests run in a judge process that never runs
    the solution's code; the solution runs in its own process and is reached only through calls
    whose arguments and results are plain data (_jail_harness.py). A test that was never reached
    (timeout, crash) counts as failed. `require_isolation` as in run_python."""
    limits, require = limits or SandboxLimits(), _required(require_isolation)

    def attempt() -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="k3post-sandbox-")
        verdict_r, verdict_w = os.pipe()
        fds = {"solution": _memfd("solution", solution.encode("utf-8", errors="replace")),
               "tests": _memfd("tests", json.dumps([str(t) for t in tests]).encode()), "verdict": verdict_w}
        try:
            return _launch("tests", limits, isolate, workdir, fds, verdict_r, require)  # it closes fds
        finally:
            _close_quietly(verdict_r)
            shutil.rmtree(workdir, ignore_errors=True)
    result = _with_fallback(attempt)
    passed = [False] * len(tests)
    for line in result.verdicts:
        parts = line.split()
        if len(parts) == 2 and parts[0] == "pass" and parts[1].isdigit() and int(parts[1]) < len(tests):
            passed[int(parts[1])] = True
    return passed, result


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
