"""The sandbox's seccomp filter, built with libseccomp (the maintained C library every container
runtime uses) through ctypes; stdlib only, so the jail can import it under `python -I -S`.

The filter allows every system call except a short deny list, so ordinary Python keeps working:

- nested user namespaces: unshare(2)/clone(2) with CLONE_NEWUSER fail with EPERM, clone3(2)
  fails with ENOSYS (its flags live in a struct that seccomp cannot read; glibc then falls back
  to clone(2), which the rule above sees). A user namespace would hand the program capabilities
  over new mounts (an uncapped tmpfs) and new namespaces;
- socket families: socket(2)/socketpair(2) with any domain other than AF_UNIX, AF_INET, AF_INET6
  fail with EAFNOSUPPORT. AF_VSOCK ignores network namespaces (two runs could meet on a port, or
  reach the hypervisor); netlink, packet, bluetooth, ... are attack surface a solution never needs;
- kernel keyrings: keyctl(2), add_key(2), request_key(2) fail with EPERM (the jail also joins a
  fresh session keyring first, so the caller's keys are never in reach, and no per-uid keyrings
  are created for the run's fresh uids);
- attack surface without a use in a test solution: bpf, perf_event_open, userfaultfd, io_uring,
  ptrace, process_vm_readv/writev;
- only where the run has no memory cgroup (`deny_uncounted_memory`: non-root, or root without a
  writable cgroup): memfd_create(2), shmget(2), msgget(2) fail with EPERM. Pages of a memfd or a
  System V segment are not counted by a process's RLIMIT_AS once unmapped, so without a cgroup
  they would let a run hold as much memory as it likes; tmpfs memory of the run is the scratch,
  whose size is capped.

A call of another architecture's ABI (e.g. int 0x80 on x86-64) kills the process (libseccomp's
default for a foreign architecture). `load()` also sets no_new_privs, which seccomp requires.
"""

from __future__ import annotations

import ctypes
import errno

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_GT, SCMP_CMP_MASKED_EQ = 4, 6, 7
CLONE_NEWUSER = 0x10000000
ALLOWED_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
MAX_FAMILY = 45  # AF_MAX - 1 on Linux 6.x; anything above is denied by one GT rule
DENIED = ("keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
          "io_uring_enter", "io_uring_register", "ptrace", "process_vm_readv", "process_vm_writev")
UNCOUNTED_MEMORY = ("memfd_create", "shmget", "msgget")


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


class Filter:
    """A filter built once (in the jail's trusted process) and loaded in each sandboxed child."""

    def __init__(self, lib: ctypes.CDLL, deny_uncounted_memory: bool = False):
        self.lib = lib
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgCmp)]
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_load.argtypes = [ctypes.c_void_p]
        self.ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
        if not self.ctx:
            raise OSError("seccomp_init failed")
        for name in DENIED + (UNCOUNTED_MEMORY if deny_uncounted_memory else ()):
            self._rule(_errno_action(errno.EPERM), name)
        user_ns = (SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)
        self._rule(_errno_action(errno.EPERM), "unshare", user_ns)
        self._rule(_errno_action(errno.EPERM), "clone", user_ns)
        self._rule(_errno_action(errno.ENOSYS), "clone3")
        for name in ("socket", "socketpair"):
            for family in range(MAX_FAMILY + 1):
                if family not in ALLOWED_FAMILIES:
                    self._rule(_errno_action(errno.EAFNOSUPPORT), name, (SCMP_CMP_EQ, family, 0))
            self._rule(_errno_action(errno.EAFNOSUPPORT), name, (SCMP_CMP_GT, MAX_FAMILY, 0))

    def _rule(self, action: int, name: str, arg0: tuple[int, int, int] | None = None) -> None:
        number = self.lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # this architecture has no such call (nothing to deny)
        args = (_ArgCmp * 1)(_ArgCmp(0, *arg0)) if arg0 else None
        result = self.lib.seccomp_rule_add_array(self.ctx, action, number, 1 if arg0 else 0, args)
        if result != 0:
            raise OSError(-result, f"seccomp rule for {name}: {errno.errorcode.get(-result, result)}")

    def load(self) -> None:
        result = self.lib.seccomp_load(self.ctx)
        if result != 0:
            raise OSError(-result, f"seccomp_load: {errno.errorcode.get(-result, result)}")


def build(deny_uncounted_memory: bool = False) -> Filter | None:
    """The filter, or None where libseccomp is not installed (the run's `seccomp` flag is then off)."""
    for path in ("libseccomp.so.2", "libseccomp.so"):  # by soname: ctypes.util.find_library costs 10 ms
        try:
            return Filter(ctypes.CDLL(path, use_errno=True), deny_uncounted_memory)
        except OSError:
            continue
    return None
