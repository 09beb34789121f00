"""vLLM on a CUDA GPU: what only a GPU exercises (the vLLM suite in tests/vllm runs there too).

- the learner's live GPU tensors synced into a vLLM engine whose core runs in a process of its
  own (CUDA IPC handles), every tensor checked on arrival, and the engine then computing the
  learner's logprobs; the same from the learner's own CUDA IPC handles handed on unopened (the
  cuda_ipc path of a sleeping sampler on Ray);
- vLLM's sleep mode: asleep, the engine hands its weights' and KV cache's memory back to the
  device; awake again, it draws exactly the tokens it drew before;
- vLLM against HF in bf16 (the tolerance is measured and stated below);
- a teacher's top-k prompt logprobs against HF's top-k.

Models: a random Llama built from a config (head size 64, which every GPU attention kernel
takes), bf16. Skipped without CUDA or without vLLM; run with the GPU bundle (tools/vllm_gpu/).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.vllm]
vllm = pytest.importorskip("vllm") if torch.cuda.is_available() else None

from k3post.config.schema import ModelSpec, OptimSpec, TeacherSpec, TinyModelSpec, VllmSpec  # noqa: E402
from k3post.engine.learner.learner import Learner, LearnerConfig  # noqa: E402
from k3post.engine.samplers.sampler import HFSampler  # noqa: E402
from k3post.engine.teachers.teacher import TeacherScorer  # noqa: E402
from k3post.engine.transport.weight_check import checksum  # noqa: E402
from k3post.model.scoring.logprobs import completion_logprobs  # noqa: E402
from k3post.types import Prompt, SamplingParams, TrainBatch  # noqa: E402

TINY = TinyModelSpec(hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2, intermediate_size=512, seed=5,
                     init_std=0.1)
STUDENT = ModelSpec(tiny=TINY, dtype="bfloat16")
PROMPTS = [Prompt(f"p{i}", "chat", "t", (("user", text),))
           for i, text in enumerate(["What is 2+2?", "Name a colour.", "Say hi", "Count to three, please."])]
# bf16 vLLM (its own kernels, fused q/k/v, FA3) against bf16 transformers on the same weights:
# up to 0.085 nats on an H100 (vLLM 0.26.0, 2026-12-07); a stale tensor is caught by its checksum.
BF16_TOL = 0.15


def engine(sleep: bool = False) -> VllmSpec:
    return VllmSpec(dtype="bfloat16", max_model_len=256, kv_cache_gib=0.5, gpu_memory_utilization=0.3,
                    sleep=sleep, enforce_eager=True)


def hf_logprobs(model, rollouts, pad_id):
    return completion_logprobs(model, rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                               pad_id, 1.0)


def trained_learner_and_rollouts(sampler):
    """A GPU learner one step away from its initial weights, and the rollouts it trained on."""
    learner = Learner(LearnerConfig(student=STUDENT, optim=OptimSpec(lr=1e-2, micro_batch_size=4), total_steps=1,
                                    device="cuda"))
    rollouts = sampler.sample(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))
    batch = TrainBatch(rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT,
                       rollouts.sampler_logprobs_BT, torch.randn_like(rollouts.sampler_logprobs_BT))
    learner.train_step(batch)
    return learner, rollouts


def assert_the_engine_holds(sampler, learner, rollouts, record_property) -> None:
    """Every checked tensor arrived as the learner holds it, straight into the live parameters
    (the direct load: a plain bf16 Llama on CUDA), and the engine computes its logprobs (every
    tensor applied, the tied head included)."""
    from k3post.engine.vllm.vllm_engine import last_sync_path

    assert last_sync_path(sampler.llm) == "direct"
    weights = learner.weights()
    received = sampler.weight_checksums(list(weights))
    assert received and all(received[name] == checksum(weights[name]) for name in received)
    got = sampler.sequence_logprobs(rollouts.prompt_ids, rollouts.completion_ids_BT, rollouts.loss_mask_BT)
    want = hf_logprobs(learner.model, rollouts, sampler.tokenizer.pad_token_id).float().cpu()
    mask = rollouts.loss_mask_BT.bool()
    diff = (got[mask] - want[mask]).abs().max().item()
    record_property("max_abs_diff_after_sync", diff)
    assert diff < BF16_TOL


def test_learner_weights_reach_a_sleeping_engine_in_its_own_process(record_property):
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    sampler = VLLMSampler(STUDENT, engine(sleep=True), num_gpus=0.3)
    assert sampler.llm.k3post_own_process
    learner, rollouts = trained_learner_and_rollouts(sampler)
    weights = learner.weights()
    assert all(t.is_cuda for t in weights.values())  # live tensors: they travel as CUDA IPC handles
    sampler.load_weights(weights, version=1)
    assert_the_engine_holds(sampler, learner, rollouts, record_property)
    counts = sampler.sample(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=2)).sampler_stats
    assert counts["sampler/wakes"] >= 2 and counts["sampler/sleeps"] >= 1, counts  # the sync's wake, the rollout's


def test_the_learners_ipc_handles_reach_a_sleeping_engines_core_unopened(record_property):
    """`cuda_ipc` on Ray: the sampler actor gets the learner's handles (`weight_ipc_handles`) and,
    its engine core being a process of its own, hands them on unopened; the core maps the learner's
    memory itself. (Mapping them in the actor first failed on an H100: torch refuses to share a
    tensor received under CUDA IPC again.) Here the handles come from this process, which plays
    the learner's part; the engine core is the third process."""
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    sampler = VLLMSampler(STUDENT, engine(sleep=True), num_gpus=0.3)
    assert sampler.llm.k3post_own_process  # else the handles would be mapped here, where they were made
    learner, rollouts = trained_learner_and_rollouts(sampler)
    assert sampler.load_ipc_weights(learner.weight_ipc_handles(), version=1) == 1
    assert_the_engine_holds(sampler, learner, rollouts, record_property)


