"""SFT: only the reply tokens carry loss, bad rows are named, and training lowers held-out NLL."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3post.cli.run import run_recipe
from k3post.config.errors import UserError
from k3post.data.sft import as_sft_rows
from k3post.engine.learner.sft_batch import sft_batch
from k3post.model.loading.load import load_model
from k3post.track.metrics import read_metrics
from k3post.types import Prompt

REPO = Path(__file__).resolve().parents[2]


def test_only_the_reply_and_its_end_token_carry_loss(tiny_spec):
    _, tokenizer = load_model(tiny_spec)
    example = Prompt("a", "s", "", (("user", "What is 2 + 2?"), ("assistant", "4")))
    batch = sft_batch(tokenizer, [example, Prompt("b", "s", "", (("user", "Hi"), ("assistant", "Hello")))], 16)
    assert batch.completion_ids_BT[0, :2].tolist() == tokenizer("4", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]
    assert batch.loss_mask_BT.sum(1).tolist() == [2.0, 6.0]
    assert tokenizer.decode(batch.prompt_ids[0]).endswith("<|im_start|>assistant\n")
    assert "4" not in tokenizer.decode(batch.prompt_ids[0]).split("user\n")[1].split("?")[1]


def test_rows_without_a_reply_are_named():
    rows = [{"id": "r0", "messages": [("user", "q")], "answer": "1"}, {"id": "r1", "messages": [("user", "q")]}]
    with pytest.raises(UserError, match=r"data.jsonl: row 1: .*'answer'"):
        as_sft_rows(rows, "answer", "data.jsonl")
    assert as_sft_rows(rows[:1], "answer", "data.jsonl")[0]["messages"][-1] == ("assistant", "1")


@pytest.mark.parametrize("qat", ["true", "false"])
def test_sft_lowers_heldout_nll_with_and_without_qat(tmp_path, qat):
    run_dir = tmp_path / "sft"
    assert run_recipe(REPO / "recipes/smoke/tiny-sft-qat.yaml", [f"qat.enabled={qat}"], run_dir, True, False) == 0
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(13))
    assert metrics[-1]["eval/nll"] < 0.85 * metrics[0]["eval/nll"]  # measured ≈ 0.73
    if qat == "true":
        assert metrics[1]["train/fake_quant"] == 0.0 and metrics[2]["train/fake_quant"] == 1.0
    assert (run_dir / "checkpoints" / "step-12" / "COMPLETE").is_file()
