"""The sandbox as a non-root user (the shipped image runs as one): the attack classes of issue 22
run from a process of uid 65534, started from this (root) test process with setpriv, so CI (root)
exercises the path a cluster pod takes.

Where the kernel allows unprivileged user namespaces the jail is built inside one (jail
"userns"): each attack must score 0 / be contained, and no process of the run may be alive when
the call returns, nor after the non-root process has exited. Without user namespaces (simulated
by loading the sandbox's own seccomp filter, which denies CLONE_NEWUSER the way Docker's default
profile does) the weak mode must say what is missing and `require_isolation` must refuse to run
the code. Skipped, with the reason, where the kernel refuses unprivileged user namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from k3post.rewards.sandbox_cgroup import _mounts, _own_paths
from tests.unit.test_sandbox_attacks import Listener
from tests.unit.test_sandbox_hardening import (ADD_TESTS, DETACH, FORGERIES, PLANT_TESTS, RIGHT_ADD, SHADOW_TESTS,
                                               WRONG_ADD)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
JAIL_KEYS = ("network", "filesystem", "pid", "ipc", "keyring", "seccomp")

# Runs as uid 65534: reads {name: case} on stdin, prints {name: outcome}. Each outcome also lists
# the processes carrying the case's marker right after the call returned.
DRIVER = r'''
import json, os, sys
if "--no-userns" in sys.argv:  # what Docker's default seccomp profile does: no CLONE_NEWUSER
    sys.path.insert(0, os.path.join(os.getcwd(), "k3post", "rewards"))
    import _jail_seccomp
    _jail_seccomp.build().load()
    sys.path.pop(0)
from k3post.rewards.sandbox import SandboxIsolationError, SandboxLimits, run_python
from rewards import code as code_reward

def marked(marker):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found

def crash(case):
    """The trainer dies mid-run (os._exit from a timer): its run must die with it."""
    import signal, time
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGALRM, lambda *_: os._exit(0))
        signal.setitimer(signal.ITIMER_REAL, case["after_s"])
        run_python(case["code"], SandboxLimits(timeout_s=30.0))
        os._exit(1)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 2.0
    while marked(case["marker"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {"survivors": marked(case["marker"])}

def break_the_userns_jail():
    """A view that cannot be mounted (an invalid tmpfs size): what an old kernel or an LSM does."""
    from k3post.rewards import sandbox
    original = sandbox._config
    def config(*args, **kwargs):
        cfg = original(*args, **kwargs)
        cfg["scratch_bytes"] = "not-a-size"
        return cfg
    sandbox._config = config

def run(case):
    if case["kind"] == "crash":
        return crash(case)
    if case["kind"] == "break_userns":
        break_the_userns_jail()
        return {}
    if case["kind"] == "userns_unusable":
        from k3post.rewards import sandbox
        return {"why": sandbox._userns_unusable}
    require = case.get("require", False)
    require = require if isinstance(require, bool) else tuple(require)
    try:
        if case["kind"] == "python":
            r = run_python(case["code"], SandboxLimits(**case.get("limits", {})), require_isolation=require)
            out = {"ok": r.ok, "stdout": r.stdout, "stderr": r.stderr[-3000:], "timed_out": r.timed_out,
                   "jail": r.jail, "isolation": r.isolation, "wall_s": r.wall_s}
        else:
            block = "```python\n" + case["code"] + "\n```"
            out = code_reward.tests_pass("", block, {"tests": case["tests"]}, timeout_s=case.get("timeout_s", 2.0),
                                         require_isolation=require)
    except SandboxIsolationError as error:
        out = {"refused": str(error)}
    out["survivors"] = marked(case["marker"]) if case.get("marker") else []
    return out

cases = json.load(sys.stdin)
print(json.dumps({name: run(case) for name, case in cases.items()}))
'''


def _uid_processes(uid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.add(int(entry))
            except FileNotFoundError:
                pass
    return found


def _prefix() -> list[str]:
    return SETPRIV if os.geteuid() == 0 else []


def _python_for_nobody() -> str | None:
    """An interpreter the non-root user can run, whose own realpath it can execute too (the sandbox
    starts realpath(sys.executable)) and that imports the sandbox from this checkout."""
    probe = ("import os, sys\nassert sys.version_info >= (3, 11)\n"
             "assert os.access(os.path.realpath(sys.executable), os.X_OK)\nimport k3post.rewards.sandbox")
    seen = []
    for candidate in (os.path.realpath(sys.executable), sys.executable, shutil.which("python3.11"), "/usr/bin/python3"):
        if candidate and candidate not in seen:
            seen.append(candidate)
            done = subprocess.run([*_prefix(), candidate, "-c", probe], cwd=REPO, env=_env(), capture_output=True)
            if done.returncode == 0:
                return candidate
    return None


def _env() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(REPO), "LANG": "C.UTF-8", "HOME": "/"}


def drive(cases: dict, *args: str, cgroup_dir: Path | None = None, masked_proc: str | None = None) -> dict:
    """Run the cases in one non-root process (optionally moved into `cgroup_dir` first, or in a
    mount namespace where /dev/null hides `masked_proc`, as container runtimes mask parts of /proc);
    then check that no process of that uid is left (with the cases' markers or any other)."""
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python that uid 65534 can run and import this checkout with")
    before = _uid_processes(NOBODY) if os.geteuid() == 0 else set()
    command = [*_prefix(), python, "-c", DRIVER, *args]
    if cgroup_dir is not None:  # root moves the shell into the delegated cgroup, then drops to 65534
        command = ["sh", "-c", f'echo $$ > "{cgroup_dir}/cgroup.procs" && exec "$@"', "sh", *command]
    if masked_proc is not None:
        command = ["unshare", "--mount", "sh", "-c", f'mount --bind /dev/null "{masked_proc}" && exec "$@"', "sh", *command]
    done = subprocess.run(command, input=json.dumps(cases), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    deadline = time.monotonic() + 3
    while os.geteuid() == 0 and _uid_processes(NOBODY) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.geteuid() == 0:
        assert _uid_processes(NOBODY) - before == set(), "a process of the non-root runs survived"
    return json.loads(done.stdout)


def _marker() -> str:
    return f"k3post-daemon-{uuid.uuid4().hex}"


def _userns_refused_reason() -> str:
    try:
        limit = Path("/proc/sys/user/max_user_namespaces").read_text().strip()
    except OSError:
        limit = "?"
    return f"the kernel refuses unprivileged user namespaces here (user.max_user_namespaces={limit}, or an LSM/seccomp)"


# ------------------------------------------------------------------ the cases, run in one process

NESTED_USERNS = ("import ctypes, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "print('unshare', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
                 "r = subprocess.run(['unshare', '--user', '--map-root-user', '--mount', 'sh', '-c',\n"
                 "                    'mount -t tmpfs -o size=1g none /tmp && echo MOUNTED'], capture_output=True, text=True)\n"
                 "print(r.returncode, r.stdout, r.stderr)\n")
CAPABILITIES = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines() if ':\\t' in line)\n"
                "print('caps', *(int(status[k], 16) for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')))\n"
                "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, b'size=1g'), ctypes.get_errno())\n"
                "print('unshare_ns', libc.unshare(0x00020000), ctypes.get_errno())\n"
                "print('nnp_seccomp', status['NoNewPrivs'], status['Seccomp'])\nprint('uid', os.getuid())\n")
MEMFD = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "print('shmget', libc.shmget(0, 2**30, 0o1000 | 0o600), ctypes.get_errno())\n"
         "fd = os.memfd_create('hog')\nblock = b'x' * 2**20\n"
         "for mib in range(1, 4097):\n    os.write(fd, block)\n")