def test_sleep_hands_memory_back_and_wakes_to_the_same_tokens(record_property):
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    sampler = VLLMSampler(STUDENT, engine(sleep=True), num_gpus=0.3)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    first = sampler.sample(PROMPTS, params)
    asleep = first.sampler_stats["sampler/free_gib_asleep"]  # the rollout put it back to sleep
    sampler.sleeper.wake()
    awake = torch.cuda.mem_get_info()[0] / 2**30
    record_property("gib_freed_by_sleep", asleep - awake)
    assert asleep - awake > 0.4  # the 0.5 GiB KV cache at least, and the weights
    second = sampler.sample(PROMPTS, params)
    assert torch.equal(first.completion_ids_BT, second.completion_ids_BT)
    assert torch.equal(first.sampler_logprobs_BT, second.sampler_logprobs_BT)


def _host_copy_addresses(worker) -> list[int]:
    return sorted(copy.data_ptr() for copy in getattr(worker, "k3post_host_weights", {}).values())


def test_a_sleeping_teacher_copies_its_weights_to_the_host_once_and_scores_the_same_after_every_wake(record_property):
    """A teacher's weights never change: its first sleep keeps vLLM's host copy, later sleeps drop
    the device memory at level 2 without copying, and each wake copies the kept copy in. The
    scores after several such turns are the first turn's, bit for bit."""
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher

    teacher = VLLMTeacher("t", TeacherSpec(model=STUDENT, engine="vllm", vllm=engine(sleep=True),
                                            resources={"num_gpus": 0.3}))
    copying_sleep = teacher.prefix_counts()["sleep_s"]  # the build's sleep: level 1, the host copy made
    kept = teacher.llm.collective_rpc(_host_copy_addresses)[0]
    assert kept and teacher.sleeper.kept
    rollouts = HFSampler(STUDENT, device="cuda").sample(PROMPTS, SamplingParams(max_new_tokens=16, seed=3))
    first = teacher.score(rollouts)
    for _ in range(3):
        assert torch.equal(teacher.score(rollouts), first)
    counts = teacher.prefix_counts()
    record_property("copying_sleep_s", copying_sleep)
    record_property("later_sleep_s", counts["sleep_s"] / counts["sleeps"])
    assert teacher.llm.collective_rpc(_host_copy_addresses)[0] == kept  # the very host copy, never made again
    assert counts["free_gib_asleep"] > counts["free_gib_awake"]  # a level-2 sleep still hands the memory back


