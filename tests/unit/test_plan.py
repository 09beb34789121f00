"""`k3post plan`: the formulas against closed forms and real tensors, the layout, the command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3post.cli.main import main
from k3post.config.load import load_run_recipe
from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.plan.memory import GIB, LearnerSetup, activation_bytes, layer_bytes_per_token, learner_peak, state_bytes
from k3post.plan.placement import Cluster
from k3post.plan.report import make_plan
from k3post.plan.shapes import model_shape, shape_of

REPO = Path(__file__).resolve().parents[2]
SIZING = REPO / "examples" / "sizing"
TINY = ModelSpec(tiny=TinyModelSpec(hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4, num_kv_heads=2))


def test_meta_counts_are_the_real_models_numel():
    from k3post.model.training.fsdp import decoder_blocks
    from k3post.model.loading.load import load_model

    model, _ = load_model(TINY)
    shape = model_shape(TINY)
    blocks = decoder_blocks(model)
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert shape.block_params == sum(p.numel() for p in blocks[0].parameters())
    assert shape.root_params == shape.params - sum(p.numel() for b in blocks for p in b.parameters())
    assert shape.linear_params == sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (3, 64, 4, 2, 16)


def test_kimi_students_and_config_only_directories_are_counted_on_meta():
    from k3post.config.schema import KimiSpec
    from k3post.model.loading.kimi import build_kimi_student
    from k3post.model.loading.load import load_tokenizer

    spec = ModelSpec(kimi=KimiSpec(tokenizer_from=TINY, num_layers=4, num_experts=4, experts_per_token=2))
    real = build_kimi_student(spec.kimi, load_tokenizer(spec))
    shape = model_shape(spec)
    assert shape.params == sum(p.numel() for p in real.parameters())
    assert shape.moe_experts == 4 and shape.moe_top_k == 2 and shape.moe_layers == 3
    assert shape.active_params < shape.params
    qwen = model_shape(ModelSpec(path=str(SIZING / "models" / "qwen2.5-7b")))  # config.json only, no weights
    assert 7.5e9 < qwen.params < 7.7e9 and not qwen.tied


def test_state_bytes_are_the_precisions_bytes_per_parameter_over_the_ranks():
    shape = model_shape(TINY)
    base = dict(micro_batch=1, seq_len=8, completion_len=4)
    mixed = state_bytes(shape, LearnerSetup(precision="bf16-mixed", sharded=True, ranks=4, **base))
    assert sum(mixed.values()) == pytest.approx(16 * shape.params / 4)
    pure = state_bytes(shape, LearnerSetup(precision="bf16", sharded=False, ranks=1, **base))
    assert sum(pure.values()) == 8 * shape.params
    lora = state_bytes(shape, LearnerSetup(precision="bf16", sharded=False, ranks=1, lora_rank=8, **base))
    adapters = 8 * sum(m.in_features + m.out_features for m in _lora_targets())
    assert lora["weights"] == 2 * shape.params + 4 * adapters
    assert lora["optimizer"] == 2 * lora["gradients"] == 8 * adapters


def _lora_targets():
    from k3post.model.loading.load import load_model

    model, _ = load_model(TINY)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [m for name, m in model.named_modules() if name.split(".")[-1] in targets]


@pytest.mark.parametrize("padded", [True, False])
def test_a_layers_saved_tensors_are_the_formulas_bytes(padded):
    """One bf16 Llama block's forward: the bytes of every tensor autograd saves for backward
    (parameters and the per-model RoPE tables and mask left out), against the eager formula."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    B, L = 3, 40
    x = torch.randn(B, L, 64, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(B, L, dtype=torch.long)
    if padded:
        mask[0, 30:] = 0
    positions = torch.arange(L)[None].expand(B, L)
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params and t.dim() > 1 and not (t.dim() == 4 and t.shape[1] == 1):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    attention = create_causal_mask(config=config, inputs_embeds=x, attention_mask=mask, past_key_values=None,
                                   position_ids=positions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, attention_mask=attention, position_embeddings=model.model.rotary_emb(x, positions),
                              position_ids=positions)
    predicted = layer_bytes_per_token(shape_of(config, "t"), compiled=False, padded=padded) * B * L
    assert sum(seen.values()) == pytest.approx(predicted, rel=0.02)


def test_activation_checkpointing_keeps_block_inputs_and_one_block():
    shape = model_shape(TINY)
    s = LearnerSetup(precision="bf16", sharded=False, ranks=1, micro_batch=2, seq_len=10, completion_len=5)
    on = LearnerSetup(**{**s.__dict__, "activation_checkpointing": True})
    layer = layer_bytes_per_token(shape, False, True)
    outside = 10 * shape.hidden
    assert activation_bytes(shape, s) == 20 * (shape.layers * layer + outside)
    assert activation_bytes(shape, on) == 20 * (shape.layers * 2 * shape.hidden + 2 * layer + outside)


def test_references_and_qat_add_what_they_hold():
    shape = model_shape(TINY)
    base = dict(precision="bf16-mixed", sharded=True, ranks=2, micro_batch=1, seq_len=8, completion_len=4)
    none = learner_peak(shape, LearnerSetup(**base))
    copy = learner_peak(shape, LearnerSetup(reference="copy", **base))
    buffer = learner_peak(shape, LearnerSetup(reference="grad_buffer", **base))
    qat = learner_peak(shape, LearnerSetup(qat=True, **base))
    assert copy.total - none.total == pytest.approx(4 * shape.params / 2)  # its fp32 shard
    assert buffer.host_pinned == pytest.approx(4 * shape.params / 2) and buffer.total - none.total == 2**26
    assert qat.total - none.total == pytest.approx(2 * shape.linear_params)


def test_a_one_rank_sharded_learner_with_samplers_keeps_their_bf16_copy():
    """engine/sharded/sharded_learner.py `_device_weights`: the student's dtype's bytes a parameter
    on one rank with samplers; nothing without samplers (sft) or on two ranks (those gather
    bucket by bucket)."""
    shape = model_shape(TINY)
    base = dict(precision="bf16-mixed", sharded=True, micro_batch=1, seq_len=8, completion_len=4)
    for ranks, dtype_bytes in ((1, 2), (1, 4), (2, 2)):
        alone = learner_peak(shape, LearnerSetup(ranks=ranks, **base))
        synced = learner_peak(shape, LearnerSetup(ranks=ranks, samplers_copy=dtype_bytes, **base))
        assert synced.total - alone.total == (dtype_bytes * shape.params if ranks == 1 else 0)


def test_the_draft_head_adds_its_parameters_state_and_the_hidden_states_it_keeps():
    """A real MTP head's parameter count × (weights, gradients, two AdamW moments) in fp32, plus a
    micro-batch's last hidden states in the compute dtype."""
    from k3post.model.generation.draft_head import MtpHead
    from k3post.model.loading.load import load_model

    model, _ = load_model(TINY)
    head_params = sum(p.numel() for p in MtpHead(model, 0).parameters())
    shape = model_shape(TINY)
    base = dict(precision="fp32", sharded=False, ranks=1, micro_batch=2, seq_len=10, completion_len=5)
    with_head = learner_peak(shape, LearnerSetup(draft=True, **base))
    assert with_head.parts["draft head"] == 16 * head_params + 2 * 10 * shape.hidden * 4
    assert with_head.total - learner_peak(shape, LearnerSetup(**base)).total == with_head.parts["draft head"]


def test_the_learner_line_gives_activation_checkpointing_off_and_on(capsys):
    assert main(["plan", str(SIZING / "1.5b-7b-teacher.yaml"), "--nodes", "1", "--gpus-per-node", "8",
                 "--gpu-memory", "80"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "activation checkpointing off:" in x)
    off, on = (float(part.split("activations ")[1].split(",")[0]) for part in line.split("; "))
    assert on < off / 4  # checkpointing keeps each block's input and one block's saved set


def _plan(path: Path, overrides: list[str], nodes: int, gpus: int, gib: float, prompt: int | None = None):
    return make_plan(load_run_recipe(path, overrides), Cluster(nodes, gpus, gib * GIB), prompt)


def test_a_full_vocab_teacher_holds_its_log_probabilities():
    recipe = load_run_recipe(REPO / "recipes" / "quickstart.yaml")  # loss.kind: full_vocab
    plan = make_plan(recipe, Cluster(1, 0, GIB), 64)
    chat = next(g for g in plan.groups if g.key == "teacher/chat")
    rows = 4  # 8 prompts, half routed to each teacher
    assert chat.need.parts["full-vocab output"] == rows * 48 * chat.shape.vocab * 4
    sampled = make_plan(load_run_recipe(REPO / "recipes" / "quickstart.yaml", ["loss.kind=sampled_token"]),
                        Cluster(1, 0, GIB), 64)
    assert "full-vocab output" not in next(g for g in sampled.groups if g.key == "teacher/chat").need.parts


def test_spread_puts_the_learner_ranks_on_different_nodes_and_pack_on_one():
    recipe = SIZING / "1.5b-7b-teacher.yaml"
    two = ["resources.learner.replicas=2"]
    spread = _plan(recipe, two + ["learner.placement=spread"], 2, 8, 80, 512)
    packed = _plan(recipe, two, 2, 8, 80, 512)
    assert sorted(spread.layout.nodes_of["learner"]) == [0, 1]
    assert packed.layout.nodes_of["learner"] == [0, 0]
    colocated = _plan(recipe, ["resources.placement.strategy=pack", "resources.learner.replicas=1",
                               "resources.learner.num_gpus=0.5", "resources.samplers.num_gpus=0.25",
                               "resources.placement.colocate=true", "sampling.engine=hf"], 1, 8, 80, 512)
    first = next(d for d in colocated.devices if "learner[0]" in d.tenants)
    assert {"samplers[0]", "samplers[1]"} <= set(first.tenants)  # one bundle: one shared GPU


@pytest.mark.parametrize("strategy, nodes_of, unplaced", [
    ("pack", [0, 0, 1], 0), ("spread", [0, 1, 0], 0), ("strict_pack", [-1, -1, -1], 3),
    ("strict_spread", [0, 1, -1], 1)])
def test_placement_strategies_on_two_nodes_of_two_gpus(strategy, nodes_of, unplaced):
    from k3post.config.placement_schema import PlacementSpec
    from k3post.config.resource_schema import ResourceSpec
    from k3post.plan.placement import place

    groups = [("learner", ResourceSpec(replicas=3, num_gpus=1), 10 * GIB)]
    layout = place(groups, Cluster(2, 2, 80 * GIB), PlacementSpec(strategy=strategy), "pack")
    assert layout.nodes_of["learner"] == nodes_of and len(layout.unplaced) == unplaced
    assert sum(len(d.tenants) for d in layout.devices) == 3 - unplaced  # one whole GPU each


def test_the_quickstart_plans_every_actor_group(capsys):
    assert main(["plan", str(REPO / "recipes" / "quickstart.yaml"), "--gpus-per-node", "0", "--host-memory", "16"]) == 0
    out = capsys.readouterr().out
    for group in ("learner", "samplers", "teacher/chat", "teacher/math"):
        assert f"| {group} |" in out
    assert "node 0 host memory" in out and "verdict: fits" in out


@pytest.mark.parametrize("recipe", ["sft/smollm2-math-fp8-qat.yaml", "rl/smollm2-boxed.yaml",
                                    "distill/kimi-student.yaml", "smoke/tiny-rl.yaml"])
def test_sft_rl_kimi_and_reward_model_recipes_plan_on_a_gpu(recipe, capsys):
    code = main(["plan", str(REPO / "recipes" / recipe), "resources.learner.num_gpus=1", "--gpus-per-node", "1",
                 "--prompt-tokens", "64"])
    out = capsys.readouterr().out
    assert code == 0 and "| learner | 1 | 1 |" in out and "node 0 GPU 0 | learner[0]" in out
    if "tiny-rl" in recipe:
        assert "| reward_model/judge |" in out


def test_in_process_is_one_device_holding_every_engine(capsys):
    gpus = ["resources.learner.num_gpus=1", "resources.samplers.num_gpus=1", "teachers.chat.resources.num_gpus=1",
            "teachers.math.resources.num_gpus=1"]
    recipe = load_run_recipe(REPO / "recipes" / "quickstart.yaml", gpus)
    plan = make_plan(recipe, Cluster(1, 1, 80 * GIB), 64, in_process=True)
    (device,) = plan.devices
    assert device.where == "node 0 GPU 0 (one process)" and len(device.tenants) == 4
    learner = next(g for g in plan.groups if g.key == "learner").need.total
    weights = sum(g.need.parts["weights"] for g in plan.groups if g.key != "learner")
    assert learner + weights < device.used < sum(g.need.total for g in plan.groups) * 1.05 + 0.6 * GIB


def test_bad_flags_are_one_clear_error(capsys):
    recipe = str(SIZING / "1.5b-7b-teacher.yaml")
    assert main(["plan", recipe, "--gpu-memory", "-8", "--nodes", "0"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-memory -8: expected the memory of one GPU in GiB" in err and "--nodes 0" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as stop:
        main(["plan", recipe, "--accelerators", "8"])
    assert stop.value.code == 2 and "unrecognized arguments: --accelerators" in capsys.readouterr().err


def test_a_too_small_gpu_gets_the_shortfall_and_a_fix_that_fits(capsys):
    recipe = str(SIZING / "1.5b-7b-teacher.yaml")
    flags = ["--gpus-per-node", "8", "--gpu-memory", "24", "--prompt-tokens", "512"]
    assert main(["plan", recipe, "sampling.engine=hf", "teachers.tutor.engine=hf", *flags]) == 1
    out = capsys.readouterr().out
    assert "SHORT by" in out and "verdict: does NOT fit" in out
    fix = next(line.strip() for line in out.splitlines() if line.strip().startswith("learner.activation_checkpointing"))
    overrides = fix.split(" (")[0].split()
    plan = _plan(Path(recipe), ["sampling.engine=hf", "teachers.tutor.engine=hf", *overrides], 1, 8, 24, 512)
    assert all(d.fits for d in plan.devices if any(t.startswith("learner") for t in d.tenants))


def test_sleeping_vllm_engines_count_one_at_a_time_on_their_gpu():
    """A fleet on one GPU (vllm.sleep): the device holds the resident tenants, the largest sleeping
    engine and a CUDA context for each other one; awake, every reservation at once."""
    share = ["resources.learner.num_gpus=0.1", "resources.samplers.num_gpus=0.3", "sampling.engine=vllm"]
    for teacher in ("chat", "math"):
        share += [f"teachers.{teacher}.engine=vllm", f"teachers.{teacher}.resources.num_gpus=0.3"]
    sleep = ["sampling.vllm.sleep=true", "teachers.chat.vllm.sleep=true", "teachers.math.vllm.sleep=true"]
    awake = make_plan(load_run_recipe(REPO / "recipes" / "quickstart.yaml", share), Cluster(1, 1, 8 * GIB), 64)
    asleep = make_plan(load_run_recipe(REPO / "recipes" / "quickstart.yaml", share + sleep), Cluster(1, 1, 8 * GIB), 64)
    (device_awake,), (device_asleep, host) = awake.devices, asleep.devices
    needs = {g.key: g.need.total for g in asleep.groups}
    learner = needs.pop("learner") * 1.05 + 0.6 * GIB
    assert all(g.sleeps == (g.key != "learner") for g in asleep.groups)
    assert device_awake.used == pytest.approx(learner + sum(needs.values()))
    assert device_asleep.used == pytest.approx(learner + max(needs.values()) + 2 * 0.6 * GIB)
    assert not device_awake.fits and device_asleep.fits
    # asleep, each engine's weights wait in pinned host memory: the plan's "pinned host" column
    for group in asleep.groups[1:]:  # the sampler and the two teachers (fp32 on this recipe's CPUs)
        assert group.need.host_pinned == 4 * group.shape.params > 0, group.key
    assert all(g.need.host_pinned == 0 for g in awake.groups if g.key != "learner")
    # ... which the node's host memory holds: a verdict of its own, checked against --host-memory
    copies = sum(g.need.host_pinned for g in asleep.groups)
    assert host.where == "node 0 host memory" and host.used == pytest.approx(copies) and host.capacity is None
    assert sorted(host.tenants) == ["samplers[0] (pinned)", "teacher/chat[0] (pinned)", "teacher/math[0] (pinned)"]
    recipe = load_run_recipe(REPO / "recipes" / "quickstart.yaml", share + sleep)
    short = make_plan(recipe, Cluster(1, 1, 8 * GIB), 64, host_bytes=copies / 2).devices[-1]
    assert not short.fits and short.used == host.used
    assert make_plan(recipe, Cluster(1, 1, 8 * GIB), 64, host_bytes=copies * 2).devices[-1].fits
    one_process = make_plan(recipe, Cluster(1, 1, 8 * GIB), 64, host_bytes=copies / 2, in_process=True).devices
    assert one_process[-1].where == "node 0 host memory" and not one_process[-1].fits  # in one process too
    assert one_process[-1].used == pytest.approx(copies)
