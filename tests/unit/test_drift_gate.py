"""The drift gate (algo/drift.py, loops/drift_gate.py, config/drift_schema.py): the figures, the
decisions, the IS corrections in the learner's loss, and the gate in the real OPD step, in process
on the tiny smoke models, with drift injected (a sampler at the wrong temperature, noise added to
the sampler's weights after each sync)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from k3post.algo.drift import drift_verdict, is_correction_factor, mismatch_stats
from k3post.algo.objectives import SampledTokenPG
from k3post.config.drift_schema import DriftSpec
from k3post.config.errors import RecipeError, RunStopped
from k3post.config.load import load_recipe
from k3post.engine.learner.learner_base import corrected
from k3post.launch.distill import build_distill_run
from k3post.launch.in_process import DirectWeightSync, InProcessBackend
from k3post.loops import distill as loop
from k3post.loops.drift_gate import DriftGate, DriftStopped
from k3post.loops.protocols import Done
from k3post.track.metrics import read_metrics
from k3post.types import Prompt, Rollouts, TrainBatch

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"


# -- the figures --

def test_mismatch_figures_by_hand_and_k3_is_the_exact_kl_in_expectation():
    student_BT = torch.log(torch.tensor([[0.5, 0.25, 0.5]]))
    sampler_BT = torch.log(torch.tensor([[0.25, 0.25, 0.9]]))
    stats = mismatch_stats(student_BT, sampler_BT, torch.tensor([[1.0, 1.0, 0.0]]))  # the third token is masked
    assert stats["ratio_max"] == pytest.approx(2.0)
    assert stats["logprob_abs_diff"] == pytest.approx(torch.log(torch.tensor(2.0)).item() / 2)
    assert stats["sampler_kl"] == pytest.approx((2 - 1 - torch.log(torch.tensor(2.0)).item()) / 2)
    # E_{y~μ}[k3(y)] = KL(μ‖π) exactly: weight each token of a vocabulary by μ(y)
    mu_V = torch.tensor([0.5, 0.3, 0.2])
    pi_V = torch.tensor([0.2, 0.3, 0.5])
    k3_V = torch.tensor([mismatch_stats(pi_V[v].log().view(1, 1), mu_V[v].log().view(1, 1),
                                        torch.ones(1, 1))["sampler_kl"] for v in range(3)])
    assert float((mu_V * k3_V).sum()) == pytest.approx(float((mu_V * (mu_V / pi_V).log()).sum()), rel=1e-5)


def test_tis_truncates_and_mis_masks_only_the_tokens_outside():
    student_BT = torch.log(torch.tensor([[0.9, 0.5, 0.1, 0.5]]))
    sampler_BT = torch.log(torch.tensor([[0.3, 0.5, 0.5, 0.45]]))  # ρ = 3, 1, 0.2, 1.11
    tis = is_correction_factor(student_BT, sampler_BT, "tis", 2.0)
    assert tis.tolist()[0] == pytest.approx([2.0 / 3.0, 1.0, 1.0, 1.0], rel=1e-5)  # weight min(ρ, 2)
    assert is_correction_factor(student_BT, sampler_BT, "mis", 2.0).tolist() == [[0.0, 1.0, 0.0, 1.0]]
    assert is_correction_factor(student_BT, sampler_BT, "none", 2.0).tolist() == [[1.0] * 4]


def test_the_corrected_loss_weights_each_token_by_min_ratio_cap():
    """Through the learner's `corrected` and the sampled-token objective: d loss / d log π_t =
    −min(ρ_t, C)·A_t/N under TIS, −ρ_t·A_t/N without (so the test fails if the correction goes)."""
    student_BT = torch.log(torch.tensor([[0.9, 0.5, 0.1]])).requires_grad_()
    sampler_BT = torch.log(torch.tensor([[0.3, 0.5, 0.5]]))
    advantages_BT = torch.tensor([[1.0, -2.0, 3.0]])
    batch = TrainBatch([[1]], torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3), sampler_BT, advantages_BT)
    ratio = torch.tensor([3.0, 1.0, 0.2])
    for correction, weight in ((None, ratio), (("tis", 2.0), ratio.clamp(max=2.0)),
                               (("mis", 2.0), torch.tensor([0.0, 1.0, 0.0]))):
        mb = TrainBatch(**{**batch.__dict__, "is_correction": correction})
        loss = SampledTokenPG().loss(corrected(mb, student_BT), student_BT, None, 3.0)
        (grad,) = torch.autograd.grad(loss, student_BT)
        assert grad[0].tolist() == pytest.approx((-weight * advantages_BT[0] / 3).tolist(), rel=1e-5), correction


def test_mis_keeps_the_dropped_tokens_in_the_normaliser(tiny_spec):
    """In the learner's step, MIS is exactly the uncorrected step with the dropped tokens'
    advantages set to 0: the same loss and the same gradients, divided by the same N (the step's
    token count before the correction), so a dropped token still counts in the denominator. A
    renormalised MIS (dividing by the kept count) would scale the loss and every gradient by
    N / N_kept, which the ratio check below tells apart."""
    from tests.unit.test_learner import learner, make_batch

    batch = make_batch(tiny_spec, n=6, seed=1)
    g = torch.Generator().manual_seed(0)
    shift_BT = torch.where(torch.rand(batch.loss_mask_BT.shape, generator=g) < 0.3, 1.5, 0.0)  # ρ = e^1.5 > 2
    batch = dataclasses.replace(batch, sampler_logprobs_BT=batch.sampler_logprobs_BT - shift_BT)
    kept_BT = (shift_BT == 0).float()
    dropped = float((batch.loss_mask_BT * (1 - kept_BT)).sum())
    total = float(batch.loss_mask_BT.sum())
    assert 0 < dropped < total

    def loss_and_grads(b):
        lrn = learner(tiny_spec, micro=2)
        loss = lrn.accumulate_gradients(b)["train/loss"]
        return loss, [p.grad.clone() for p in lrn.params]

    mis_loss, mis_grads = loss_and_grads(dataclasses.replace(batch, is_correction=("mis", 2.0)))
    zeroed_loss, zeroed_grads = loss_and_grads(dataclasses.replace(batch, advantages_BT=batch.advantages_BT * kept_BT))
    assert mis_loss == pytest.approx(zeroed_loss, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(mis_grads, zeroed_grads))
    assert abs(mis_loss) > 1e-4 and total / (total - dropped) > 1.1  # renormalising would show


# -- the decisions --

def test_verdicts_and_the_schema():
    assert drift_verdict(1e-7, 0.1, 1.0, "tis", "f").action == "ok"
    assert drift_verdict(0.2, 0.1, 1.0, "none", "f").action == "warn"
    assert drift_verdict(0.2, 0.1, 1.0, "mis", "f").action == "correct"
    assert drift_verdict(1.5, 0.1, 1.0, "mis", "f").action == "stop"
    assert drift_verdict(50.0, 0.1, None, "none", "f").action == "warn"
    assert drift_verdict(float("nan"), 0.1, 1.0, "none", "f").action == "ok"
    assert DriftSpec(correction="tis", tis_cap=3.0).correction_args == ("tis", 3.0)
    assert DriftSpec().correction_args is None
    with pytest.raises(ValueError, match="stop_abs_diff .* must be above warn_abs_diff"):
        DriftSpec(warn_abs_diff=0.5, stop_abs_diff=0.2)
    with pytest.raises(RecipeError, match="train.drift.bogus"):
        load_recipe(SMOKE, ["train.drift.bogus=1"])
    assert load_recipe(SMOKE, ["train.drift.correction=mis"]).train.drift.correction == "mis"


def test_the_gate_warns_once_per_streak_corrects_and_stops():
    said: list[str] = []
    gate = DriftGate(DriftSpec(warn_abs_diff=0.1, stop_abs_diff=1.0, correction="tis", tis_cap=3.0), said.append)
    figures = {"train/sampler_kl": 0.01, "train/ratio_max": 1.5}
    assert gate.check(1, {**figures, "train/logprob_abs_diff": 1e-6}) == {"drift/warned": 0.0, "drift/correction": 0.0}
    assert gate.check(2, {**figures, "train/logprob_abs_diff": 0.3}) == {"drift/warned": 1.0, "drift/correction": 1.0}
    assert gate.correction == ("tis", 3.0)
    assert gate.check(3, {**figures, "train/logprob_abs_diff": 0.3})["drift/warned"] == 1.0
    assert len(said) == 1 and "step 2" in said[0] and "TIS importance-sampling correction on from step 3" in said[0]
    with pytest.raises(DriftStopped, match=r"stopped at step 4: .*train/logprob_abs_diff=1.7 > 1") as stop:
        gate.check(4, {**figures, "train/logprob_abs_diff": 1.7})
    assert isinstance(stop.value, RunStopped)  # the CLI prints it as one line


class StubTeacher:
    """A teacher group whose engine reports fixed spot-check figures (None: an HF teacher)."""

    def __init__(self, found):
        self.found, self.rows_seen = found, []

    def check_scores(self, rollouts):
        self.rows_seen.append(len(rollouts))
        return Done(self.found)


def rollouts_for(teachers: list[str]) -> Rollouts:
    prompts = [Prompt(uid=str(i), source="s", teacher=t, messages=(("user", "x"),)) for i, t in enumerate(teachers)]
    return Rollouts(prompts, [[1]] * len(prompts), torch.zeros(len(prompts), 2, dtype=torch.long),
                    torch.ones(len(prompts), 2), torch.zeros(len(prompts), 2))


def test_the_teacher_spot_check_runs_every_n_steps_on_each_teachers_rows():
    said: list[str] = []
    spec = DriftSpec(teacher_check_every=2, teacher_warn_abs_diff=0.05, teacher_stop_abs_diff=0.5)
    vllm_like, hf = StubTeacher({"max_abs_diff": 0.4, "mean_abs_diff": 0.08}), StubTeacher(None)
    gate = DriftGate(spec, said.append)
    rollouts = rollouts_for(["v", "h", "v"])
    assert gate.check(1, {}, rollouts, {"v": vllm_like, "h": hf}) == {}  # not due
    out = gate.check(2, {}, rollouts, {"v": vllm_like, "h": hf})
    assert out == {"drift/teacher_abs_diff/v": 0.08, "drift/teacher_max_abs_diff/v": 0.4,
                   "drift/teacher_warned/v": 1.0}
    assert vllm_like.rows_seen == [2] and hf.rows_seen == [1]
    assert len(said) == 1 and "teacher 'v''s engine scores" in said[0]
    vllm_like.found = {"max_abs_diff": 2.0, "mean_abs_diff": 0.9}
    with pytest.raises(DriftStopped, match=r"step 4: .*drift/teacher_abs_diff/v=0.9 > 0.5"):
        gate.check(4, {}, rollouts, {"v": vllm_like, "h": hf})


# -- the gate in the real OPD step (in process, tiny smoke models) --

# The figures docs/learner.md ("Drift") quotes from the runs below, at the precision it quotes them;
# asserted within FIGURE_REL (the dropped-token count exactly): change both together.
FIGURE_REL = 0.02
WRONG_TEMPERATURE = {"train/logprob_abs_diff": 0.060, "train/sampler_kl": 0.0027, "train/ratio_max": 1.18}
TIS_STEP2_LOSS = {"with": 0.03650, "without": 0.03732}
NOISY_WEIGHTS = {"train/logprob_abs_diff": 0.25, "train/sampler_kl": 0.057, "train/ratio_max": 2.2}
MIS_STEP2_DROPPED = (2, 24)  # tokens dropped, of the step's tokens


def assert_quoted(measured: dict[str, float], quoted: dict[str, float]) -> None:
    for key, value in quoted.items():
        assert measured[key] == pytest.approx(value, rel=FIGURE_REL), (key, measured[key], "docs/learner.md says", value)


def steps(tmp_path, monkeypatch, overrides=(), temperature=None, noise=0.0, count=2):
    """Run `count` real OPD steps; drift injected by a sampler temperature other than the learner's,
    or by noise added to the sampler's weights after each sync. Returns (metrics per step, lines)."""
    if temperature is not None:
        real = loop.step_sampling
        monkeypatch.setattr(loop, "step_sampling", lambda *a: dataclasses.replace(real(*a), temperature=temperature))
    if noise:
        real_push = DirectWeightSync.push

        def noisy_push(self, version):
            real_push(self, version)
            with torch.no_grad():
                generator = torch.Generator().manual_seed(version)
                for p in self.samplers.engine.model.parameters():
                    p.add_(noise * torch.randn(p.shape, generator=generator))

        monkeypatch.setattr(DirectWeightSync, "push", noisy_push)
    lines: list[str] = []
    recipe = load_recipe(SMOKE, ["train.eval_every=0", "sampling.max_new_tokens=6", *overrides])
    run = build_distill_run(recipe, tmp_path, InProcessBackend())
    run.drift.say = lines.append
    run.weight_sync.push(0)
    run.batches = []  # what the learner was handed each step
    train_step = run.learner.train_step
    run.learner.train_step = lambda batch, *payloads: (run.batches.append(batch), train_step(batch, *payloads))[1]
    return [loop.distill_step(run, step) for step in range(1, count + 1)], lines, run


