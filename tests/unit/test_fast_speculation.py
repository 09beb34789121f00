"""Speculative rounds in the static-cache sampler (model/fast_speculation.py) on tiny real HF models:
the same samples as the plain engine's speculative decoder, greedy equal to plain greedy, the
student's logprobs, the exact law (chi-square), stops and budgets, and the engine around it."""

from __future__ import annotations

import pytest
import torch

from k3post.model.draft_head import MtpHead
from k3post.model.fast_sampling import StaticSampler
from k3post.model.fast_speculation import StaticSpeculativeDecoder, emit_block
from k3post.model.logprobs import completion_logprobs
from k3post.model.speculative_sampling import Emitted, SpeculativeDecoder
from k3post.types import SamplingParams
from tests.unit.test_speculative_sampling import EOS, PAD, PROMPTS, chi_square_p, copy_head, exact_law, tiny


def static(model, head: MtpHead, K: int) -> StaticSpeculativeDecoder:
    return StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, K)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_seeded_rounds_equal_the_plain_engines_speculative_decoder(K):
    """Same seed, same draws in the same order: the static cache changes where keys live, not what
    is computed, so the tokens, logprobs and counts are the plain speculative decoder's."""
    model = tiny(8, 5, std=0.8)
    head, params = MtpHead(model, 1), SamplingParams(16, 0.9, 0.95, seed=3)
    fast, fast_stats = static(model, head, K).sample(PROMPTS, params)
    plain, plain_stats = SpeculativeDecoder(model, head, PAD, [EOS], K).sample(PROMPTS, params)
    assert torch.equal(fast.completion_ids_BT, plain.completion_ids_BT)
    assert torch.equal(fast.loss_mask_BT, plain.loss_mask_BT)
    torch.testing.assert_close(fast.logprobs_BT, plain.logprobs_BT, atol=1e-5, rtol=0)
    assert fast_stats == plain_stats and 0 < fast_stats.accepted < fast_stats.drafted


@pytest.mark.parametrize("K", [1, 2, 3])
def test_greedy_and_temperature_towards_zero_equal_plain_greedy(K):
    model = tiny(8, 4, std=0.8)
    plain = StaticSampler(model, PAD, [EOS], min_bucket=4).sample(PROMPTS, SamplingParams(12, 1.0, 1.0, 0), greedy=True)
    dec = static(model, copy_head(model), K)
    greedy, stats = dec.sample(PROMPTS, SamplingParams(12, 1.0, 1.0, 0), greedy=True)
    assert torch.equal(greedy.completion_ids_BT, plain.completion_ids_BT)
    assert torch.equal(greedy.loss_mask_BT, plain.loss_mask_BT)
    assert 0 < stats.accepted < stats.drafted  # accepted drafts and rolled-back ones, rows differing
    cold, _ = dec.sample(PROMPTS, SamplingParams(12, 1e-4, 1.0, 0))
    assert torch.equal(cold.completion_ids_BT, plain.completion_ids_BT)


@pytest.mark.parametrize("K", [1, 3])
def test_stored_logprobs_are_the_students_teacher_forced_ones(K):
    model = tiny(8, 5, dtype=torch.float64, std=0.8)
    params = SamplingParams(16, 0.9, 0.95, seed=3)
    out, stats = static(model, MtpHead(model, 1), K).sample(PROMPTS, params)
    assert 0 < stats.accepted < stats.drafted
    recomputed = completion_logprobs(model, PROMPTS, out.completion_ids_BT, out.loss_mask_BT, PAD, params.temperature)
    assert (recomputed - out.logprobs_BT).abs().max() < 1e-6
    assert (out.logprobs_BT[out.loss_mask_BT == 0] == 0).all()


def test_eager_attention_takes_additive_masks_and_gives_the_same_samples():
    """Soft-capped families run eager attention, which adds its mask: the boolean mask must become 0 / -inf."""
    model = tiny(8, 5, std=0.8)
    eager = tiny(8, 5, std=0.8)
    eager.set_attn_implementation("eager")
    params = SamplingParams(16, 0.9, 0.95, seed=3)
    a, _ = static(model, MtpHead(model, 1), 2).sample(PROMPTS, params)
    b, _ = static(eager, MtpHead(eager, 1), 2).sample(PROMPTS, params)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)
    torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, atol=1e-5, rtol=0)


