"""The jail without root: an unprivileged user namespace, and how the job is kept capless in it.

Linux lets an ordinary user create a user namespace (unless `user.max_user_namespaces` is 0, a
seccomp profile such as Docker's default denies `unshare(CLONE_NEWUSER)`, or an LSM restricts it,
e.g. Ubuntu's `kernel.apparmor_restrict_unprivileged_userns`). Inside it the creator holds every
capability *over the namespaces that user namespace owns*: it can then make network, IPC, mount
and PID namespaces, mount tmpfs (with size and nr_inodes), bind host directories read-only,
pivot_root and mount a /proc for its PID namespace — none of which reaches the host. It gains no
power over anything the host owns: host files keep their owners and modes (a file of host root is
seen as owned by the overflow uid 65534), and the kernel refuses to clear a mount flag the host
set.

An unprivileged caller may map exactly one uid, its own: `0 <caller> 1` (root inside). So the
run's processes cannot get uids of their own as they do under real root; they run as uid 0 of the
namespace (the caller's uid outside) and must be stripped of the capabilities that the namespace's
root would otherwise have (`drop_capabilities`). RLIMIT_NPROC is counted per (user namespace, uid)
since Linux 5.14, so the process limit is the run's own, not shared with the trainer.

Stdlib only (ctypes); runs in the launcher under `python -I -S`.
"""

from __future__ import annotations

import ctypes
import os

CLONE_NEWUSER = 0x10000000
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# SECBIT_NOROOT (+ locked): uid 0 gains no capabilities at execve; SECBIT_NO_SETUID_FIXUP (+ locked);
# SECBIT_KEEP_CAPS_LOCKED; SECBIT_NO_CAP_AMBIENT_RAISE (+ locked). All locked: the job cannot undo them.
SECUREBITS_LOCKED = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
CAPABILITY_VERSION_3 = 0x20080522

LIBC = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _prctl(option: int, arg: int, what: str) -> None:
    if LIBC.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def last_capability() -> int:
    """The highest capability number this kernel knows (read before /proc is replaced)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return 63  # dropping an unknown capability fails with EINVAL, which drop_capabilities allows


def enter() -> bool:
    """unshare(CLONE_NEWUSER) and map the caller to root inside; False where the kernel refuses.

    setgroups is denied first (an unprivileged writer of gid_map must): the run can never drop a
    supplementary group to get past a "deny this group" permission on the host."""
    uid, gid = os.getuid(), os.getgid()
    if LIBC.unshare(ctypes.c_int(CLONE_NEWUSER)) != 0:
        return False
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1\n")
    _write("/proc/self/gid_map", f"0 {gid} 1\n")
    return True


def drop_capabilities(last_cap: int) -> None:
    """Leave this process with no capability, now or after any execve, in any namespace.

    Order matters: the securebits and the bounding set need CAP_SETPCAP, so they go first; then
    effective, permitted and inheritable are cleared. With SECBIT_NOROOT locked and an empty
    bounding set, executing a program as uid 0 (or a file with capabilities) grants nothing."""
    _prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED, "securebits")
    for cap in range(last_cap + 1):
        if LIBC.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) and ctypes.get_errno() != 22:  # EINVAL: the kernel has no such cap
            raise OSError(ctypes.get_errno(), f"drop capability {cap} from the bounding set")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear ambient capabilities")
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if LIBC.capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"capset: {os.strerror(errno)}")
