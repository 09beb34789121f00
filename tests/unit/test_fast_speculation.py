"""What is particular to speculation in the static-cache sampler (model/generation/fast_speculation.py), on tiny
real HF models: seeded, the plain engine's speculative decoder's exact samples; eager attention's
additive masks; the sync-free emit; group prefill; the recipe. What both engines must do (the
student's exact law, greedy, the logprobs, stops, budgets, rows, the on/off rule) is tested on both in
tests/unit/test_speculative_sampling.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.cache_utils import Cache

from k3post.model.generation.draft_head import MtpHead, residual_stream
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.fast_speculation import RowCache, StaticSpeculativeDecoder, emit_block
from k3post.model.generation.speculative_sampling import Emitted, SpeculativeDecoder
from k3post.types import SamplingParams
from tests.unit.test_speculative_sampling import EOS, PAD, PROMPTS, decoder, tiny


@pytest.mark.parametrize("hidden", ["final_norm", "residual"])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_seeded_rounds_equal_the_plain_engines_speculative_decoder(K, hidden):
    """Same seed, same draws in the same order: the static cache changes where keys live, not what
    is computed, so the tokens, logprobs and counts are the plain speculative decoder's - with either
    hidden state the head reads (each decoder runs a `residual` head inside `residual_stream`)."""
    model = tiny(8, 5, std=0.8)
    head, params = MtpHead(model, 1, hidden=hidden), SamplingParams(16, 0.9, 0.95, seed=3)
    fast, fast_stats = StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, K).sample(
        PROMPTS, params)
    plain, plain_stats = SpeculativeDecoder(model, head, PAD, [EOS], K).sample(PROMPTS, params)
    assert torch.equal(fast.completion_ids_BT, plain.completion_ids_BT)
    assert torch.equal(fast.loss_mask_BT, plain.loss_mask_BT)
    torch.testing.assert_close(fast.logprobs_BT, plain.logprobs_BT, atol=1e-5, rtol=0)
    assert fast_stats == plain_stats and 0 < fast_stats.accepted < fast_stats.drafted


def test_eager_attention_takes_additive_masks_and_gives_the_same_samples():
    """Soft-capped families run eager attention, which adds its mask: the boolean mask must become 0 / -inf."""
    model = tiny(8, 5, std=0.8)
    eager = tiny(8, 5, std=0.8)
    eager.set_attn_implementation("eager")
    params = SamplingParams(16, 0.9, 0.95, seed=3)
    a, _ = decoder(model, 2, cache="static").sample(PROMPTS, params)
    b, _ = decoder(eager, 2, cache="static").sample(PROMPTS, params)
    assert torch.equal(a.completion_ids_BT, b.completion_ids_BT)
    torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, atol=1e-5, rtol=0)


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


def test_repeated_prompts_are_prefilled_once_with_the_same_samples():
    model = tiny(8, 5, std=0.8)
    dec, params = decoder(model, 2, cache="static"), SamplingParams(10, 1.0, 1.0, seed=2)
    grouped, _ = dec.sample(PROMPTS[:3] * 4, params)
    each, _ = dec.sample(PROMPTS[:3] * 4, params, groups=False)
    assert torch.equal(grouped.completion_ids_BT, each.completion_ids_BT)
    assert grouped.prefill_tokens < each.prefill_tokens


def test_a_static_cache_recipe_may_speculate():
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415
    from k3post.engine.samplers.fast_sampler import FastHFSampler  # noqa: PLC0415
    from k3post.launch.engines import sampler_spec  # noqa: PLC0415

    recipe = load_distill_recipe("recipes/smoke/tiny.yaml", ["draft.kind=mtp", "draft.speculate.tokens=3",
                                                             "sampling.cache=static"])
    engine = sampler_spec(recipe)
    assert engine.cls is FastHFSampler and engine.kwargs["speculate"].tokens == 3


def test_compiled_forwards_write_only_into_caches_allocated_outside_them(monkeypatch):
    """CUDA graphs write a cache in place only if its tensors were marked as fixed addresses, which
    transformers does only when the cache is allocated outside a compiled region: the compiled round
    (here a stand-in that checks the head's and the student's caches, on a CPU) must never be the first
    to write a cache, and the samples are the uncompiled engine's."""
    def checked(step, **_):
        def run(*args):
            caches = [a for a in args if isinstance(a, Cache)]
            for cache in caches:
                assert all(layer.is_initialized for layer in cache.layers), "a compiled round allocated a cache"
                assert all(getattr(t, "_dynamo_static_input_type", None) for layer in cache.layers
                           for t in (layer.keys, layer.values)), "a compiled round writes an unmarked cache"
            calls.append([len(c.layers) for c in caches] or "emit")
            return step(*args)
        return run

    calls: list[int] = []
    model, params = tiny(8, 5, std=0.8), SamplingParams(16, 0.9, 0.95, seed=3)
    head = MtpHead(model, 1)
    plain, _ = StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, 2).sample(PROMPTS, params)
    monkeypatch.setattr(torch, "compile", checked)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    sampler = StaticSampler(model, PAD, [EOS], min_bucket=4)
    sampler.compiled = True  # as on a GPU with compile: true
    for _ in range(2):  # the second call reuses the caches of the first
        fast, _ = StaticSpeculativeDecoder(sampler, head, 2).sample(PROMPTS, params)
        assert torch.equal(fast.completion_ids_BT, plain.completion_ids_BT)
        torch.testing.assert_close(fast.logprobs_BT, plain.logprobs_BT, atol=1e-6, rtol=0)
    # the round (the head's cache, then the student's) and the emit ran compiled
    assert [1, len(model.model.layers)] in calls and "emit" in calls


