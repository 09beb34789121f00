"""Progress: metric formatting and the plain (non-tty) output."""

import io
import re

from k3post.track.progress import Progress, format_metrics

METRICS = {
    "distill/kl/chat": 0.5121,
    "train/loss": -0.01,
    "distill/kl/math": 0.43,
    "throughput/tokens_per_s": 812.4,
    "other/ignored": 3.0,
}


def test_format_metrics():
    assert format_metrics(METRICS) == "kl[chat]=0.512 kl[math]=0.430 | tok/s=812 | loss=-0.01"


def test_format_metrics_shows_rewards_of_rl_steps():
    line = format_metrics({"rl/reward/total": 0.4166, "rl/pass_rate": 0.25, "train/loss": -0.2})
    assert line == "reward=0.417 pass=0.25 | loss=-0.2"


def test_format_metrics_partial_and_nonfinite():
    assert format_metrics({}) == ""
    assert format_metrics({"train/loss": float("nan")}) == "loss=nan"
    assert format_metrics({"distill/kl/chat": None, "throughput/tokens_per_s": 1e4}) == "kl[chat]=nan | tok/s=10000"


def test_plain_mode_prints_one_line_per_update():
    stream = io.StringIO()  # not a tty -> plain lines, auto-detected
    with Progress(total_steps=40, start_step=2, stream=stream) as progress:
        assert not progress.live
        progress.update(3, METRICS)
        progress.message("eval at step 3: reward=0.5")
        progress.update(4, {})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"step 3/40 \| kl\[chat\]=0\.512 kl\[math\]=0\.430 \| tok/s=812 \| loss=-0\.01 \| "
                        r"\d+\.\ds/step \(avg \d+\.\ds with evals\)", lines[0])
    assert lines[1] == "eval at step 3: reward=0.5"
    assert re.fullmatch(r"step 4/40 \| \d+\.\ds/step \(avg \d+\.\ds with evals\)", lines[2])
    assert "\x1b" not in stream.getvalue()  # no escape codes in logs


def test_live_mode_draws_bar_with_metrics():
    stream = io.StringIO()
    with Progress(total_steps=40, enabled=True, stream=stream) as progress:
        assert progress.live
        progress.update(3, METRICS)
        progress.message("eval [done]")  # brackets are not rich markup here
    out = stream.getvalue()
    assert "step 3/40" in out
    assert "kl[chat]=0.512" in out
    assert "eval [done]" in out


def test_plain_line_shows_the_last_steps_own_time_not_the_average():
    """The average includes evaluations; the last step's time is metrics' time/step_s."""
    stream = io.StringIO()
    with Progress(total_steps=10, stream=stream) as progress:
        progress.update(1, {"time/step_s": 12.34})
        progress.update(2, {"time/step_s": 3.0})
    first, second = stream.getvalue().splitlines()
    assert "| 12.3s/step (avg " in first
    assert "| 3.0s/step (avg " in second


def test_live_bar_shows_the_last_steps_time():
    stream = io.StringIO()
    with Progress(total_steps=10, enabled=True, stream=stream) as progress:
        progress.update(1, {"time/step_s": 7.25})
    assert "7.2s/step" in stream.getvalue()
