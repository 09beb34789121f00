"""An attack corpus against the sandbox: each program tries to harm the host; each must be
contained, leave no trace, and score 0 as a code solution — and the test process survives.

Every payload raises (or fails its final "proof" line) when contained, so the same program
doubles as a `rewards.code:tests_pass` solution that could only score by escaping. Needs
root for the full jail (namespaces, uid switch); as another user the attacks are skipped.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from k3post.rewards.sandbox import SANDBOX_UIDS, SandboxLimits, SandboxResult, run_python
from rewards import code as code_reward

ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not ROOT, reason="the full jail (namespaces, uid switch) needs root")
OUTPUT_CAP = 4096


class Listener:
    """A server the sandbox must not reach: TCP on 127.0.0.1 and an abstract unix socket."""

    def __init__(self, family: int, address):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.address = self.sock.getsockname()
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


@dataclass
class Host:
    tcp: Listener
    unix: Listener
    run_socket: Listener  # a world-connectable unix socket in /run: filesystem sockets ignore network namespaces
    shm_file: Path  # a world-readable POSIX shared-memory object of the host
    marker: Path  # a host file only the host sees; "proof" lines try to read it
    token: str
    shared_dir: Path  # world-writable, on the host's root file system
    secret_file: Path  # mode 600, root's
    secret: str
    env_name: str
    escape_tmp: Path
    escape_late: Path

    def fields(self) -> dict:
        proof = f"assert open({str(self.marker)!r}).read() == {self.token!r}, 'no host access'"
        return dict(port=self.tcp.address[1], abstract=self.unix.address, proof=proof, shared=str(self.shared_dir),
                    run_socket=self.run_socket.address, shm_file=str(self.shm_file),
                    secret_file=str(self.secret_file), env_name=self.env_name, escape_tmp=str(self.escape_tmp),
                    escape_late=str(self.escape_late), test_pid=os.getpid())


@pytest.fixture(scope="module")
def host():
    tag = uuid.uuid4().hex
    # Not under /tmp: a world-writable directory that the jail does not mask.
    shared_dir = Path("/var/lib") / f"k3post-attack-{tag}"
    shared_dir.mkdir()
    shared_dir.chmod(0o1777)
    secret_file = shared_dir / "secret"
    secret = f"root-only-{tag}"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    marker = Path(f"/tmp/k3post-marker-{tag}")
    marker.write_text(tag)
    marker.chmod(0o644)
    env_name = f"K3POST_TEST_SECRET_{tag[:8]}"
    os.environ[env_name] = f"env-secret-{tag}"
    tcp = Listener(socket.AF_INET, ("127.0.0.1", 0))
    unix = Listener(socket.AF_UNIX, f"\0k3post-attack-{tag}")
    run_socket = Listener(socket.AF_UNIX, f"/run/k3post-attack-{tag}.sock")
    os.chmod(run_socket.address, 0o777)
    shm_file = Path(f"/dev/shm/k3post-attack-{tag}")
    shm_file.write_text(secret)
    shm_file.chmod(0o644)
    state = Host(tcp, unix, run_socket, shm_file, marker, tag, shared_dir, secret_file, secret, env_name,
                 Path(f"/tmp/k3post-escape-{tag}"), Path(f"/tmp/k3post-escape-late-{tag}"))
    yield state
    for listener in (tcp, unix, run_socket):
        listener.close()
    Path(run_socket.address).unlink(missing_ok=True)
    del os.environ[env_name]
    for path in (marker, shm_file, state.escape_tmp, state.escape_late):
        path.unlink(missing_ok=True)
    for child in shared_dir.iterdir():
        child.unlink()
    shared_dir.rmdir()


def sandbox_processes() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in SANDBOX_UIDS:
                    found.append(int(entry))
            except FileNotFoundError:
                pass
    return found


def assert_no_survivors():
    deadline = time.monotonic() + 3
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def failed(result: SandboxResult, *needles: str):
    assert not result.ok, result
    for needle in needles:
        assert needle in result.stderr, result.stderr[-1500:]


# Each attack: (name, payload template, timeout, host-side check(result, host)).
ATTACKS = [
    ("tcp_to_host_loopback",
     "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')",
     2.0, lambda r, h: (failed(r, "Network is unreachable"), r.network_isolated, h.tcp.accepted == 0)),
    ("abstract_unix_socket",
     "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({abstract!r})",
     2.0, lambda r, h: (failed(r, "ConnectionRefusedError"), h.unix.accepted == 0)),
    ("unix_socket_in_run",
     "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({run_socket!r})",
     2.0, lambda r, h: (failed(r, "FileNotFoundError"), h.run_socket.accepted == 0)),
    ("read_host_shared_memory",
     "print(open({shm_file!r}).read())",
     2.0, lambda r, h: (failed(r, "FileNotFoundError"), h.secret not in r.stdout)),
    ("write_host_tmp",
     "open({escape_tmp!r}, 'w').write('escaped')\n{proof}",
     2.0, lambda r, h: (failed(r, "No such file"), not h.escape_tmp.exists())),
    ("write_world_writable_host_dir",
     "open({shared!r} + '/escape', 'w').write('escaped')",
     2.0, lambda r, h: (failed(r, "No such file"), not (h.shared_dir / "escape").exists())),
    ("write_through_proc_root",
     "open('/proc/1/root' + {shared!r} + '/escape2', 'w').write('escaped')",
     2.0, lambda r, h: (failed(r), not (h.shared_dir / "escape2").exists())),
    ("read_environment_secret",
     "import os\nprint(dict(os.environ))\nassert {env_name!r} in os.environ",
     2.0, lambda r, h: (failed(r, "AssertionError"), os.environ[h.env_name] not in r.stdout + r.stderr)),
    ("read_root_only_file",
     "print(open({secret_file!r}).read())",
     2.0, lambda r, h: (failed(r, "FileNotFoundError"), h.secret not in r.stdout)),
    ("read_parent_environ",
     "print(open('/proc/{test_pid}/environ').read())",
     2.0, lambda r, h: (failed(r), os.environ[h.env_name] not in r.stdout)),
    ("kill_parent",
     "import os, signal\n"
     "for kill in (lambda: os.kill({test_pid}, 9), lambda: os.kill(os.getppid(), 9),\n"
     "             lambda: os.killpg(os.getpgid(os.getppid()), 9), lambda: os.kill(-1, 9)):\n"
     "    try:\n        kill()\n    except OSError as error:\n        print('blocked', error)\n{proof}",
     2.0, lambda r, h: (failed(r), os.kill(os.getppid(), 0) is None)),
    ("fork_bomb",
     "import os\nrefused = False\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
     "        if not refused:\n            refused = True\n            print('fork refused', flush=True)",
     1.0, lambda r, h: (r.timed_out, "fork refused" in r.stdout, r.wall_s < 3, assert_no_survivors())),
    ("daemon_outlives_its_parent",
     "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
     "        time.sleep(5)\n        open({escape_late!r}, 'w').write('late')\n    os._exit(0)\n{proof}",
     3.0, lambda r, h: (failed(r), r.wall_s < 2, assert_no_survivors(), not h.escape_late.exists())),
    ("infinite_loop", "while True:\n    pass",
     1.0, lambda r, h: (r.timed_out, r.killed_reason == "timeout", r.exit_code == -9, r.wall_s < 2.5)),
    ("sleep_forever", "import time\ntime.sleep(100)",
     1.0, lambda r, h: (r.timed_out, r.wall_s < 2.5)),
    ("memory_bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))",
     3.0, lambda r, h: (failed(r, "MemoryError"), not r.timed_out)),
    ("huge_output", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
     2.0, lambda r, h: (r.killed_reason == "output_limit", len(r.stdout) <= OUTPUT_CAP)),
    ("huge_file", "with open('big', 'wb') as f:\n    for _ in range(64):\n        f.write(b'0' * 2**20)",
     2.0, lambda r, h: failed(r, "File too large")),
    ("fill_the_disk", "for i in range(64):\n    open(f'f{{i}}', 'wb').write(b'0' * 8 * 2**20)",
     2.0, lambda r, h: failed(r, "No space left on device")),
    ("regain_root", "import os\nos.setuid(0)",
     2.0, lambda r, h: failed(r, "PermissionError")),
]
LIMITS = dict(memory_bytes=256 * 2**20, max_output_bytes=OUTPUT_CAP, max_file_bytes=16 * 2**20,
              scratch_bytes=32 * 2**20)


@pytest.mark.parametrize("name,payload,timeout_s,check", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_is_contained(host, name, payload, timeout_s, check):
    result = run_python(payload.format(**host.fields()), SandboxLimits(timeout_s=timeout_s, **LIMITS))
    outcomes = check(result, host)
    assert all(o is not False for o in (outcomes if isinstance(outcomes, tuple) else (outcomes,))), (name, result)
    assert result.isolation and all(result.isolation.values()), result


@pytest.mark.parametrize("name,payload,timeout_s,check", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_scores_zero_as_a_code_solution(host, name, payload, timeout_s, check):
    program = payload.format(**host.fields()) + "\n\ndef add(a, b):\n    return a + b\n"
    meta = {"tests": ["assert add(1, 2) == 3"]}
    out = code_reward.tests_pass("", f"```python\n{program}```", meta, timeout_s=min(timeout_s, 1.5))
    assert out["reward"] == 0.0, (name, out)


def test_harmless_control_scores_one(host):
    """The zero above comes from containment: the same wrapper around a harmless payload scores 1."""
    program = "x = 1\n\ndef add(a, b):\n    return a + b\n"
    assert code_reward.tests_pass("", f"```python\n{program}```", {"tests": ["assert add(1, 2) == 3"]})["reward"] == 1.0


def test_fresh_private_workdir_is_deleted_afterwards():
    result = run_python("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nopen('left', 'w').write('x')")
    cwd, listing = result.stdout.splitlines()
    assert result.ok and listing == "['main.py']"
    assert not Path(cwd).exists()


def test_without_isolation_the_flags_say_so():
    result = run_python("print('hi')", isolate=False)
    assert result.ok and result.stdout == "hi\n"
    jail = ("network", "filesystem", "pid", "uid", "ipc", "keyring", "seccomp")
    assert {key: result.isolation[key] for key in jail} == dict.fromkeys(jail, False)
    assert not result.network_isolated
