"""Speculative rollouts in the HF engines: the student's MTP head drafts, the student verifies
(model/generation/speculative_sampling.py in the plain engine, model/generation/fast_speculation.py in the static-cache
one), and the engine decides call by call whether it pays.

The head arrives with the student at every weight sync (the learner sends it under `mtp.`
names: engine/learner/draft_trainer.py), so the drafts track the student as it trains.

The rule (algo/speculation_rule.py) compares the measured seconds of a speculative round with
the measured seconds of a plain decode step. Both are measured on this engine: the first call
speculates, the second runs plain (and so do the next ones while speculating, until a plain call
is measured cleanly), and after that every `PROBE_EVERY`-th call runs the mode not in use, so a
stale measurement cannot keep the engine in the wrong mode. A switch is logged once.

A call during which torch.compile built a graph measures the compilation, not the mode (on a GPU
the static engines compile each new batch and prompt-bucket shape: seconds against a round's
milliseconds, and a speculative engine's second call at a shape compiles its first round), so its
seconds are not kept: the rule goes on with the last clean measurement of that mode.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from k3post.algo.speculation_rule import speculation_pays, steps_per_round
from k3post.model.generation.draft_head import MtpHead
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.fast_speculation import StaticSpeculativeDecoder
from k3post.model.generation.sampling import Completions, eos_ids, sample_completions
from k3post.model.generation.speculative_sampling import SpeculativeDecoder
from k3post.model.training.weights import import_weights
from k3post.types import SamplingParams

logger = logging.getLogger("k3post.engine.samplers.speculative_sampler")
PROBE_EVERY = 16
WEIGHT_PREFIX = "mtp."


def graphs_compiled() -> int:
    """How many graphs torch.compile has built in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return counters["stats"]["unique_graphs"]


class Speculation:
    """The head, the decoder and the on/off rule of one HF sampler. `static`: the static-cache
    engine's sampler (engine/samplers/fast_sampler.py): both modes then run on its caches
    (model/generation/fast_speculation.py), else on the plain engine's."""

    def __init__(self, model, tokenizer, tokens: int, min_accept: float, seed: int = 0, hidden: str = "final_norm",
                 static: StaticSampler | None = None):
        self.model, self.tokenizer, self.min_accept = model, tokenizer, min_accept
        self.head = MtpHead(model, seed, hidden=hidden)  # the learner's initial head: the same seed, the same student
        if static is None:
            self.decoder = SpeculativeDecoder(model, self.head, tokenizer.pad_token_id,
                                              eos_ids(tokenizer, model.generation_config), tokens)
            self._plain = partial(sample_completions, model, tokenizer)
        else:
            self.decoder, self._plain = StaticSpeculativeDecoder(static, self.head, tokens), static.sample
        self.on, self.calls, self.speculated = True, 0, False
        self.round_s = self.decode_step_s = 0.0
        self.last: dict[str, float] = {}

    def load_weights(self, weights: dict) -> dict:
        """Take the head's tensors out of a sync; returns the student's."""
        head = {k[len(WEIGHT_PREFIX):]: v for k, v in weights.items() if k.startswith(WEIGHT_PREFIX)}
        if not head:
            raise ValueError("weight sync carries no draft head (mtp.*): the learner must run with draft.speculate")
        import_weights(self.head, head)
        return {k: v for k, v in weights.items() if not k.startswith(WEIGHT_PREFIX)}

    def complete(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        self.calls += 1
        # While speculating without a clean plain measurement (the probe compiled), probe again at
        # once: else a round that does not pay would run until the next periodic probe.
        unmeasured = self.on and self.decode_step_s == 0.0
        probe = self.calls > 1 and (unmeasured or self.calls % PROBE_EVERY == 0)
        self.speculated = speculate = self.on != probe
        start, graphs = time.perf_counter(), graphs_compiled()
        if speculate:
            out, stats = self.decoder.sample(prompt_ids, params)  # a `residual` head: inside head.reading()
            if graphs_compiled() == graphs:
                self.round_s = (time.perf_counter() - start) / max(stats.rounds, 1)  # a plain call: per decode step
            self.last = {"rollout/draft_acceptance_length": stats.acceptance_length,
                         "rollout/draft_steps_per_round": steps_per_round(out.completion_ids_BT.shape[1], stats.rounds),
                         "rollout/draft_accepted": float(stats.accepted),
                         "rollout/draft_proposed": float(stats.drafted),
                         "rollout/draft_round_s": self.round_s}
        else:
            out = self._plain(prompt_ids, params)
            if graphs_compiled() == graphs:
                self.decode_step_s = (time.perf_counter() - start) / max(out.completion_ids_BT.shape[1], 1)
        self._decide()
        return out

    def _decide(self) -> None:
        length = self.last.get("rollout/draft_acceptance_length", 0.0)
        steps = self.last.get("rollout/draft_steps_per_round", 0.0)
        pays = speculation_pays(length, steps, self.round_s, self.decode_step_s, self.min_accept, self.on)
        if pays != self.on:
            seconds = lambda s: f"{s:.4f} s" if s > 0 else "not measured yet"  # noqa: E731
            logger.warning("speculative rollouts %s: acceptance length %.2f, a round replaces %.2f decode steps and "
                           "takes %s against a decode step %s (draft.speculate.min_accept %.2f)",
                           "on" if pays else "off", length, steps, seconds(self.round_s), seconds(self.decode_step_s),
                           self.min_accept)
            self.on = pays
        self.last["rollout/speculating"] = float(self.on)
