"""Live progress display for the training loop.

On a terminal: a rich progress bar with the key metrics next to it. Anywhere else (CI
logs, `ray job logs`, a file) a live bar would print escape codes or nothing useful, so
we print one plain line per update instead.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

KL_PREFIX = "distill/kl/"
TOKENS_PER_S = "throughput/tokens_per_s"
LOSS = "train/loss"


def _fmt(value: Any, spec: str) -> str:
    """Format a metric value; missing or non-finite values show as 'nan' instead of crashing."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "nan"
    return format(number, spec) if math.isfinite(number) else "nan"


REWARD, PASS_RATE, ZERO_VAR = "rl/reward/total", "rl/pass_rate", "rl/zero_variance_groups"


def format_metrics(metrics: dict[str, Any]) -> str:
    """The metrics worth watching, e.g. 'kl[chat]=0.512 kl[math]=0.430 | tok/s=812 | loss=-0.01'.

    Per-teacher KL keeps the recipe's (insertion) order; groups that are absent are left out.
    """
    groups = []
    kls = [f"kl[{k[len(KL_PREFIX):]}]={_fmt(v, '.3f')}" for k, v in metrics.items() if k.startswith(KL_PREFIX)]
    if kls:
        groups.append(" ".join(kls))
    if REWARD in metrics:  # RL, and OPD mixed with task rewards
        reward = f"reward={_fmt(metrics[REWARD], '.3f')} pass={_fmt(metrics.get(PASS_RATE), '.2f')}"
        if ZERO_VAR in metrics:  # share of groups with equal rewards: why the loss may be 0
            reward += f" zero_var={_fmt(metrics[ZERO_VAR], '.0%')}"
        groups.append(reward)
    if TOKENS_PER_S in metrics:
        groups.append(f"tok/s={_fmt(metrics[TOKENS_PER_S], '.0f')}")
    if LOSS in metrics:
        groups.append(f"loss={_fmt(metrics[LOSS], '.4g')}")
    return " | ".join(groups)


class Progress:
    """Progress of steps start_step+1..total_steps; a rich bar on a tty, plain lines otherwise.

    enabled: True forces the live bar, False forces plain lines, None asks stream.isatty().
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool | None = None,
                 stream: TextIO | None = None, description: str = "train"):
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stdout  # resolved now: capture-friendly
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.live = enabled
        self._t0 = self._last_update = time.monotonic()
        self._bar: RichProgress | None = None
        if self.live:
            self._start_bar(description)

    def _start_bar(self, description: str) -> None:
        """Start the rich bar; force_terminal because enabled=True may be asked for explicitly."""
        console = Console(file=self.stream, force_terminal=True)
        self._bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=30),  # leaves room for the metrics on an 80-column terminal
            TextColumn("step {task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}", markup=False),  # 'kl[chat]' is not rich markup
            console=console,
        )
        self._task = self._bar.add_task(description, total=self.total_steps,
                                        completed=self.start_step, metrics="")
        self._bar.start()

    def _seconds_per_step(self, step: int) -> float | None:
        """Average wall time per step since this process started (a resume does not count),
        evaluations and checkpoints included."""
        done = step - self.start_step
        return (time.monotonic() - self._t0) / done if done > 0 else None

    def _last_step_s(self, metrics: dict[str, Any]) -> float:
        """The step's own time (`time/step_s`, what metrics.jsonl records: no evaluation, no
        checkpoint); the wall time since the last update when the step does not report it."""
        now, last = time.monotonic(), self._last_update
        self._last_update = now
        value = metrics.get("time/step_s")
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else now - last

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Show that `step` is finished, with its metrics and its time."""
        text = format_metrics(metrics)
        last = f"{self._last_step_s(metrics):.1f}s/step"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, metrics=" | ".join(p for p in (text, last) if p))
            return
        parts = [f"step {step}/{self.total_steps}"]
        if text:
            parts.append(text)
        sps = self._seconds_per_step(step)
        parts.append(last + (f" (avg {sps:.1f}s with evals)" if sps is not None else ""))
        print(" | ".join(parts), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """Print a line above the bar (or as a plain line), e.g. 'eval at step 10: ...'."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Stop the live bar (leaving its last state on screen); safe to call twice."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