INODE_FLOOD = ("import os\nmade = 0\ntry:\n    for i in range(100_000):\n        open(f'/tmp/f{i}', 'w').close()\n        made += 1\n"
               "finally:\n    print(made)\n")
FORKS = ("import os, time\nmade = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
         "            os._exit(0)\n        made += 1\nexcept OSError:\n    print('forks', made)\n")
SCRATCH = ("for path in ('/tmp/a', '/dev/shm/b', '/var/tmp/c', 'd'):\n    with open(path, 'wb') as f:\n"
           "        f.write(b'0' * 12 * 2**20)\n    print(path, flush=True)\n")
HOST = ("import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('REACHED tcp')\n"
        "except OSError as e:\n    print('tcp', e.errno)\ntry:\n    print('READ', open({path!r}).read())\n"
        "except OSError as e:\n    print('file', e.errno)\n")
WRONG_FORGERIES = ("patch_builtins", "always_equal_result", "int_subclass_result", "shadow_builtin_names",
                   "gc_rewrite_tests", "frame_walk", "forge_verdict_on_every_fd", "read_judge_through_proc",
                   "exit_early_with_success", "kill_everything", "plant_module_on_judge_path")
# Around a right solution the judge must survive the attack. kill(-1) is left out: the candidate
# shares the judge's uid without root and can kill it (a zero it earns, not a forgery).
RIGHT_FORGERIES = ("patch_builtins", "gc_rewrite_tests", "read_judge_through_proc")


