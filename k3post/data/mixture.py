"""The prompt mixture: which training prompts each step sees, with resumable state.

Each source keeps `heldout` rows aside for evaluation (picked by a stable hash of the row id, so
the held-out set does not depend on the seed or on row order) and serves the rest in epochs of
a seeded permutation. A batch of n prompts is split across sources in proportion to the weights
with largest-remainder rounding. The rounding debt of earlier batches is carried into the next
quota, so that small batches still follow the weights over time (with weights 1:1:1 and n=8 the
short source rotates instead of always being the last one).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from k3post.config.errors import UserError
from k3post.data.prompt_length import LengthReport, length_metrics
from k3post.data.sources import HELDOUT_MARK
from k3post.types import Prompt

_STATE_VERSION = 1


@dataclass(frozen=True)
class PromptSource:
    """One data source of the mixture; the config layer builds these from the recipe."""

    name: str
    rows: list[dict]  # normalised rows from load_prompt_rows
    teacher: str
    weight: float = 1.0
    heldout: int = 16  # rows reserved for evaluation, never trained on
    lengths: LengthReport | None = None  # rows the prompt-length policy dropped or truncated


def _digest(text: str) -> bytes:
    """A hash that is the same in every process (python's hash() of str is salted)."""
    return hashlib.sha256(text.encode("utf-8")).digest()


def _to_prompt(source: PromptSource, row: dict) -> Prompt:
    messages = tuple((str(role), str(content)) for role, content in row["messages"])
    return Prompt(uid=f"{source.name}/{row['id']}", source=source.name, teacher=source.teacher,
                  messages=messages)


class _Stream:
    """The training rows of one source, served in epochs of a permutation seeded by (seed, name, epoch)."""

    def __init__(self, source: PromptSource, seed: int):
        self.name = source.name
        ranked = sorted(range(len(source.rows)), key=lambda i: _digest(str(source.rows[i]["id"])))
        # A source with a held-out file (data/sources.py: HELDOUT_MARK) holds out exactly that file's rows.
        marked = {i for i, row in enumerate(source.rows) if row.get(HELDOUT_MARK)}
        held = marked or set(ranked[: source.heldout])
        # Both lists keep file order; only the epoch permutation decides the training order.
        self.heldout = [_to_prompt(source, r) for i, r in enumerate(source.rows) if i in held]
        self.train = [_to_prompt(source, r) for i, r in enumerate(source.rows) if i not in held]
        self.fingerprint = _digest("\n".join(p.uid for p in self.train)).hex()[:16]
        # Of the rows' text too: ids made from row positions ("p-0", ...) stay the same when a file's
        # prompts are edited in place, and a resume must not go on over other prompts unnoticed.
        self.content = _digest(repr([(p.uid, p.messages) for p in self.train])).hex()[:16]
        self.seed = seed
        self.epoch, self.pos, self.drawn = 0, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        # Derived from the seed, the source name and the epoch only, so a resumed stream can
        # rebuild the current epoch's order from (epoch, pos) alone.
        key = int.from_bytes(_digest(f"{self.seed}/{self.name}/{epoch}")[:8], "big")
        order = list(range(len(self.train)))
        random.Random(key).shuffle(order)
        return order

    def take(self, k: int) -> list[Prompt]:
        out = []
        for _ in range(k):
            if self.pos == len(self._order):  # epoch done: reshuffle
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.train[self._order[self.pos]])
            self.pos += 1
        self.drawn += k
        return out

    def state(self) -> dict:
        return {"name": self.name, "num_train": len(self.train), "fingerprint": self.fingerprint,
                "content": self.content, "epoch": self.epoch, "pos": self.pos, "drawn": self.drawn}

    def restore(self, state: dict) -> None:
        self.epoch, self.pos, self.drawn = int(state["epoch"]), int(state["pos"]), int(state["drawn"])
        self._order = self._permutation(self.epoch)