@pytest.mark.parametrize("K", [1, 3])
def test_the_round_steps_trace_whole_with_their_draws(monkeypatch, K):
    """On a GPU a round (K head steps and the verify step, with their draws) is compiled as one CUDA
    graph, and the emit as one compiled function: a graph break would launch their small kernels
    from Python again. Traced here whole (fullgraph: a break raises) with the GPU's draw, the
    engine samples what the eager engine samples."""
    import k3post.algo.speculative as speculative
    import k3post.model.generation.fast_speculation as fast_speculation
    from k3post.algo.token_draws import draw_exponential_race

    monkeypatch.setattr(fast_speculation, "draw", draw_exponential_race)  # the draw a GPU makes
    monkeypatch.setattr(speculative, "draw", draw_exponential_race)
    model, params = tiny(8, 5, std=0.8), SamplingParams(16, 0.9, 0.95, seed=3)
    head = MtpHead(model, 1)
    eager, eager_stats = StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, K).sample(
        PROMPTS, params)
    sampler = StaticSampler(model, PAD, [EOS], min_bucket=4)
    sampler.compiled = True  # as on a GPU with compile: true
    traced = StaticSpeculativeDecoder(sampler, head, K)
    torch._dynamo.reset()
    whole = lambda fn: torch.compile(fn, fullgraph=True, backend="eager", dynamic=False)  # noqa: E731
    traced._round, traced._emit = whole(traced._round_eager), whole(traced._emit_eager)
    counters.clear()
    out, stats = traced.sample(PROMPTS, params)
    assert counters["stats"]["unique_graphs"] == 2  # the round (after the first, eager) and the emit
    assert torch.equal(out.completion_ids_BT, eager.completion_ids_BT)
    torch.testing.assert_close(out.logprobs_BT, eager.logprobs_BT, atol=1e-6, rtol=0)
    assert stats == eager_stats and stats.rounds > 2
    torch._dynamo.reset()


def test_the_round_compiled_by_inductor_with_the_merging_pass_draws_the_eager_rounds_tokens():
    """The compiled round (Inductor, with model/generation/fused_projections.py's pass that merges equal pure
    nodes, as on a GPU) draws what the eager round draws: merging equal GEMMs and quantisations must
    never merge two random draws. (On a CPU the draws are the generator's; the sampler compiles only
    on CUDA, so it is switched on by hand here.)"""
    model = tiny(64, 3)
    head, params = MtpHead(model, 1).eval(), SamplingParams(12, 1.0, 1.0, seed=5)
    rows, outs, graphs = [[1, 5, 9], [2, 7], [4, 4, 4, 8], [3]], [], []
    for compiled in (False, True):
        torch._dynamo.reset()
        sampler = StaticSampler(model, PAD, [EOS], min_bucket=8)
        sampler.compiled = compiled  # the decoder compiles its round and emit when its sampler does
        graphs.append(counters["stats"]["unique_graphs"])
        outs.append(StaticSpeculativeDecoder(sampler, head, 1).sample(rows, params))
        graphs[-1] = counters["stats"]["unique_graphs"] - graphs[-1]
    torch._dynamo.reset()
    assert graphs[0] == 0 and graphs[1] >= 2  # the round and the emit were compiled, and ran
    (eager, eager_stats), (compiled, compiled_stats) = outs
    assert torch.equal(compiled.completion_ids_BT, eager.completion_ids_BT) and compiled_stats == eager_stats
    torch.testing.assert_close(compiled.logprobs_BT, eager.logprobs_BT, atol=1e-5, rtol=0)
    assert eager_stats.rounds > 2 and 0 < eager_stats.accepted < eager_stats.drafted


