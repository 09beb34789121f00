"""The benchmark figures as data (bench/results/*.jsonl) and the tables rendered from them.

Every row has the same fields with the right types; docs/benchmarks.md's current-figures block
and README.md's headline block are exactly what bench/render_tables.py renders from the data
(regenerate with `.venv/bin/python bench/render_tables.py`); every bench script or recipe a current
row's command names exists (a script recorded at its path before the scripts moved into subject
folders: where `results.moved` says it is now); and bench/results.py's record() fills, checks and
supersedes rows.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
# The subjects docs/benchmarks.md's current figures must cover.
SUBJECTS = {"quickstart", "opd-vs-trl", "learner-sharded-h200", "reference-cost", "fp8-qat", "sandbox-cost",
            "weight-check-cost", "cross-tokenizer", "cross-tokenizer-cost", "sft-opd-eval"}


def _module(name: str):
    """A module of bench/ by its dotted path there: "render_tables", "teachers.cross_tokenizer_arms"."""
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="module")
def render():
    return _module("render_tables")


@pytest.fixture(scope="module")
def results(render):
    return render.results


@pytest.fixture(scope="module")
def rows(render):
    return render.load()


def test_every_row_has_the_same_fields_with_the_right_types(results):
    files = sorted(RESULTS.glob("*.jsonl"))
    assert SUBJECTS <= {p.stem for p in files}, f"subjects without a results file: {SUBJECTS - {p.stem for p in files}}"
    bad, count = [], 0
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{n}"
            row = json.loads(line, parse_float=Decimal)
            count += 1
            if list(row) != list(results.FIELDS):
                bad.append(f"{where}: fields {list(row)}, expected {list(results.FIELDS)}")
            bad += [f"{where}: {p}" for p in results.problems(row)]
            if row.get("subject") != path.stem:
                bad.append(f"{where}: subject {row.get('subject')!r} in {path.name}")
            if isinstance(row.get("date"), str) and row["date"] > dt.date.today().isoformat():
                bad.append(f"{where}: date {row['date']} is in the future")
    assert count > 100 and not bad, "\n".join(bad)


def test_a_subject_has_one_current_row_per_metric_and_a_few_headlines(render, rows):
    # render.load() refuses two current rows of one subject with the same metric
    current = render.current(rows)
    assert SUBJECTS <= {r["subject"] for r in current}
    heads = [r for r in current if r["headline"]]
    assert 4 <= len(heads) <= 6, [r["metric"] for r in heads]
    assert not [r for r in rows if r["headline"] and not r["current"]], "a superseded row is still a headline"


def test_each_row_names_a_section_of_the_docs(results, rows):
    """source_section (a script in it read where it is now: results.moved) is a heading of
    docs/benchmarks.md (the current table links to it), or of docs/benchmarks-history.md for a
    superseded row."""
    def headings(path: Path) -> set[str]:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        return {m.group(1) for m in re.finditer(r"^#{2,6}\s+(.+?)\s*$", text, re.M)}

    docs, history = headings(REPO / "docs" / "benchmarks.md"), headings(REPO / "docs" / "benchmarks-history.md")
    sections = [(results.moved(r["source_section"]), r["current"]) for r in rows]
    missing = sorted({s for s, current in sections if s not in docs and (current or s not in history)})
    assert not missing, f"source_section names no heading of docs/benchmarks.md: {missing}"


def test_the_docs_block_is_what_the_data_renders(render, rows):
    text = render.DOCS.read_text(encoding="utf-8")
    block = render.block(text, render.DOCS_MARKERS)
    assert block is not None, f"docs/benchmarks.md lacks the markers {render.DOCS_MARKERS}"
    first_section = re.search(r"^## (?!Current figures)", text, re.M).start()
    assert text.index(render.DOCS_MARKERS[0]) < first_section, "the current figures are not at the top of the page"
    assert block == render.render_docs_block(rows), (
        f"docs/benchmarks.md's current figures differ from bench/results/*.jsonl; regenerate them with "
        f"`{render.COMMAND}`")


def test_the_page_holds_each_marker_and_each_section_once(render):
    """A rendered block pasted twice leaves a stale copy of figures and prose below the markers,
    which the renderer never refreshes (the first pair of markers is the one it rewrites)."""
    for path in (render.DOCS, render.README):
        text = path.read_text(encoding="utf-8")
        markers = render.DOCS_MARKERS if path == render.DOCS else render.README_MARKERS
        assert [text.count(m) for m in markers] == [1, 1], (path.name, markers)
    headings = re.findall(r"^## .*$", render.DOCS.read_text(encoding="utf-8"), re.M)
    assert not {h for h in headings if headings.count(h) > 1}, "docs/benchmarks.md repeats a section"


def test_the_history_block_is_what_the_data_renders(render, rows):
    """docs/benchmarks-history.md opens with the superseded rows' tables, rendered from the data."""
    text = render.HISTORY.read_text(encoding="utf-8")
    block = render.block(text, render.HISTORY_MARKERS)
    assert block is not None, f"docs/benchmarks-history.md lacks the markers {render.HISTORY_MARKERS}"
    assert block == render.render_history_block(rows, render.headings(render.DOCS)), (
        f"docs/benchmarks-history.md's tables differ from bench/results/*.jsonl; regenerate them with "
        f"`{render.COMMAND}`")
    old = [r for r in rows if not r["current"]]
    assert old and all(render.number(r["value"]) in block for r in old)
    assert text.index(render.HISTORY_MARKERS[0]) < text.index("\n## ", text.index(render.HISTORY_MARKERS[1]))