def _round_to_total(quotas: list[float], n: int) -> list[int]:
    """Non-negative integers summing to n close to `quotas` (largest remainder when all ≥ 0)."""
    counts = [max(0, math.floor(q)) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    while sum(counts) < n:
        for i in by_remainder[: n - sum(counts)]:
            counts[i] += 1
    # A carried surplus can make the floors overshoot; give back where the overshoot is largest.
    while sum(counts) > n:
        i = min((i for i in range(len(counts)) if counts[i] > 0),
                key=lambda i: (quotas[i] - counts[i], -i))
        counts[i] -= 1
    return counts


class PromptMixture:
    """Weighted, seeded, resumable sampler of training prompts over several sources."""

    def __init__(self, sources: list[PromptSource], seed: int):
        _validate(sources)
        self.sources = list(sources)
        self.seed = int(seed)
        self._streams = [_Stream(s, self.seed) for s in self.sources]

    def input_metrics(self) -> dict[str, int]:
        """What the prompt-length policy did to each source (data/long_prompts_*/<source>), for
        the first logged row of a run."""
        return length_metrics({s.name: s.lengths for s in self.sources if s.lengths is not None})

    def next_batch(self, n: int) -> list[Prompt]:
        """The next n training prompts, grouped by source in source order."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        total_w = sum(s.weight for s in self.sources)
        done = sum(st.drawn for st in self._streams)
        # Each source's share of everything drawn so far plus this batch, minus what it already got.
        quotas = [(done + n) * s.weight / total_w - st.drawn
                  for s, st in zip(self.sources, self._streams)]
        counts = _round_to_total(quotas, n)
        return [p for st, k in zip(self._streams, counts) for p in st.take(k)]

    def peek_batch(self, n: int) -> list[Prompt]:
        """The prompts the next `next_batch(n)` will return, left undrawn (the position is put back)."""
        saved = [st.state() for st in self._streams]
        out = self.next_batch(n)
        for st, state in zip(self._streams, saved):
            st.restore(state)
        return out

    def heldout(self, source_name: str | None = None) -> list[Prompt]:
        """The held-out prompts of one source, or of all sources in source order."""
        if source_name is None:
            return [p for st in self._streams for p in st.heldout]
        for st in self._streams:
            if st.name == source_name:
                return list(st.heldout)
        raise UserError(f"unknown prompt source {source_name!r}; sources: "
                        f"{', '.join(s.name for s in self.sources)}")

    def teachers(self) -> list[str]:
        """Distinct teacher names, in the order their first source appears."""
        return list(dict.fromkeys(s.teacher for s in self.sources))

    def state_dict(self) -> dict:
        """JSON-serialisable position of every source stream (the orders are rebuilt from the seed)."""
        return {"version": _STATE_VERSION, "seed": self.seed,
                "sources": [st.state() for st in self._streams]}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`; refuses state from a mixture with other sources or seed."""
        problem = _state_mismatch(state, self.seed, [st.state() for st in self._streams])
        if problem:
            raise UserError(f"cannot resume the prompt mixture: {problem}")
        for st, saved in zip(self._streams, state["sources"]):
            st.restore(saved)


def _state_mismatch(state: dict, seed: int, current: list[dict]) -> str | None:
    """Why `state` cannot be resumed by a mixture with this seed and these streams (None if it can)."""
    if state.get("version") != _STATE_VERSION:
        return f"state version {state.get('version')!r}, expected {_STATE_VERSION}"
    if state.get("seed") != seed:
        return f"it was saved with seed {state.get('seed')!r}, this run uses seed {seed}"
    saved = state.get("sources", [])
    if [s["name"] for s in saved] != [s["name"] for s in current]:
        return (f"it was saved with sources {[s['name'] for s in saved]}, this run has "
                f"{[s['name'] for s in current]}")
    for old, new in zip(saved, current):
        if (old["num_train"], old["fingerprint"]) != (new["num_train"], new["fingerprint"]):
            return (f"the training rows of source {new['name']!r} changed since the state was "
                    f"saved ({old['num_train']} rows then, {new['num_train']} now)")
        if old.get("content", new["content"]) != new["content"]:  # states saved before it have none
            return (f"the training prompts of source {new['name']!r} changed since the state was saved "
                    f"(the same {new['num_train']} rows and ids, other text): resume with the data it was "
                    f"made from, or pass --restart")
    return None


def _validate(sources: list[PromptSource]) -> None:
    """Reject mixtures that cannot be sampled, naming the source at fault."""
    if not sources:
        raise UserError("the prompt mixture needs at least one source")
    seen: set[str] = set()
    for s in sources:
        if s.name in seen:
            raise UserError(f"prompt source {s.name!r} is listed twice; source names must be unique")
        seen.add(s.name)
        if not (isinstance(s.weight, (int, float)) and math.isfinite(s.weight) and s.weight > 0):
            raise UserError(f"prompt source {s.name!r}: weight must be a number > 0, got {s.weight!r}")
        if not isinstance(s.heldout, int) or s.heldout < 0:
            raise UserError(f"prompt source {s.name!r}: heldout must be an integer >= 0, got {s.heldout!r}")
        marked = sum(1 for row in s.rows if row.get(HELDOUT_MARK))
        if marked and marked == len(s.rows):
            raise UserError(f"prompt source {s.name!r}: its training file has no rows that are not held out")
        if not marked and s.heldout >= len(s.rows):
            raise UserError(
                f"prompt source {s.name!r}: heldout={s.heldout} leaves no training rows "
                f"(the source has {len(s.rows)} rows); heldout must be smaller than that"
            )