def _forgery_case(name: str, body: str) -> dict:
    tests = {"shadow_builtin_names": SHADOW_TESTS, "plant_module_on_judge_path": PLANT_TESTS}.get(name, ADD_TESTS)
    return {"kind": "score", "code": body, "tests": tests["tests"]}


@pytest.fixture(scope="module")
def userns_run():
    """All user-namespace cases in one non-root process; skips if the jail is not "userns" there."""
    secret = Path(f"/dev/shm/k3post-nonroot-{uuid.uuid4().hex}")  # world-readable on the host
    secret.write_text("host-secret")
    secret.chmod(0o644)
    listener = Listener(socket.AF_INET, ("127.0.0.1", 0))
    markers = {name: _marker() for name in ("returns", "times_out", "passing", "crash")}
    cases = {
        "flags": {"kind": "python", "code": "print('hi')"},
        "capabilities": {"kind": "python", "code": CAPABILITIES},
        "detach_returns": {"kind": "python", "code": DETACH.format(marker=markers["returns"]),
                           "limits": {"timeout_s": 1.0}, "marker": markers["returns"]},
        "detach_times_out": {"kind": "python", "code": DETACH.format(marker=markers["times_out"]) + "time.sleep(100)\n",
                             "limits": {"timeout_s": 1.0}, "marker": markers["times_out"]},
        "detach_passing": {"kind": "score", "code": DETACH.format(marker=markers["passing"]) + RIGHT_ADD,
                           "tests": ADD_TESTS["tests"], "marker": markers["passing"]},
        "crash": {"kind": "crash", "code": DETACH.format(marker=markers["crash"]) + "time.sleep(100)\n",
                  "after_s": 0.8, "marker": markers["crash"]},
        "memfd": {"kind": "python", "code": MEMFD, "limits": {"timeout_s": 3.0}},
        "nested_userns": {"kind": "python", "code": NESTED_USERNS, "limits": {"timeout_s": 3.0}},
        "inode_flood": {"kind": "python", "code": INODE_FLOOD, "limits": {"timeout_s": 5.0, "scratch_inodes": 2000}},
        "scratch": {"kind": "python", "code": SCRATCH},
        "forks": {"kind": "python", "code": FORKS, "limits": {"max_processes": 16}},
        "host": {"kind": "python", "code": HOST.format(port=listener.address[1], path=str(secret))},
        "require_strict": {"kind": "python", "code": "print('ran')", "require": True},
        "require_uid": {"kind": "python", "code": "print('ran')", "require": ["uid"]},
        "require_cgroup": {"kind": "python", "code": "print('ran')", "require": ["cgroup_memory"]},
    }
    for name in WRONG_FORGERIES:
        body = FORGERIES[name] + ("" if "def add" in FORGERIES[name] else WRONG_ADD)
        cases[f"wrong:{name}"] = _forgery_case(name, body)
    for name in RIGHT_FORGERIES:
        cases[f"right:{name}"] = _forgery_case(name, FORGERIES[name] + RIGHT_ADD)
    try:
        outcomes = drive(cases)
    finally:
        listener.close()
        secret.unlink()
    if outcomes["flags"].get("jail") != "userns":
        pytest.skip(_userns_refused_reason())
    outcomes["_listener_accepted"] = listener.accepted
    outcomes["_markers"] = markers
    return outcomes


