"""The lines `k3post run` prints at the end of a run: the first and the last held-out
evaluation's headline figures, per recipe kind."""

from __future__ import annotations


def first_and_last_eval(history: list[dict], key: str) -> tuple[dict, dict] | None:
    """The first and last logged rows that hold `key` (None unless there are two)."""
    evals = [h for h in history if key in h]
    return (evals[0], evals[-1]) if len(evals) >= 2 else None


def distill_summary(history: list[dict], recipe) -> list[str]:
    evals = [h for h in history if any(k.startswith("eval/kl/") for k in h)]
    if len(evals) < 2:
        return []
    first, last = evals[0], evals[-1]
    lines = [f"held-out KL, step {first['step']} → step {last['step']}:"]
    for name in recipe.teachers:
        for key, label in ((f"eval/kl/{name}", "reverse KL(student‖teacher)"),
                           (f"eval/fkl/{name}", "forward KL(teacher‖student)")):
            a, b = first.get(key), last.get(key)
            if a is not None and b is not None:
                change = 100 * (b - a) / a if a else 0.0
                lines.append(f"  {name:>10} {label}: {a:.3f} → {b:.3f} ({change:+.0f}%)")
    return lines


def sft_summary(history: list[dict], recipe) -> list[str]:
    ends = first_and_last_eval(history, "eval/nll")
    if ends is None:
        return []
    a, b = (row["eval/nll"] for row in ends)
    return [f"held-out NLL, step {ends[0]['step']} → step {ends[1]['step']}: {a:.4f} → {b:.4f} "
            f"({100 * (b - a) / a:+.0f}%)"]


def rl_summary(history: list[dict], recipe) -> list[str]:
    ends = first_and_last_eval(history, "eval/reward/total")
    if ends is None:
        return []
    first, last = ends
    return [f"held-out reward, step {first['step']} → step {last['step']}: {first['eval/reward/total']:.3f} → "
            f"{last['eval/reward/total']:.3f}; pass rate {first['eval/pass_rate']:.2f} → {last['eval/pass_rate']:.2f}"]
