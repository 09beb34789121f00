"""One cgroup per sandbox run: every process of the run counted, capped and killable at once.

Made by the trusted parent before the jail starts; the jail's launcher moves itself in as its first
step, so everything the run ever starts is inside. What the host offers decides what we get:

- cgroup v2 with the memory and pids controllers delegable (a root VM, a systemd host as root):
  `<v2 mount>/k3post-sandbox/<run>` with memory.max (swap off), pids.max and cgroup.kill;
- a hybrid host (v1 controllers, v2 "unified" without them — e.g. a 2-core CPU machine k3post was tested on): the
  v2 cgroup for cgroup.kill, plus v1 `memory` (limit_in_bytes, memsw) and `pids` cgroups under the
  caller's own v1 cgroups;
- not root, but the caller's own cgroup delegated to its uid (a systemd unit or user session with
  `Delegate=yes`, a container given its cgroup subtree): the same, made under that cgroup. A
  process may move only between cgroups whose common ancestor's cgroup.procs it can write, so runs
  live below the caller's own cgroup. Controllers usually cannot be enabled there while the
  trainer itself lives in that cgroup (cgroup v2's "no internal processes" rule): then kill-only;
- no writable cgroup file system (non-root without delegation, most containers): nothing; the
  flags say so and the run relies on its PID namespace and rlimits (docs/rewards.md, threat model).

The memory limit covers what RLIMIT_AS cannot: memfds, tmpfs pages and kernel memory of the run's
processes, summed over all of them. `kill()` is cgroup.kill where there is one, else a SIGKILL
sweep of cgroup.procs (repeated until empty; pids.max bounds a fork race).
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

BASE = "k3post-sandbox"


@dataclass(frozen=True)
class _Hierarchies:
    v2: Path | None  # the directory under which run cgroups are made (v2)
    v2_limits: bool  # memory and pids controllers enabled there
    v1_memory: Path | None
    v1_pids: Path | None


def _mounts() -> dict[str, Path]:
    """Mount points by kind: "cgroup2", "memory", "pids" (v1), from /proc/self/mountinfo."""
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, extra = left.split(), right.split()
        if len(fields) < 5 or len(extra) < 3:
            continue
        if extra[0] == "cgroup2":
            found.setdefault("cgroup2", Path(fields[4]))
        elif extra[0] == "cgroup":
            for option in extra[2].split(","):
                if option in ("memory", "pids"):
                    found.setdefault(option, Path(fields[4]))
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and "" for v2, from /proc/self/cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
        return True
    except OSError:
        return False


def _v2_base(mount: Path) -> tuple[Path | None, bool]:
    """`<mount>/k3post-sandbox` with memory+pids delegated if the host allows, else kill-only."""
    base = mount / BASE
    try:
        base.mkdir(exist_ok=True)
    except OSError:
        return None, False
    available = set((mount / "cgroup.controllers").read_text().split()) if (mount / "cgroup.controllers").exists() else set()
    if not {"memory", "pids"} <= available:
        return base, False
    limits = _write(mount / "cgroup.subtree_control", "+memory +pids") and \
        _write(base / "cgroup.subtree_control", "+memory +pids")
    return base, limits


def _v1_base(mount: Path | None, own: str | None) -> Path | None:
    if mount is None or own is None:
        return None
    base = mount / own.lstrip("/") / BASE
    try:
        base.mkdir(exist_ok=True)
    except OSError:
        return None
    return base


@functools.lru_cache(maxsize=1)
def hierarchies() -> _Hierarchies:
    """What this host offers to this process's uid (looked up once per process): a run directory
    is tried under the caller's own cgroup of each hierarchy; without root or delegation every
    mkdir fails with EACCES (or EROFS) and nothing is used."""
    mounts, own = _mounts(), _own_paths()
    v2, v2_limits = _v2_base(mounts["cgroup2"] / own.get("", "/").lstrip("/")) if "cgroup2" in mounts else (None, False)
    if v2_limits:
        return _Hierarchies(v2, True, None, None)
    return _Hierarchies(v2, False, _v1_base(mounts.get("memory"), own.get("memory")),
                        _v1_base(mounts.get("pids"), own.get("pids")))


@dataclass
class RunCgroup:
    """The cgroups of one run (possibly none). `flags` says which layers hold."""

    dirs: list[Path] = field(default_factory=list)
    kill_file: Path | None = None
    memory_dir: Path | None = None
    flags: dict[str, bool] = field(default_factory=lambda: {"cgroup_kill": False, "cgroup_memory": False,
                                                             "cgroup_pids": False})

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> "RunCgroup":
        found, run = hierarchies(), cls()
        name = f"run-{uuid.uuid4().hex[:12]}"
        if found.v2 is not None and run._make(found.v2 / name):
            run.kill_file = found.v2 / name / "cgroup.kill"
            run.flags["cgroup_kill"] = run.kill_file.exists()
            if found.v2_limits:
                run.flags["cgroup_memory"] = _write(found.v2 / name / "memory.max", str(memory_bytes))
                _write(found.v2 / name / "memory.swap.max", "0")
                run.flags["cgroup_pids"] = _write(found.v2 / name / "pids.max", str(max_pids))
                run.memory_dir = found.v2 / name
        if found.v1_memory is not None and run._make(found.v1_memory / name):
            directory = found.v1_memory / name
            run.flags["cgroup_memory"] = _write(directory / "memory.limit_in_bytes", str(memory_bytes))
            _write(directory / "memory.memsw.limit_in_bytes", str(memory_bytes))  # absent without swap accounting
            run.memory_dir = directory
        if found.v1_pids is not None and run._make(found.v1_pids / name):
            run.flags["cgroup_pids"] = _write(found.v1_pids / name / "pids.max", str(max_pids))
        return run

    def _make(self, directory: Path) -> bool:
        try:
            directory.mkdir()
        except OSError:
            return False
        self.dirs.append(directory)
        return True

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found = set()
        for path in self.procs_files:
            try:
                found.update(int(pid) for pid in Path(path).read_text().split())
            except OSError:
                pass
        return found

    def memory_peak(self) -> int | None:
        """Peak memory charged to the run (v2 memory.peak or v1 max_usage_in_bytes), if known."""
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            if self.memory_dir is not None and (self.memory_dir / name).exists():
                try:
                    return int((self.memory_dir / name).read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    return None
        return None

    def kill(self) -> None:
        """SIGKILL every process of the run: cgroup.kill, then a sweep for the v1-only case."""
        if self.kill_file is not None and self.flags["cgroup_kill"]:
            _write(self.kill_file, "1")
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Wait until the run's cgroups are empty, then remove them; False if one stayed."""
        deadline = time.monotonic() + timeout_s
        removed = True
        for directory in reversed(self.dirs):
            while True:
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        removed = False
                        break
                    self.kill()
                    time.sleep(0.002)
        return removed
