"""The sharded learner (FSDP2 over 2 gloo ranks, real processes, no Ray) against the
one-process learner: the same losses, grad norms and weights; the grad-buffer reference under
sharding; checkpoints that reshard 2 -> 1 and 1 -> 2, and move between the one-process learner
and 2 ranks both ways; the HF export.

One spawn of 2 ranks runs every scenario (process start-up dominates on a 2-core box) and rank
0 saves what it saw; the tests compare it with runs in this process.
"""

from __future__ import annotations

import dataclasses
import socket
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from k3post.algo.objectives import FullVocabReverseKL, RlPolicyLoss, SampledTokenPG, SftNll
from k3post.config.errors import UserError
from k3post.config.learner_schema import LearnerSpec
from k3post.config.schema import ModelSpec, OptimSpec, QatSpec, ReferenceSpec, TinyModelSpec
from k3post.engine.sharded import sharded_reference
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.engine.sharded.rank import RankSpec, destroy_group
from k3post.model.loading.load import load_tokenizer
from k3post.model.loading.tiny import save_tiny
from k3post.types import Prompt, TrainBatch
from tests.spawned_rank import leave_without_teardown
from tests.unit.test_learner import make_batch, save_old_format

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))
ALWAYS = LearnerSpec(sharding="always", precision="fp32")
GB_REF = ReferenceSpec(kind="grad_buffer", kl_coef=0.1)
TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(objective=None, reference=None, qat=False, micro=2) -> LearnerConfig:
    return LearnerConfig(student=SPEC, optim=OptimSpec(lr=1e-2, micro_batch_size=micro),
                         objective=objective or SampledTokenPG(), reference=reference or ReferenceSpec(),
                         total_steps=10, num_threads=1, qat=QatSpec(enabled=qat))


def sft_examples(n: int, offset: int = 0) -> list[Prompt]:
    return [Prompt(f"e{i}", "s", "t", (("user", f"Say {i}?"), ("assistant", f"Number {i} {'x' * (i % 4)}.")))
            for i in range(offset, offset + n)]


def with_teacher(batch: TrainBatch, vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    B, T = batch.completion_ids_BT.shape
    teacher = torch.log_softmax(torch.randn(B, T, vocab, generator=g), dim=-1)
    return TrainBatch(batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT, batch.sampler_logprobs_BT,
                      batch.advantages_BT, teacher)


def steps(lrn, batches, sft: bool = False) -> list[dict]:
    return [lrn.sft_step(b) if sft else lrn.train_step(b) for b in batches]


def gathered(lrn) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).clone() for k, v in lrn.weights().items()}


def scenarios(lrn_cls, rank: RankSpec, data: dict, out: Path) -> dict:
    """Every sharded run of the module, on the ranks of `rank`'s group."""
    res = {}

    def make(cfg):
        return lrn_cls(cfg, rank, ALWAYS)

    lrn = make(config())
    res["opd"] = (steps(lrn, data["opd"]), gathered(lrn))
    lrn = make(config(FullVocabReverseKL()))
    res["full_vocab"] = (steps(lrn, data["full_vocab"]), gathered(lrn))
    lrn = make(config(RlPolicyLoss()))
    res["rl"] = (steps(lrn, data["opd"][:2]), gathered(lrn))
    lrn = make(config(SftNll(), qat=True))
    res["sft_qat"] = (steps(lrn, data["sft"], sft=True) + [lrn.sft_eval(data["sft_eval"])], gathered(lrn))
    # The grad-buffer reference against a separate sharded copy of the initial model; a scratch
    # of 100 elements makes every swap of a shard go piece by piece, with a short last piece.
    default_scratch, sharded_reference.SCRATCH_ELEMENTS = sharded_reference.SCRATCH_ELEMENTS, 100
    try:
        trick = make(config(reference=ReferenceSpec(kind="grad_buffer", kl_coef=0.1)))
    finally:
        sharded_reference.SCRATCH_ELEMENTS = default_scratch
    assert trick.reference.scratch[torch.float32].numel() == 100
    copy = make(config(reference=ReferenceSpec(kind="copy", kl_coef=0.1)))
    res["ref_steps"] = (steps(trick, data["opd"][:2]), steps(copy, data["opd"][:2]))
    mbs = [mb for mb, _ in trick._work(data["opd"][2])]
    res["ref_logprobs"] = (trick.reference.logprobs(mbs, 0, 1.0), copy.reference.logprobs(mbs, 0, 1.0))
    res["ref_weights"] = (gathered(trick), gathered(copy))
    res["ref_grads_zero"] = all(float(p.grad.to_local().abs().max()) == 0 for p in trick.params)
    # Checkpoints: train, save at step 1, go on (the uninterrupted run); resume other groups'.
    lrn = make(config(reference=GB_REF))
    res.update(checkpointed_run(lrn, data, out / f"w{rank.world_size}" / "step-1"))
    if rank.world_size == 2:
        scenarios_two_only(lrn_cls, rank, data, res)
    res["resumed"] = {source: resumed_run(make(config(reference=GB_REF)), directory, data)
                      for source, directory in data.get("resume_from", {}).items()}
    return res


