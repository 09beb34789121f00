"""What an FP8 export changed, measured: the held-out NLL of the export against its source.

Both models score the same reference replies (`builtin:reference`, the eval harness's `nll`
set, never trained on), so the change is paired reply by reply:

    Δ = Σ_i (NLL_fp8(y_i) − NLL_src(y_i)) / Σ_i |y_i|     (nats per reply token)

with a percentile bootstrap over the replies (algo/eval_metrics.py `bootstrap_ratio`). Pairing
removes the spread between replies, which dwarfs the FP8 error: the interval is that of the
change itself. The export is loaded the way the harness and transformers load it
(compressed-tensors), so the number is the served model's, not a simulation of it.

Which way Δ points says how the checkpoint was trained. A model trained without QAT loses a
little (Δ > 0). A model trained with FP8 QAT learned under the quantised forward: its weights
fit that forward, and the unquantised source is the shifted one, so the export may score as
well as or *better* than its source (Δ ≤ 0) — by design, not by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from k3post.algo.eval_metrics import Estimate, bootstrap_ratio, sequence_nll
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.data.eval_sets import load_eval_rows
from k3post.model.scoring.logprobs import completion_logprobs

REFERENCE_SET = "builtin:reference"


@dataclass(frozen=True)
class NllChange:
    source: float  # nats per reply token
    fp8: float
    change: Estimate  # fp8 − source, paired over replies
    replies: int
    tokens: int


def reference_replies(count: int) -> list:
    """The first `count` reference replies of `builtin:reference`, as chat examples."""
    from k3post.engine.evaluation.eval_model import reference_examples  # noqa: PLC0415 (torch models: only when asked)

    rows, label = load_eval_rows(REFERENCE_SET, Path.cwd())
    return reference_examples(rows[:count], "completion", label)


def reply_nll(model, tokenizer, examples: list, max_tokens: int = 128, batch_size: int = 8
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ NLL per reply [N], reply tokens [N]) of `model` on `examples` (the harness's scoring)."""
    from k3post.engine.evaluation.eval_model import encode_examples  # noqa: PLC0415

    nll, tokens = [], []
    for start in range(0, len(examples), batch_size):
        rollouts = encode_examples(tokenizer, examples[start:start + batch_size], max_tokens)
        with torch.no_grad():
            logprobs_BT = completion_logprobs(model, rollouts.prompt_ids, rollouts.completion_ids_BT,
                                              rollouts.loss_mask_BT, tokenizer.pad_token_id, 1.0)
        nll.append(sequence_nll(logprobs_BT, rollouts.loss_mask_BT))
        tokens.append(rollouts.loss_mask_BT.sum(dim=1).double())
    return torch.cat(nll), torch.cat(tokens)


def export_nll(export_dir: Path, examples: list, max_tokens: int = 128, batch_size: int = 8
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`reply_nll` of the FP8 export in `export_dir`, loaded as the harness serves it
    (compressed-tensors, with its warm-up forward: engine/evaluation/eval_model.py)."""
    from k3post.engine.evaluation.eval_model import build_eval_model  # noqa: PLC0415

    model = build_eval_model(str(export_dir), TeacherSpec(model=ModelSpec(path=str(export_dir))), "hf")
    return reply_nll(model.model, model.tokenizer, examples, max_tokens, batch_size)


def nll_change(source: tuple[torch.Tensor, torch.Tensor], fp8: tuple[torch.Tensor, torch.Tensor],
               seed: int = 0) -> NllChange:
    """The paired change from the source's reply NLLs to the export's (same replies, same tokens)."""
    (source_nll, tokens), (fp8_nll, fp8_tokens) = source, fp8
    assert torch.equal(tokens, fp8_tokens), "the export's tokenizer encodes the replies differently"
    change = bootstrap_ratio(fp8_nll - source_nll, tokens, seed=seed)
    total = float(tokens.sum())
    return NllChange(float(source_nll.sum()) / total, float(fp8_nll.sum()) / total, change, len(tokens), int(total))


def heldout_nll_change(source_dir: Path, export_dir: Path, replies: int = 32, max_tokens: int = 128,
                       batch_size: int = 8, seed: int = 0) -> NllChange:
    """The export's held-out NLL against its source's (both loaded from disk), on the first
    `replies` reference replies."""
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    examples = reference_replies(replies)
    model, tokenizer = load_model(ModelSpec(path=str(source_dir)))
    source = reply_nll(model, tokenizer, examples, max_tokens, batch_size)
    del model
    return nll_change(source, export_nll(export_dir, examples, max_tokens, batch_size), seed)