def test_the_jail_is_built_in_a_user_namespace_and_says_what_is_missing(userns_run):
    flags = userns_run["flags"]
    assert flags["ok"] and flags["stdout"] == "hi\n", flags
    assert all(flags["isolation"][key] for key in JAIL_KEYS), flags["isolation"]
    assert flags["isolation"]["uid"] is False  # one uid for the whole run: said plainly
    if not flags["isolation"]["cgroup"]:  # no delegated cgroup for uid 65534 on this host
        assert not any(flags["isolation"][key] for key in ("cgroup_kill", "cgroup_memory", "cgroup_pids"))


def test_the_job_has_no_capabilities_in_its_namespace(userns_run):
    out = userns_run["capabilities"]
    lines = dict(line.split(" ", 1) for line in out["stdout"].splitlines())
    assert lines["caps"] == "0 0 0 0 0", out  # inheritable, permitted, effective, bounding, ambient
    assert lines["mount"] == "-1 1" and lines["unshare_ns"] == "-1 1", out  # EPERM
    assert lines["nnp_seccomp"] == "1 2" and lines["uid"] == "0", out  # uid 0 of the namespace only


@pytest.mark.parametrize("case", ["detach_returns", "detach_times_out"])
def test_a_detached_forker_dies_with_the_run(userns_run, case):
    out = userns_run[case]
    assert out["timed_out"] == (case == "detach_times_out"), out
    assert out["survivors"] == [], out  # at once, when run_python returned
    marker = userns_run["_markers"]["returns" if case == "detach_returns" else "times_out"]
    assert _marked(marker) == []  # and after the non-root process is gone (drive checked every uid-65534 process)


def test_a_passing_solution_cannot_leave_a_daemon_behind(userns_run):
    out = userns_run["detach_passing"]
    assert out["reward"] == 1.0 and out["survivors"] == [], out


def test_a_crashed_trainer_takes_its_run_with_it(userns_run):
    """No cgroup without root: the launcher dies with the caller and PID 1 with the launcher
    (parent-death signals), and PID 1's exit ends the namespace, the detached daemon included."""
    assert userns_run["crash"]["survivors"] == [], userns_run["crash"]


def test_memory_the_rlimits_cannot_see_is_denied_without_a_memory_cgroup(userns_run):
    out = userns_run["memfd"]
    assert not out["ok"] and "shmget -1 1" in out["stdout"], out
    assert "PermissionError" in out["stderr"], out  # memfd_create: EPERM, before any page is held


def test_nested_user_namespaces_are_denied(userns_run):
    out = userns_run["nested_userns"]
    assert out["ok"] and "unshare -1 1" in out["stdout"] and "MOUNTED" not in out["stdout"], out


def test_an_inode_flood_hits_the_inode_cap(userns_run):
    out = userns_run["inode_flood"]
    assert "No space left on device" in out["stderr"], out
    assert 0 < int(out["stdout"].split()[-1]) < 2000


