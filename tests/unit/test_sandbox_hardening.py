"""Attacks on the sandbox by class (issue 22), as a reward-hacking policy would try them.

1. verdict forgery: a wrong solution that attacks the harness must score 0;
2. nothing outlives a run: no process of the run is alive when run_python / tests_pass return,
   including one that detached itself (new session, parent-death signal cleared, double fork);
3. limits that hold: memfds, nested user namespaces, inode floods, one scratch budget;
4. isolation gaps: AF_VSOCK and other families, unix sockets anywhere on the host, keyrings.

Each attack also checks that no host object (socket, key, file) was reached. Needs root.
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import time
import uuid
from pathlib import Path

import pytest

from k3post.rewards import _jail_harness as harness
from k3post.rewards.sandbox import SANDBOX_UIDS, SandboxLimits, run_python, run_tests
from k3post.rewards.sandbox_cgroup import hierarchies
from rewards import code as code_reward
from tests.unit.test_sandbox_attacks import Listener, assert_no_survivors

ROOT = os.geteuid() == 0
jail = pytest.mark.skipif(not ROOT, reason="the full jail (namespaces, uid switch, cgroups) needs root")
ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
WRONG_ADD = "\ndef add(a, b):\n    return a - b\n"
RIGHT_ADD = "\ndef add(a, b):\n    return a + b\n"


def score(body: str, tests: dict = ADD_TESTS, timeout_s: float = 2.0) -> float:
    return code_reward.tests_pass("", f"```python\n{body}\n```", tests, timeout_s=timeout_s)["reward"]


# ------------------------------------------------------------------ 1. verdict forgery

FORGERIES = {
    "patch_builtins": "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.AssertionError = type('X', (BaseException,), {})\n"
                      "builtins.enumerate = lambda xs: []\nbuiltins.compile = lambda *a, **k: compile('pass', 'x', 'exec')",
    "patch_sys_modules": "import sys, json, os\nsys.modules['json'] = None\nos.write = lambda fd, data: len(data)",
    "always_equal_result": "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
                           "def add(a, b):\n    return Any()",
    "int_subclass_result": "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
                           "def add(a, b):\n    return I(0)",
    "shadow_builtin_names": "def abs(x):\n    return 0\ndef isinstance(*a):\n    return True",
    "gc_rewrite_tests": "import gc\nfor o in gc.get_objects():\n    if isinstance(o, list) and o and all(isinstance(t, str) for t in o):\n"
                       "        o[:] = ['pass'] * len(o)",
    "frame_walk": "import sys\nf = sys._getframe()\nwhile f:\n    for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
                  "        if isinstance(v, list):\n            v[:] = ['pass'] * len(v)\n    f = f.f_back",
    "forge_verdict_on_every_fd": "import os\nfor fd in range(64):\n    for i in range(3):\n        try:\n"
                                 "            os.write(fd, ('pass %d\\n' % i).encode())\n        except OSError:\n            pass",
    "read_judge_through_proc": "import os\nfor pid in os.listdir('/proc'):\n    for what in ('mem', 'fd/5', 'fd/6', 'cmdline'):\n        try:\n"
                               "            with open(f'/proc/{pid}/{what}', 'w') as f:\n                f.write('pass 0\\npass 1\\npass 2\\n')\n"
                               "        except OSError:\n            pass",
    "exit_early_with_success": "import os\ndef add(a, b):\n    os._exit(0)",
    "kill_everything": "import os\nfor sig in (9, 15):\n    try:\n        os.kill(-1, sig)\n    except OSError:\n        pass",
    # Plant a module on the judge's import path (or rename a directory on it away and recreate it):
    # imported by a test, it would run inside the judge and write pass lines on its verdict pipe.
    # Under the user-namespace jail the job owns the view's skeleton; it is mounted read-only.
    "plant_module_on_judge_path": (
        "import os, sys\n"
        "PLANT = 'import os\\nfor fd in range(3, 256):\\n    try:\\n        os.write(fd, b\"pass 0\\\\npass 1\\\\npass 2\\\\n\")\\n"
        "    except OSError:\\n        pass\\n'\n"
        "def plant(directory):\n    try:\n        os.makedirs(directory, exist_ok=True)\n"
        "        with open(os.path.join(directory, 'k3post_planted.py'), 'w') as f:\n            f.write(PLANT)\n"
        "        print('PLANTED', directory)\n    except OSError:\n        pass\n"
        "try:  # the jail's own directory is named on PID 1's command line\n"
        "    named = [a for a in open('/proc/1/cmdline', 'rb').read().decode().split('\\0') if a.startswith('/')]\n"
        "except OSError:\n    named = []\n"
        "for entry in [p for p in sys.path if p] + named:\n    plant(entry)\n    parent = entry\n"
        "    while parent not in ('/', ''):\n        try:\n            os.rename(parent, parent + '.moved')\n"
        "            plant(entry)\n            break\n        except OSError:\n            parent = os.path.dirname(parent)\n"),
}
PLANT_TESTS = {"tests": ["import k3post_planted\nassert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}
# Tests the shadowing attack would pass in a shared namespace; every other attack faces ADD_TESTS.
SHADOW_TESTS = {"tests": ["assert abs(add(0.1, 0.2) - 0.3) < 1e-9", "assert isinstance(add(1, 2), str)"]}


@jail
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_score_zero(name):
    tests = {"shadow_builtin_names": SHADOW_TESTS, "plant_module_on_judge_path": PLANT_TESTS}.get(name, ADD_TESTS)
    body = FORGERIES[name] + ("" if "def add" in FORGERIES[name] else WRONG_ADD)
    assert score(body, tests) == 0.0, name


@jail
@pytest.mark.parametrize("name", ["patch_builtins", "gc_rewrite_tests", "read_judge_through_proc", "kill_everything"])
def test_the_same_attacks_around_a_right_solution_still_score_one(name):
    """The zeros above come from the wrong answers: the judge survives the attack itself. (Writing
    on every descriptor is left out: it garbles the solution's own answers, a zero it earns.)"""
    assert score(FORGERIES[name] + RIGHT_ADD) == 1.0, name


def test_only_exact_builtin_types_cross():
    class Evil(int):
        def __eq__(self, other):
            return True
    refs: list = []
    assert harness.encode(Evil(3), refs) == {"$t": "ref", "v": 0} and refs == [Evil(3)]  # stays behind
    with pytest.raises(TypeError):
        harness.encode(Evil(3))  # the judge never sends anything but plain data
    value = {"a": (1, 2.5, None), 3: [b"x", {1, 2}, frozenset({"z"}), 1j]}
    assert harness.decode(harness.encode(value), None) == value
    for forged in ({"$t": "tuple"}, {"$t": "eval", "v": "1"}, {"$t": "dict", "v": [[1]]}, {"x": 1}):
        with pytest.raises(ValueError):
            harness.decode(forged, None)
    assert type(harness.decode({"$t": "ref", "v": 0}, lambda i: ("ref", i))) is tuple


@jail
def test_objects_of_the_solution_are_used_by_reference():
    body = ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
            "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n")
    tests = ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and s.items == [1]", "assert Stack() == Stack()"]
    passed, result = run_tests(body, tests)
    assert passed == [True, False], result  # identity, not the solution's __eq__


