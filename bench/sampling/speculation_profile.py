"""Where a speculative round's time goes on a GPU, against a decode step's
(bench/sampling/speculation_gpu.py --profile).

One call of an engine, after its compiling passes, under torch.profiler. Per loop iteration (a
decode step of the static engine, a round of the speculative one):
- the GPU's busy time: the union of the intervals in which any kernel, copy or memset ran;
- the kernels' summed time, and how many ran;
- the kernels that take the most time.
Set against the iteration's wall time measured without the profiler (its tracing slows the host),
the busy time says what bounds a round: a GPU busy for most of the wall is bounded by its kernels
(fewer or faster kernels help), one idle for much of it waits on the host (launches, guards, the
emit compiled without CUDA graphs), which neither a better head nor faster kernels fix.
"""

from __future__ import annotations

from collections import defaultdict


def busy_ns(intervals: list[tuple[str, int, int]]) -> int:
    """The length of the union of the (name, start, end) intervals: time in which anything ran."""
    total, reach = 0, None
    for _, start, end in sorted(intervals, key=lambda i: i[1]):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def breakdown(intervals: list[tuple[str, int, int]], iterations: int, top: int = 10) -> dict:
    """Per iteration: busy µs, summed kernel µs, kernel count, and the `top` kernels by summed time
    as (name, µs, count)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, start, end in intervals:
        by_name[name][0] += (end - start) / 1e3
        by_name[name][1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"busy_us": busy_ns(intervals) / 1e3 / iterations,
            "kernel_us": sum(end - start for _, start, end in intervals) / 1e3 / iterations,
            "kernels": len(intervals) / iterations,
            "top": [(name, us / iterations, count / iterations) for name, (us, count) in ranked]}


def gpu_intervals(prof) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every GPU activity the profiler recorded."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    return [(e.name(), e.start_ns(), e.start_ns() + e.duration_ns())
            for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]


def profile_call(run, call: list, params, sync) -> dict:
    """`breakdown` of one call of `run` (an engine's sample) over the prompts `call`."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    sync()
    gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []  # a CPU smoke run records no kernels
    with profile(activities=[ProfilerActivity.CPU, *gpu]) as prof:
        out = run(call, params)
        sync()
    out, stats = out if isinstance(out, tuple) else (out, None)
    iterations = out.completion_ids_BT.shape[1] if stats is None else stats.rounds
    return breakdown(gpu_intervals(prof), max(iterations, 1))


def print_profiles(batch: int, found: dict) -> None:
    """The profiled figures of each K (0: no speculation) beside its unprofiled wall time per iteration."""
    print(f"\nbatch {batch}: per decode step (K = 0) or round, one profiled call")
    print("| K | wall µs | GPU busy µs | busy ÷ wall | kernel µs | kernels | busy ÷ decode step's |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    plain = found[0]["profile"]["busy_us"] or float("nan")  # nan: no kernels recorded (a CPU)
    for K, f in sorted(found.items()):
        p, wall = f["profile"], 1e6 * f["iteration_s"]
        print(f"| {K} | {wall:.0f} | {p['busy_us']:.0f} | {p['busy_us'] / wall:.2f} | {p['kernel_us']:.0f} | "
              f"{p['kernels']:.0f} | {p['busy_us'] / plain:.2f} |")
    for K, f in sorted(found.items()):
        print(f"\nK = {K}: the kernels taking the most time, per {'round' if K else 'decode step'}")
        for name, us, count in f["profile"]["top"]:
            print(f"  {us:8.1f} µs  {count:5.1f}×  {name[:100]}")
