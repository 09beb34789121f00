"""The MTP draft head: it learns to track the student during OPD, and the student never notices it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3post.cli.run import run_recipe
from k3post.config.draft_schema import DraftSpec, SpeculateSpec
from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, OptimSpec, TinyModelSpec
from k3post.engine.learner.draft_trainer import draft_positions
from k3post.engine.learner.learner import Learner, LearnerConfig
from k3post.track.metrics import read_metrics
from tests.unit.test_learner import make_batch

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"
PEAKED = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3, init_std=0.2))


def learner(draft: DraftSpec, spec: ModelSpec = PEAKED) -> Learner:
    return Learner(LearnerConfig(student=spec, optim=OptimSpec(lr=1e-3, micro_batch_size=2), total_steps=10,
                                 num_threads=2, draft=draft))


def test_the_trained_positions_are_pairs_of_completion_tokens():
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    rows, cols = draft_positions([3, 5, 2], mask_BT)
    # h_t at column t = P + j - 1 reads completion token j and predicts completion token j + 1.
    assert rows.tolist() == [0, 0, 2] and cols.tolist() == [2, 3, 1]


def test_the_student_trajectory_is_bit_identical_with_the_head_on_and_off():
    batches = [make_batch(PEAKED, n=4, seed=s) for s in range(3)]
    runs = {}
    for kind in ("none", "mtp"):
        lrn = learner(DraftSpec(kind="mtp", lr=1e-2) if kind == "mtp" else DraftSpec())
        metrics = [lrn.train_step(b) for b in batches]
        runs[kind] = ([m["train/loss"] for m in metrics], [m["train/grad_norm"] for m in metrics],
                      {k: v.detach().clone() for k, v in lrn.model.state_dict().items()}, lrn)
    off, on = runs["none"], runs["mtp"]
    assert on[0] == off[0] and on[1] == off[1]  # exactly, not approximately
    assert on[2].keys() == off[2].keys() and all(torch.equal(on[2][k], off[2][k]) for k in off[2])
    head = on[3].draft.head
    assert all(p.grad is None for p in head.parameters())  # its own AdamW stepped and cleared them
    assert not any(k.startswith("mtp") or "eh_proj" in k for k in on[2])  # the student's state is its own


def test_the_head_learns_to_track_the_student_during_opd(tmp_path):
    """A tiny in-process OPD run: each step logs the head's teacher-forced acceptance Σ_v min(p, q)
    on that step's fresh rollouts before it trains on them (held out from the head), and it rises."""
    args = ["draft.kind=mtp", "draft.lr=1e-2", "student.tiny.init_std=0.2", "train.steps=6", "train.eval_every=0",
            "train.checkpoint_every=0", "sampling.max_new_tokens=16"]
    assert run_recipe(SMOKE, args, tmp_path / "r", in_process=True, restart=False) == 0
    accept = [m["train/draft_accept"] for m in read_metrics(tmp_path / "r" / "metrics.jsonl") if m["step"] > 0]
    assert len(accept) == 6
    # Measured on 2026-12-03: 0.453 at step 1, 0.533 at step 6 (0.621 at step 10).
    assert sum(accept[-2:]) / 2 > accept[0] + 0.04, accept


def test_checkpoints_carry_the_head_and_its_optimizer(tmp_path):
    batch = make_batch(PEAKED, n=4, seed=0)
    first = learner(DraftSpec(kind="mtp", lr=1e-2))
    first.train_step(batch)
    first.save_checkpoint(str(tmp_path / "ck"), {})
    resumed = learner(DraftSpec(kind="mtp", lr=1e-2))
    assert not torch.equal(resumed.draft.head.eh_proj.weight, first.draft.head.eh_proj.weight) or \
        not torch.equal(resumed.draft.head.enorm.weight, first.draft.head.enorm.weight)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    for (name, a), b in zip(first.draft.head.state_dict().items(), resumed.draft.head.state_dict().values()):
        assert torch.equal(a, b), name
    after_first, after_resumed = first.train_step(batch), resumed.train_step(batch)
    assert after_first["train/draft_loss"] == after_resumed["train/draft_loss"]
    assert torch.equal(first.draft.head.eh_proj.weight, resumed.draft.head.eh_proj.weight)
    without = learner(DraftSpec())
    with pytest.raises(FileNotFoundError, match="no draft head"):
        learner(DraftSpec(kind="mtp")).load_checkpoint(str(tmp_path / "ck-none"))
    assert without.draft is None


def test_the_weights_sent_to_samplers_carry_the_head_only_when_they_speculate():
    plain = learner(DraftSpec(kind="mtp")).weights()
    drafting = learner(DraftSpec(kind="mtp", speculate=SpeculateSpec(tokens=2))).weights()
    head = {k for k in drafting if k.startswith("mtp.")}
    assert not any(k.startswith("mtp.") for k in plain)
    assert {"mtp.eh_proj.weight", "mtp.enorm.weight", "mtp.hnorm.weight"} <= head
    assert set(drafting) - head == set(plain)


@pytest.mark.parametrize("override, message", [
    (["draft.lr=1e-2"], "draft.lr: applies to a draft head"),
    (["draft.kind=mtp", "draft.speculate.tokens=2", "sampling.engine=vllm"], "speculative rollouts run in the HF"),
])
def test_draft_keys_that_cannot_apply_are_load_errors(tmp_path, override, message):
    from k3post.config.load import load_recipe  # noqa: PLC0415

    with pytest.raises(UserError, match=message):
        load_recipe(SMOKE, override)


def test_a_sharded_learner_may_train_the_head():
    """Several learner ranks shard the head like a block (tests/unit/test_sharded_draft.py)."""
    from k3post.config.load import load_recipe  # noqa: PLC0415

    recipe = load_recipe(SMOKE, ["draft.kind=mtp", "draft.hidden=residual", "resources.learner.replicas=2"])
    assert recipe.draft.kind == "mtp" and recipe.resources.learner.replicas == 2
