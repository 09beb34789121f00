"""The FP8 table's Δ: paired over the units both models were measured on, with its interval and
the direction that is better for the metric (lower NLL, higher pass@k)."""

from __future__ import annotations

from k3post.track.report import delta_cell, fp8_table


def rec(model: str, metric: str, per_unit: list[float], fp8_of: str | None = None, tokens: float = 1.0) -> dict:
    return {"model": model, "fp8_of": fp8_of, "task": metric, "kind": "nll" if metric == "nll" else "generation",
            "metric": metric, "value": sum(per_unit) / (tokens * len(per_unit)), "ci_low": 0.0, "ci_high": 0.0,
            "confidence": 0.95, "seed": 0, "unit_ids": [f"u{i}" for i in range(len(per_unit))],
            "units": [[x, tokens] for x in per_unit]}


SPREAD = [0.1, 3.0, 0.7, 5.0, 1.9, 0.4, 2.2, 4.1]  # replies (prompts) that differ far more than the models do


def test_a_small_consistent_drop_in_nll_is_better_and_in_pass_rate_is_worse():
    assert delta_cell(rec("a", "nll", SPREAD), rec("b", "nll", [x - 0.05 for x in SPREAD])).endswith("better")
    rates = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0] * 4
    fewer = [0.0 if i % 8 == 0 else x for i, x in enumerate(rates)]  # 4 prompts of 32 lost, none won
    assert delta_cell(rec("a", "pass@1", rates), rec("b", "pass@1", fewer)).endswith("worse")


def test_changes_both_ways_are_within_noise_and_unpaired_records_say_so():
    mixed = [x + (0.3 if i % 2 else -0.3) for i, x in enumerate(SPREAD)]
    assert delta_cell(rec("a", "nll", SPREAD), rec("b", "nll", mixed)).endswith("within noise")
    bare = {k: v for k, v in rec("b", "nll", SPREAD).items() if k not in ("units", "unit_ids")}
    assert delta_cell(bare, rec("c", "nll", SPREAD)) == "0 (unpaired)"


def test_the_fp8_table_explains_what_its_deltas_mean():
    table = "\n".join(fp8_table([rec("m", "nll", SPREAD), rec("m@fp8", "nll", [x + 0.01 for x in SPREAD], "m")]))
    assert "| m@fp8 | m |" in table and "+0.0100 [+0.0100, +0.0100] worse" in table
    assert "paired bootstrap interval" in table and "QAT" in table