def test_a_clean_run_stays_silent(tmp_path, monkeypatch):
    metrics, lines, _ = steps(tmp_path, monkeypatch, ["train.drift.correction=tis"])
    for m in metrics:
        assert m["train/logprob_abs_diff"] < 1e-4 and m["train/sampler_kl"] < 1e-6
        assert m["drift/warned"] == 0.0 and m["drift/correction"] == 0.0 and m["train/is_affected"] == 0.0
    assert lines == []


def test_a_wrong_sampler_temperature_warns_then_tis_reweights(tmp_path, monkeypatch):
    # The tiny random models are near uniform over ~100 ids: a temperature moves log p by a few
    # hundredths (clean: ~1e-7), hence the low thresholds.
    metrics, lines, run = steps(tmp_path, monkeypatch, ["train.drift.correction=tis", "train.drift.tis_cap=1.1",
                                                        "train.drift.warn_abs_diff=0.02"], temperature=3.0)
    first, second = metrics
    print("wrong temperature:", {k: v for k, v in first.items() if "drift" in k or "ratio" in k
                                 or "abs_diff" in k or "sampler_kl" in k or "is_affected" in k})
    assert_quoted(first, WRONG_TEMPERATURE)
    assert first["train/logprob_abs_diff"] > 0.02 and first["drift/warned"] == 1.0
    assert first["train/is_affected"] == 0.0  # the step that found the drift trained as before...
    assert second["drift/correction"] == 1.0 and second["train/is_affected"] > 0.0  # ...the next one is corrected
    assert run.drift.correction == ("tis", 1.1)
    # The learner's loss on the corrected batch differs from the same batch uncorrected (same weights).
    batch = run.batches[1]
    assert run.batches[0].is_correction is None and batch.is_correction == ("tis", 1.1)
    with_tis = run.learner.accumulate_gradients(batch)["train/loss"]
    without = run.learner.accumulate_gradients(dataclasses.replace(batch, is_correction=None))["train/loss"]
    print(f"step-2 batch: loss {with_tis:.6f} with TIS (cap 1.1), {without:.6f} without")
    assert_quoted({"with": with_tis, "without": without}, TIS_STEP2_LOSS)
    assert abs(with_tis - without) > 1e-4 * abs(without)
    assert len(lines) == 1 and lines[0].startswith("warning: step 1: the sampler's log μ and the learner's log π")


