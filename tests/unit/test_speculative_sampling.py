"""Speculative rollouts with the real code on tiny real HF models, in both HF engines (the plain
one's decoder, model/generation/speculative_sampling.py, and the static-cache one's, model/generation/fast_speculation.py):
the samples follow the student's distribution (chi-square against the exact law), greedy is greedy,
the logprobs are the student's, and stops, budgets and batch rows behave."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import k3post.model.generation.fast_speculation as fast_module
import k3post.model.generation.speculative_sampling as spec_module
from k3post.algo.speculative import acceptance_probs, accept_count_probs
from k3post.algo.token_draws import draw, sampling_probs
from k3post.model.generation.draft_head import MtpHead
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.fast_speculation import StaticSpeculativeDecoder
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.model.generation.speculative_sampling import Emitted, SpeculativeDecoder, emit_round
from k3post.types import SamplingParams

EOS, PAD = 3, 0


def tiny(vocab: int, seed: int, dtype=torch.float32, std: float = 0.5) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         initializer_range=std, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).to(dtype).eval()


def decoder(model, K: int, head_seed: int = 1, copying: bool = False, cache: str = "dynamic"):
    """The plain engine's speculative decoder, or (cache "static") the static-cache engine's."""
    head = copy_head(model) if copying else MtpHead(model, head_seed)
    if cache == "static":
        return StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, K)
    return SpeculativeDecoder(model, head, PAD, [EOS], K)


@torch.no_grad()
def copy_head(model) -> MtpHead:
    """A head whose draft for x_{t+2} is the student's own guess for x_{t+1} (eh_proj picks h_t, the
    block adds nothing): on a student whose greedy text repeats itself it is often right, so greedy
    runs exercise accepted drafts and rejected ones (holes) in the same batch."""
    head = MtpHead(model, 0)
    d = model.config.hidden_size
    head.eh_proj.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], 1).to(head.eh_proj.weight.dtype))
    head.block.self_attn.o_proj.weight.zero_()
    head.block.mlp.down_proj.weight.zero_()
    return head


@torch.no_grad()
def exact_law(model, prompt: list[int], length: int, temperature: float, top_p: float) -> dict[tuple, float]:
    """P(completion) for every completion of up to `length` tokens (ending at EOS or at the budget)."""
    law: dict[tuple, float] = {}
    for seq in itertools.product(range(model.config.vocab_size), repeat=length):
        cut = next((i + 1 for i, t in enumerate(seq) if t == EOS), length)
        law.setdefault(seq[:cut], 0.0)
    for outcome in law:
        ids = torch.tensor([prompt + list(outcome)])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
        p = sampling_probs(logits, temperature, top_p)
        law[outcome] = float(p.gather(-1, torch.tensor(outcome)[:, None]).prod())
    return law


def chi_square_p(counts: dict[tuple, int], law: dict[tuple, float], n: int) -> float:
    """The p-value of Pearson's chi-square over the outcomes of positive probability; an outcome
    of probability 0 that was drawn gives 0."""
    if any(law.get(k, 0.0) == 0.0 for k in counts):
        return 0.0
    cells = [k for k, p in law.items() if p > 0]
    stat = sum((counts.get(k, 0) - n * law[k]) ** 2 / (n * law[k]) for k in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def completion_counts(out) -> dict[tuple, int]:
    """How often each completion (its tokens up to its length) came out, counted without a Python
    loop over the rows."""
    lengths = out.loss_mask_BT.sum(1).long()
    ids = out.completion_ids_BT.masked_fill(torch.arange(out.completion_ids_BT.shape[1])[None] >= lengths[:, None], -1)
    rows, counts = torch.unique(ids, dim=0, return_counts=True)
    return {tuple(t for t in row if t >= 0): c for row, c in zip(rows.tolist(), counts.tolist())}


def law_p(model, K: int, params: SamplingParams, samples: int, cache: str) -> float:
    """The chi-square p-value of `samples` speculative completions of [1, 2] against the student's
    exact law, drawn in one batched call of the plain engine's decoder (cache "dynamic") or the
    static-cache engine's (model/generation/fast_speculation.py)."""
    out, stats = decoder(model, K, cache=cache).sample([[1, 2]] * samples, params)
    assert 0 < stats.accepted < stats.drafted
    counts = completion_counts(out)
    assert sum(counts.values()) == samples
    law = exact_law(model, [1, 2], params.max_new_tokens, params.temperature, params.top_p)
    return chi_square_p(counts, law, samples)