def test_a_new_subject_gets_its_tables_without_being_named(render, rows):
    """Rendering is generic: a subject SUBJECTS does not name still gets a current and a history table."""
    new = [{**rows[0], "subject": "zz-new-subject", "metric": "m", "current": c, "source_section": "S"}
           for c in (True, False)]
    assert "zz-new-subject" not in render.SUBJECTS
    assert "### zz-new-subject" in render.render_docs_block(rows + new)
    assert "### zz-new-subject" in render.render_history_block(rows + new, set())


def test_the_readme_block_is_what_the_data_renders(render, rows):
    block = render.block(render.README.read_text(encoding="utf-8"), render.README_MARKERS)
    assert block is not None, f"README.md lacks the markers {render.README_MARKERS}"
    assert block == render.render_readme_block(rows), (
        f"README.md's headline figures differ from bench/results/*.jsonl; regenerate them with `{render.COMMAND}`")
    assert "docs/benchmarks.md" in block


FILE = re.compile(r"(?<![\w./-])((?:bench|recipes)/[\w./-]+\.(?:py|ya?ml))\b")


def test_the_commands_of_current_rows_name_files_that_exist(results, render, rows):
    named, missing = set(), set()
    for row in render.current(rows):
        for path in FILE.findall(results.moved(row["command"])):
            named.add(path)
            if not (REPO / path).is_file():
                missing.add(f"{row['subject']}: {path} (in {row['command']!r})")
    assert len(named) >= 8 and not missing, "\n".join(sorted(missing))


def test_every_moved_script_is_where_moved_says(results):
    """results.MOVED (old path -> path now) reads the rows recorded before the scripts moved into
    subject folders: each new path is a script, and no old one is left."""
    assert len(results.MOVED) >= 30
    assert [new for new in results.MOVED.values() if not (REPO / new).is_file()] == []
    assert [old for old in results.MOVED if (REPO / old).exists()] == []
    assert results.moved("python bench/opd_step.py --steps 2") == "python bench/opd/opd_step.py --steps 2"
    assert results.moved("bench/render_tables.py; bench/opd/opd_step.py") == "bench/render_tables.py; bench/opd/opd_step.py"


def test_values_render_with_their_digits_as_written(render):
    assert render.number(Decimal("0.260")) == "0.260"
    assert render.number(Decimal("-0.0367")) == "−0.0367"
    assert render.number(24956) == "24,956" and render.number(501) == "501"
    assert render.number(Decimal("1234.50")) == "1,234.50"