def checkpointed_run(lrn, data: dict, directory: Path) -> dict:
    """One step, a checkpoint, two more steps: the uninterrupted run a resume must reproduce."""
    lrn.train_step(data["opd"][0])
    lrn.save_checkpoint(str(directory), {"step": 1})
    weights = gathered(lrn)
    return {"ckpt_weights": weights, "straight": (steps(lrn, data["opd"][1:3]), gathered(lrn))}


def resumed_run(lrn, directory: Path, data: dict) -> tuple[dict, tuple[list, dict]]:
    """The run state read back, and the two steps after the checkpoint (with the weights)."""
    state = lrn.load_checkpoint(str(directory))
    return state, (steps(lrn, data["opd"][1:3]), gathered(lrn))


def scenarios_two_only(lrn_cls, rank: RankSpec, data: dict, res: dict) -> None:
    """Loading each rank's rows from a model directory (meta device: QAT prepared there) with
    activation checkpointing; bf16-mixed precision."""
    from k3post.engine.sharded.rank import peak_host_rss_gib

    path_cfg = dataclasses.replace(config(qat=True), student=ModelSpec(path=data["model_dir"]))
    lrn = lrn_cls(path_cfg, rank, LearnerSpec(sharding="always", precision="fp32", activation_checkpointing=True))
    res["dir_ac"] = (steps(lrn, data["opd"]), gathered(lrn))
    res["dir_local_numel"] = sum(p.to_local().numel() for p in lrn.params)
    res["rss_gib"] = peak_host_rss_gib()
    lrn = lrn_cls(config(), rank, LearnerSpec(sharding="always", precision="fp32", shard_unit="model"))
    res["unit_model"] = (steps(lrn, data["opd"]), gathered(lrn), len([m for m in lrn.root.modules()
                                                                      if isinstance(m, FSDPModule)]))
    lrn = lrn_cls(config(), rank, LearnerSpec(sharding="always", precision="bf16-mixed"))
    res["bf16_mixed"] = (steps(lrn, data["opd"][:1]), {p.dtype for p in lrn.params},
                         {t.dtype for s in lrn.optimizer.state.values() for t in s.values() if t.dim()})


def _rank_main(rank: int, world: int, port: int, data: dict, out: Path) -> None:
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    torch.set_num_threads(1)
    try:
        res = scenarios(ShardedLearner, RankSpec(rank, world, "gloo", "127.0.0.1", port), data, out)
        if rank == 0:
            torch.save(res, out / "two_ranks.pt")
    finally:
        destroy_group()
    leave_without_teardown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    out = tmp_path_factory.mktemp("sharded")
    opd = [make_batch(SPEC, n=5, seed=s) for s in range(3)]  # 3 micro-batches of 2: one rank pads
    vocab = len(load_tokenizer(SPEC))
    data = {"model_dir": str(save_tiny(SPEC.tiny, out / "tiny-model")), "opd": opd, "full_vocab": [with_teacher(b, vocab, s) for s, b in enumerate(opd[:2])],
            "sft": [sft_examples(5, 5 * s) for s in range(3)], "sft_eval": sft_examples(5, 40)}
    # In this process: one rank (the FSDP path at world size 1), and the unsharded learner (its
    # own checkpoint layout). Their checkpoints are resumed on 2 ranks, and the 2 ranks' here.
    try:
        one = scenarios(ShardedLearner, RankSpec(0, 1, "gloo", "127.0.0.1", free_port()), data, out)
        unsharded = checkpointed_run(Learner(config(reference=GB_REF)), data, out / "u1" / "step-1")
        resume_from = {"one": out / "w1" / "step-1", "unsharded": out / "u1" / "step-1"}
        mp.spawn(_rank_main, args=(2, free_port(), dict(data, resume_from=resume_from), out), nprocs=2)
        two = torch.load(out / "two_ranks.pt", weights_only=False)
        w2 = out / "w2" / "step-1"
        lrn = ShardedLearner(config(reference=GB_REF), RankSpec(0, 1, "gloo", "127.0.0.1", 0), ALWAYS)
        one["resumed"]["two"] = resumed_run(lrn, w2, data)
        unsharded["resumed"] = {"two": resumed_run(Learner(config(reference=GB_REF)), w2, data)}
        save_old_format(Learner(config()), out / "old" / "step-1", {"step": 1})
        with pytest.raises(UserError, match="only one unsharded learner rank can resume it") as refused:
            lrn.load_checkpoint(str(out / "old" / "step-1"))
    finally:
        destroy_group()
    return {"one": one, "two": two, "unsharded": unsharded, "refused": str(refused.value), "data": data, "out": out}