# 2·10^5 samples per seed in one batched call: 21-37 s each on 2 cores (measured 2026-12-04; the
# model's forwards over 2·10^5 rows, not Python, take the time), so opt-in; the quick case below
# runs in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("seed, K, temperature, top_p", [(0, 2, 1.0, 1.0), (1, 3, 0.8, 0.9), (2, 1, 1.3, 0.95)])
def test_speculative_samples_follow_the_students_law(seed, K, temperature, top_p, cache):
    assert law_p(tiny(4, seed), K, SamplingParams(3, temperature, top_p, seed), 200_000, cache) > 1e-3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_speculative_samples_follow_the_students_law_quick(cache):
    assert law_p(tiny(4, 1), 3, SamplingParams(3, 0.8, 0.9, 1), 40_000, cache) > 1e-3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_chi_square_check_catches_a_biased_rule(monkeypatch, cache):
    """Resampling from p instead of the residual (a classic bug) must fail the same check."""
    def biased(p_BK1V, q_BKV, draft_BK):
        accepted_B = draw(accept_count_probs(acceptance_probs(p_BK1V[:, :-1], q_BKV, draft_BK)))
        return accepted_B, draw(p_BK1V[torch.arange(len(accepted_B)), accepted_B])
    monkeypatch.setattr(spec_module if cache == "dynamic" else fast_module, "verify_draft", biased)
    assert law_p(tiny(4, 0), 2, SamplingParams(3, 1.0, 1.0, 0), 40_000, cache) < 1e-6


PROMPTS = [[1, 2], [2], [1, 1, 2, 1], [2, 1, 1], [1], [2, 2, 1, 2, 1]] * 4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_greedy_and_temperature_towards_zero_equal_greedy_decoding(K, cache):
    model = tiny(8, 4, std=0.8)
    plain = StaticSampler(model, PAD, [EOS], min_bucket=4).sample(PROMPTS, SamplingParams(12, 1.0, 1.0, 0), greedy=True)
    dec = decoder(model, K, copying=True, cache=cache)
    greedy, stats = dec.sample(PROMPTS, SamplingParams(12, 1.0, 1.0, 0), greedy=True)
    assert torch.equal(greedy.completion_ids_BT, plain.completion_ids_BT)
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # both branches ran, rows differ
    cold, _ = dec.sample(PROMPTS, SamplingParams(12, 1e-4, 1.0, 0))
    assert torch.equal(cold.completion_ids_BT, plain.completion_ids_BT)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("K", [1, 3])
def test_stored_logprobs_are_the_students_teacher_forced_ones(K, cache):
    model = tiny(8, 5, dtype=torch.float64, std=0.8)
    params = SamplingParams(16, 0.9, 0.95, seed=3)
    out, stats = decoder(model, K, cache=cache).sample(PROMPTS, params)
    assert 0 < stats.accepted < stats.drafted
    recomputed = completion_logprobs(model, PROMPTS, out.completion_ids_BT, out.loss_mask_BT, PAD, params.temperature)
    assert (recomputed - out.logprobs_BT).abs().max() < 1e-6
    assert (out.logprobs_BT[out.loss_mask_BT == 0] == 0).all()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batch_rows_do_not_depend_on_each_others_acceptance(cache):
    model = tiny(8, 4, std=0.8)
    dec = decoder(model, 3, copying=True, cache=cache)
    together, _ = dec.sample(PROMPTS[:6], SamplingParams(12, 1.0, 1.0, 0), greedy=True)
    for b, prompt in enumerate(PROMPTS[:6]):
        alone, _ = dec.sample([prompt], SamplingParams(12, 1.0, 1.0, 0), greedy=True)
        width = alone.completion_ids_BT.shape[1]
        assert torch.equal(together.completion_ids_BT[b, :width], alone.completion_ids_BT[0])
        assert int(together.loss_mask_BT[b].sum()) == int(alone.loss_mask_BT[0].sum())


def emitted(B: int, N: int) -> Emitted:
    return Emitted(torch.full((B, N), PAD), torch.zeros(B, N), torch.zeros(B, dtype=torch.long),
                   torch.ones(B, dtype=torch.bool))


def test_an_eos_inside_an_accepted_draft_ends_the_row_there():
    out = emitted(2, 8)
    tokens = torch.tensor([[5, EOS, 6, 7], [5, 6, 7, 4]])
    logprobs = -torch.arange(1.0, 9.0).reshape(2, 4)
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    assert emit_round(out, tokens, logprobs, valid, torch.tensor([EOS])) == 4
    assert out.tokens_BN[0, :3].tolist() == [5, EOS, PAD] and out.count_B.tolist() == [2, 2]
    assert out.running_B.tolist() == [False, True]
    assert out.logprobs_BN[0, :2].tolist() == [-1.0, -2.0] and out.logprobs_BN[1, :2].tolist() == [-5.0, -6.0]


