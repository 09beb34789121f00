"""`k3post export-fp8`: write the FP8 export, then say what it did; `k3post export-draft`: the
student and its MTP draft head as a checkpoint vLLM serves with speculative decoding.

The FP8 report (printed, and in the export's model card):
- per kind of tensor, how many tensors and parameters went to FP8 e4m3 and which stayed;
- the held-out NLL of the export against its source, paired reply by reply
  (engine/evaluation/fp8_check.py), so a user sees what FP8 serving costs before serving it;
- whether the checkpoint was trained with FP8 QAT (its model card's `fp8-qat` tag), with a
  warning when it was not, or when nothing says;
- the draft head, when the checkpoint has one (`draft.kind: mtp`): copied beside the export as
  `mtp_head.safetensors`, kept in the checkpoint's dtype (`head_line`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3post.config.errors import UserError, located
from k3post.track.model_card import CARD_FILE, split_card

QAT_TAG = "fp8-qat"
HEAD_FILE = "mtp_head.safetensors"  # engine/learner/draft_trainer.py writes it beside the student


def check_export_target(out: Path, checkpoint: Path) -> None:
    """The export's output is a new directory (or an empty one), not the checkpoint itself."""
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            where = "is a file" if path == out else f"is inside {path}, which is a file"
            raise UserError(located(out, f"the export's output {where}; expected a new directory"))
    if out.resolve() == checkpoint.resolve():
        raise UserError(located(out, "the export would overwrite the checkpoint it reads; give another output"))
    if out.is_dir() and any(out.iterdir()):
        raise UserError(located(out, "the export's output directory exists and is not empty; give a new directory "
                                     "(or remove this one)"))


def qat_trained(card_text: str | None) -> bool | None:
    """Whether the checkpoint's card says FP8 QAT trained it; None without a k3post card."""
    meta, _ = split_card(card_text or "")
    tags = meta.get("tags") or []
    return (QAT_TAG in tags) if "k3post" in tags else None


def qat_warning(trained: bool | None) -> str | None:
    if trained:
        return None
    why = ("its model card says it was trained without FP8 QAT" if trained is False else
           "it has no k3post model card, so nothing says it was trained with FP8 QAT")
    return (f"warning: {why}: the export is post-training quantisation, and the held-out NLL change above is what it "
            f"costs. To train for FP8 serving, set `qat: {{enabled: true}}` in the recipe (docs/learner.md, "
            f"\"FP8 quantization-aware training\").")


def kinds_table(kinds: list[dict], kept_dtype: str) -> list[str]:
    lines = [f"  {'tensor kind':<28} {'tensors':>7} {'parameters':>12}  stored as"]
    for row in kinds:
        stored = "FP8 e4m3 + a float32 scale per row" if row["fp8"] else f"{kept_dtype} (kept)"
        lines.append(f"  {row['kind']:<28} {row['tensors']:>7} {row['parameters']:>12,}  {stored}")
    return lines


def nll_line(change) -> str:
    c = change.change
    sign = "better" if c.high < 0 else "worse" if c.low > 0 else "no change beyond noise"
    return (f"held-out NLL ({change.replies} replies of builtin:reference, {change.tokens} tokens): source "
            f"{change.source:.4f} → FP8 {change.fp8:.4f} nats/token, Δ {c.value:+.4f} ({c.value / change.source:+.2%}) "
            f"[{c.low:+.4f}, {c.high:+.4f}] ({c.confidence:.0%} paired bootstrap): {sign}")


def head_line(tensors: int, parameters: int, dtype: str) -> str:
    """Why the draft head stays in the checkpoint's dtype beside an FP8 export: no engine loads
    this file in FP8 (vLLM serves a head only inside a MiMo checkpoint: `k3post export-draft`,
    from the unquantised checkpoint), the head is one block (FP8 would save little), and its
    acceptance was measured on these exact numbers."""
    return (f"draft head: {HEAD_FILE} ({tensors} tensors, {parameters:,} parameters) copied beside the export, kept "
            f"in {dtype} (not FP8: no engine loads it in FP8; for vLLM speculative decoding run `k3post export-draft` "
            f"on the checkpoint)")


def export_report(kinds: list[dict], kept_dtype: str, change, trained: bool | None) -> list[str]:
    lines = kinds_table(kinds, kept_dtype)
    lines.append(nll_line(change) if change is not None else "held-out NLL not measured (--nll-replies 0)")
    if change is not None and trained and change.change.value < 0:
        lines.append("  (a QAT-trained model learned under the FP8 forward, so its export can score better than its "
                     "unquantised source)")
    warning = qat_warning(trained)
    return lines + ([warning] if warning else [])