# ------------------------------------------------------------------ 2. nothing outlives a run

DETACH = ("import ctypes, os, sys, time\n"
          "libc = ctypes.CDLL(None)\n"
          "if os.fork() == 0:\n"
          "    os.setsid()\n"
          "    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0\n"
          "    if os.fork() == 0:\n"
          "        libc.prctl(1, 0, 0, 0, 0)\n"
          "        os.execv(sys.executable, [sys.executable, '-c', 'import os, time\\nwhile True:\\n    if os.fork() == 0:\\n"
          "        time.sleep(30)\\n        os._exit(0)\\n    time.sleep(0.05)', '{marker}'])\n"
          "    os._exit(0)\n"
          "time.sleep(0.3)\n")


def marked_processes(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def run_cgroups() -> set[str]:
    found = hierarchies()
    return {p.name for base in (found.v2, found.v1_memory, found.v1_pids) if base for p in base.iterdir() if p.is_dir()}


@jail
@pytest.mark.parametrize("isolate", [True, False], ids=["jail", "cgroup-only"])
@pytest.mark.parametrize("ending", ["returns", "times_out"])
def test_a_detached_forker_dies_with_the_run(isolate, ending):
    """isolate=False has no PID namespace: only the run's cgroup can find the daemon."""
    marker = f"k3post-daemon-{uuid.uuid4().hex}"
    code = DETACH.format(marker=marker) + ("time.sleep(100)\n" if ending == "times_out" else "")
    before = run_cgroups()
    result = run_python(code, SandboxLimits(timeout_s=1.0), isolate=isolate)
    assert result.timed_out == (ending == "times_out"), result
    assert marked_processes(marker) == []  # at once: run_python waited for the kill
    assert_no_survivors()
    assert run_cgroups() <= before  # and its cgroups are gone


@jail
def test_a_passing_solution_cannot_leave_a_daemon_behind():
    marker = f"k3post-daemon-{uuid.uuid4().hex}"
    assert score(DETACH.format(marker=marker) + RIGHT_ADD) == 1.0
    assert marked_processes(marker) == []
    assert_no_survivors()


# ------------------------------------------------------------------ 3. limits that hold

@jail
def test_memory_in_memfds_is_capped_for_the_whole_run():
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=128 * 2**20, scratch_bytes=16 * 2**20)
    code = ("import os\nfd = os.memfd_create('hog')\nblock = b'x' * 2**20\n"
            "for mib in range(1, 1025):\n    os.write(fd, block)\n    if mib % 8 == 0:\n        print(mib, flush=True)\n")
    result = run_python(code, limits)
    reached = max((int(line) for line in result.stdout.split()), default=0)
    assert not result.ok and reached * 2**20 < limits.cgroup_memory(), (reached, result)
    assert result.memory_peak_bytes is not None and result.memory_peak_bytes <= limits.cgroup_memory()
    assert_no_survivors()