def assert_same_run(sharded, single, keys=("train/loss", "train/grad_norm")):
    assert len(sharded) == len(single)
    for got, want in zip(sharded, single):
        for key in keys:
            assert got[key] == pytest.approx(want[key], abs=TOL, rel=TOL), key


def assert_same_weights(got: dict, want: dict, tol: float = TOL):
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.allclose(got[name], torch.as_tensor(value), atol=tol), name


def unsharded(cfg, batches, sft=False):
    lrn = Learner(cfg)
    return steps(lrn, batches, sft), {k: torch.as_tensor(v) for k, v in lrn.weights().items()}


def test_the_whole_model_as_one_fsdp_unit_trains_as_one_process(runs):
    """learner.shard_unit: model - one FSDP unit (the root), gathered once per forward."""
    metrics, weights = unsharded(config(), runs["data"]["opd"])
    got_metrics, got_weights, units = runs["two"]["unit_model"]
    assert units == 1
    assert_same_run(got_metrics, metrics)
    assert_same_weights(got_weights, weights)


@pytest.mark.parametrize("world", ["one", "two"])
def test_sampled_token_opd_equals_the_one_process_learner(runs, world):
    metrics, weights = unsharded(config(), runs["data"]["opd"])
    got_metrics, got_weights = runs[world]["opd"]
    assert_same_run(got_metrics, metrics, ("train/loss", "train/grad_norm", "train/ratio_mean", "train/ratio_max",
                                           "train/tokens"))
    assert_same_weights(got_weights, weights)
    assert any(m["train/grad_norm"] > 0.1 for m in metrics)  # the steps did move the weights


def test_full_vocab_opd_and_rl_equal_the_one_process_learner(runs):
    for key, objective, batches in (("full_vocab", FullVocabReverseKL(), runs["data"]["full_vocab"]),
                                    ("rl", RlPolicyLoss(), runs["data"]["opd"][:2])):
        metrics, weights = unsharded(config(objective), batches)
        assert_same_run(runs["two"][key][0], metrics)
        assert_same_weights(runs["two"][key][1], weights)


def test_qat_sft_on_two_ranks_equals_one_process(runs):
    single = Learner(config(SftNll(), qat=True))
    metrics = steps(single, runs["data"]["sft"], sft=True) + [single.sft_eval(runs["data"]["sft_eval"])]
    got, weights = runs["two"]["sft_qat"]
    assert_same_run(got[:-1], metrics[:-1])
    assert got[-1]["eval/nll"] == pytest.approx(metrics[-1]["eval/nll"], abs=TOL)
    assert got[-1]["eval/tokens"] == metrics[-1]["eval/tokens"]
    assert_same_weights(weights, {k: torch.as_tensor(v) for k, v in single.weights().items()})
    assert single.qat_layers  # fake quantization was on