def test_noisy_sampler_weights_with_mis_drop_tokens(tmp_path, monkeypatch):
    metrics, lines, _ = steps(tmp_path, monkeypatch, ["train.drift.correction=mis"], noise=0.05)  # default thresholds
    print("noisy weights:", [{k: v for k, v in m.items() if k in (
        "train/logprob_abs_diff", "train/sampler_kl", "train/ratio_max", "train/is_affected", "drift/warned", "train/tokens")}
        for m in metrics])
    assert_quoted(metrics[0], NOISY_WEIGHTS)
    dropped, tokens = MIS_STEP2_DROPPED
    assert metrics[1]["train/tokens"] == tokens and metrics[1]["train/is_affected"] == pytest.approx(dropped / tokens)
    assert all(m["drift/warned"] == 1.0 for m in metrics)
    assert metrics[1]["train/is_affected"] > 0.0 and "MIS" in lines[0]


def test_drift_past_the_stop_threshold_ends_the_run_naming_the_step(tmp_path, monkeypatch):
    with pytest.raises(DriftStopped, match=r"stopped at step 1: the sampler's log μ and the learner's log π disagree: "
                                           r"train/logprob_abs_diff=[\d.]+ > 0.05"):
        steps(tmp_path, monkeypatch, ["train.drift.warn_abs_diff=0.01", "train.drift.stop_abs_diff=0.05"],
              temperature=3.0, count=1)