@jail
def test_nested_user_namespaces_are_denied():
    code = ("import ctypes, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print('unshare', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
            "r = subprocess.run(['unshare', '--user', '--map-root-user', '--mount', 'sh', '-c',\n"
            "                    'mount -t tmpfs -o size=1g none /tmp && echo MOUNTED'], capture_output=True, text=True)\n"
            "print(r.returncode, r.stdout, r.stderr)\nassert 'MOUNTED' not in r.stdout\n")
    result = run_python(code, SandboxLimits(timeout_s=3.0))
    assert result.ok, result
    assert "unshare -1 1" in result.stdout and "MOUNTED" not in result.stdout


@jail
def test_an_inode_flood_hits_the_inode_cap():
    limits = SandboxLimits(timeout_s=5.0, scratch_inodes=2000)
    code = ("import os\nmade = 0\ntry:\n    for i in range(100_000):\n        open(f'/tmp/f{i}', 'w').close()\n        made += 1\n"
            "finally:\n    print(made)\n")
    result = run_python(code, limits)
    assert "No space left on device" in result.stderr, result
    assert int(result.stdout.split()[-1]) < limits.scratch_inodes


@jail
def test_scratch_is_one_budget_for_all_its_directories():
    code = ("for path in ('/tmp/a', '/dev/shm/b', '/var/tmp/c', 'd'):\n    with open(path, 'wb') as f:\n"
            "        f.write(b'0' * 12 * 2**20)\n    print(path, flush=True)\n")
    result = run_python(code, SandboxLimits(scratch_bytes=32 * 2**20, max_file_bytes=16 * 2**20))
    assert "No space left on device" in result.stderr, result
    assert result.stdout.split() == ["/tmp/a", "/dev/shm/b"]


