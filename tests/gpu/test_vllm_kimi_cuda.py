"""A Kimi Linear student served by vLLM (0.26, GPU) from `export_kimi_for_vllm`, against the same
model in transformers on the same GPU, both in bf16:

(a) prompt logprobs (`prompt_logprobs=0`) of four token sequences (5 to 130 tokens: inside one
    64-token KDA chunk and across several) within `TOL` (max) and `MEAN_TOL` (mean) of
    transformers' log-softmax;
(b) 16 greedy tokens per prompt, each transformers' argmax given the prefix, unless its margin
    there is under 2 × TOL (a near-tie the two kernels may break either way);
(c) weights perturbed in transformers, renamed with `vllm_kimi_state` and reloaded in place in
    the engine (`collective_rpc` → `model_runner.reload_weights`, every vLLM parameter written):
    vLLM's logprobs then match the perturbed model as in (a), and had moved well beyond `TOL`.

The model (`build_student`): 4 layers KDA, MLA, KDA, MLA; dense then MoE MLPs (8 experts, top 2,
one shared); sizes every kernel on the path takes: KDA heads of 128 (the fla chunk kernels take
K <= 256), MLA with DeepSeek's dims (qk_nope 128, qk_rope 64, v 128 — the only ones vLLM 0.26's
FlashAttention MLA prefill takes on Hopper: v1/attention/backends/mla/prefill/flash_attn.py) and
kv_lora_rank 512 (cache head size 576 = 512 + 64: the MLA decode backends other than Triton's take
only 320 or 576; FLASH_ATTN_MLA comes first on SM90 and needs FA3, which the bundle has; FLASHMLA,
next, would need `_flashmla_C`, which it lacks; TRITON_MLA takes any size). Set
K3POST_KIMI_MLA_BACKEND=TRITON_MLA to force the Triton decode backend instead.

Routing is made tie-free (`make_routing_separable`): top-k routing is discontinuous, and two
implementations that round differently (transformers scores the router in fp32, vLLM in bf16)
choose different experts wherever two scores are within their rounding of each other, which
changes that token's MoE output by a whole expert. Three residual channels carry a ±4/±2/±1 code
of the token id (no sublayer writes them: their output rows are zero), and the routers read only
those channels, so every token's expert scores are a fixed ranking (spacing 2 in logit units times
a bounded scale) and its top 2 are far from the third. `router_margin` measures it.

Tolerances: the two sides run different kernels in bf16 (vLLM: fla Triton KDA with an fp32
state, FA3 MLA with the kv_b projection absorbed, fused MoE, a bf16 router GEMM; transformers: its
PyTorch KDA fallback in fp32, SDPA, per-expert loops, an fp32 router GEMM), each rounding
activations to bf16 (relative 2^-8) a dozen times a layer. Measured on this model (CPU, 2026-12-07),
transformers in bf16 against itself in fp32: max |Δ| 0.052 nats, mean 0.011, over the 261 prompt
positions; two bf16 implementations should differ by up to about twice that. TOL = 0.15 on the
max (the Llama comparison in test_vllm_gpu.py measured 0.085 on an H100 under the same bound) and
MEAN_TOL = 0.03 on the mean. What they must catch, measured the same way: dropping one KDA layer's
output moves the max by ~0.5 nats, one MLA layer's by ~2, one MoE MLP's by ~1.2; A_log + 0.5 on the
KDA layers moves the mean by 0.038, dt_bias + 1 by 0.071; the perturbation in (c) moves the max by
> 1 nat. Every part prints "KIMI-VLLM: ..." lines with its measurements.

Skipped without CUDA, vLLM or transformers' Kimi Linear. Run with the GPU bundle (tools/vllm_gpu/;
the MoE kernels need its `moe_C` part): `python -m pytest tests/gpu/test_vllm_kimi_cuda.py -s`.
tools/vllm_gpu/kimi_probe.py runs the same stages, reporting every failure.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.vllm]

LIN, FULL = "linear_attention", "full_attention"
TOL = 0.15  # nats, max |Δ| over positions; see the module docstring
MEAN_TOL = 0.03  # nats, mean |Δ|: bf16 noise averages ~0.01, a wrong gate or decay shifts it by more
PROMPT_LENGTHS = (5, 40, 90, 130)
CODE_CHANNELS = 3  # residual channels 0..2: the token's routing code (4·s0, 2·s1, 1·s2)
SIZES = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             layer_types=[LIN, FULL, LIN, FULL], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
             linear_num_heads=2, linear_head_dim=128, linear_conv_kernel_dim=4,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
             routed_scaling_factor=2.446, initializer_range=0.04, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ROUTER_SCALE = 0.3  # router logit per code unit where rms(h) = 1: ranked experts 0.6 apart, scores unsaturated
KDA_OUTPUT_SCALE = 3.0  # KDA layers' o_proj × this: removing one then moves logprobs by ~0.5 nats
AVOIDED_EXPERT_BIAS = -2.0  # e_score_correction_bias of one expert: never chosen, but only if the bias is applied


def build_student(seed: int = 0):
    """The test's Kimi Linear model in transformers (fp32, CPU, eval): random, then made routable."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: PLC0415

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = KimiLinearForCausalLM(KimiLinearConfig(**SIZES)).eval()
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 1.0)  # a token signal the layers add to
            model.lm_head.weight.normal_(0.0, 0.125)  # logits of std ~2: errors in the body show in logprobs
            for layer, kind in zip(model.model.layers, SIZES["layer_types"]):
                if kind == LIN:  # at init a KDA layer moves logprobs by < 0.2 nats: too quiet to test
                    layer.self_attn.o_proj.weight.mul_(KDA_OUTPUT_SCALE)
    make_routing_separable(model, avoided_expert=5)
    return model


