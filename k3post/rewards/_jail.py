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

The filesystem view is built from an allowlist: a small fresh tmpfs (the skeleton: directories,
symlinks and mount points) becomes the root; into it go read-only binds of /usr, /lib*, /bin,
/sbin, /etc/ld.so.cache, the Python installation and a few /dev nodes. Nothing else of the host
exists there: no /run, /home, /var/lib, host /dev/shm, host sockets. The skeleton is made
read-only once PID 1 has pivoted into it. What stays writable is a second tmpfs, the scratch (size
`scratch_bytes`, at most `scratch_inodes` inodes: one budget), whose directories are bound at /tmp,
/var/tmp, /dev/shm (mode 1777) and the work directory (owned by the run's uid).

Not root: where the kernel lets an unprivileged user create user namespaces, the launcher enters a
new one (mapping the caller to root inside, the only uid it may map) and builds the same network,
IPC, mount and PID namespaces and the same view from there (_jail_userns.py). What it cannot do is
give the run uids of its own: the job, the judge and the candidate all run as the caller's uid,
with every capability dropped (bounding set emptied, securebits locked) and the judge not
dumpable. Without user namespaces either (or with isolate=False) the namespaces are skipped. The
status sent to the parent says which layers were in force; with `require` set the launcher
refuses to start the job when one of those is missing.
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
import _jail_userns  # noqa: E402

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
OLD_ROOT = "/.old-root"  # where the scratch is staged; the host root goes below it at pivot_root
PUT_OLD = OLD_ROOT + "/host"
# The scratch's directories and where each is bound in the view (the work dir: cfg["workdir"]).
SCRATCH_BINDS = (("tmp", "/tmp"), ("var-tmp", "/var/tmp"), ("shm", "/dev/shm"))
SKELETON = "size=1m,nr_inodes=1024,mode=0755"  # directories, symlinks and mount points only
HERE = os.path.dirname(os.path.abspath(__file__))
REFUSED_EXIT = 124  # the launcher refused to start the job (a required layer is missing)
USERNS_FAILED_EXIT = 123  # a user namespace was made but the view could not be built in it

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


def _setattr(path: str, attrs: int, recursive: bool = True) -> None:
    """Set mount flags (only ever adding restrictions: inside a user namespace the kernel refuses
    to clear a flag the host set, and allows adding one)."""
    attr = MountAttr(attr_set=attrs)
    result = LIBC.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(-100), path.encode(),
                          ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                          ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(result, f"mount_setattr {path}")


def _read_only(path: str, nodev: bool = True) -> None:
    _setattr(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | (MOUNT_ATTR_NODEV if nodev else 0))


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
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, SKELETON)
    for path in (*HOST_RO, *cfg["expose"]):
        if os.path.lexists(path) and not os.path.lexists(root + path):
            _bind(path, root)
    for node in DEV_NODES:
        _bind(f"/dev/{node}", root, nodev=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", exist_ok=True)
    _scratch(cfg, root, program)


def _scratch(cfg: dict, root: str, program: bytes | None) -> None:
    """One tmpfs (size `scratch_bytes`, `scratch_inodes` inodes), staged at OLD_ROOT: its
    directories are bound at /tmp, /var/tmp, /dev/shm (mode 1777) and the work directory (0700, the
    run's uid). The staging mount stays until PID 1 has pivoted the host root below it (PUT_OLD):
    one detach then drops both (each unmount may wait ~20 ms for an RCU grace period), while the
    binds keep the one file system alive."""
    stage = root + OLD_ROOT
    os.makedirs(stage)
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['scratch_bytes']},nr_inodes={cfg['scratch_inodes']},mode=0755")
    for name, target in (*SCRATCH_BINDS, ("work", cfg["workdir"])):
        os.mkdir(f"{stage}/{name}", 0o700 if name == "work" else 0o1777)
        os.chmod(f"{stage}/{name}", 0o700 if name == "work" else 0o1777)  # past the umask
        os.makedirs(root + target, exist_ok=True)  # the work dir may lie under /tmp, bound just before
        _mount(f"{stage}/{name}", root + target, None, MS_BIND)
        _setattr(root + target, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=False)
    os.mkdir(root + PUT_OLD, 0o700)
    workdir = root + cfg["workdir"]
    if program is not None:
        with open(os.path.join(workdir, cfg["program"]), "wb") as handle:
            handle.write(program)
    if cfg["uid"] is not None:
        for path in (workdir, *(os.path.join(workdir, name) for name in os.listdir(workdir))):
            os.chown(path, cfg["uid"], cfg["uid"])


