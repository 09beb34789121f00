"""Does FP8 QAT pay off? SFT the same model on the same data with and without QAT, export both
to FP8, and compare held-out NLL: full precision, FP8 after plain training (PTQ), FP8 after QAT.

    .venv/bin/python bench/fp8/qat_vs_ptq.py                       # recipes/sft/smollm2-math-fp8-qat.yaml
    .venv/bin/python bench/fp8/qat_vs_ptq.py RECIPE train.steps=40

The FP8 models are the exported compressed-tensors checkpoints loaded through transformers,
whose CPU path emulates the FP8 weights and per-token FP8 activations.

At the end the table's NLLs, and what QAT gains when served in FP8 (the PTQ model's FP8 NLL minus
the QAT model's), are appended to bench/results/fp8-qat.jsonl (`results.record`; the rows they
replace marked "current": false); `--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "Does FP8 QAT pay off? (`bench/fp8/qat_vs_ptq.py`)"
LABELS = {"plain": "plain SFT → FP8 (PTQ)", "QAT": "FP8 QAT → FP8"}
GAIN = "served in FP8: held-out NLL of the PTQ model minus the QAT model's (QAT ahead when positive)"


def result_rows(start: float, rows: dict[str, tuple[float, float]]) -> list[dict]:
    """bench/results rows: the NLL before SFT; per training its held-out NLL in full precision and
    served in FP8, and the difference (4 decimals, as the table); the PTQ model's FP8 NLL minus the
    QAT model's (3 decimals)."""
    out = [{"metric": "held-out NLL before SFT", "value": rounded(start, 4), "unit": "nats/token"}]
    for name, (full, fp8) in rows.items():
        out += [{"metric": f"{LABELS[name]}: held-out NLL, full precision", "value": rounded(full, 4), "unit": "nats/token"},
                {"metric": f"{LABELS[name]}: held-out NLL, FP8 served", "value": rounded(fp8, 4), "unit": "nats/token"},
                {"metric": f"{LABELS[name]}: FP8 − full precision", "value": rounded(fp8 - full, 4), "unit": "nats/token"}]
    if {"plain", "QAT"} <= set(rows):
        ptq, qat = rows["plain"][1], rows["QAT"][1]
        out.append({"metric": GAIN, "value": rounded(ptq - qat, 3), "unit": "nats/token",
                    "notes": f"FP8-served NLL {qat:.4f} (QAT) against {ptq:.4f} (PTQ)"})
    return out


def heldout_nll(model, tokenizer, examples, max_tokens: int) -> float:
    import torch  # noqa: PLC0415

    from k3post.engine.learner.sft_batch import sft_batch  # noqa: PLC0415
    from k3post.model.scoring.logprobs import completion_logprobs  # noqa: PLC0415

    batch = sft_batch(tokenizer, examples, max_tokens)
    with torch.no_grad():
        lp = completion_logprobs(model, batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT,
                                 tokenizer.pad_token_id)
    return float(-(lp * batch.loss_mask_BT).sum() / batch.loss_mask_BT.sum())


def load_served_fp8(directory: Path, eos_id: int):
    """The export as transformers serves it. compressed-tensors sets the layers up on the first
    forward of the *whole* model; k3post's logprob path calls the decoder directly, so run one
    top-level forward first (without it the FP8 weights reach F.linear as they are)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        model(input_ids=torch.tensor([[eos_id]]))
    return model


def main() -> int:
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415

    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="recipes/sft/smollm2-math-fp8-qat.yaml")
    parser.add_argument("overrides", nargs="*")
    add_no_record(parser)
    args = parser.parse_args()
    from k3post.cli.run import run_recipe  # noqa: PLC0415
    from k3post.config.load import load_recipe  # noqa: PLC0415
    from k3post.config.schema import ModelSpec  # noqa: PLC0415
    from k3post.launch.sft import build_sft_data  # noqa: PLC0415
    from k3post.model.export.fp8_export import export_fp8  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    recipe = load_recipe(args.recipe, args.overrides)
    data = build_sft_data(recipe)
    heldout = [p for s in recipe.data.sources for p in data.heldout(s.name)]
    max_tokens = recipe.data.max_completion_tokens
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for qat in (False, True):
            run_dir = Path(tmp) / f"qat-{qat}"
            with contextlib.redirect_stdout(io.StringIO()):
                run_recipe(Path(args.recipe), args.overrides + [f"qat.enabled={str(qat).lower()}"], run_dir, True, True)
            model, tokenizer = load_model(ModelSpec(path=str(run_dir / "checkpoints" / f"step-{recipe.train.steps}")))
            full = heldout_nll(model, tokenizer, heldout, max_tokens)
            export_fp8(model, tokenizer, run_dir / "fp8")
            fp8 = heldout_nll(load_served_fp8(run_dir / "fp8", tokenizer.eos_token_id), tokenizer, heldout, max_tokens)
            rows["QAT" if qat else "plain"] = (full, fp8)
    base, tokenizer = load_model(recipe.model)
    start = heldout_nll(base, tokenizer, heldout, max_tokens)
    print(f"\nheld-out NLL (nats/token) on {len(heldout)} examples, {args.recipe} {' '.join(args.overrides)}")
    print(f"before SFT: {start:.4f}")
    print("| training | full precision | FP8 served | FP8 − full |\n|---|---|---|---|")
    for name, (full, fp8) in rows.items():
        label = "plain SFT → FP8 (PTQ)" if name == "plain" else "FP8 QAT → FP8"
        print(f"| {label} | {full:.4f} | {fp8:.4f} | {fp8 - full:+.4f} |")
    where = f"{args.recipe} {' '.join(args.overrides)}".strip() + f"; held-out NLL on {len(heldout)} examples"
    out = [{**r, "notes": f"{r['notes']}; {where}" if r.get("notes") else where} for r in result_rows(start, rows)]
    record_and_say("fp8-qat", out, args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
