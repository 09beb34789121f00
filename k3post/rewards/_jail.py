"""The sandbox launcher: a fresh, single-threaded process that builds the jail, then execs Python.

Run as `python -I -S -B _jail.py '<json config>'` by sandbox.py (never imported by the parent;
stdlib only, so it works under -S). Doing this work in a fresh process, not in a
`subprocess.Popen(preexec_fn=...)` hook, matters: preexec_fn runs in a fork of a possibly
multi-threaded parent (Ray actors, the reward thread pool), where taking any lock another thread
held at fork time deadlocks.

As root (the jail; each step is recorded in the status line sent back on fd `status_fd`):

1. unshare(CLONE_NEWNET): a new network namespace holding only a loopback interface that is
   down. connect() to any address, 127.0.0.1 included, fails; abstract unix sockets of the
   host are invisible (they are per network namespace). unshare(CLONE_NEWIPC) likewise hides
   the host's System V IPC objects.
2. unshare(CLONE_NEWNS), make every mount private (nothing propagates back to the host), then
   mount_setattr(AT_RECURSIVE, RDONLY | NOSUID) on "/": the whole host tree becomes read-only
   and setuid bits are ignored, in this namespace only.
3. Empty tmpfs over /tmp, /var/tmp, /dev/shm (writable scratch, size-capped) and /run, /root,
   /home (root-owned, hides the host's sockets and home directories). The Python installation
   is bind-mounted back (read-only) if it lived under a masked directory. The work directory
   is a fresh size-capped tmpfs at the same path the parent created; the program is copied in.
4. unshare(CLONE_NEWPID) and fork: the child is PID 1 of a new PID namespace with a fresh
   /proc, so it sees no host process and cannot signal one; when it dies the kernel kills
   every process left in the namespace (a fork bomb dies with it).
5. In the child: rlimits, no_new_privs, chdir, drop to a fresh unprivileged uid/gid (no
   capabilities left; its own RLIMIT_NPROC count), parent-death signal, exec.

Without root (or where a step fails) only what succeeded is applied; the status says which.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x20000000, 0x40000000, 0x10000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE, AT_FDCWD = 0x1, 0x2, 0x8000, -100
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in Linux 5.12)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
HIDDEN_DIRS = ("/run", "/root", "/home")

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


def _unshare(flags: int) -> bool:
    return LIBC.unshare(ctypes.c_int(flags)) == 0


def _readonly_root() -> None:
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    result = LIBC.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/",
                          ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(result, "mount_setattr / read-only")


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _build_filesystem(cfg: dict, program: bytes) -> None:
    """Steps 2-3 of the module docstring; raises OSError if any step fails."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: our mounts must never reach the host
    _readonly_root()
    # Handles on the Python install before its parents get masked (bind sources are paths).
    masked = HIDDEN_DIRS + SCRATCH_DIRS
    exposed = {root: os.open(root, os.O_PATH) for root in cfg["expose"] if any(_under(root, d) for d in masked)}
    size = cfg["scratch_bytes"]
    for directory in SCRATCH_DIRS:
        if os.path.isdir(directory) and not os.path.islink(directory):
            _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    for directory in HIDDEN_DIRS:
        if os.path.isdir(directory) and not os.path.islink(directory):
            _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for root, fd in exposed.items():
        os.makedirs(root, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", root, None, MS_BIND | MS_REC)  # inherits read-only from "/"
        os.close(fd)
    workdir = cfg["workdir"]
    os.makedirs(workdir, exist_ok=True)  # inside a fresh /tmp, or an existing dir of the ro host tree
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0700")
    with open(os.path.join(workdir, cfg["program"]), "wb") as handle:
        handle.write(program)
    os.chmod(os.path.join(workdir, cfg["program"]), 0o644)
    if cfg["uid"] is not None:
        os.chown(workdir, cfg["uid"], cfg["uid"])


def _set_limits(limits: dict) -> None:
    for name, value in limits.items():
        number = getattr(resource, name)
        # Lower both soft and hard limits: the child can never raise them back.
        resource.setrlimit(number, (value, value) if name != "RLIMIT_CPU" else (value, value + 1))


def _child(cfg: dict, status: dict, status_fd: int) -> None:
    """PID 1 of the new namespace (or a plain child): step 5, then exec. Never returns."""
    try:
        if status["pid"]:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # our namespace's /proc
        _set_limits(cfg["limits"])
        _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        os.chdir(cfg["workdir"])
        if status["uid"]:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])  # drops every capability: from here on an ordinary user
        elif cfg["isolate"] and not status["network"] and _unshare(CLONE_NEWUSER | CLONE_NEWNET):
            status["network"] = True  # unprivileged fallback: a user + network namespace
        # After setuid: a credential change clears the parent-death signal.
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.write(status_fd, (json.dumps(status) + "\n").encode())
        os.close(status_fd)
        argv = [cfg["python"], "-I", "-S", "-B", "-u", cfg["program"]]
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as error:  # noqa: BLE001 - report anything, then die without cleanup
        os.write(2, f"k3post sandbox: jail setup failed: {error!r}\n".encode())
        os._exit(126)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    # Die with the caller: a crashed trainer must not leave sandboxes running (race checked next).
    # The "parent" is the caller's *thread*, the one blocked in run_python for the whole run.
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != cfg["parent_pid"]:
        sys.exit(125)
    with open(os.path.join(cfg["workdir"], cfg["program"]), "rb") as handle:
        program = handle.read()
    status = {"network": False, "filesystem": False, "pid": False, "uid": False, "ipc": False, "error": None}
    if cfg["isolate"] and os.geteuid() == 0:
        status["network"] = _unshare(CLONE_NEWNET)
        status["ipc"] = _unshare(CLONE_NEWIPC)  # the host's System V shared memory and queues
        try:
            _check(0 if _unshare(CLONE_NEWNS) else -1, "unshare mount namespace")
            _build_filesystem(cfg, program)
            status["filesystem"] = True
        except OSError as error:
            status["error"] = str(error)
        status["pid"] = status["filesystem"] and _unshare(CLONE_NEWPID)  # needs our mounts for /proc
        status["uid"] = cfg["uid"] is not None
        if status["uid"] and not status["filesystem"]:
            os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])  # the parent's real directory
    else:
        cfg["uid"] = None
    pid = os.fork()
    if pid == 0:
        _child(cfg, status, status_fd)
    os.close(status_fd)
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    if code < 0:  # killed by a signal: die the same way so the parent sees it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