def _enter_view(cfg: dict, root: str) -> None:
    """In PID 1: our own /proc (other uids' processes invisible), then the view becomes "/" and
    its skeleton read-only (in a user namespace the job owns "/" and its directories: without that
    it could rename them and plant files on paths the judge imports from)."""
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        if cfg.get("jail") != "userns":
            raise
        # A container that masks parts of its /proc forbids a new proc mount from a user namespace:
        # the run then has no /proc (isolation is not weaker; /proc/self and /dev/fd are missing).
    os.chdir(root)
    _check(_syscall("pivot_root", root.encode(), (root + PUT_OLD).encode()), "pivot_root")
    os.chdir("/")
    _check(LIBC.umount2(OLD_ROOT.encode(), MNT_DETACH), "detach the host root and the scratch's staging")
    os.rmdir(OLD_ROOT)
    _setattr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=False)
    sys.path[:] = [entry for entry in sys.path if entry != HERE]  # only the read-only stdlib from here


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
    elif cfg["jail"] == "userns":
        _jail_userns.drop_capabilities(cfg["last_cap"])  # uid 0 of our namespace, without its powers
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
        # Die with the launcher (which dies with the caller): without a cgroup this is what ends
        # the run's namespace if the trainer crashes. A fork does not inherit the launcher's setting.
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if cfg["mode"] == "tests":
            import _jail_harness  # noqa: F401 - before the view hides our directory; once for both children
        if status["filesystem"]:
            _enter_view(cfg, cfg["root"])
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
    """The launcher's steps as root (real, or of its own user namespace), each recorded in `status`."""
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


def _die_with_parent(cfg: dict) -> None:
    """Die with the caller: a crashed trainer must not leave sandboxes running (race checked next).
    Set again after entering a user namespace: a change of credentials clears it."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        sys.exit(125)


def _jail(cfg: dict, status: dict, program: bytes | None) -> None:
    """Build what this host allows: as root the full jail; else, in a user namespace of our own,
    the same namespaces and view with the caller's uid; else nothing (the status says so)."""
    status["keyring"] = _syscall("keyctl", KEYCTL_JOIN_SESSION_KEYRING, None) >= 0
    if os.geteuid() == 0:
        cfg["jail"] = "root"
        _isolate(cfg, status, program)
        return
    cfg["uid"] = cfg["judge_uid"] = None
    cfg["last_cap"] = _jail_userns.last_capability()
    if not (cfg["userns"] and _jail_userns.enter()):
        return
    _die_with_parent(cfg)
    cfg["jail"] = "userns"
    # The launcher and PID 1 count against the namespace's process limit too, and the judge beside
    # the candidate: the job keeps the budget it has under root.
    cfg["limits"]["RLIMIT_NPROC"] += 2 + (cfg["mode"] == "tests")
    try:
        _isolate(cfg, status, program)
    except OSError as error:  # the parent falls back to the weaker mode (or refuses, if required)
        status["userns_error"] = str(error)
        _report(cfg["control_fd"], status, None)
        os._exit(USERNS_FAILED_EXIT)


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[2]))
    _die_with_parent(cfg)
    cfg["jail"] = "none"
    status = {key: False for key in ("network", "filesystem", "pid", "uid", "ipc", "keyring", "seccomp", "cgroup")}
    status["cgroup"] = _join_cgroups(cfg["cgroup_procs"])
    program = None
    if cfg["mode"] == "program":
        with open(os.path.join(cfg["workdir"], cfg["program"]), "rb") as handle:
            program = handle.read()
    seccomp = None
    if cfg["isolate"]:
        seccomp = _jail_seccomp.build(deny_uncounted_memory=cfg["deny_uncounted_memory"])
        status["seccomp"] = seccomp is not None
        _jail(cfg, status, program)
    else:
        cfg["uid"] = cfg["judge_uid"] = None
    status["jail"] = cfg["jail"]
    missing = [key for key in cfg["require"] if not status.get(key)]
    if missing:  # fail closed: the job never starts
        status["refused"] = missing
        _report(cfg["control_fd"], status, None)
        sys.exit(REFUSED_EXIT)
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


def _report(control_fd: int, status: dict, pid: int | None) -> None:
    """Send the status line and a pidfd of PID 1 (not reaped yet, so the pid is still ours); no
    pidfd when the job was never started."""
    control = _socket.socket(fileno=control_fd)  # _socket: the socket module costs 5 ms to import
    pidfd = os.pidfd_open(pid) if pid is not None else None
    try:
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))] if pidfd is not None else []
        control.sendmsg([marshal.dumps(status)], rights)
    except OSError:
        pass  # the parent is gone or gave up; the parent-death signal does the rest
    finally:
        if pidfd is not None:
            os.close(pidfd)
        control.close()