def test_max_new_tokens_reached_mid_draft_truncates():
    out = emitted(1, 3)
    out.count_B[:] = 1
    assert emit_round(out, torch.tensor([[4, 5, 6, 7]]), torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool),
                      torch.tensor([EOS])) == 2
    assert out.tokens_BN[0, 1:].tolist() == [4, 5] and not out.running_B[0]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_budgets_and_stops_in_the_real_decoder(cache):
    model = tiny(4, 7)
    out, _ = decoder(model, 3, cache=cache).sample(PROMPTS, SamplingParams(5, 1.0, 1.0, 0))
    lengths = out.loss_mask_BT.sum(1)
    assert lengths.max() <= 5 and lengths.min() < lengths.max()
    for row, length in zip(out.completion_ids_BT.tolist(), lengths.long().tolist()):
        assert EOS not in row[:length - 1] and (length == 5 or row[length - 1] == EOS)


def test_the_rule_speculates_only_when_a_call_s_rounds_beat_its_decode_steps():
    from k3post.algo.speculation_rule import speculation_pays, steps_per_round  # noqa: PLC0415

    assert speculation_pays(2.0, 2.0, round_s=1.5, decode_step_s=1.0, min_accept=0.5)  # 2 steps in 1.5
    assert not speculation_pays(1.4, 1.4, round_s=1.5, decode_step_s=1.0, min_accept=0.0)  # 1.4 steps in 1.5
    # The rows' mean ℓ would pay; the call's slowest row makes a round replace 1.3 steps only: it does not.
    assert not speculation_pays(1.6, 1.3, round_s=1.5, decode_step_s=1.0, min_accept=0.5)
    assert not speculation_pays(2.0, 2.0, round_s=1.0, decode_step_s=1.0, min_accept=1.5)  # under the recipe's floor
    assert speculation_pays(1.0, 1.0, round_s=0.0, decode_step_s=0.0, min_accept=0.0)  # nothing measured yet
    assert not speculation_pays(1.0, 1.0, round_s=0.0, decode_step_s=0.0, min_accept=0.5)  # the floor still applies
    assert steps_per_round(256, 160) == 1.6 and steps_per_round(5, 0) == 5.0


def test_near_break_even_the_rule_keeps_the_mode_in_use():
    """A switch needs the other mode faster by SWITCH_MARGIN (3%): a round 2% slower or faster than
    the decode steps it replaces leaves the mode as it is; 4% switches it."""
    from k3post.algo.speculation_rule import SWITCH_MARGIN, speculation_pays  # noqa: PLC0415

    assert 0.02 < SWITCH_MARGIN < 0.04  # the cases below sit on either side of it
    for speculating in (True, False):
        for steps, pays in ((1.02, speculating), (0.98, speculating), (1.04, True), (0.96, False)):
            assert speculation_pays(2.0, steps, round_s=1.0, decode_step_s=1.0, min_accept=0.0,
                                    speculating=speculating) == pays, (speculating, steps)


def test_the_engine_s_rule_reads_a_call_s_steps_per_round_not_its_rows_mean(monkeypatch, tiny_spec):
    """The engine records s = (its longest row's tokens) / (its rounds) for each speculative call,
    and decides on s: a call whose rows' mean ℓ would pay but whose rounds replace too few decode
    steps switches speculation off."""
    from k3post.engine.samplers.speculative_sampler import Speculation  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    model, tokenizer = load_model(tiny_spec)
    engine = Speculation(model, tokenizer, tokens=2, min_accept=0.0)
    seen, sample = {}, engine.decoder.sample

    def recording(*args):
        seen["out"], seen["stats"] = result = sample(*args)
        return result

    monkeypatch.setattr(engine.decoder, "sample", recording)
    engine.complete([[1, 5, 9], [2, 7], [3]], SamplingParams(12, 1.0, 1.0, seed=0))
    out, stats = seen["out"], seen["stats"]
    assert engine.last["rollout/draft_steps_per_round"] == out.completion_ids_BT.shape[1] / stats.rounds
    engine.round_s, engine.decode_step_s = 1.5, 1.0
    for s, on in ((1.2, False), (1.8, True)):  # ℓ = 2 pays at 1.5 steps a round; s decides
        engine.last |= {"rollout/draft_acceptance_length": 2.0, "rollout/draft_steps_per_round": s}
        engine._decide()
        assert engine.on == on