def _signs(index: torch.Tensor) -> torch.Tensor:
    """[N] integers → [N, 3] of ±1: their three low bits."""
    return torch.stack([(index >> b) & 1 for b in range(CODE_CHANNELS)], -1).float() * 2 - 1


def make_routing_separable(model, avoided_expert: int) -> None:
    """Give every token a fixed expert ranking with wide gaps (module docstring): the embedding's
    channels 0..2 hold (4, 2, 1) × the signs of the token id's low bits; no sublayer writes them
    (zero output rows); expert e's router row reads them with the signs of e's bits, so its logit
    is ROUTER_SCALE·τ·(4s0σ0 + 2s1σ1 + s2σ2), τ = 1/rms(h) > 0: a ranking 7, 5, 3, 1, -1, ... by
    expert, the same at every layer. One expert's correction bias keeps it out of every top 2."""
    config = model.config
    code = torch.tensor([4.0, 2.0, 1.0])
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, :CODE_CHANNELS] = (_signs(torch.arange(embed.shape[0])) * code).to(embed)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:CODE_CHANNELS] = 0
            layer.post_attention_layernorm.weight[:CODE_CHANNELS] = 1.0  # the routers' input: the code as is
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.down_proj[:, :CODE_CHANNELS] = 0
                mlp.shared_experts.down_proj.weight[:CODE_CHANNELS] = 0
                mlp.gate.weight.zero_()
                mlp.gate.weight[:, :CODE_CHANNELS] = (ROUTER_SCALE * _signs(torch.arange(config.num_experts))).to(
                    mlp.gate.weight)
                mlp.gate.e_score_correction_bias.zero_()
                mlp.gate.e_score_correction_bias[avoided_expert] = AVOIDED_EXPERT_BIAS
            else:
                mlp.down_proj.weight[:CODE_CHANNELS] = 0