def test_grad_buffer_reference_under_fsdp_matches_a_separate_copy_exactly(runs):
    two = runs["two"]
    trick_steps, copy_steps = two["ref_steps"]
    for a, b in zip(trick_steps, copy_steps):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        assert a["train/ref_kl"] == b["train/ref_kl"]
    for a, b in zip(*two["ref_logprobs"]):
        assert torch.equal(a, b)  # bit-identical: the same gathered weights, the same kernels
    trick_w, copy_w = two["ref_weights"]
    assert all(torch.equal(trick_w[k], copy_w[k]) for k in trick_w)  # identical optimizer trajectories
    assert two["ref_grads_zero"]  # the buffers are zero after the reference pass
    # ... and the one-process learner with its own grad-buffer reference takes the same steps.
    metrics, weights = unsharded(config(reference=ReferenceSpec(kind="grad_buffer", kl_coef=0.1)),
                                 runs["data"]["opd"][:2])
    assert_same_run(trick_steps, metrics, ("train/loss", "train/grad_norm", "train/ref_kl"))
    assert trick_steps[1]["train/ref_kl"] != 0.0


@pytest.mark.parametrize("saved,resumed", [("two", "one"), ("one", "two"), ("unsharded", "two"),
                                           ("two", "unsharded")])
def test_checkpoints_reshard_and_resume_the_uninterrupted_run(runs, saved, resumed):
    """Saved by a group of one size (or the one-process learner), resumed by another: the next
    steps and the weights are the uninterrupted run's."""
    state, (metrics, weights) = runs[resumed]["resumed"][saved]
    assert state == {"step": 1}
    straight_metrics, straight_weights = runs[saved]["straight"]
    assert_same_run(metrics, straight_metrics, ("train/loss", "train/grad_norm", "train/lr", "train/ref_kl"))
    assert_same_weights(weights, straight_weights)
    embed = "model.embed_tokens.weight"  # tied to the LM head
    assert not torch.equal(weights[embed], runs[saved]["ckpt_weights"][embed])  # the two steps did move it


def test_the_one_process_learner_writes_the_sharded_layout(runs):
    """Model and optimizer under dcp/ with the HF names, trainer_state.pt without the optimizer."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = runs["out"] / "u1" / "step-1"
    keys = set(FileSystemReader(str(directory / "dcp")).read_metadata().state_dict_metadata)
    assert {"model.model.embed_tokens.weight", "optim.state.model.embed_tokens.weight.exp_avg"} <= keys
    assert keys == set(FileSystemReader(str(runs["out"] / "w2" / "step-1" / "dcp")).read_metadata().state_dict_metadata)
    assert "optimizer" not in torch.load(directory / "trainer_state.pt", weights_only=False)
    assert "one more checkpoint" in runs["refused"]  # an old-layout checkpoint on a rank: what to do


def test_hf_export_of_a_sharded_checkpoint_is_the_gathered_model(runs):
    directory = runs["out"] / "w2" / "step-1"
    assert (directory / "COMPLETE").is_file() and (directory / "dcp").is_dir()
    hf = AutoModelForCausalLM.from_pretrained(directory)
    state = {k: v for k, v in hf.state_dict().items() if k in runs["two"]["ckpt_weights"]}
    assert_same_weights(state, runs["two"]["ckpt_weights"], tol=0.0)
    assert not list(directory.parent.glob(".step-1.tmp-*"))  # the temporary directory was renamed away


def test_a_damaged_rank_shard_of_a_sharded_checkpoint_is_found(runs, tmp_path):
    """The group's checkpoint: each rank's dcp/ file is in the COMPLETE manifest, and a format
    check alone (a checkpoint from before the manifest) still finds rank 1's file cut short."""
    from k3post.track.checkpoint_files import checkpoint_problem, manifest_of

    shards = sorted(n for n in manifest_of(runs["out"] / "w2" / "step-1") if n.endswith(".distcp"))
    assert len(shards) == 2
    for marker, damage, words in (("manifest", lambda b: b[:9] + bytes([b[9] ^ 1]) + b[10:], "bytes changed"),
                                  ("complete\n", lambda b: b[:-8], "is cut short")):
        ckpt = Path(shutil.copytree(runs["out"] / "w2" / "step-1", tmp_path / marker.strip() / "step-1"))
        if marker != "manifest":
            (ckpt / "COMPLETE").write_text(marker)
        assert checkpoint_problem(ckpt) is None
        (ckpt / shards[1]).write_bytes(damage((ckpt / shards[1]).read_bytes()))
        assert f"{shards[1]}" in checkpoint_problem(ckpt) and words in checkpoint_problem(ckpt)


