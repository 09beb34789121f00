"""The rows bench/opd/opd_step_gpu.py records (bench/results.py) and the table it prints: the
names say the placement, the learner's precision, the engines and the batch, so that a re-run of
the same arm supersedes its own rows and never another arm's."""

from __future__ import annotations

from bench.results import rounded

SECTIONS = {False: "OPD step throughput on one H200 (`bench/opd/opd_step_gpu.py`)",
            True: "OPD step on two H200s: sampler on its own GPU, weights over NCCL "
                  "(`bench/opd/opd_step_gpu.py --placement`)"}
LEARNER = {"bf16": "bf16 learner", "bf16-mixed": "bf16-mixed learner (FSDP2, 1 rank)"}
ENGINES = {"hf": "", "vllm": ", vLLM sampler and teacher", "vllm-sleep": ", vLLM sampler and teacher in sleep mode"}
NUMBER = {2: "two", 3: "three", 4: "four", 8: "eight"}


def result_rows(results: list[dict], placement: str, precision: str, gpu: str, gpus: int, params: int,
                baseline: float | None = None, against: list[dict] | None = None, engine: str = "hf") -> list[dict]:
    """bench/results rows of a run (`results`: summarize()'s dicts with batch and mode): per batch
    and mode the student tokens/s and the learner's MFU; per batch the sync mode's weight-sync time
    (the bf16 weights: 2 bytes a parameter); the plain-`generate` baseline's sampler tokens/s; and
    with `against` (an in-process run's results) each tokens/s against the same batch and mode there."""
    learner = f", {LEARNER[precision]}" + ENGINES[engine]
    where = {"in-process": f"in-process{learner}" if gpus == 1
             else f"in-process on one of the {NUMBER.get(gpus, gpus)} {gpu}s",
             "ray-shared": f"ray-shared (cuda_ipc){learner}", "ray-shared-store": f"ray-shared-store{learner}",
             "ray-split": f"two {gpu}s (ray-split)" + (learner if precision != "bf16" else "")}[placement]
    gb = f"{params * 2 / 1e9:.2f} GB"
    sync = {"in-process": f"{where}, batch {{b}}, sync: weight sync of {gb}, device to device",
            "ray-shared": f"ray-shared (cuda_ipc), batch {{b}}, sync: weight sync of {gb}, checksum check included",
            "ray-shared-store": f"{where}, batch {{b}}, sync: weight sync through the object store",
            "ray-split": f"{where}, batch {{b}}, sync: NCCL weight sync of {gb}"}[placement]
    rows = []
    for r in results:
        head = f"{where}, batch {r['batch']}, {r['mode']}"
        rows += [{"metric": f"{head}: student tokens/s", "value": round(r["tokens/s"]), "unit": "tokens/s"},
                 {"metric": f"{head}: learner MFU", "value": rounded(100 * r["mfu"], 1), "unit": "%"}]
        if r["mode"] == "sync":
            rows.append({"metric": sync.format(b=r["batch"]), "value": rounded(r["sync"], 3), "unit": "s"})
        one = next((a for a in against or () if (a["batch"], a["mode"]) == (r["batch"], r["mode"])), None)
        if one:
            rows.append({"metric": f"{head}: against one GPU in process", "value": rounded(r["tokens/s"] / one["tokens/s"], 2),
                         "unit": "×", "ratio_to": f"in-process, batch {r['batch']}, {r['mode']} "
                                                  f"({one['tokens/s']:,.0f} student tokens/s)"})
    if baseline:
        rows.append({"metric": "plain `generate` (dynamic KV cache) of the same student, batch 32: sampler tokens/s",
                     "value": round(baseline), "unit": "tokens/s"})
    return rows


def prefix_rows(results: list[dict], placement: str, gpu: str, tokens: int, cache: str) -> list[dict]:
    """bench/results rows of a run with a teacher system prompt (`summarize()`'s dicts): per batch
    and mode the teacher phase, the whole step and the student tokens/s, labelled with the system
    prompt's length and whether the teacher's prefix cache was on."""
    rows = []
    for r in results:
        head = (f"OPD step on one {gpu} ({placement}), 1.39B teacher with a {tokens}-token system prompt, "
                f"prefix cache {cache}, batch {r['batch']}, {r['mode']}")
        rows += [{"metric": f"{head}: teacher phase", "value": rounded(r["score"], 3), "unit": "s"},
                 {"metric": f"{head}: step", "value": rounded(r["step"], 3), "unit": "s"},
                 {"metric": f"{head}: student tokens/s", "value": round(r["tokens/s"]), "unit": "tokens/s"}]
    return rows


