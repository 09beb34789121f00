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

REFERENCE_SET = "builtin:reference"


@dataclass(frozen=True)
class NllChange:
    source: float  # nats per reply token
    fp8: float
    change: Estimate  # fp8 − source, paired over replies
    replies: int
    tokens: int


def _reply_nll(model_dir: Path, examples: list, max_tokens: int, batch_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ NLL per reply [N], reply tokens [N]) of the model in `model_dir`."""
    from k3post.engine.eval_model import build_eval_model  # noqa: PLC0415 (torch models: only when asked)

    model = build_eval_model(str(model_dir), TeacherSpec(model=ModelSpec(path=str(model_dir))), "hf")
    nll, tokens = [], []
    for start in range(0, len(examples), batch_size):
        rollouts = model.encode_examples(examples[start:start + batch_size], max_tokens)
        nll.append(sequence_nll(model.score(rollouts), rollouts.loss_mask_BT))
        tokens.append(rollouts.loss_mask_BT.sum(dim=1).double())
    del model
    return torch.cat(nll), torch.cat(tokens)


def heldout_nll_change(source_dir: Path, export_dir: Path, replies: int = 32, max_tokens: int = 128,
                       batch_size: int = 8, seed: int = 0) -> NllChange:
    """The export's held-out NLL against its source's, on the first `replies` reference replies."""
    from k3post.engine.eval_model import reference_examples  # noqa: PLC0415

    rows, label = load_eval_rows(REFERENCE_SET, Path.cwd())
    examples = reference_examples(rows[:replies], "completion", label)
    source, tokens = _reply_nll(source_dir, examples, max_tokens, batch_size)
    fp8, fp8_tokens = _reply_nll(export_dir, examples, max_tokens, batch_size)
    assert torch.equal(tokens, fp8_tokens), "the export's tokenizer encodes the replies differently"
    change = bootstrap_ratio(fp8 - source, tokens, seed=seed)
    total = float(tokens.sum())
    return NllChange(float(source.sum()) / total, float(fp8.sum()) / total, change, len(examples), int(total))