def router_margin(model, sequences: list[list[int]]) -> float:
    """The smallest gap, over tokens and MoE layers, between the k-th and (k+1)-th expert score
    (+ correction bias) that transformers' routers see: how far every choice is from a tie."""
    gaps = []

    def hook(module, _args, output):
        scores = torch.sigmoid(output[0].float()) + module.e_score_correction_bias.float()
        top = scores.topk(module.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).min())

    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            for ids in sequences:
                model(input_ids=torch.tensor([ids], device=device))
    finally:
        for handle in handles:
            handle.remove()
    return float(torch.stack(gaps).min())


def prompts(seed: int = 0, vocab: int = SIZES["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T, V] log-softmax (fp32) of the model's logits at every position of `ids`."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]
    return torch.log_softmax(logits.float(), -1).cpu()


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T-1]: log p(ids[t] | ids[:t]) for t >= 1, what vLLM's prompt_logprobs holds."""
    return hf_logprobs(model, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def start_engine(path: Path, backend: str | None = None):
    """vLLM on the export: token ids only, eager, in this process (collective_rpc then calls the
    worker directly), no prefix caching (a hybrid KDA model's cache would only add a mode)."""
    from vllm import LLM  # noqa: PLC0415

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    backend = backend or os.environ.get("K3POST_KIMI_MLA_BACKEND")
    extra = {"attention_config": {"backend": backend}} if backend else {}
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
               gpu_memory_utilization=0.3, max_model_len=256, enable_prefix_caching=False, seed=0, **extra)


def vllm_prompt_logprobs(llm, sequences: list[list[int]]) -> list[torch.Tensor]:
    from vllm import SamplingParams  # noqa: PLC0415

    outs = llm.generate([{"prompt_token_ids": ids} for ids in sequences],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    return [torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])])
            for out, ids in zip(outs, sequences)]


def prompt_logprob_gap(llm, model, sequences: list[list[int]]) -> tuple[float, float]:
    """(max, mean) of |vLLM − transformers| over every prompt position of `sequences`."""
    got = vllm_prompt_logprobs(llm, sequences)
    gaps = torch.cat([(g - hf_prompt_logprobs(model, ids)).abs() for g, ids in zip(got, sequences)])
    return float(gaps.max()), float(gaps.mean())