def test_a_call_that_compiles_a_graph_does_not_feed_the_rule(monkeypatch, tiny_spec):
    """A call during which torch.compile built a graph timed the compilation: the rule keeps the
    last clean seconds of that mode (here, none yet: the floor alone decides)."""
    import time  # noqa: PLC0415

    from torch._dynamo.utils import counters  # noqa: PLC0415

    from k3post.engine.samplers.speculative_sampler import Speculation  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    model, tokenizer = load_model(tiny_spec)
    COMPILE_S = 1.0  # a call that compiled takes at least this long: well above a tiny model's call on a busy CPU
    speculation = Speculation(model, tokenizer, tokens=2, min_accept=0.0)

    def compiling_once(run):
        calls = []

        def wrapped(*args):
            if not calls:  # the first call at a shape: a graph is built, slowly
                counters["stats"]["unique_graphs"] += 1
                time.sleep(COMPILE_S)
            calls.append(1)
            return run(*args)
        return wrapped

    monkeypatch.setattr(speculation.decoder, "sample", compiling_once(speculation.decoder.sample))
    speculation._plain = compiling_once(speculation._plain)
    prompts, params = [[1, 5, 9], [2, 7]], SamplingParams(6, 1.0, 1.0, seed=0)
    speculation.complete(prompts, params)  # speculates, compiles
    assert speculation.round_s == 0.0 and speculation.last["rollout/draft_proposed"] > 0
    speculation.complete(prompts, params)  # the plain probe, compiles
    assert speculation.decode_step_s == 0.0 and speculation.on  # nothing measured: the floor (0) keeps it on
    speculation.complete(prompts, params)  # plain again (its probe was not measured), nothing compiled
    assert not speculation.speculated and 0.0 < speculation.decode_step_s < COMPILE_S / 6
    speculation.complete(prompts, params)  # speculates, nothing compiled: measured
    assert speculation.speculated and 0.0 < speculation.round_s < COMPILE_S / 6
    decided = speculation.on
    speculation.complete(prompts, params)  # both measured: the rule decides, no probe until PROBE_EVERY
    assert speculation.speculated == decided


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_hf_sampler_speculates_with_the_synced_head_and_switches_off_with_one_line(caplog, cache):
    from k3post.config.draft_schema import DraftSpec, SpeculateSpec  # noqa: PLC0415
    from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec  # noqa: PLC0415
    from k3post.engine.samplers.fast_sampler import FastHFSampler  # noqa: PLC0415
    from k3post.engine.learner.learner import Learner, LearnerConfig  # noqa: PLC0415
    from k3post.engine.samplers.sampler import HFSampler  # noqa: PLC0415
    from k3post.types import Prompt  # noqa: PLC0415

    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3, init_std=0.2))
    speculate = SpeculateSpec(tokens=2, min_accept=5.0)  # a floor no head reaches: it must switch off
    lrn = Learner(LearnerConfig(student=spec, optim=OptimSpec(), total_steps=2, num_threads=2,
                                draft=DraftSpec(kind="mtp", speculate=speculate)))
    with torch.no_grad():
        lrn.draft.head.eh_proj.weight.mul_(2.0)  # the sampler must draft with the synced head, not its own
    sampler = (HFSampler if cache == "dynamic" else FastHFSampler)(spec, num_threads=2, speculate=speculate)
    sampler.load_weights(lrn.weights(), 1)
    assert torch.equal(sampler.speculation.head.eh_proj.weight, lrn.draft.head.eh_proj.weight)
    # The static engine speculates over its own static caches (model/generation/fast_speculation.py).
    assert isinstance(sampler.speculation.decoder, StaticSpeculativeDecoder) == (cache == "static")
    prompts = [Prompt(f"u{i}", "s", "t", (("user", f"Question {i}?"),)) for i in range(4)]
    with caplog.at_level("WARNING", logger="k3post.engine.samplers.speculative_sampler"):
        first = sampler.sample(prompts, SamplingParams(8, 1.0, 1.0, 0))
        assert first.sampler_stats["rollout/draft_proposed"] > 0 and first.sampler_stats["rollout/speculating"] == 0
        sampler.sample(prompts, SamplingParams(8, 1.0, 1.0, 1))
    [line] = [r.getMessage() for r in caplog.records if "speculative rollouts off" in r.getMessage()]
    # Off after the first (speculative) call, before any plain call was timed: said so, not "0.0000 s".
    assert "against a decode step not measured yet" in line and "0.0000" not in line
    with pytest.raises(ValueError, match="no draft head"):
        sampler.load_weights({k: v for k, v in lrn.weights().items() if not k.startswith("mtp.")}, 2)
    getattr(sampler, "close", lambda: None)()