def test_scratch_is_one_budget(userns_run):
    out = userns_run["scratch"]
    assert "No space left on device" in out["stderr"] and out["stdout"].split() == ["/tmp/a", "/dev/shm/b"], out


def test_the_process_limit_is_the_runs_own(userns_run):
    """RLIMIT_NPROC counts per user namespace: the job gets its 16 (itself + 15 children) whatever
    else the uid runs on the host, and no more."""
    assert "forks 15" in userns_run["forks"]["stdout"], userns_run["forks"]


def test_host_network_and_files_are_out_of_reach(userns_run):
    out = userns_run["host"]
    assert "REACHED" not in out["stdout"] and "READ" not in out["stdout"], out
    assert "tcp 101" in out["stdout"] and "file 2" in out["stdout"], out  # ENETUNREACH, ENOENT
    assert userns_run["_listener_accepted"] == 0


@pytest.mark.parametrize("name", WRONG_FORGERIES)
def test_forged_verdicts_score_zero(userns_run, name):
    assert userns_run[f"wrong:{name}"]["reward"] == 0.0, userns_run[f"wrong:{name}"]


@pytest.mark.parametrize("name", RIGHT_FORGERIES)
def test_the_judge_survives_the_attacks_around_a_right_solution(userns_run, name):
    assert userns_run[f"right:{name}"]["reward"] == 1.0, userns_run[f"right:{name}"]


def test_require_isolation_runs_where_the_layers_hold_and_refuses_where_not(userns_run):
    assert userns_run["require_strict"]["stdout"] == "ran\n", userns_run["require_strict"]
    assert "uid" in userns_run["require_uid"]["refused"]  # one uid per run needs root
    if not userns_run["flags"]["isolation"]["cgroup_memory"]:
        assert "cgroup_memory" in userns_run["require_cgroup"]["refused"]