def greedy_disagreements(llm, model, sequences: list[list[int]], new_tokens: int = 16) -> dict:
    """vLLM's greedy continuations checked token by token against transformers' argmax given the
    same prefix: counts of exact agreements, near-ties (margin < 2·TOL) and real disagreements."""
    from vllm import SamplingParams  # noqa: PLC0415

    outs = llm.generate([{"prompt_token_ids": ids} for ids in sequences],
                        SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    counts = {"agree": 0, "near_tie": 0, "disagree": 0, "worst_margin": 0.0}
    for out, ids in zip(outs, sequences):
        generated = list(out.outputs[0].token_ids)
        logp = hf_logprobs(model, ids + generated)[len(ids) - 1:-1]
        for j, token in enumerate(generated):
            margin = float(logp[j].max() - logp[j, token])
            kind = "agree" if margin == 0 else "near_tie" if margin < 2 * TOL else "disagree"
            counts[kind] += 1
            counts["worst_margin"] = max(counts["worst_margin"], margin)
    return counts


def perturb(model, seed: int = 1) -> None:
    """Every tensor × (1 + 0.1·noise), then the routing code laid again with another expert
    avoided (noise on the code would bring expert scores within rounding of each other), so
    the routers' correction biases change too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=g).to(tensor.device, torch.float32)
                tensor.copy_((tensor.float() * (1 + 0.1 * noise)).to(tensor.dtype))
    make_routing_separable(model, avoided_expert=2)


def reload_in_worker(worker, payload: bytes) -> list[str]:
    """On the vLLM worker: reload the model in place from vLLM-named tensors (pickled, so that the
    call also works with the engine core in a process of its own); the parameters not written."""
    weights = pickle.loads(payload)
    model = worker.model_runner.model
    expected, written = {name for name, _ in model.named_parameters()}, set()
    load = model.load_weights

    def recording_load(tensors):
        loaded = load(tensors)
        written.update(loaded)
        return loaded

    model.load_weights = recording_load
    try:
        worker.model_runner.reload_weights(weights_iterator=iter(weights.items()))
    finally:
        del model.load_weights
    torch.cuda.synchronize()
    return sorted(expected - written)


def sync_into_engine(llm, model) -> list[str]:
    """transformers' weights → vLLM's names → the engine; the vLLM parameters left unwritten."""
    from k3post.model.export.kimi_export import vllm_kimi_state  # noqa: PLC0415

    tensors = {n: t.detach().cpu().contiguous() for n, t in vllm_kimi_state(model.state_dict()).items()}
    missed = llm.collective_rpc(reload_in_worker, args=(pickle.dumps(tensors),))
    llm.reset_prefix_cache()
    return sorted({name for worker in missed for name in worker})


def engine_layers(worker) -> dict:
    """On the worker: which implementation each attention layer got (for the probe's report)."""
    out = {}
    for name, module in worker.model_runner.model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is not None:
            out[name] = type(impl).__name__
        elif type(module).__name__ in ("KimiGatedDeltaNetAttention", "MoERunner", "FusedMoE"):
            out[name] = type(module).__name__
    return out


# --- the test --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(transformers model on the GPU in bf16, the vLLM engine on its export)."""
    pytest.importorskip("vllm")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip("this transformers has no Kimi Linear")
    from k3post.model.export.kimi_export import export_kimi_for_vllm  # noqa: PLC0415

    model = build_student()
    margin = router_margin(model, prompts())
    print(f"KIMI-VLLM: router margin (k-th minus (k+1)-th biased score, fp32) min {margin:.4f}")
    assert margin > 0.02, "the routing code failed to separate the experts; the comparison would flip experts"
    path = export_kimi_for_vllm(model, None, tmp_path_factory.mktemp("kimi") / "export", dtype=torch.bfloat16)
    model = model.to("cuda", torch.bfloat16)
    llm = start_engine(path)
    print(f"KIMI-VLLM: layers {llm.collective_rpc(engine_layers)[0]}")
    yield model, llm
    del llm


def test_prompt_logprobs_match_transformers(served):
    model, llm = served
    gap, mean = prompt_logprob_gap(llm, model, prompts())
    print(f"KIMI-VLLM: (a) prompt logprobs, lengths {PROMPT_LENGTHS}: |vLLM - HF| max {gap:.4f} (tol {TOL}), "
          f"mean {mean:.4f} (tol {MEAN_TOL}) nats")
    assert gap < TOL and mean < MEAN_TOL


def test_greedy_tokens_are_transformers_argmax(served):
    model, llm = served
    counts = greedy_disagreements(llm, model, prompts(seed=1)[:3])
    print(f"KIMI-VLLM: (b) greedy 16 tokens x 3: {counts}")
    assert counts["disagree"] == 0 and counts["agree"] >= 40


def test_weights_synced_in_place_reach_the_engine(served):
    model, llm = served
    sequences = prompts(seed=2)
    before = [hf_prompt_logprobs(model, ids) for ids in sequences]
    perturb(model)
    moved = max(float((hf_prompt_logprobs(model, ids) - b).abs().max()) for ids, b in zip(sequences, before))
    margin = router_margin(model, sequences)
    missed = sync_into_engine(llm, model)
    gap, mean = prompt_logprob_gap(llm, model, sequences)
    print(f"KIMI-VLLM: (c) after the perturbation HF moved {moved:.3f} nats; router margin {margin:.4f}; "
          f"unwritten vLLM parameters {missed}; |vLLM - HF| max {gap:.4f} (tol {TOL}), mean {mean:.4f} nats")
    assert not missed and moved > 5 * TOL and margin > 0.02
    assert gap < TOL and mean < MEAN_TOL