def test_the_gate_acts_in_rl_too(tmp_path, monkeypatch):
    """The RL step (tiny-rl smoke recipe, in process): a wrong sampler temperature warns and the
    next batch carries the MIS correction; the same step at the right temperature stays silent."""
    from k3post.launch.rl import build_rl_run
    from k3post.loops import rl

    real = rl.step_sampling
    lines: list[str] = []
    recipe = load_recipe(REPO / "recipes" / "smoke" / "tiny-rl.yaml",
                         ["train.drift.warn_abs_diff=0.02", "train.drift.correction=mis", "data.prompts_per_step=1",
                          "sampling.max_new_tokens=6"])
    run = build_rl_run(recipe, tmp_path, InProcessBackend())
    run.drift.say = lines.append
    run.weight_sync.push(0)
    clean = rl.rl_step(run, 1)
    assert clean["drift/warned"] == 0.0 and lines == []
    monkeypatch.setattr(rl, "step_sampling", lambda *a: dataclasses.replace(real(*a), temperature=3.0))
    drifted = rl.rl_step(run, 2)
    assert drifted["drift/warned"] == 1.0 and run.drift.correction == ("mis", 2.0) and len(lines) == 1
    assert rl.rl_step(run, 3)["drift/correction"] == 1.0


def wrong_temperature_from(monkeypatch, module, first_step: int) -> None:
    """The sampler of `module`'s loop draws at temperature 3 from `first_step` on (the learner: 1)."""
    real = module.step_sampling
    monkeypatch.setattr(module, "step_sampling", lambda sampling, seed, step: dataclasses.replace(
        real(sampling, seed, step), temperature=3.0 if step >= first_step else sampling.temperature))


