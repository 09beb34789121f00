"""The vLLM-on-GPU hazards (docs/engines.md) on a machine with a GPU but no vLLM: the k3post side of
the vLLM engines, with the vLLM engine itself replaced by a stub (the lent H200 has no vLLM wheel).
Run from the repository root: `python bench/engines/vllm_hazards_on_gpu.py`. Prints, with CUDA present:

1. engine_options for an actor holding half a GPU (what would reach LLM(...));
2. a vLLM teacher whose actor holds num_gpus 0.5 evaluates (exact KL) on a CPU HF copy: no byte of
   its own on the GPU; the pre-fix placement (TeacherScorer on engine_device) lands on cuda;
3. a vLLM sampler handed CUDA weights keeps them by reference (no host copy at the sync, no HF
   copy), and its full distributions (CPU copy built at that call) equal the GPU model's.
"""

import sys
import time

import torch

sys.path.insert(0, ".")
import k3post.engine.samplers.vllm_sampler as vs  # noqa: E402
import k3post.engine.teachers.vllm_teacher as vt  # noqa: E402
from k3post.config.schema import ModelSpec, ResourceSpec, TeacherSpec, TinyModelSpec, VllmSpec  # noqa: E402
from k3post.engine.samplers.sampler import HFSampler  # noqa: E402
from k3post.engine.teachers.teacher import TeacherScorer  # noqa: E402
from k3post.engine.vllm.vllm_engine import engine_options  # noqa: E402
from k3post.model.training.weights import unique_tensors  # noqa: E402
from k3post.types import Prompt, SamplingParams  # noqa: E402

assert torch.cuda.is_available(), "no GPU"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
TINY = dict(hidden_size=64, num_heads=2, num_kv_heads=1)
STUDENT = ModelSpec(tiny=TinyModelSpec(**TINY, seed=5))
TEACHER = TeacherSpec(model=ModelSpec(tiny=TinyModelSpec(**TINY, seed=6, init_std=0.2)), engine="vllm",
                      resources=ResourceSpec(num_gpus=0.5))
PROMPTS = [Prompt(f"p{i}", "chat", "t", (("user", q),)) for i, q in enumerate(["What is 2+2?", "Name a colour."])]

opts = engine_options("/m", VllmSpec(), num_gpus=0.5)
print("1. LLM options, num_gpus 0.5:", {k: opts[k] for k in ("gpu_memory_utilization", "tensor_parallel_size",
                                                               "enforce_eager")}, "kv_cache_memory_bytes set:", "kv_cache_memory_bytes" in opts)

STUB = object()  # stands for vllm.LLM
vt.build_llm = lambda *a, **k: STUB
vs.build_llm = lambda *a, **k: STUB
vs.timed_sync = lambda llm, weights, how, check=(): 0.0

gpu_sampler = HFSampler(STUDENT, device="cuda")
rollouts = gpu_sampler.sample(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1))
student_BTV = gpu_sampler.full_logprobs(rollouts)  # on the GPU, as a sampler group's would be
teacher = vt.VLLMTeacher("t", TEACHER)
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
kl = teacher.exact_kl(rollouts, student_BTV, "reverse")
torch.cuda.synchronize()
print(f"2. vLLM teacher (num_gpus 0.5) exact KL {kl['kl_sum'] / kl['tokens']:.4f} over {kl['tokens']:.0f} tokens;"
      f" HF copy on {teacher._hf.device}, parameters on {sorted({p.device.type for p in teacher._hf.model.parameters()})};"
      f" GPU bytes held after the evaluation: {torch.cuda.memory_allocated() - before}")
old = TeacherScorer("t", TEACHER.model_copy(update={"engine": "hf"}))  # where _full() used to build it
print(f"   pre-fix placement (TeacherScorer on engine_device): {old.device}, "
      f"{sum(p.numel() * p.element_size() for p in old.model.parameters())} parameter bytes on the GPU")
del old

sampler = vs.VLLMSampler(STUDENT, VllmSpec(), num_gpus=0.5)
with torch.no_grad():
    for p in gpu_sampler.model.parameters():
        p.add_(0.01 * torch.randn_like(p))  # a "learner step"
weights = unique_tensors(gpu_sampler.model.state_dict())  # the learner's live CUDA tensors
started = time.perf_counter()
sampler.load_weights(weights, 1)
sync_s = time.perf_counter() - started
same = all(sampler._weights[k] is weights[k] for k in weights)
held = [n for n, v in vars(sampler).items() if isinstance(v, (torch.nn.Module, HFSampler))]
full_BTV = sampler.full_logprobs(rollouts, 1.0)
want_BTV = gpu_sampler.full_logprobs(rollouts).cpu()
mask = rollouts.loss_mask_BT.bool()
print(f"3. sampler sync: {sync_s * 1e3:.2f} ms beside the (stubbed) engine reload; kept weights are the very CUDA "
      f"tensors handed over: {same}; modules held after the sync: {held}; after full_logprobs: HF copy on "
      f"{sampler._hf.device}, max |full - GPU model's| {(full_BTV[mask] - want_BTV[mask]).abs().max().item():.2e}; "
      f"weights reference let go: {sampler._weights is None}")
sampler.load_weights(weights, 2)
print("   after the next sync, modules held:", [n for n, v in vars(sampler).items() if isinstance(v, (torch.nn.Module, HFSampler))])