def test_loading_each_ranks_rows_from_a_model_directory_with_activation_checkpointing(runs):
    """ModelSpec(path=...) on 2 ranks: parameters built on the meta device and FP8 QAT prepared
    there, each rank reads its rows from the safetensors file; blocks recompute activations in
    backward. The same run as one process with QAT."""
    metrics, weights = unsharded(config(qat=True), runs["data"]["opd"])
    got, got_weights = runs["two"]["dir_ac"]
    assert_same_run(got, metrics)
    assert_same_weights(got_weights, weights)
    total = sum(v.numel() for v in weights.values())
    assert runs["two"]["dir_local_numel"] <= total // 2 + 64  # rank 0 holds its half (plus row rounding)


def test_bf16_mixed_keeps_fp32_masters_and_moments_and_computes_in_bf16(runs):
    metrics, _ = unsharded(config(), runs["data"]["opd"][:1])
    got, param_dtypes, state_dtypes = runs["two"]["bf16_mixed"]
    assert param_dtypes == {torch.float32} and state_dtypes == {torch.float32}
    # bf16 compute: close to the fp32 step, but not equal to it (the compute did run in bf16).
    assert got[0]["train/loss"] == pytest.approx(metrics[0]["train/loss"], rel=0.05, abs=5e-3)
    assert got[0]["train/grad_norm"] == pytest.approx(metrics[0]["train/grad_norm"], rel=0.05)
    assert got[0]["train/grad_norm"] != pytest.approx(metrics[0]["train/grad_norm"], rel=1e-6)


def test_lora_is_refused_at_load_with_a_clear_message():
    from k3post.config.errors import UserError
    from k3post.config.schema import LoraSpec
    from k3post.engine.sharded.sharded_learner import ShardedLearner

    with pytest.raises(UserError, match="LoRA is not supported under FSDP"):
        ShardedLearner(dataclasses.replace(config(), lora=LoraSpec(rank=4)), RankSpec(0, 1), ALWAYS)


def test_micro_batches_are_dealt_round_robin_and_short_ranks_pad_with_zero_weight():
    from k3post.engine.sharded.sharded_learner import rank_micro_batches

    mbs = ["a", "b", "c", "d", "e"]
    assert rank_micro_batches(mbs, 0, 2) == [("a", 1.0), ("c", 1.0), ("e", 1.0)]
    assert rank_micro_batches(mbs, 1, 2) == [("b", 1.0), ("d", 1.0), ("a", 0.0)]
    assert rank_micro_batches(["a"], 2, 4) == [("a", 0.0)]


def test_one_rank_without_sharding_is_todays_learner():
    from k3post.engine.sharded.learner_rank import make_learner, uses_sharding

    assert type(make_learner(config())) is Learner  # the quickstart path, untouched
    assert not uses_sharding(LearnerSpec(), 1, "cpu", "float32")
    assert uses_sharding(LearnerSpec(), 2, "cpu", "float32")
    assert uses_sharding(LearnerSpec(), 1, "cuda", "bfloat16")  # auto = bf16-mixed on GPUs: the FSDP path
    assert uses_sharding(LearnerSpec(sharding="always"), 1, "cpu", "float32")
    assert not uses_sharding(LearnerSpec(precision="bf16"), 1, "cuda", "bfloat16")  # today's pure-bf16 GPU learner
    with pytest.raises(UserError, match="learner.shard_unit: model needs the sharded learner"):
        make_learner(config(), LearnerSpec(shard_unit="model"))  # never silently ignored


def test_large_hf_exports_are_several_safetensors_files_with_an_index(tmp_path, tiny_model):
    from k3post.model.training.sharded_weights import save_hf_weights

    model, _ = tiny_model
    save_hf_weights(model, tmp_path, shard_bytes=20_000)
    model.config.save_pretrained(tmp_path)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_train_compile_compiles_each_sharded_block_in_place():
    """`train.compile` is not silently dropped by the sharded learner: each decoder block is
    compiled in place (parameter names unchanged). No step is run (inductor is slow on a CPU)."""
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from k3post.model.training.fsdp import decoder_blocks

    lrn = ShardedLearner(dataclasses.replace(config(), compile=True), RankSpec(0, 1, port=free_port()), ALWAYS)
    blocks = decoder_blocks(lrn.model)
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert not any("_orig_mod" in name for name, _ in lrn.model.named_parameters())