def test_the_step_that_trips_the_gate_is_logged_then_the_run_stops(tmp_path, monkeypatch):
    """A distillation run (the whole loop: run_distill) whose sampler goes wrong at step 2: step 2's
    metrics are in metrics.jsonl like any step's, with the figure that tripped the gate and
    drift/stopped = 1, and the run still stops with the gate's error and no step-2 checkpoint."""
    wrong_temperature_from(monkeypatch, loop, 2)
    recipe = load_recipe(SMOKE, ["train.steps=3", "train.eval_every=0", "train.checkpoint_every=1",
                                 "sampling.max_new_tokens=6", "train.drift.warn_abs_diff=0.01",
                                 "train.drift.stop_abs_diff=0.05"])
    run = build_distill_run(recipe, tmp_path, InProcessBackend())
    with pytest.raises(DriftStopped, match=r"stopped at step 2: the sampler's log μ and the learner's log π disagree: "
                                           r"train/logprob_abs_diff=[\d.]+ > 0.05"):
        loop.run_distill(run)
    rows = {row["step"]: row for row in read_metrics(tmp_path / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2]
    assert rows[1]["train/logprob_abs_diff"] < 1e-4 and rows[1]["drift/warned"] == 0.0
    tripped = rows[2]
    assert tripped["train/logprob_abs_diff"] > 0.05 and tripped["drift/stopped"] == 1.0
    for key in ("train/loss", "train/sampler_kl", "train/ratio_max", "distill/kl/alpha", "time/train_s"):
        assert key in tripped, key
    assert (tmp_path / "checkpoints" / "step-1").is_dir() and not (tmp_path / "checkpoints" / "step-2").exists()


def test_the_rl_step_that_trips_the_gate_is_logged_then_the_run_stops(tmp_path, monkeypatch):
    """The same in RL (run_rl on the tiny-rl smoke recipe): step 2's row carries its reward figures too."""
    from k3post.launch.rl import build_rl_run
    from k3post.loops import rl

    wrong_temperature_from(monkeypatch, rl, 2)
    recipe = load_recipe(REPO / "recipes" / "smoke" / "tiny-rl.yaml",
                         ["train.steps=3", "train.eval_every=0", "train.checkpoint_every=1", "data.prompts_per_step=1",
                          "sampling.max_new_tokens=6", "train.drift.warn_abs_diff=0.01",
                          "train.drift.stop_abs_diff=0.02"])
    run = build_rl_run(recipe, tmp_path, InProcessBackend())
    with pytest.raises(DriftStopped, match=r"stopped at step 2: .*train/logprob_abs_diff=[\d.]+ > 0.02"):
        rl.run_rl(run)
    rows = {row["step"]: row for row in read_metrics(tmp_path / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2]
    tripped = rows[2]
    assert tripped["train/logprob_abs_diff"] > 0.02 and tripped["drift/stopped"] == 1.0
    for key in ("train/loss", "rl/reward/total", "rl/response_len", "time/train_s"):
        assert key in tripped, key
    assert not (tmp_path / "checkpoints" / "step-2").exists()