def test_record_fills_checks_and_supersedes(results, render, tmp_path):
    path = tmp_path / "demo.jsonl"
    fixed = {"source_section": "A section", "commit_": "abc1234", "machine_": "2-core AMD EPYC test machine",
             "command_": "python bench/x.py"}
    results.record("demo", [{"metric": "step time", "value": Decimal("0.260"), "unit": "s"},
                            {"metric": "tokens", "value": 382, "unit": "tokens", "notes": "n"}], path=path, **fixed)
    first = path.read_text(encoding="utf-8").splitlines()
    assert '"value": 0.260' in first[0] and len(first) == 2
    row = results.loads(first[0])
    assert row["date"] == dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert (row["commit"], row["current"], row["headline"], row["ratio_to"]) == ("abc1234", True, False, None)
    results.record("demo", [{"metric": "step time", "value": 0.25, "unit": "s"}], path=path, **fixed)
    rows = render.load(tmp_path)
    assert [(r["metric"], r["current"]) for r in rows] == [("step time", False), ("tokens", True), ("step time", True)]
    assert results.dumps(rows[1]) == first[1]  # an untouched line stays as it was
    before = path.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="value must be a number"):
        results.record("demo", [{"metric": "m", "value": "fast", "unit": "s"}], path=path, **fixed)
    with pytest.raises(ValueError, match="unknown fields"):
        results.record("demo", [{"metric": "m", "value": 1, "unit": "s", "speed": 2}], path=path, **fixed)
    with pytest.raises(ValueError, match="source_section"):
        results.record("demo", [{"metric": "m", "value": 1, "unit": "s"}], path=path, commit_=None)
    assert path.read_text(encoding="utf-8") == before  # nothing written when a row is bad
    assert re.match(r"^\d+-core ", results.machine()) and results.command()


def test_rows_name_a_commit_and_a_cpu_or_gpu_model(results, render, tmp_path, monkeypatch):
    """A new row without a commit, or whose machine names no CPU or GPU model, is refused; rows
    transcribed from the docs' history may say 'recorded at <hash>' and what was not recorded."""
    row = {"subject": "demo", "metric": "m", "value": 1, "unit": "s", "ratio_to": None,
           "date": dt.date.today().isoformat(), "commit": "abc1234", "machine": "2-core AMD EPYC 9B14, 24 GiB",
           "command": "python bench/x.py", "source_section": "S", "notes": None, "current": True, "headline": False}
    assert results.problems(row) == []
    for commit in ("recorded at abc1234", "93125dc–0463bfa", "0123456789abcdef0123456789abcdef01234567"):
        assert results.problems({**row, "commit": commit}) == [], commit
    for commit in (None, "", "unknown", "recorded at", "abc"):
        assert any("commit must be" in p for p in results.problems({**row, "commit": commit})), commit
    for machine in ("16-core Intel(R) Xeon(R) Processor with amx; 1 × NVIDIA H200", "one NVIDIA H200",
                    "8-core Apple M2", "Graviton3, 4 vCPUs"):
        assert results.problems({**row, "machine": machine}) == [], machine
    for machine in ("2-core CPU machine", "CPU machine, under load from other jobs", "a VM",
                    "2-core CPU machine (CPU model not recorded)"):
        assert any("names no CPU or GPU model" in p for p in results.problems({**row, "machine": machine})), machine
    legacy = {**row, "date": "2026-11-30", "machine": "2-core x86-64 CPU machine (CPU model not recorded)"}
    assert results.problems(legacy) == []
    assert results.problems({**legacy, "machine": "2-core x86-64 CPU machine"})
    path = tmp_path / "demo.jsonl"
    with pytest.raises(ValueError, match="commit must be"):
        results.record("demo", [{"metric": "m", "value": 1, "unit": "s"}], path=path, source_section="S",
                       commit_=None, machine_="2-core AMD EPYC")
    with pytest.raises(ValueError, match="names no CPU or GPU model"):
        results.record("demo", [{"metric": "m", "value": 1, "unit": "s"}], path=path, source_section="S",
                       commit_="abc1234", machine_="2-core CPU machine")
    assert not path.exists()
    # Without git (a copy of the tree), the commit comes from K3POST_COMMIT; the machine text from K3POST_MACHINE.
    monkeypatch.setattr(results, "REPO", tmp_path)
    monkeypatch.delenv("K3POST_COMMIT", raising=False)
    assert results.commit() is None
    monkeypatch.setenv("K3POST_COMMIT", "fedcba9")
    monkeypatch.setenv("K3POST_MACHINE", "one NVIDIA H200 (driver 580.159.04)")
    written = results.record("demo", [{"metric": "m", "value": 1, "unit": "s"}], path=path, source_section="S")
    assert (written[0]["commit"], written[0]["machine"]) == ("fedcba9", "one NVIDIA H200 (driver 580.159.04)")
    # K3POST_COMMIT names the code that ran even inside a checkout (a copy may carry a stale .git).
    monkeypatch.setattr(results, "REPO", Path(results.__file__).resolve().parents[1])
    assert results.commit() == "fedcba9"


