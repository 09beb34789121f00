"""How far the GPU's FP8 GEMM lands from the exact product of the QAT grid, and from the learner's.

The FP8 rollout sampler multiplies per-token e4m3 activations by per-row e4m3 weights with
`torch._scaled_mm` (algo/fp8.py `linear_scaled_mm`); the learner's QAT forward multiplies the same
grid values dequantised to bf16 (`linear_dequantised`). On the grid, with x̃ = q_x·s_x and
w̃ = q_w·s_w, the exact product is

    y_mn = Σ_k x̃_mk w̃_nk        (computed here in float64),

and any kernel's error is best read against Σ_k |x̃_mk w̃_nk| (the size of the terms, not of their
sum, which may cancel): an fp32 accumulation of K terms stays within about K·2⁻²⁴ of it, an
output rounded to bf16 adds up to 2⁻⁹ of |y|. Per GEMM of the 0.40B student of
bench/opd/opd_step_gpu.py (and the K = 256 of tests/gpu/test_fp8_gemm_cuda.py), 32 rows, this prints
for each form

- `max err / Σ|terms|`: the largest |y − exact| over Σ|x̃w̃| (log₂ in brackets: the effective
  precision of the form);
- `vs learner`: mean |y − y_learner| over mean |y_learner|, the gap the sampler's logprobs inherit
  from this GEMM.

Forms: the learner's (bf16 operands, bf16 out); `_scaled_mm` with bf16 output (what the sampler
runs) and with fp32 output (not rounded: its error is the accumulation's, against the ~K·2⁻²⁴ of
an fp32 one), each with `use_fast_accum` off and on. A
form the kernel refuses (row-wise scaling with fp32 output is cuBLAS-only, on sm_90) is reported
as such. The worst `max err / Σ|terms|` and `vs learner` of each form over the shapes are
appended to bench/results/fp8-gemm-gpu.jsonl; `--no-record` leaves the file alone.

    python bench/fp8/fp8_gemm_error_gpu.py [--rows 32] [--seed 0] [--commit SHA]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say  # noqa: E402

from k3post.algo.fp8 import dequantize_rows, quantize_rows  # noqa: E402
from k3post.model.quant.qat import ACTIVATION_AMAX_FLOOR  # noqa: E402

SECTION = "The FP8 GEMM against the exact product of the QAT grid (`bench/fp8/fp8_gemm_error_gpu.py`)"
SHAPES = {"test (K = 256)": (256, 512), "q, k, v stacked": (896, 1152), "o": (896, 896),
          "gate, up stacked": (896, 9728), "down": (4864, 896)}
FORMS = ("learner (bf16 operands)", "scaled_mm bf16 out", "scaled_mm bf16 out, fast accum",
         "scaled_mm fp32 out", "scaled_mm fp32 out, fast accum")


def operands(rows: int, k: int, n: int, seed: int) -> dict:
    """Activations like an RMSNorm's output and weights like an initialised Linear's, on the grid."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.02 * torch.randn(n, k, device="cuda", generator=g)).to(torch.bfloat16)
    (q_x, s_x), (q_w, s_w) = quantize_rows(x, ACTIVATION_AMAX_FLOOR), quantize_rows(w)
    x_t, w_t = q_x.double() * s_x.double(), q_w.double() * s_w.double()
    return {"q_x": q_x, "s_x": s_x, "q_w": q_w, "s_w": s_w, "exact": x_t @ w_t.T, "terms": x_t.abs() @ w_t.abs().T}


def product(form: str, o: dict) -> torch.Tensor | None:
    """The form's y (in fp32 as the kernel wrote it for the fp32-output forms, so that their error is
    the accumulation's alone), or None where the kernel refuses it."""
    if form.startswith("learner"):
        return F.linear(dequantize_rows(o["q_x"], o["s_x"], torch.bfloat16),
                        dequantize_rows(o["q_w"], o["s_w"], torch.bfloat16))
    out = torch.float32 if "fp32" in form else torch.bfloat16
    try:
        y = torch._scaled_mm(o["q_x"], o["q_w"].t(), scale_a=o["s_x"], scale_b=o["s_w"].reshape(1, -1),
                             out_dtype=out, use_fast_accum="fast" in form)
    except RuntimeError as refused:
        print(f"{form}: refused ({str(refused).splitlines()[0][:100]})", flush=True)
        return None
    return y


def measure(rows: int, seed: int) -> dict[str, dict[str, tuple[float, float] | None]]:
    """{form: {shape: (max err / Σ|terms|, mean gap to the learner's form) or None}}."""
    found: dict = {form: {} for form in FORMS}
    for name, (k, n) in SHAPES.items():
        o = operands(rows, k, n, seed)
        learner = product(FORMS[0], o).double()
        for form in FORMS:
            y = product(form, o)
            if y is None:
                found[form][name] = None
                continue
            err = ((y.double() - o["exact"]).abs() / o["terms"].clamp(min=1e-30)).max().item()
            gap = ((y.double() - learner).abs().mean() / learner.abs().mean()).item()
            found[form][name] = (err, gap)
    return found


def print_table(found: dict, rows: int) -> None:
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {rows} rows: "
          "max |y − exact| ÷ Σ|x̃w̃| (log₂) / mean |y − y_learner| ÷ mean |y_learner|")
    print("| form | " + " | ".join(f"{name} ({k} × {n})" for name, (k, n) in SHAPES.items()) + " |")
    print("|---|" + "---:|" * len(SHAPES))
    for form, per in found.items():
        cells = ["refused" if v is None else f"{v[0]:.1e} (2^{torch.tensor(v[0]).log2():.1f}) / {v[1]:.1e}"
                 for v in per.values()]
        print(f"| {form} | " + " | ".join(cells) + " |")


def result_rows(found: dict, gpu: str, rows: int) -> list[dict]:
    """Per form the worst error over the shapes and the worst mean gap to the learner's form."""
    out = []
    for form, per in found.items():
        seen = [v for v in per.values() if v is not None]
        if not seen:
            continue
        head = f"FP8 GEMM on one {gpu}, {rows} rows, {form}"
        out.append({"metric": f"{head}: worst max |y − exact| ÷ Σ|x̃w̃| over the student's GEMMs",
                    "value": float(f"{max(v[0] for v in seen):.3g}"), "unit": "ratio"})
        if not form.startswith("learner"):
            out.append({"metric": f"{head}: worst mean |y − y_learner| ÷ mean |y_learner|",
                        "value": float(f"{max(v[1] for v in seen):.3g}"), "unit": "ratio"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="auto")
    add_no_record(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    found = measure(args.rows, args.seed)
    print_table(found, args.rows)
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    record_and_say("fp8-gemm-gpu", result_rows(found, gpu, args.rows), args.no_record, commit_=args.commit,
                   source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
