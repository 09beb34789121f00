"""How many operator calls one learner pass makes in the batch-invariant mode, laid out as on a GPU,
counted on a CPU (docs/on-policy.md).

    .venv/bin/python bench/learner/mode_op_count.py

On a GPU the mode's learner costs ×5.5 (bf16) and ×12.6 (FP8 QAT) the default pass, most likely in
the launches of its many small calls rather than in arithmetic. A count of the calls needs no GPU:
this script runs the learner's log π forward and backward (`completion_logprobs`, as
bench/learner/on_policy_cost.py does) over 32 rollouts of 70 + 256 tokens on a 2-layer Qwen2
(hidden 64), with the mode's GPU layout — 256-row blocks (`GPU_ROWS`), the rotary embedding left
as it is — and counts every ATen operator the dispatcher sees (views and copies included; each
is a kernel launch or at least a Python-to-C++ call on a GPU). The GPU's Triton attention is one
launch; here the mode's attention is counted as the ordinary batched attention (a dozen calls),
in both modes. Counts are exact and the same on any machine; what they cost is the GPU's to say.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.learner.on_policy_cost import SECTION  # noqa: E402
from bench.results import add_no_record, record_and_say  # noqa: E402

import k3post.model.batch_invariant as mode  # noqa: E402
from k3post.model.scoring.logprobs import completion_logprobs  # noqa: E402

ROWS, PROMPT, NEW = 32, 70, 256


class Calls(TorchDispatchMode):
    """Counts the ATen operators dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def as_on_a_gpu() -> None:
    """The mode's GPU layout on this CPU: 256-row blocks, the rotary embedding as it is, attention
    batched (standing in for the one Triton launch)."""
    mode.rows_per_call = lambda device: mode.GPU_ROWS
    mode.query_attention = mode.batched_attention
    override = mode._override
    mode._override = lambda module, on_gpu: override(module, True)


def student(qat: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256)
    model = tf.Qwen2ForCausalLM(config)
    if qat:
        from k3post.model.quant.qat import prepare_fp8_qat  # noqa: PLC0415

        prepare_fp8_qat(model)
    return model.train()


def count(model: torch.nn.Module, bitwise: bool) -> Counter[str]:
    """The operators of one forward + backward of log π over the rollouts."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 255, (ROWS, PROMPT), generator=g).tolist()
    completions = torch.randint(1, 255, (ROWS, NEW), generator=g)
    calls = Calls()
    with calls:
        completion_logprobs(model, prompts, completions, torch.ones(ROWS, NEW), 0, bitwise=bitwise).sum().backward()
    return calls.by_op


def result_rows(counts: dict[tuple[str, str], int]) -> list[dict]:
    """bench/results rows from the totals by (precision, mode)."""
    rows = []
    for precision in ("fp32", "FP8 QAT"):
        off, on = counts[precision, "off"], counts[precision, "bitwise"]
        head = f"operator calls of one learner pass, 2-layer Qwen2, {ROWS} × {PROMPT + NEW} tokens, {precision}"
        rows.append({"metric": f"{head}, mode off", "value": off, "unit": "calls"})
        rows.append({"metric": f"{head}, sampling.on_policy: bitwise (GPU layout)", "value": on, "unit": "calls",
                     "notes": f"×{on / off:.1f} the calls with the mode off"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=6, help="print this many of the commonest operators per arm")
    add_no_record(parser)
    args = parser.parse_args()
    as_on_a_gpu()
    counts = {}
    for precision in ("fp32", "FP8 QAT"):
        model = student(precision == "FP8 QAT")
        for arm in ("off", "bitwise"):
            by_op = count(model, arm == "bitwise")
            counts[precision, arm] = sum(by_op.values())
            common = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in by_op.most_common(args.top))
            print(f"{precision:8} {arm:8} {counts[precision, arm]:7,} calls  ({common})")
    record_and_say("on-policy-cost", result_rows(counts), args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