def test_the_shard_local_adamw_updates_bit_for_bit_as_torchs_adamw_over_the_dtensors():
    """The sharded learner's AdamW runs on the plain local shards (no DTensor dispatch); against
    torch's AdamW over the same DTensor parameters, the same steps give identical weights, and
    the optimizer state stays DTensors (what distributed checkpoints save and reshard)."""
    from torch.distributed.tensor import DTensor

    from k3post.engine.learner.learner_base import make_optimizer
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from k3post.model.training.fsdp import ShardLocalAdamW

    cfg = dataclasses.replace(config(), optim=OptimSpec(lr=1e-2, micro_batch_size=2, weight_decay=0.1))
    batches = [make_batch(SPEC, n=4, seed=s) for s in range(3)]
    ours = ShardedLearner(cfg, RankSpec(0, 1, port=free_port()), ALWAYS)
    torchs = ShardedLearner(cfg, RankSpec(0, 1, port=free_port()), ALWAYS)
    torchs.optimizer, torchs.scheduler = make_optimizer(torchs.params, cfg.optim, cfg.total_steps)
    assert type(ours.optimizer) is ShardLocalAdamW and type(torchs.optimizer) is torch.optim.AdamW
    got, want = steps(ours, batches), steps(torchs, batches)
    assert [m["train/loss"] for m in got] == [m["train/loss"] for m in want]
    assert got[-1]["train/grad_norm"] == want[-1]["train/grad_norm"]
    ours_w, torchs_w = gathered(ours), gathered(torchs)
    assert all(torch.equal(ours_w[k], torchs_w[k]) for k in torchs_w)
    initial = torch.as_tensor(Learner(cfg).weights()["model.embed_tokens.weight"])
    assert not torch.equal(ours_w["model.embed_tokens.weight"], initial)
    moments = [t for s in ours.optimizer.state.values() for t in s.values() if t.dim()]
    assert moments and all(isinstance(t, DTensor) for t in moments)
    destroy_group()


def test_a_one_rank_group_refills_its_export_buffers_in_place_with_the_gathered_weights():
    """model/training/sharded_weights.py: refill_full_state, what a one-rank learner on a GPU hands
    its samplers. Its buffers hold exactly what the bucketed gather gives (cast to bf16), are
    made once and keep their addresses after a step (so CUDA IPC handles stay valid), and hold the
    stepped weights then; a tensor this rank holds only a shard of is refused."""
    from k3post.engine.sharded.sharded_learner import ShardedLearner
    from k3post.model.training.sharded_weights import gathered_state, refill_full_state

    lrn = ShardedLearner(config(), RankSpec(0, 1, port=free_port()), ALWAYS)
    try:
        buffers: dict[str, torch.Tensor] = {}
        refill_full_state(lrn.model, buffers, torch.bfloat16)
        want = gathered_state(lrn.model, torch.bfloat16)
        assert set(buffers) == set(want) and all(torch.equal(buffers[k], want[k]) for k in want)
        addresses = {k: t.data_ptr() for k, t in buffers.items()}
        before = buffers["model.embed_tokens.weight"].clone()
        lrn.train_step(make_batch(SPEC, n=4, seed=0))
        refill_full_state(lrn.model, buffers, torch.bfloat16)
        want = gathered_state(lrn.model, torch.bfloat16)
        assert {k: t.data_ptr() for k, t in buffers.items()} == addresses
        assert all(torch.equal(buffers[k], want[k]) for k in want)
        assert not torch.equal(buffers["model.embed_tokens.weight"], before)
    finally:
        destroy_group()

    from unittest import mock

    from torch.distributed.tensor import DTensor

    shard = mock.MagicMock(spec=DTensor, shape=torch.Size([4, 2]))  # half of [4, 2], as in a group of two
    shard.to_local.return_value = torch.zeros(2, 2)
    with mock.patch("k3post.model.training.sharded_weights._unique_entries", return_value=[("w", shard)]):
        with pytest.raises(ValueError, match=r"w: this rank holds \(2, 2\) of \(4, 2\)"):
            refill_full_state(torch.nn.Module(), {})