def completion_counts(out) -> dict[tuple, int]:
    """How often each completion (its tokens up to its length) came out, counted without a Python
    loop over the rows."""
    lengths = out.loss_mask_BT.sum(1).long()
    keyed = out.completion_ids_BT.masked_fill(torch.arange(out.completion_ids_BT.shape[1])[None] >= lengths[:, None], -1)
    rows, counts = torch.unique(keyed, dim=0, return_counts=True)
    return {tuple(t for t in row if t >= 0): c for row, c in zip(rows.tolist(), counts.tolist())}


def speculative_law_p(model, K: int, params: SamplingParams, samples: int, fast: bool) -> float:
    """The chi-square p-value of `samples` completions of [1, 2], drawn in one batched call."""
    head = MtpHead(model, 1)
    dec = static(model, head, K) if fast else SpeculativeDecoder(model, head, PAD, [EOS], K)
    out, stats = dec.sample([[1, 2]] * samples, params)
    assert 0 < stats.accepted < stats.drafted
    counts = completion_counts(out)
    assert sum(counts.values()) == samples
    return chi_square_p(counts, exact_law(model, [1, 2], params.max_new_tokens, params.temperature, params.top_p),
                        samples)


# 2·10^5 samples in one batched call per seed, both engines: measured at ~2 s each on 2 cores.
@pytest.mark.parametrize("fast", [True, False], ids=["static", "plain"])
@pytest.mark.parametrize("seed, K, temperature, top_p", [(0, 2, 1.0, 1.0), (1, 3, 0.8, 0.9), (2, 1, 1.3, 0.95)])
def test_speculative_samples_follow_the_students_law(seed, K, temperature, top_p, fast):
    model = tiny(4, seed)
    assert speculative_law_p(model, K, SamplingParams(3, temperature, top_p, seed), 200_000, fast) > 1e-3


def emitted(B: int, N: int) -> Emitted:
    return Emitted(torch.full((B, N + 1), PAD), torch.zeros(B, N + 1), torch.zeros(B, dtype=torch.long),
                   torch.ones(B, dtype=torch.bool))


def test_an_eos_inside_an_accepted_draft_ends_the_row_there():
    out = emitted(3, 8)
    tokens = torch.tensor([[5, EOS, 6, 7], [5, 6, 7, 4], [EOS, 4, 4, 4]])
    logprobs = -torch.arange(1.0, 13.0).reshape(3, 4)
    valid = torch.tensor([[True, True, True, True], [True, True, False, False], [True, True, False, False]])
    assert emit_block(out, tokens, logprobs, valid, torch.tensor([EOS]), 8).tolist() == [2, 2, 1]
    assert out.tokens_BN[0, :3].tolist() == [5, EOS, PAD] and out.count_B.tolist() == [2, 2, 1]
    assert out.running_B.tolist() == [False, True, False]
    assert out.logprobs_BN[0, :3].tolist() == [-1.0, -2.0, 0.0] and out.logprobs_BN[1, :3].tolist() == [-5.0, -6.0, 0.0]
    # A stopped row takes nothing more.
    assert emit_block(out, tokens, logprobs, valid, torch.tensor([EOS]), 8).tolist() == [0, 2, 0]
    assert out.tokens_BN[1, :4].tolist() == [5, 6, 5, 6]


def test_max_new_tokens_reached_mid_draft_truncates():
    out = emitted(2, 3)
    out.count_B[:] = torch.tensor([1, 0])
    taken = emit_block(out, torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7]]), torch.zeros(2, 4),
                       torch.ones(2, 4, dtype=torch.bool), torch.tensor([EOS]), 3)
    assert taken.tolist() == [2, 3] and out.tokens_BN[:, :3].tolist() == [[PAD, 4, 5], [4, 5, 6]]
    assert not out.running_B.any()


def test_budgets_and_stops_in_the_real_decoder():
    model = tiny(4, 7)
    out, _ = static(model, MtpHead(model, 1), 3).sample(PROMPTS, SamplingParams(5, 1.0, 1.0, 0))
    lengths = out.loss_mask_BT.sum(1)
    assert lengths.max() <= 5 and lengths.min() < lengths.max()
    for row, length in zip(out.completion_ids_BT.tolist(), lengths.long().tolist()):
        assert EOS not in row[:length - 1] and (length == 5 or row[length - 1] == EOS)