def qat_rows(results: list[dict], gpu: str, qat: str) -> list[dict]:
    """bench/results rows of a QAT run (`summarize()`'s dicts): per batch and mode the gap between
    the sampler's log μ and the learner's fake-quantised log π on the same tokens
    (`train/logprob_abs_diff`), the sampling time and the step."""
    rollouts = {"bf16-rollouts": "bf16 rollouts", "fp8-rollouts": "FP8 rollouts (sampling.weights: fp8)",
                "fp8-rollouts-dequantised": "FP8 rollouts dequantised to the learner's bf16 operands"}[qat]
    rows = []
    for r in results:
        head = f"OPD step on one {gpu}, FP8 QAT learner, {rollouts}, batch {r['batch']}, {r['mode']}"
        rows += [{"metric": f"{head}: sampler-vs-learner mean |Δ log-prob|", "value": float(f"{r['logprob_abs_diff']:.3g}"),
                  "unit": "nats"},
                 {"metric": f"{head}: sampling", "value": rounded(r["sample"], 3), "unit": "s"},
                 {"metric": f"{head}: step", "value": rounded(r["step"], 3), "unit": "s"}]
    return rows


ON_POLICY_SECTION = "Bitwise on-policy on a GPU: what the batch-invariant mode costs (`bench/opd/opd_step_gpu.py --on-policy bitwise`)"


def on_policy_arm(cache: str, qat: str) -> str:
    """The words that tell a `--on-policy bitwise` run's arm apart: the sampler's cache and the precision."""
    sampler = "static-cache sampler, CUDA graphs" if cache == "static" else "dynamic-cache sampler"
    return f"{sampler}, " + ("bf16" if qat == "off" else f"FP8 QAT ({qat})")


def on_policy_rows(results: list[dict], against: list[dict] | None, gpu: str, arm: str) -> list[dict]:
    """bench/results rows of a `--on-policy bitwise` run (`arm`: `on_policy_arm`): per batch and
    mode the largest |log π − log μ| over every step it ran (0 when the mode holds), its step, and
    the step against the default step (`against`: a run of the same call without the mode, same
    precision) at the same batch and mode."""
    rows = []
    for r in results:
        head = f"OPD step on one {gpu}, sampling.on_policy: bitwise ({arm}), batch {r['batch']}, {r['mode']}"
        rows += [{"metric": f"{head}: largest |log π − log μ| over {r['steps']} steps",
                  "value": r["logprob_abs_diff_max"], "unit": "nats"},
                 {"metric": f"{head}: step", "value": rounded(r["step"], 3), "unit": "s"}]
        one = next((a for a in against or () if (a["batch"], a["mode"]) == (r["batch"], r["mode"])), None)
        phases = (("step", "step"), ("sample", "sampling phase"), ("train", "learner's train phase")) if one else ()
        rows += [{"metric": f"{head}: {what} against the default", "value": rounded(r[phase] / one[phase], 2),
                  "unit": "×", "ratio_to": f"the default (static-cache sampler, {one[phase]:.3f} s)"}
                 for phase, what in phases]
    return rows


def print_table(results: list[dict], baseline, args, params: int) -> None:
    import torch  # noqa: PLC0415

    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    where = {"in-process": "in process (no Ray), one GPU",
             "ray-shared": "Ray actors sharing one GPU, weights over CUDA IPC",
             "ray-shared-store": "Ray actors sharing one GPU, weights via the object store",
             "ray-split": "Ray actors, sampler on GPU 1, learner + teacher on GPU 0, weights over NCCL"}[args.placement]
    if args.engine == "vllm":
        where += "; vLLM sampler and teacher" + (" in sleep mode" if args.sleep else "")
    if args.qat != "off":
        where += f"; FP8 QAT learner, {args.qat}"
    if args.teacher_system_tokens:
        where += f"; teacher system prompt of {args.teacher_system_tokens} tokens, prefix cache {args.teacher_prefix_cache}"
    print(f"\nOPD step, {name}, {where}, student {params / 1e9:.2f}B / teacher 1.39B bf16, "
          f"{args.new_tokens} new tokens, median of {args.steps} steps after {args.warmup} warm-up, "
          f"torch {torch.__version__}")
    print("| batch | mode | sample s | sample_wait s | score s | train s | sync s | step s | tokens/step | "
          "student tok/s | (all steps) | sampler tok/s | learner MFU | peak GiB (all, or learner / sampler / teacher) | staleness | ratio mean | "
          "sampler-vs-learner |Δ log-prob| |")
    print("|" + "---|" * 17)
    for r in results:
        print(f"| {r['batch']} | {r['mode']} | {r['sample']:.3f} | {r['sample_wait']:.3f} | {r['score']:.3f} | "
              f"{r['train']:.3f} | {r['sync']:.3f} | {r['step']:.3f} | {r['tokens/step']:.0f} | "
              f"{r['tokens/s']:,.0f} | {r['tokens/s all steps']:,.0f} | {r['sample tok/s']:,.0f} | {100 * r['mfu']:.1f}% | "
              f"{' / '.join(f'{v:.1f}' for v in r['peak_gib'].values()) or '—'} | "
              f"{r['staleness']:.0f} | {r['ratio_mean']:.4f} | {r['logprob_abs_diff']:.3g} |")
    if baseline:
        print(f"plain generate (dynamic KV cache) at batch 32: {baseline:,.0f} sampler tok/s")
