"""Distillation runs with a teacher of another tokenizer, in-process on tiny models: one teacher on
the direct path and one on the cross-tokenizer path in the same recipe (routed by data source),
learning measured by the held-out per-byte reverse KL."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3post.cli.run import run_recipe
from k3post.config.schema import TinyModelSpec
from k3post.track.metrics import read_metrics
from tests.tokenizer_fixtures import byte_level_bpe, permuted_tiny_teacher_dir, tiny_teacher_dir

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"
LEARN = ("train.steps=32", "train.eval_every=32", "loss.kind=sampled_token", "optim.lr=0.01", "optim.grad_clip=100.0",
         "teachers.alpha.model.tiny.init_std=0.2", "data.prompts_per_step=8", "sampling.max_new_tokens=12",
         "eval.max_new_tokens=12", "eval.prompts_per_source=4")


def run(run_dir: Path, *overrides: str) -> list[dict]:
    assert run_recipe(SMOKE, list(overrides), run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def test_a_permuted_vocabulary_teacher_learns_exactly_as_the_direct_path(tmp_path, capsys):
    """Teacher beta behind a permuted vocabulary (the same model on the same text, other ids) takes
    the cross-tokenizer path with every chunk 1:1: it trains as the direct path does, and the
    per-byte held-out reverse KL falls."""
    beta = permuted_tiny_teacher_dir(tmp_path / "beta", TinyModelSpec(hidden_size=32, num_layers=2, seed=12,
                                                                       init_std=0.2))
    direct = run(tmp_path / "direct", *LEARN, "teachers.beta.model.tiny.init_std=0.2")
    cross = run(tmp_path / "cross", *LEARN, f"teachers.beta.model={{path: {beta}}}")
    assert "teacher 'beta' reads the student's text with its own tokenizer" in capsys.readouterr().out
    assert cross[1]["distill/kl/alpha"] == direct[1]["distill/kl/alpha"]  # the same samples at step 1
    assert all(m["align/one_to_one/beta"] == 1.0 and m["align/chunk_tokens/beta"] == 1.0 for m in cross[1:])
    first, last = cross[0], cross[-1]
    assert "eval/kl/beta" not in first  # no per-token KL across vocabularies, only per byte
    # Where the text is the same, the reading is the same: the per-byte reverse KL on both paths.
    assert cross[0]["eval/kl_per_byte/beta"] == pytest.approx(direct[0]["eval/kl_per_byte/beta"], rel=1e-5)
    assert last["eval/kl_per_byte/beta"] == pytest.approx(direct[-1]["eval/kl_per_byte/beta"], rel=1e-4)
    # measured: 0.895 of its start after 32 steps
    assert last["eval/kl_per_byte/beta"] < 0.95 * first["eval/kl_per_byte/beta"]


def test_a_byte_level_bpe_teacher_beside_a_same_tokenizer_one(tmp_path):
    """A mixed-family recipe: alpha shares the student's character tokenizer, beta is a tiny Llama
    over a trained byte-level BPE (multi-character tokens: many-to-one chunks)."""
    beta = tiny_teacher_dir(tmp_path / "beta", byte_level_bpe(), seed=5)
    metrics = run(tmp_path / "mixed", "train.steps=2", f"teachers.beta.model={{path: {beta}}}",
                  "teachers.beta.cross_tokenizer={split: broadcast, max_chunk_tokens: 4}")
    step = metrics[1]
    for key in ("align/one_to_one/beta", "align/chunk_tokens/beta", "align/signal/beta", "distill/kl/beta"):
        assert key in step, key
    assert not any(k.startswith("align/") and k.endswith("/alpha") for k in step)
    assert 0 < step["align/signal/beta"] <= 1 and step["align/chunk_tokens/beta"] >= 1
    final = metrics[-1]
    assert {"eval/kl/alpha", "eval/kl_per_byte/alpha", "eval/kl_per_byte/beta", "eval/fkl_per_byte/beta"} <= set(final)


def test_a_byte_level_bpe_teacher_teaches_across_tokenizers(tmp_path):
    """Learning from a teacher over a trained byte-level BPE (a tiny Llama; tokens of several of the
    student's characters), the sampled-token loss split `uniform`: the held-out per-byte reverse KL
    to it falls. The student's samples start as random characters, which the BPE merges only now
    and then: some chunks are not 1:1 (measured: 2-5% of them at most steps)."""
    beta = tiny_teacher_dir(tmp_path / "beta", byte_level_bpe(), seed=5, init_std=0.2)
    metrics = run(tmp_path / "bpe", *LEARN, f"teachers.beta.model={{path: {beta}}}")
    assert min(m["align/one_to_one/beta"] for m in metrics[1:]) < 0.99
    first, last = metrics[0]["eval/kl_per_byte/beta"], metrics[-1]["eval/kl_per_byte/beta"]
    assert last < 0.85 * first, (first, last)  # measured: 2.265 -> 1.582 nats per byte (0.70)


def test_a_top_k_loss_on_the_mapped_support_trains_as_the_direct_path(tmp_path):
    """The permuted-vocabulary teacher with topk_reverse: its distribution mapped onto the student's
    ids at every 1:1 chunk (here every token) gives the direct path's run, step for step, and the
    training KL on the bins falls."""
    beta = permuted_tiny_teacher_dir(tmp_path / "beta", TinyModelSpec(hidden_size=32, num_layers=2, seed=12,
                                                                       init_std=0.2))
    dense = ("teachers.beta.loss={kind: topk_reverse, k: 16}",)
    direct = run(tmp_path / "direct", *LEARN, *dense, "teachers.beta.model.tiny.init_std=0.2")
    cross = run(tmp_path / "dense", *LEARN, *dense, f"teachers.beta.model={{path: {beta}}}")
    assert all(m["align/dense_positions/beta"] == 1.0 and m["align/mapped_mass/beta"] == pytest.approx(1.0)
               for m in cross[1:])
    for a, b in zip(direct[1:], cross[1:]):
        assert b["train/kl/beta"] == pytest.approx(a["train/kl/beta"], rel=1e-4), a["step"]
    assert cross[-1]["eval/kl_per_byte/beta"] == pytest.approx(direct[-1]["eval/kl_per_byte/beta"], rel=1e-4)
    kl = [m["train/kl/beta"] for m in cross[1:]]
    assert sum(kl[-8:]) / 8 < 0.9 * sum(kl[:4]) / 4  # measured: 0.85


def test_the_eval_harness_reports_the_kl_per_byte_for_a_student_of_another_tokenizer(tmp_path):
    """`k3post eval`'s kl task with a student over a byte-level BPE and the tiny character teacher:
    per-byte KLs (no per-token ones: the vocabularies differ) in the records and the report's table
    (the per-byte sums themselves: test_cross_tokenizer_teacher.py, against brute force)."""
    import torch

    from k3post.config.eval_schema import EvalRecipe
    from k3post.config.schema import ModelSpec, TeacherSpec
    from k3post.engine.evaluation.eval_model import build_eval_model, reference_examples
    from k3post.loops.eval_harness import run_evaluation
    from k3post.loops.eval_plan import ModelEntry

    student_dir = tiny_teacher_dir(tmp_path / "student", byte_level_bpe(), seed=3)
    recipe = EvalRecipe.model_validate({
        "kind": "eval", "students": {"s": {"model": {"path": str(student_dir)}}},
        "teachers": {"t": {"model": {"tiny": {"hidden_size": 32, "num_layers": 2, "seed": 11}}}},
        "tasks": [{"name": "kl", "kind": "kl", "prompts": "builtin:heldout-chat", "limit": 3}],
        "sampling": {"max_new_tokens": 6, "batch_size": 3}})
    specs = {"s": TeacherSpec(model=ModelSpec(path=str(student_dir))),
             "t": TeacherSpec(model=ModelSpec(tiny={"hidden_size": 32, "num_layers": 2, "seed": 11}))}
    entries = [ModelEntry("s", "student", specs["s"], "s"), ModelEntry("t", "teacher", specs["t"], "t")]
    opened = {}

    def open_model(entry):
        return opened.setdefault(entry.name, build_eval_model(entry.name, entry.spec))

    results = run_evaluation(recipe, entries, open_model, tmp_path / "out", reference_examples)
    got = {r["metric"]: r for r in results.records if r["model"] == "s"}
    assert "reverse_kl" not in got and {"reverse_kl_per_byte", "forward_kl_per_byte"} <= set(got)
    assert got["reverse_kl_per_byte"]["bytes"] > 0 and got["reverse_kl_per_byte"]["teacher"] == "t"
    assert results.failures == []
    from k3post.track.report import students_by_teachers

    table = "\n".join(students_by_teachers(results.records, []))
    assert "nats per byte of text" in table and "nats per token" not in table