def test_vllm_scores_equal_hf_scores_in_bf16(record_property):
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher

    teacher_spec = TeacherSpec(model=STUDENT, engine="vllm", vllm=engine())
    teacher = VLLMTeacher("t", teacher_spec)
    hf = HFSampler(STUDENT, device="cuda")
    rollouts = hf.sample(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=3))
    got = teacher.score(rollouts)
    want = hf_logprobs(hf.model, rollouts, hf.tokenizer.pad_token_id).float().cpu()
    mask = rollouts.loss_mask_BT.bool()
    diff = (got[mask] - want[mask]).abs()
    record_property("bf16_max_abs_diff", diff.max().item())
    record_property("bf16_mean_abs_diff", diff.mean().item())
    assert diff.max() < BF16_TOL
    # top-k: the teacher's own best ids hold HF's best id at each position, values within the tolerance
    token_BT, topk = teacher.score_topk(rollouts, 5)
    hf_teacher = TeacherScorer("t", teacher_spec.model_copy(update={"engine": "hf"}))
    full_BTV = hf_teacher.score_full(rollouts).float()
    best_BT = full_BTV.argmax(dim=-1)
    assert (topk.ids_BTK[..., 0][mask] == best_BT[mask]).float().mean() > 0.95
    torch.testing.assert_close(token_BT[mask], got[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "ray"])
def test_three_roles_take_turns_on_one_gpu(tmp_path, record_property, in_process):
    """The learner, a vLLM sampler and a vLLM teacher on one GPU, both engines asleep between their
    turns (`vllm.sleep`), through `k3post run`, in process and as Ray actors colocated on the GPU
    (the learner's weights then reach the sampler actor's engine core as the learner's own CUDA IPC
    handles): every step trains, the sampler drew with the weights the learner holds, the teacher
    reports its sleep and wake seconds, and the free memory it finds asleep exceeds what it finds awake."""
    from pathlib import Path

    if not in_process:
        pytest.importorskip("ray")

    from k3post.cli.run import run_recipe
    from k3post.track.metrics import read_metrics

    repo = Path(__file__).resolve().parents[2]
    engine = "{dtype: bfloat16, max_model_len: 256, kv_cache_gib: 0.5, gpu_memory_utilization: 0.9, sleep: true}"
    overrides = [f"sampling.vllm={engine}", f"teachers.gamma.vllm={engine}",
                 "resources.samplers.num_gpus=0.3", "resources.learner.num_gpus=0.3",
                 "teachers.gamma.resources.num_gpus=0.3", "train.steps=3", "train.eval_every=3",
                 # head size 64, which every GPU attention kernel takes (the recipe's 32 is for CPUs)
                 "student.tiny.hidden_size=128", "teachers.gamma.model.tiny.hidden_size=128"]
    if not in_process:  # one GPU shared by fractions: the placement keeps the three actors on it (cuda_ipc needs that)
        overrides += ["resources.placement.colocate=true", "sampling.weight_transport=cuda_ipc"]
    recipe = repo / "recipes" / "smoke" / "tiny-vllm.yaml"
    assert run_recipe(recipe, overrides, tmp_path / "run", in_process, False) == 0
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [m for m in metrics if m.get("step", 0) >= 1]
    assert len(steps) == 3 and all(m["train/loss"] == m["train/loss"] for m in steps)
    # bf16 vLLM decode against the learner's forward: the BF16_TOL scale, not a stale policy's
    record_property("logprob_abs_diff_max_step", max(m["train/logprob_abs_diff"] for m in steps))
    assert max(m["train/logprob_abs_diff"] for m in steps) < BF16_TOL
    last = steps[-1]
    record_property("teacher_sleep_s", last["teacher/sleep_s/gamma"])
    record_property("teacher_wake_s", last["teacher/wake_s/gamma"])
    assert last["teacher/sleeps/gamma"] >= 1 and last["teacher/wakes/gamma"] >= 1
    assert last["teacher/free_gib_asleep/gamma"] > last["teacher/free_gib_awake/gamma"]
    assert last["sampler/sleeps"] >= 1 and last["sampler/free_gib_asleep"] > last["sampler/free_gib_awake"]