def test_a_compiled_row_write_touches_only_the_columns_it_writes():
    """Each forward of a round writes J columns of every cache layer. Compiled (Inductor, as on a GPU)
    the write must land in the cache in place: a lowering that writes into a fresh tensor and copies
    the whole cache back costs two passes over B × L columns per layer and forward (a quarter of a
    round's GPU time at batch 32 on an H100, the scatter this layer once used). Read in the generated
    code: no loop runs over the cache's B·H·L·D elements, and the writes are the eager ones."""
    from torch._inductor.utils import run_and_get_code

    B, H, L, D, J = 4, 3, 512, 64, 3
    caches = [RowCache(1, L) for _ in range(2)]
    new_BHJD, at_BJ = torch.randn(B, H, J, D), torch.stack([torch.randperm(L)[:J] for _ in range(B)])
    for cache in caches:
        cache.layers[0].lazy_initialization(new_BHJD, new_BHJD)

    def write(cache, new_BHJD, at_BJ):
        cache.columns.at = at_BJ
        keys, values = cache.layers[0].update(new_BHJD, -new_BHJD)
        return keys[:, :, 0].sum() + values[:, :, 0].sum()

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(lambda *a: write(caches[0], *a)), new_BHJD, at_BJ)
    write(caches[1], new_BHJD, at_BJ)
    assert str(B * H * L * D) not in "\n".join(code), "the compiled write passes over the whole cache"
    for mine, eager in zip((caches[0].layers[0].keys, caches[0].layers[0].values),
                           (caches[1].layers[0].keys, caches[1].layers[0].values), strict=True):
        assert torch.equal(mine, eager)
    rows_BJ = torch.arange(B)[:, None].expand(B, J)
    assert torch.equal(caches[0].layers[0].keys[rows_BJ, :, at_BJ], new_BHJD.transpose(1, 2))
    assert int((caches[0].layers[0].keys != 0).sum()) == B * H * J * D  # nothing else written
    torch._dynamo.reset()


def test_a_head_copied_from_a_fused_student_drafts_with_its_synced_weights_when_compiled():
    """A compiled static sampler fuses the student's q/k/v and gate/up (model/generation/fused_projections.py)
    before the speculation engine builds its head from a copy of the student's last block; the
    compiled round computes each of those from its group's stack. A weight sync into the head must
    reach those stacks: the head computes the same eagerly and as compiled (stacks read), with the
    synced weights. (Until the fix the copy's stacks kept the student's block: on a GPU the compiled
    rounds drafted with partly untrained weights.)"""
    from unittest import mock  # noqa: PLC0415

    from k3post.model.generation.fused_projections import fuse_projections  # noqa: PLC0415
    from k3post.model.training.weights import import_weights  # noqa: PLC0415

    model = tiny(8, 5, std=0.8)
    assert fuse_projections(model) > 0
    head = MtpHead(model, 1)
    torch.manual_seed(0)
    synced = {k: v + 0.05 * torch.randn_like(v) for k, v in head.state_dict().items()}
    import_weights(head, synced)
    h_BLH = torch.randn(2, 6, model.config.hidden_size)
    next_BL, positions_BL = torch.randint(0, 8, (2, 6)), torch.arange(6)[None].expand(2, -1)
    with torch.no_grad():
        eager = head(h_BLH, next_BL, positions_BL)
        with mock.patch("torch.compiler.is_compiling", return_value=True):
            compiled = head(h_BLH, next_BL, positions_BL)
        fresh = MtpHead(tiny(8, 5, std=0.8), 1)  # the same head, unfused, with the same weights
        import_weights(fresh, synced)
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)  # one GEMM or three: rounding apart
        torch.testing.assert_close(eager, fresh(h_BLH, next_BL, positions_BL), atol=1e-6, rtol=0)


@pytest.mark.parametrize("static", [False, True])
def test_a_residual_head_reads_the_residual_stream_whoever_calls_the_decoder(static):
    """Both decoders run a `residual` head's student inside `residual_stream` themselves: called
    bare (as the benchmarks call them) they draw what they draw inside it (as the engine ran them),
    and the student's final norm is back in place after."""
    model = tiny(8, 5, std=0.8)
    norm = model.model.norm
    with torch.no_grad():  # a norm that is not the identity on normed states (unit weights would be)
        norm.weight.copy_(0.5 + torch.rand_like(norm.weight))
    head, params = MtpHead(model, 1, hidden="residual"), SamplingParams(16, 0.9, 0.95, seed=3)
    make = (lambda: StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, 2)) if static \
        else (lambda: SpeculativeDecoder(model, head, PAD, [EOS], 2))
    bare, bare_stats = make().sample(PROMPTS, params)
    with residual_stream(model):
        inside, inside_stats = make().sample(PROMPTS, params)
    assert torch.equal(bare.completion_ids_BT, inside.completion_ids_BT) and bare_stats == inside_stats
    assert model.model.norm is norm and bare_stats.accepted > 0