# ------------------------------------------------------------------ 4. isolation gaps

@jail
def test_unneeded_socket_families_are_denied():
    code = ("import socket\nfor fam in (40, 16, 17, 31, 38, 0, 99, 2**32 + 40):\n    try:\n"
            "        socket.socket(fam, socket.SOCK_STREAM if fam in (40, 99) else socket.SOCK_RAW)\n"
            "        print('OPEN', fam)\n    except (OSError, OverflowError) as e:\n        print('denied', fam, getattr(e, 'errno', None))\n"
            "socket.socketpair()\nprint('unix ok')\n")
    result = run_python(code)
    assert result.ok and "OPEN" not in result.stdout and "unix ok" in result.stdout, result
    assert "denied 40 97" in result.stdout  # AF_VSOCK: EAFNOSUPPORT


@jail
def test_unix_sockets_anywhere_on_the_host_are_out_of_view():
    tag = uuid.uuid4().hex[:12]
    directories = [Path("/var/lib") / f"k3post-sock-{tag}", Path("/etc") / f"k3post-sock-{tag}"]
    listeners = []
    try:
        for directory in directories:
            directory.mkdir(mode=0o777)
            listeners.append(Listener(socket.AF_UNIX, str(directory / "s.sock")))
            os.chmod(directory / "s.sock", 0o777)
        code = "import socket\nfor path in {paths!r}:\n    try:\n        socket.socket(socket.AF_UNIX).connect(path)\n" \
               "        print('REACHED', path)\n    except OSError as e:\n        print('no', path, e.errno)\n"
        result = run_python(code.format(paths=[str(d / "s.sock") for d in directories]))
        assert result.ok and "REACHED" not in result.stdout, result
        assert all(listener.accepted == 0 for listener in listeners)
    finally:
        for listener in listeners:
            listener.close()
        for directory in directories:
            (directory / "s.sock").unlink(missing_ok=True)
            directory.rmdir()


KEYCTL = {"x86_64": (248, 250)}.get(platform.machine())  # add_key, keyctl


def key_users() -> set[int]:
    return {int(line.split(":")[0]) for line in Path("/proc/key-users").read_text().splitlines()}


@jail
@pytest.mark.skipif(KEYCTL is None, reason="syscall numbers known for x86-64 only")
def test_the_callers_session_keyring_is_out_of_reach_and_no_keyrings_stay_behind():
    libc = ctypes.CDLL(None, use_errno=True)
    add_key, keyctl = KEYCTL
    secret = uuid.uuid4().hex.encode()
    # A session keyring of this test process, with a key in it (inherited by children by default).
    assert libc.syscall(keyctl, 1, None) > 0  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    key = libc.syscall(add_key, b"user", b"k3post-test", secret, len(secret), -3)  # KEY_SPEC_SESSION_KEYRING
    assert key > 0
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(256)\n"
            f"print('read', libc.syscall({keyctl}, 11, {key}, buf, 256), ctypes.get_errno(), buf.value)\n"
            f"print('search', libc.syscall({keyctl}, 10, -3, b'user', b'k3post-test', 0), ctypes.get_errno())\n"
            f"print('write', libc.syscall({keyctl}, 2, {key}, b'forged', 6), ctypes.get_errno())\n"
            f"print('add', libc.syscall({add_key}, b'user', b'mine', b'x', 1, -3), ctypes.get_errno())\n")
    result = run_python(code)
    assert result.ok and secret not in result.stdout.encode(), result
    assert all(line.split()[1] == "-1" for line in result.stdout.splitlines()), result.stdout
    buf = ctypes.create_string_buffer(256)
    assert libc.syscall(keyctl, 11, key, buf, 256) == len(secret) and buf.value == secret  # untouched
    assert not any(uid in SANDBOX_UIDS for uid in key_users())  # no per-uid keyrings of the run left
