"""The sandbox launcher: a fresh, single-threaded process that builds the jail and runs the job.

Run by sandbox.py as `python -I -S -B -c "...import _jail; _jail.main()" <dir> <config>` (the
config a marshal dump in hex: marshal is built in, json would cost 10 ms of imports a call; as a
module, not a script, so its bytecode is cached); stdlib only. A fresh process, not a `Popen(preexec_fn=...)` hook, because preexec_fn runs in a
fork of a possibly multi-threaded parent (Ray actors, the reward threads), where taking a lock
another thread held at fork time deadlocks.

    launcher (this file, root, host PID namespace)   joins the run's cgroups; fresh session keyring;
    │                                                 new network, IPC, mount namespaces; the view;
    │                                                 sends the parent a pidfd of PID 1
    └─ PID 1 of a new PID namespace (trusted, root)   mounts /proc, pivot_root into the view, reaps
         ├─ program   (mode "program": exec python main.py)         ┐ each: rlimits, setuid to its
         └─ judge + candidate (mode "tests": _jail_harness.py)     ┘ own uid, seccomp, no_new_privs

PID 1 is our code, not the model's: the model cannot make it leave the process group or clear its
parent-death signal, and when it exits (its job done, or killed by the parent through the pidfd)
the kernel kills every process left in the namespace, a detached double-forked daemon included.

The filesystem view is built from an allowlist: a fresh tmpfs (size `scratch_bytes`, at most
`scratch_inodes` inodes, one budget for all scratch) becomes the root; into it go read-only binds
of /usr, /lib*, /bin, /sbin, /etc/ld.so.cache, the Python installation, a few /dev nodes, then
/tmp, /var/tmp, /dev/shm (mode 1777) and the work directory (owned by the run's uid). Nothing
else of the host exists there: no /run, /home, /var/lib, host /dev/shm, host sockets.

Without root (or with isolate=False) the namespaces and uid switch are skipped; the status sent
to the parent says which layers were in force.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import signal
import _socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves our own directory out
import _jail_seccomp  # noqa: E402

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x20000000, 0x40000000, 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 0x1000, 0x4000, 0x40000, 0x2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, AT_RECURSIVE = 0x1, 0x2, 0x4, 0x8000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
KEYCTL_JOIN_SESSION_KEYRING = 1
SYSCALLS = {"x86_64": {"pivot_root": 155, "keyctl": 250}, "aarch64": {"pivot_root": 41, "keyctl": 219}}
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux 5.12+)
HOST_RO = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
OLD_ROOT = "/.old-root"

LIBC = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if x is None else x.encode() for x in (source, target, fstype, data)]
    _check(LIBC.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _syscall(name: str, *args) -> int:
    number = SYSCALLS.get(os.uname().machine, {}).get(name)
    if number is None:
        ctypes.set_errno(38)
        return -1
    return LIBC.syscall(ctypes.c_long(number), *args)


def _unshare(flags: int) -> bool:
    return LIBC.unshare(ctypes.c_int(flags)) == 0


def _read_only(path: str, nodev: bool = True) -> None:
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | (MOUNT_ATTR_NODEV if nodev else 0))
    result = LIBC.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(-100), path.encode(),
                          ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(result, f"mount_setattr read-only {path}")


def _bind(source: str, root: str, nodev: bool = True) -> None:
    """Bind `source` at the same path under `root`, read-only (a symlink is copied as a symlink)."""
    target = root + source
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "wb").close()
    _mount(source, target, None, MS_BIND | MS_REC)
    _read_only(target, nodev)


def _build_view(cfg: dict, root: str, program: bytes | None) -> None:
    """The allowlisted filesystem of the module docstring, mounted at `root` (pivoted into later)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: our mounts must never reach the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID,
           f"size={cfg['scratch_bytes']},nr_inodes={cfg['scratch_inodes']},mode=0755")
    for path in (*HOST_RO, *cfg["expose"]):
        if os.path.lexists(path) and not os.path.lexists(root + path):
            _bind(path, root)
    for node in DEV_NODES:
        _bind(f"/dev/{node}", root, nodev=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    for directory in SCRATCH_DIRS:
        os.makedirs(root + directory, exist_ok=True)
        os.chmod(root + directory, 0o1777)
    os.makedirs(root + "/proc", exist_ok=True)
    os.makedirs(root + OLD_ROOT, exist_ok=True)
    workdir = root + cfg["workdir"]
    os.makedirs(workdir, exist_ok=True)
    os.chmod(workdir, 0o700)
    if program is not None:
        with open(os.path.join(workdir, cfg["program"]), "wb") as handle:
            handle.write(program)
    if cfg["uid"] is not None:
        for path in (workdir, *(os.path.join(workdir, name) for name in os.listdir(workdir))):
            os.chown(path, cfg["uid"], cfg["uid"])


def _enter_view(root: str) -> None:
    """In PID 1: our own /proc (other uids' processes invisible), then the view becomes "/"."""
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    os.chdir(root)
    _check(_syscall("pivot_root", root.encode(), (root + OLD_ROOT).encode()), "pivot_root")
    os.chdir("/")
    _check(LIBC.umount2(OLD_ROOT.encode(), MNT_DETACH), "detach the host root")
    os.rmdir(OLD_ROOT)


def _keep_only(fds: tuple[int, ...]) -> None:
    """Close every descriptor above 2 except `fds`: nothing trusted leaks into a sandboxed child."""
    low = 3
    for fd in sorted(f for f in fds if f >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 65536)


def _drop(cfg: dict, uid: int | None, seccomp, keep: tuple[int, ...], dumpable: bool = True) -> None:
    """Turn this fork of PID 1 into a sandboxed process: the last trusted steps."""
    _keep_only(keep)
    for name, value in cfg["limits"].items():
        # Both soft and hard limits: the child can never raise them back.
        resource.setrlimit(getattr(resource, name), (value, value) if name != "RLIMIT_CPU" else (value, value + 1))
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir(cfg["workdir"])
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # drops every capability: from here on an ordinary user
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    if not dumpable:
        LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, /proc/<pid>/mem or fd access, same uid or not
    if seccomp is not None:
        seccomp.load()


def _run_program(cfg: dict, seccomp) -> int:
    """Mode "program": fork the untrusted interpreter; returns the pid to wait for."""
    pid = os.fork()
    if pid == 0:
        _guard(lambda: (_drop(cfg, cfg["uid"], seccomp, ()),
                        os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", "-u", cfg["program"]], cfg["env"])))
    return pid


def _run_tests(cfg: dict, seccomp) -> int:
    """Mode "tests": the candidate, then the judge (_jail_harness.py); returns the judge's pid."""
    import _jail_harness  # loaded by _init (it brings json, which the program mode does not need)

    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    fds = cfg["fds"]
    candidate = os.fork()  # before anything of the tests is read: the candidate's memory holds none
    if candidate == 0:
        _guard(lambda: (_drop(cfg, cfg["uid"], seccomp, (fds["solution"], call_r, reply_w)),
                        _jail_harness.serve_candidate(fds["solution"], call_r, reply_w), os._exit(0)))
    judge = os.fork()
    if judge == 0:
        keep = (fds["tests"], call_w, reply_r, fds["verdict"])
        _guard(lambda: (_drop(cfg, cfg["judge_uid"], seccomp, keep, dumpable=False),
                        _jail_harness.run_judge(fds["tests"], call_w, reply_r, fds["verdict"]), os._exit(0)))
    for fd in (call_r, call_w, reply_r, reply_w, fds["solution"], fds["tests"], fds["verdict"]):
        os.close(fd)
    return judge


def _guard(steps) -> None:
    """Run a child's steps; any failure is reported on stderr and ends the child. Never returns."""
    try:
        steps()
    except BaseException as error:  # noqa: BLE001 - report anything, then die without cleanup
        os.write(2, f"k3post sandbox: {error!r}\n".encode())
        os._exit(126)
    os._exit(0)


def _init(cfg: dict, status: dict, seccomp, exit_w: int) -> None:
    """PID 1 of the run (or a plain child without namespaces). Never returns."""
    def steps():
        os.close(cfg["control_fd"])
        if cfg["mode"] == "tests":
            import _jail_harness  # noqa: F401 - before the view hides our directory; once for both children
        if status["filesystem"]:
            _enter_view(cfg["root"])
        main = _run_tests(cfg, seccomp) if cfg["mode"] == "tests" else _run_program(cfg, seccomp)
        while True:  # reap everything (orphans re-parent to us); stop when the main child is done
            pid, wait_status = os.wait()
            if pid == main:
                break
        # PID 1 cannot die by its own signal: the launcher re-raises the program's, read from here.
        os.write(exit_w, f"{os.waitstatus_to_exitcode(wait_status)}\n".encode())
        # Leaving kills the namespace (or, without one, the parent's cgroup kill does the rest).
        os._exit(0)
    _guard(steps)


def _isolate(cfg: dict, status: dict, program: bytes | None) -> None:
    """The launcher's root-only steps, each recorded in `status`."""
    status["keyring"] = _syscall("keyctl", KEYCTL_JOIN_SESSION_KEYRING, None) >= 0
    status["network"] = _unshare(CLONE_NEWNET)
    status["ipc"] = _unshare(CLONE_NEWIPC)
    try:
        _check(0 if _unshare(CLONE_NEWNS) else -1, "unshare mount namespace")
        _build_view(cfg, cfg["root"], program)
        status["filesystem"] = True
    except OSError as error:
        status["error"] = str(error)
    status["pid"] = status["filesystem"] and _unshare(CLONE_NEWPID)  # needs our mounts for /proc
    status["uid"] = cfg["uid"] is not None and status["filesystem"]
    if not status["filesystem"]:
        raise OSError(f"k3post sandbox: could not build the filesystem view: {status['error']}")


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[2]))
    # Die with the caller: a crashed trainer must not leave sandboxes running (race checked next).
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        sys.exit(125)
    status = {key: False for key in ("network", "filesystem", "pid", "uid", "ipc", "keyring", "seccomp", "cgroup")}
    status["cgroup"] = _join_cgroups(cfg["cgroup_procs"])
    program = None
    if cfg["mode"] == "program":
        with open(os.path.join(cfg["workdir"], cfg["program"]), "rb") as handle:
            program = handle.read()
    seccomp = None
    if cfg["isolate"]:
        seccomp = _jail_seccomp.build()
        status["seccomp"] = seccomp is not None
        if os.geteuid() == 0:
            _isolate(cfg, status, program)
        else:
            cfg["uid"] = cfg["judge_uid"] = None
            status["keyring"] = _syscall("keyctl", KEYCTL_JOIN_SESSION_KEYRING, None) >= 0
    else:
        cfg["uid"] = cfg["judge_uid"] = None
    exit_r, exit_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(exit_r)
        _init(cfg, status, seccomp, exit_w)
    os.close(exit_w)
    _report(cfg["control_fd"], status, pid)
    for fd in cfg.get("fds", {}).values():
        os.close(fd)
    _, wait_status = os.waitpid(pid, 0)
    reported = os.read(exit_r, 64).strip()
    code = int(reported) if reported else os.waitstatus_to_exitcode(wait_status)
    if code < 0:  # killed by a signal: die the same way so the parent sees it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _join_cgroups(procs_files: list[str]) -> bool:
    """Move this process (and so everything it starts) into the run's cgroups."""
    try:
        for path in procs_files:
            with open(path, "w") as handle:
                handle.write(str(os.getpid()))
    except OSError:
        return False
    return bool(procs_files)


def _report(control_fd: int, status: dict, pid: int) -> None:
    """Send the status line and a pidfd of PID 1 (not reaped yet, so the pid is still ours)."""
    control = _socket.socket(fileno=control_fd)  # _socket: the socket module costs 5 ms to import
    pidfd = os.pidfd_open(pid)
    try:
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))]
        control.sendmsg([marshal.dumps(status)], rights)
    except OSError:
        pass  # the parent is gone or gave up; the parent-death signal does the rest
    finally:
        os.close(pidfd)
        control.close()