def cmd_export_fp8(args: argparse.Namespace) -> int:
    from k3post.config.schema import ModelSpec  # noqa: PLC0415 (torch: after the arguments are checked)
    from k3post.model.loading.checks import check_model_dir  # noqa: PLC0415
    from k3post.model.export.fp8_export import export_fp8, fp8_tensor_kinds  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415
    from k3post.track.atomic import atomic_directory  # noqa: PLC0415
    from k3post.track.model_card import append_section, fp8_card  # noqa: PLC0415

    check_model_dir(args.checkpoint)  # named errors before any weight is read
    check_export_target(args.out, args.checkpoint)
    model, tokenizer = load_model(ModelSpec(path=str(args.checkpoint.resolve())))
    source_card = args.checkpoint / CARD_FILE
    card_text = source_card.read_text(encoding="utf-8") if source_card.is_file() else None
    kept_dtype = str(model.dtype).removeprefix("torch.")
    kinds = fp8_tensor_kinds(model)
    if args.nll_replies:  # the source's NLL from the model already loaded, the export's once written
        from k3post.engine.evaluation.fp8_check import export_nll, nll_change, reference_replies, reply_nll  # noqa: PLC0415

        replies = reference_replies(args.nll_replies)
        source_nll = reply_nll(model, tokenizer, replies)
    with atomic_directory(args.out) as tmp:  # a failed export leaves no half-written directory
        counts = export_fp8(model, tokenizer, tmp)
        del model
        change = nll_change(source_nll, export_nll(tmp, replies)) if args.nll_replies else None
        report = export_report(kinds, kept_dtype, change, qat_trained(card_text)) + copy_head(args.checkpoint, tmp)
        card = append_section(fp8_card(card_text, str(args.checkpoint), counts, kept_dtype), "What the export changed",
                              ["```", *report, "```"])
        (Path(tmp) / CARD_FILE).write_text(card, encoding="utf-8")  # the model card, inside the atomic write
    print(f"k3post: wrote {args.out}: {counts['fp8_layers']} Linear layers in FP8 e4m3 (per-row scales), "
          f"{counts['kept_layers']} kept in {kept_dtype}")
    for line in report:
        print(f"k3post: {line}" if line.startswith("warning") else line if line.startswith(" ") else f"  {line}")
    return 0


def copy_head(checkpoint: Path, out: Path) -> list[str]:
    """The checkpoint's draft head copied into `out` as it is; its report line ([] without one)."""
    import shutil  # noqa: PLC0415

    from safetensors import safe_open  # noqa: PLC0415

    source = checkpoint / HEAD_FILE
    if not source.is_file():
        return []
    shutil.copy2(source, Path(out) / HEAD_FILE)
    with safe_open(source, framework="pt") as f:
        shapes = [f.get_slice(name) for name in f.keys()]
        dtypes = {s.get_dtype() for s in shapes}
        parameters = sum(_numel(s.get_shape()) for s in shapes)
    return [head_line(len(shapes), parameters, "/".join(sorted(dtypes)).lower())]


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def serve_lines(out: Path, tokens: int = 2) -> list[str]:
    """How vLLM serves a MiMo export with its MTP layer drafting."""
    config = f'{{"method": "mtp", "num_speculative_tokens": {tokens}}}'
    return [f"serve it: vllm serve {out} --speculative-config '{config}'",
            f"  (offline: LLM(model=\"{out}\", speculative_config={config}))"]


def cmd_export_draft(args: argparse.Namespace) -> int:
    """The student and its `draft.hidden: residual` head as a MiMo checkpoint (model/export/mimo_export.py)."""
    from safetensors import safe_open  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    from k3post.config.schema import ModelSpec  # noqa: PLC0415
    from k3post.model.loading.checks import check_model_dir  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415
    from k3post.model.export.mimo_export import mimo_problem, write_mimo_checkpoint  # noqa: PLC0415
    from k3post.track.atomic import atomic_directory  # noqa: PLC0415

    check_model_dir(args.checkpoint)
    check_export_target(args.out, args.checkpoint)
    head_path = args.checkpoint / HEAD_FILE
    if not head_path.is_file():
        raise UserError(located(args.checkpoint, f"no draft head ({HEAD_FILE}): the run had no `draft: {{kind: mtp}}`"))
    with safe_open(head_path, framework="pt") as f:
        hidden = (f.metadata() or {}).get("hidden", "final_norm")
        head = {name: f.get_tensor(name) for name in f.keys()}
    if hidden != "residual":
        raise UserError(located(head_path, f"this head reads the student's states after its final norm (draft.hidden: "
                                           f"{hidden}); vLLM's MTP layers read them before it, and no norm can be "
                                           f"undone, so it would draft differently there. Train with "
                                           f"`draft.hidden: residual`, then export (docs/engines.md)"))
    stored = str(AutoConfig.from_pretrained(args.checkpoint).dtype).removeprefix("torch.")
    dtype = "bfloat16" if stored == "bfloat16" else "float32"  # the checkpoint's own, not upcast
    model, tokenizer = load_model(ModelSpec(path=str(args.checkpoint.resolve()), dtype=dtype))
    problem = mimo_problem(model.config)
    if problem is not None:
        raise UserError(located(args.checkpoint, f"no exact vLLM MTP layout for this student: {problem}"))
    with atomic_directory(args.out) as tmp:
        tensors = write_mimo_checkpoint(model, head, tokenizer, tmp)
    print(f"k3post: wrote {args.out}: the student as MiMoForCausalLM (Qwen2 layers) with its draft head as MTP layer 0 "
          f"({tensors} tensors, {str(model.dtype).removeprefix('torch.')})")
    for line in serve_lines(args.out):
        print(line)
    return 0