def test_batch_rows_do_not_depend_on_each_others_acceptance():
    model = tiny(8, 4, std=0.8)
    dec = static(model, copy_head(model), 3)
    together, _ = dec.sample(PROMPTS[:6], SamplingParams(12, 1.0, 1.0, 0), greedy=True)
    for b, prompt in enumerate(PROMPTS[:6]):
        alone, _ = dec.sample([prompt], SamplingParams(12, 1.0, 1.0, 0), greedy=True)
        width = alone.completion_ids_BT.shape[1]
        assert torch.equal(together.completion_ids_BT[b, :width], alone.completion_ids_BT[0])
        assert int(together.loss_mask_BT[b].sum()) == int(alone.loss_mask_BT[0].sum())


def test_repeated_prompts_are_prefilled_once_with_the_same_samples():
    model = tiny(8, 5, std=0.8)
    dec, params = static(model, MtpHead(model, 1), 2), SamplingParams(10, 1.0, 1.0, seed=2)
    grouped, _ = dec.sample(PROMPTS[:3] * 4, params)
    each, _ = dec.sample(PROMPTS[:3] * 4, params, groups=False)
    assert torch.equal(grouped.completion_ids_BT, each.completion_ids_BT)
    assert grouped.prefill_tokens < each.prefill_tokens


def test_the_static_engine_speculates_with_the_synced_head_and_switches_off_with_one_line(caplog):
    from k3post.config.draft_schema import DraftSpec, SpeculateSpec  # noqa: PLC0415
    from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec  # noqa: PLC0415
    from k3post.engine.fast_sampler import FastHFSampler  # noqa: PLC0415
    from k3post.engine.learner import Learner, LearnerConfig  # noqa: PLC0415
    from k3post.engine.sampler import HFSampler  # noqa: PLC0415
    from k3post.types import Prompt  # noqa: PLC0415

    spec = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3, init_std=0.2))
    speculate = SpeculateSpec(tokens=2, min_accept=5.0)  # a floor no head reaches: it must switch off
    lrn = Learner(LearnerConfig(student=spec, optim=OptimSpec(), total_steps=2, num_threads=2,
                                draft=DraftSpec(kind="mtp", speculate=speculate)))
    with torch.no_grad():
        lrn.draft.head.eh_proj.weight.mul_(2.0)  # the sampler must draft with the synced head, not its own
    fast, plain = FastHFSampler(spec, num_threads=2, speculate=speculate), HFSampler(spec, num_threads=2,
                                                                                      speculate=speculate)
    for sampler in (fast, plain):
        sampler.load_weights(lrn.weights(), 1)
    assert torch.equal(fast.speculation.head.eh_proj.weight, lrn.draft.head.eh_proj.weight)
    prompts = [Prompt(f"u{i}", "s", "t", (("user", f"Question {i}?"),)) for i in range(4)]
    with caplog.at_level("WARNING", logger="k3post.engine.speculative_sampler"):
        first = fast.sample(prompts, SamplingParams(8, 1.0, 1.0, 0))
        assert first.sampler_stats["rollout/draft_proposed"] > 0 and first.sampler_stats["rollout/speculating"] == 0
        # The first call speculated in both engines: the same tokens (model/fast_speculation.py).
        assert torch.equal(first.completion_ids_BT, plain.sample(prompts, SamplingParams(8, 1.0, 1.0, 0)).completion_ids_BT)
        fast.sample(prompts, SamplingParams(8, 1.0, 1.0, 1))
    assert len([r for r in caplog.records if "speculative rollouts off" in r.getMessage()]) == 2  # one per engine
    fast.close()


def test_a_static_cache_recipe_may_speculate():
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415
    from k3post.engine.fast_sampler import FastHFSampler  # noqa: PLC0415
    from k3post.launch.engines import sampler_spec  # noqa: PLC0415

    recipe = load_distill_recipe("recipes/smoke/tiny.yaml", ["draft.kind=mtp", "draft.speculate.tokens=3",
                                                             "sampling.cache=static"])
    engine = sampler_spec(recipe)
    assert engine.cls is FastHFSampler and engine.kwargs["speculate"].tokens == 3
