"""Render the benchmark figures from `bench/results/*.jsonl` into the docs.

    .venv/bin/python bench/render_tables.py           # rewrite the three blocks below
    .venv/bin/python bench/render_tables.py --check   # exit 1 if a block differs from the data

docs/benchmarks.md, between `<!-- current-figures:start -->` and `<!-- current-figures:end -->`:
per subject the rows whose `current` is not false, grouped by run: a line with the run's date,
commit, machine and command, then a table of its metrics and values (with units). docs/benchmarks-history.md, between `<!-- history:start -->` and
`<!-- history:end -->`: the same of the superseded rows (`"current": false`), newest first.
README.md, between `<!-- headline:start -->` and `<!-- headline:end -->`: the rows marked
`"headline": true`. After README.md changes, docs/index.md (the docs site's home page, generated
from README.md by tools/docs_site.py) is rewritten too. Every subject in the data gets its tables:
SUBJECTS below only orders and titles them. The rows' fields: bench/results.py; a row's command
and source_section are read through `results.moved` (a script recorded at its path before the
scripts moved into subject folders is named where it is now). tests/unit/test_benchmark_tables.py
checks the data and that the blocks are current.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.results
from bench import results  # noqa: E402

REPO = results.REPO
DOCS = REPO / "docs" / "benchmarks.md"
HISTORY = REPO / "docs" / "benchmarks-history.md"
README = REPO / "README.md"
COMMAND = ".venv/bin/python bench/render_tables.py"
DOCS_MARKERS = ("<!-- current-figures:start -->", "<!-- current-figures:end -->")
HISTORY_MARKERS = ("<!-- history:start -->", "<!-- history:end -->")
README_MARKERS = ("<!-- headline:start -->", "<!-- headline:end -->")
RENDERED = f"<!-- Rendered from bench/results/*.jsonl by `{COMMAND}`: edit the data, then re-run it. -->"
COMMITS = ("A run \"recorded at commit\" names the commit that first wrote its figures into these docs (the code "
           "measured is that commit or an earlier one); the others name the commit measured.")

# The tables' order and titles; a subject not named here follows, titled by its name.
SUBJECTS = {
    "quickstart": "Quickstart, `make demo`",
    "quickstart-gpu": "The quickstart on one GPU with vLLM, `k3post run`",
    "opd-vs-trl": "OPD step against TRL GKDTrainer, CPU and GPU",
    "learner-one-forward": "The learner step on the CPU: one decoder forward against two",
    "opd-step-cpu": "OPD step on the CPU, quickstart models: in process and on Ray",
    "opd-vs-alternatives": "OPD against off-policy distillation and TRL GKD at equal wall-clock",
    "behaviour-prompt": "The OPD benchmark's behaviour: which system prompt SmolLM2 follows",
    "opd-step-gpu": "OPD step throughput on H200s",
    "decode-step-gpu": "The sampler's decode step against the memory roofline, one GPU",
    "fp8-gemm-gpu": "The FP8 GEMM against the exact product of the QAT grid, one GPU",
    "learner-sharded-h200": "Learner MFU and memory, sharded learner on one H200",
    "plan-vs-measured": "`k3post plan`'s learner peak against the measured one, one GPU",
    "head-logprobs": "The learner's LM head, eager against compiled, one H200",
    "reference-cost": "Reference cost: grad_buffer against copy and none",
    "fp8-qat": "FP8 QAT: QAT against PTQ, and the QAT step's cost",
    "sft-precision": "bf16-mixed against pure bf16 on an SFT task, one H200",
    "opd-losses": "OPD loss families at a 152k vocabulary: bytes and seconds a step",
    "rollout-engines": "Rollout and scoring engines: HF against vLLM on the CPU",
    "kimi-step-gpu": "Kimi Linear student's step on one H200: fla kernels against the PyTorch fallback",
    "kimi-demo": "Kimi Linear student against dense, and MoE balance",
    "sandbox-cost": "Sandbox cost per call, the current jail",
    "weight-check-cost": "Weight-sync check cost",
    "cross-tokenizer": "Distilling across tokenizers: each arm at its last evaluation",
    "cross-tokenizer-cost": "Distilling across tokenizers: the cost of reading the text",
    "sft-opd-eval": "Evaluation harness: SFT (FP8 QAT) → OPD → eval on SmolLM2",
    "teacher-prefix-cache": "Teacher prompt-prefix cache: teacher phase today vs cached",
    "chat-render": "Rendering prompts with a long system prompt: every row whole vs the head once",
    "speculative-acceptance": "Speculative rollouts: MTP head acceptance on the quickstart, and the cost on a CPU",
    "speculation-gpu": "Speculative rollouts with a trained head, one GPU",
    "vllm-gpu": "vLLM on one GPU: decode against the static sampler, weight sync, sleep mode",
    "teacher-fleet-gpu": "A teacher fleet on one GPU: three vLLM teachers in turn against one resident",
}


def load(folder: Path = results.RESULTS) -> list[dict]:
    """Every row of every results file, checked: raises ValueError listing what is wrong."""
    rows, bad = [], []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{n}"
            try:
                row = results.loads(line)
            except ValueError as e:
                bad.append(f"{where}: not JSON ({e})")
                continue
            if not isinstance(row, dict):
                bad.append(f"{where}: not a JSON object")
                continue
            bad += [f"{where}: {p}" for p in results.problems(row)]
            if row.get("subject") != path.stem:
                bad.append(f"{where}: subject {row.get('subject')!r} in {path.name}")
            rows.append(row)
    seen: dict[tuple, int] = {}
    for row in current(rows):
        key = (row.get("subject"), row.get("metric"))
        seen[key] = seen.get(key, 0) + 1
    bad += [f"{s}: {seen[(s, m)]} current rows for the metric {m!r}; mark the older ones \"current\": false"
            for (s, m) in seen if seen[(s, m)] > 1]
    if bad:
        raise ValueError("bench/results: " + "; ".join(bad))
    return rows


def current(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("current", True) is not False]


def number(value) -> str:
    """A value as the docs write it: digits as recorded, thousands separated, a real minus sign."""
    text = format(value, "f") if isinstance(value, Decimal) else (repr(value) if isinstance(value, float) else str(value))
    sign, text = ("−", text[1:]) if text.startswith("-") else ("", text)
    whole, dot, frac = text.partition(".")
    if len(whole) > 3 and whole.isdigit():
        whole = f"{int(whole):,}"
    return sign + whole + dot + frac


def value_cell(row: dict) -> str:
    unit = row["unit"]
    return number(row["value"]) + (unit if unit in ("×", "%") else f" {unit}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{_cell(text)}{pad}{fence}"


def _metric(row: dict) -> str:
    return row["metric"] + (f"; ratio to {row['ratio_to']}" if row.get("ratio_to") else "")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (as tests/unit/test_docs_links.py computes it)."""
    text = re.sub(r"`|\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _order(subject: str) -> tuple:
    names = list(SUBJECTS)
    return (names.index(subject), "") if subject in SUBJECTS else (len(names), subject)


def commit_cell(row: dict) -> str:
    """The commit as the tables write it: `abc1234`, or recorded at `abc1234` (see results.py)."""
    commit = row.get("commit")
    if not commit:
        return "—"
    prefix = "recorded at "
    return f"{prefix}{_code(commit[len(prefix):])}" if commit.startswith(prefix) else _code(commit)


def run_of(row: dict) -> tuple:
    """What names one measurement run: its date, commit, machine and command."""
    return row["date"], row.get("commit"), row["machine"], row["command"]


def _tables(rows: list[dict], link) -> list[str]:
    """Per subject (in SUBJECTS' order, then any other by name) its rows, grouped by run: a line
    naming the run's date, commit, machine and command, then its metrics and values; `link(section)`
    is the address of a row's source_section."""
    out = []
    for subject in sorted({r["subject"] for r in rows}, key=_order):
        mine = [r for r in rows if r["subject"] == subject]
        sections = list(dict.fromkeys(results.moved(r["source_section"]) for r in mine))
        out += [f"### {SUBJECTS.get(subject, subject)}", "",
                "Details: " + ", ".join(f"[{s}]({link(s)})" for s in sections) + ".", ""]
        for run in dict.fromkeys(run_of(r) for r in mine):
            date, _, machine, command = run
            first = next(r for r in mine if run_of(r) == run)
            commit = commit_cell(first)
            commit = commit.replace("recorded at ", "recorded at commit ", 1) if "recorded at" in commit else f"commit {commit}"
            out += [f"**{date}**, {commit}, {_cell(machine)}: {_code(results.moved(command))}", "",
                    "| metric | value |", "|---|---|"]
            out += [f"| {_cell(_metric(r))} | {value_cell(r)} |" for r in mine if run_of(r) == run]
            out.append("")
    return out


def render_docs_block(rows: list[dict]) -> str:
    out = [DOCS_MARKERS[0], RENDERED, "", "## Current figures", "",
           "The latest measurement of each subject, under the line naming the run it comes from (its date, "
           "commit, machine and command), and the section below that describes it. " + COMMITS, ""]
    out += _tables(current(rows), lambda section: f"#{slug(section)}")
    out.append(DOCS_MARKERS[1])
    return "\n".join(out)


def headings(path: Path) -> set[str]:
    """The headings (## to ######) of a Markdown file, outside code fences."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {m.group(1) for m in re.finditer(r"^#{2,6}\s+(.+?)\s*$", text, re.M)}


def render_history_block(rows: list[dict], docs_headings: set[str]) -> str:
    """The superseded rows, newest first, as tables per subject; a row's section links to
    benchmarks.md where that page has the heading, else to this page."""
    old = sorted((r for r in rows if r.get("current", True) is False), key=lambda r: r["date"], reverse=True)
    out = [HISTORY_MARKERS[0], RENDERED, "", "## Superseded figures", "",
           "Every measurement a later one replaced, newest first, under the line naming the run it comes from "
           "(its date, commit, machine and command). " + COMMITS, ""]
    out += _tables(old, lambda s: f"benchmarks.md#{slug(s)}" if s in docs_headings else f"#{slug(s)}")
    out.append(HISTORY_MARKERS[1])
    return "\n".join(out)


def render_readme_block(rows: list[dict]) -> str:
    heads = sorted((r for r in current(rows) if r.get("headline")), key=lambda r: _order(r["subject"]))
    out = [README_MARKERS[0], RENDERED, "", "| figure | value | measured |", "|---|---|---|"]
    out += [f"| {_cell(_metric(r))} | {value_cell(r)} | {r['date']}, {_cell(r['machine'])} |" for r in heads]
    out += ["", "Each with its command and commit, and every other current figure: "
                "[docs/benchmarks.md](docs/benchmarks.md#current-figures).", README_MARKERS[1]]
    return "\n".join(out)


def block(text: str, markers: tuple[str, str]) -> str | None:
    """The text from the start marker to the end marker, both included (None if either is missing)."""
    start, end = text.find(markers[0]), text.find(markers[1])
    if start < 0 or end < start:
        return None
    return text[start:end + len(markers[1])]


def replace(text: str, markers: tuple[str, str], new: str) -> str:
    old = block(text, markers)
    if old is None:
        raise ValueError(f"the markers {markers[0]} ... {markers[1]} are missing")
    return text.replace(old, new, 1)


def _docs_site():
    spec = importlib.util.spec_from_file_location("docs_site", REPO / "tools" / "docs_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        rows = load()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    targets = ((DOCS, DOCS_MARKERS, render_docs_block(rows)),
               (HISTORY, HISTORY_MARKERS, render_history_block(rows, headings(DOCS))),
               (README, README_MARKERS, render_readme_block(rows)))
    stale = []
    for path, markers, new in targets:
        text = path.read_text(encoding="utf-8")  # read now: others may be editing the docs
        if block(text, markers) is None:
            print(f"{path.relative_to(REPO)}: the markers {markers[0]} ... {markers[1]} are missing", file=sys.stderr)
            return 1
        if block(text, markers) == new:
            continue
        stale.append(path)
        if "--check" not in args:
            path.write_text(replace(text, markers, new), encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    if "--check" in args:
        for path in stale:
            print(f"{path.relative_to(REPO)}: the rendered figures differ from bench/results/*.jsonl; "
                  f"regenerate them with `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    if README in stale:
        _docs_site().main([])
        print("wrote docs/index.md (from README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