def _marked(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


# ------------------------------------------------------------------ no user namespaces either

@pytest.fixture
def open_dir():
    """A host directory uid 65534 may write (the weak mode can reach it; pytest's tmp is root's)."""
    directory = Path(tempfile.mkdtemp(prefix="k3post-nonroot-"))
    directory.chmod(0o1777)
    yield directory
    shutil.rmtree(directory)


def test_without_user_namespaces_the_weak_mode_says_so_and_require_isolation_fails_closed(open_dir):
    weak, strict = open_dir / "weak", open_dir / "strict"
    write = "open({path!r}, 'w').write('ran')\n"
    outcomes = drive({
        "weak": {"kind": "python", "code": write.format(path=str(weak))},
        "strict": {"kind": "python", "code": write.format(path=str(strict)), "require": True},
        "strict_score": {"kind": "score", "code": RIGHT_ADD, "tests": ADD_TESTS["tests"], "require": True},
    }, "--no-userns")
    out = outcomes["weak"]
    assert out["ok"] and out["jail"] == "none", out
    assert not any(out["isolation"][key] for key in ("network", "filesystem", "pid", "ipc", "uid")), out["isolation"]
    assert weak.read_text() == "ran"  # the weak mode reaches the host: that is why the flags say so
    assert "pid" in outcomes["strict"]["refused"] and "network" in outcomes["strict"]["refused"]
    assert not strict.exists()  # refused before the code ran
    assert "refused" in outcomes["strict_score"], outcomes["strict_score"]


# ------------------------------------------------------------------ a delegated cgroup

@pytest.fixture
def delegated_cgroup():
    """A cgroup v2 directory handed to uid 65534 the way systemd's Delegate=yes does (the directory
    and its cgroup.procs, cgroup.threads, cgroup.subtree_control chowned)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to delegate a cgroup")
    mount = _mounts().get("cgroup2")
    if mount is None:
        pytest.skip("no cgroup v2 mount")
    directory = mount / _own_paths().get("", "/").lstrip("/") / f"k3post-delegated-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a cgroup here: {error}")
    for path in (directory, *(directory / name for name in ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control"))):
        os.chown(path, NOBODY, NOBODY)
    yield directory
    for child in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if child.is_dir():
            child.rmdir()
    directory.rmdir()


def test_a_delegated_cgroup_is_used_without_root(delegated_cgroup):
    marker = _marker()
    case = {"kind": "python", "code": DETACH.format(marker=marker), "limits": {"timeout_s": 1.0}, "marker": marker}
    out = drive({"detach": case}, cgroup_dir=delegated_cgroup)["detach"]
    assert out["isolation"]["cgroup"] and out["isolation"]["cgroup_kill"], out["isolation"]
    assert out["survivors"] == [], out
    runs = [p for p in (delegated_cgroup / "k3post-sandbox").iterdir() if p.is_dir()]
    assert runs == []  # the run's cgroup was emptied and removed


# ------------------------------------------------------------------ a container's masked /proc

def test_a_masked_proc_costs_the_run_its_proc_not_its_jail():
    """Container runtimes hide parts of /proc (kcore, keys, timer_list, ...); the kernel then refuses
    a new proc mount from a user namespace. The jail is built without /proc and still holds."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mask /proc like a container runtime")
    masked = next((p for p in ("/proc/kcore", "/proc/keys", "/proc/timer_list") if os.path.exists(p)), None)
    if masked is None:
        pytest.skip("no /proc file to mask")
    marker = _marker()
    outcomes = drive({
        "listing": {"kind": "python", "code": "import os\nprint(sorted(os.listdir('/proc')))"},
        "detach": {"kind": "python", "code": DETACH.format(marker=marker), "limits": {"timeout_s": 1.0}, "marker": marker},
    }, masked_proc=masked)
    if outcomes["listing"]["jail"] != "userns":
        pytest.skip(_userns_refused_reason())
    assert outcomes["listing"]["stdout"] == "[]\n", outcomes["listing"]
    assert all(outcomes["detach"]["isolation"][key] for key in JAIL_KEYS), outcomes["detach"]
    assert outcomes["detach"]["survivors"] == [], outcomes["detach"]


# ------------------------------------------------------------------ the user namespace made, the jail not

def test_a_jail_that_fails_inside_the_user_namespace_falls_back_once_and_says_so():
    outcomes = drive({
        "break": {"kind": "break_userns"},
        "first": {"kind": "python", "code": "print('ran')"},
        "second": {"kind": "python", "code": "print('ran')"},
        "strict": {"kind": "python", "code": "print('ran')", "require": True},
        "why": {"kind": "userns_unusable"},
    })
    if outcomes["why"]["why"] is None:
        pytest.skip(_userns_refused_reason())
    assert "mount" in outcomes["why"]["why"], outcomes["why"]  # the tmpfs mount failed in the namespace
    first, second = outcomes["first"], outcomes["second"]
    if not first["ok"] or first["stdout"] != "ran\n":
        pytest.fail(f"the fallback did not run the job: {first}")
    assert first["jail"] == second["jail"] == "none", outcomes
    assert not first["isolation"]["pid"] and not first["isolation"]["filesystem"]
    assert "pid" in outcomes["strict"]["refused"], outcomes["strict"]  # the weak mode, remembered: refused


# ------------------------------------------------------------------ require_isolation in this process

def test_require_isolation_names_known_layers_only():
    from k3post.rewards.sandbox import run_python
    with pytest.raises(ValueError, match="unknown layer"):
        run_python("print(1)", require_isolation=("network", "firewall"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the full jail needs root")
def test_require_isolation_as_root_runs_with_every_layer():
    from k3post.rewards.sandbox import STRICT, run_python
    result = run_python("print('ran')", require_isolation=(*STRICT, "uid"))
    assert result.stdout == "ran\n" and result.jail == "root", result
    assert all(result.isolation[key] for key in (*STRICT, "uid")), result.isolation