def test_record_and_say_prints_the_rows_it_could_not_write(results, tmp_path, capsys):
    with pytest.raises(ValueError):
        results.record_and_say("demo", [{"metric": "m", "value": 1.5, "unit": "s"}], False, path=tmp_path / "d.jsonl",
                               source_section="S", commit_=None, machine_="2-core AMD EPYC")
    err = capsys.readouterr().err
    assert "not recorded" in err and '"value": 1.5' in err


def test_the_cross_tokenizer_bench_records_the_metrics_the_table_shows(rows):
    """bench/teachers/cross_tokenizer_arms.py's rows for an arm's final step have the metrics of the
    current table, so that a re-run supersedes them."""
    arms = _module("teachers.cross_tokenizer_arms")
    metrics = [{"arm": "uniform", "step": s, "train_s": t, "kl_per_byte/chat": 0.3171, "kl_per_byte/math": 0.26,
                "fkl_per_byte/chat": 1.444, "fkl_per_byte/math": 0.8268} for s, t in ((0, 0.0), (28, 346.2))]
    out = arms.result_rows(metrics)
    seeded = {r["metric"] for r in rows if r["subject"] == "cross-tokenizer" and r["current"]}
    assert len(out) == 5 and {r["metric"] for r in out} <= seeded
    assert [str(r["value"]) for r in out] == ["0.317", "0.260", "1.444", "0.827", "346"]


def test_an_arm_with_its_own_start_records_step_0_and_its_alignment():
    """The mixed-family arm starts from another student and teachers: its step-0 figures are
    recorded beside its last ones, and the training steps' alignment figures are averaged."""
    arms = _module("teachers.cross_tokenizer_arms")
    kls = {"kl_per_byte/chat": 0.5, "kl_per_byte/math": 0.6, "fkl_per_byte/chat": 0.7, "fkl_per_byte/math": 0.8}
    metrics = [{"step": 0, **{f"eval/{k}": v for k, v in kls.items()}},
               {"step": 1, "time/step_s": 10.0, "align/one_to_one/math": 0.5, "align/signal/math": 0.75},
               {"step": 2, "time/step_s": 12.0, "align/one_to_one/math": 0.7, "align/signal/math": 0.25,
                **{f"eval/{k}": v / 2 for k, v in kls.items()}}]
    out = {r["metric"]: str(r["value"]) for r in arms.result_rows(arms.rows_of("mixed-family", metrics))}
    assert out["arm `mixed-family`: held-out reverse KL per byte, math teacher, step 0"] == "0.600"
    assert out["arm `mixed-family`: held-out reverse KL per byte, math teacher, step 2"] == "0.300"
    assert out["arm `mixed-family`: share of 1:1 chunks, math teacher, training steps"] == "0.600"
    assert out["arm `mixed-family`: share of student tokens with a signal, math teacher, training steps"] == "0.500"
    assert out["arm `mixed-family`: training seconds to step 2"] == "22" and len(out) == 8 + 2 + 1
