"""Benchmark results as data: `bench/results/<subject>.jsonl`, one JSON object per measurement.

docs/benchmarks.md opens with the current figures of every subject, and README.md with a few
headline ones; both are rendered from these files (`.venv/bin/python bench/render_tables.py`,
checked by tests/unit/test_benchmark_tables.py). Every row has the same fields:

    subject         the file's name: "quickstart", "cross-tokenizer", ...
    metric          what is measured, in words (unique among a subject's current rows)
    value           a number; hand-written rows keep their digits as written ("0.260" stays
                    0.260: the files are read with json's parse_float=Decimal)
    unit            "s", "ms", "GiB", "%", "×", "nats/token", ...
    ratio_to        what a ratio compares against, else null
    date            YYYY-MM-DD of the measurement
    commit          the commit measured (`git rev-parse --short HEAD` when the bench ran; "a–b" for a run
                    over a range of commits), or "recorded at <hash>" where only the commit that first
                    wrote the figure into the docs is known (the code measured is that commit or an
                    earlier one: figures transcribed from the docs' history)
    machine         the machine in words, naming its CPU model or GPU model ("2-core AMD EPYC VM with
                    AVX-512, 24 GiB", "16-core Intel Xeon ...; 1 × NVIDIA H200 (driver 580.159.04, CUDA
                    13.0)"); rows measured before 2026-12-04 may say instead what was not recorded
                    ("CPU model not recorded", "driver not recorded")
    command         the exact command that produced the figure
    source_section  the docs/benchmarks.md heading whose text describes the measurement
    notes           short remarks, else null
    current         false once a later measurement supersedes the row
    headline        true for the few rows README.md's headline table shows

A bench script lives in the folder of its subject (bench/README.md), puts the repository root
on sys.path (it runs as `python bench/<subject>/<script>.py`) and appends its rows at the end of a
run:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    from bench.results import record

    record("my-subject", [{"metric": "step time, median of 5", "value": 0.42, "unit": "s"}],
           source_section="My section (`bench/my_subject/my_bench.py`)")

`record` fills date (today, UTC), commit (the environment variable K3POST_COMMIT when set: a copy
of the tree on another machine may carry a stale .git; else `git rev-parse --short HEAD`), machine (CPU model, vector extensions, cores
and memory; GPUs and driver through torch.cuda when torch is loaded, else nvidia-smi; or the text
K3POST_MACHINE gives) and command (the interpreter and sys.argv), checks every field (a row without
a commit, or whose machine names no CPU or GPU model, is refused), marks the rows
already in the file with the same subject and metric `"current": false`, and appends one line per
row. A row that supersedes a headline row stays a headline unless it says `"headline": false`.
Then re-render the docs with `.venv/bin/python bench/render_tables.py`
(bench/teachers/cross_tokenizer_arms.py is a worked example).

Every bench script that records takes `--no-record` (a trial run: print the table, write nothing;
`add_no_record`), and builds its rows in a plain function of the measured numbers, so the rows'
metric names are tested against the data (tests/unit/test_bench_recording.py). The environment
variable K3POST_BENCH_RESULTS names another folder to write to instead of bench/results (a trial
run kept apart, or a test).

The rows recorded before the scripts moved into their subject folders name them where they were,
`bench/<script>.py`, in their command and source_section. The rows stay as recorded; MOVED maps
each old path to the new one, and render_tables.py and the tests read those two fields through
`moved()`, so that the tables name every script where it is now and link to the heading as it is
now.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import shlex
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
FIELDS = ("subject", "metric", "value", "unit", "ratio_to", "date", "commit", "machine", "command",
          "source_section", "notes", "current", "headline")
_OPTIONAL = {"ratio_to": None, "notes": None, "current": True, "headline": False}
_SUBJECT = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
# A short or full hash, a range of them, or "recorded at <hash>" (the commit that wrote the figure
# into the docs, for figures transcribed from the docs' history).
_COMMIT = re.compile(r"^(?:recorded at )?[0-9a-f]{7,40}(?:[–-][0-9a-f]{7,40})?$")
# A machine text must name what the figure ran on: a CPU model or a GPU model, by vendor or family.
_MODEL = re.compile(r"\b(?:Intel|Xeon|AMD|EPYC|Ryzen|Threadripper|Apple M\d|Neoverse|Graviton\d*|Ampere|"
                    r"Cortex-[AX]\d+|NVIDIA|GeForce|RTX|Tesla|[ABHL]\d{2,3}S?|GH200|GB200|Instinct|MI\d{3}X?|Radeon|"
                    r"Gaudi|TPU)\b")
# Rows measured before this date were transcribed from the docs' history: their machine may say
# what was not recorded ("CPU model not recorded") instead of naming a model.
TRANSCRIBED_BEFORE = "2026-12-04"
# Where each script of bench/ went when the scripts moved into subject folders: the old path
# (`bench/<script>.py`, as the rows recorded before the move name it) -> the path now.
MOVED = {f"bench/{name}.py": f"bench/{folder}/{name}.py" for folder, names in {
    "opd": ("opd_step", "opd_step_gpu", "opd_vs_trl_step", "learner_one_forward", "opd_losses"),
    "alternatives": ("opd_vs_alternatives", "bench_arms", "bench_report", "bench_trl", "behaviour_prompt"),
    "sampling": ("decode_step_gpu", "skinny_gemm_gpu", "speculative_acceptance", "speculation_gpu",
                 "speculation_profile", "acceptance_check"),
    "teachers": ("teacher_prefix_cache", "prefix_cases", "chat_render", "vllm_teacher_recompute",
                 "cross_tokenizer_arms", "cross_tokenizer_cost"),
    "learner": ("learner_memory", "learner_sharded", "head_logprobs", "sft_precision", "plan_vs_measured"),
    "fp8": ("qat_vs_ptq", "qat_step_gpu", "fp8_gemm_error_gpu"),
    "engines": ("vllm_vs_hf", "vllm_hazards_on_gpu", "weight_check_cost", "weight_check_gpu"),
    "demos": ("quickstart_demo", "kimi_demo_report", "kimi_step_gpu"),
    "sandbox": ("sandbox_cost",),
}.items() for name in names}
_SCRIPT = re.compile(r"(?<![\w/.-])bench/\w+\.py\b")


def results_folder() -> Path:
    """Where record() writes: the folder K3POST_BENCH_RESULTS names, else bench/results."""
    return Path(os.environ.get("K3POST_BENCH_RESULTS") or RESULTS)


def moved(text: str) -> str:
    """`text` (a row's command or source_section) with every old script path of MOVED replaced by
    the path now: "python bench/opd_step.py" -> "python bench/opd/opd_step.py"."""
    return _SCRIPT.sub(lambda m: MOVED.get(m.group(0), m.group(0)), text)


def rounded(value: float, digits: int) -> Decimal:
    """`value` with `digits` decimals, kept as written (the table's precision: 0.260 stays 0.260)."""
    return Decimal(f"{value:.{digits}f}")


def add_no_record(parser) -> None:
    """The `--no-record` flag of every recording bench script."""
    parser.add_argument("--no-record", action="store_true",
                        help="print the table only; append nothing to bench/results (a trial run)")


def record_and_say(subject: str, rows: list[dict], no_record: bool, **kwargs) -> list[dict]:
    """record() unless `no_record`, then say where the rows went and how to re-render the docs."""
    if no_record or not rows:
        return []
    try:
        written = record(subject, rows, **kwargs)
    except ValueError:
        # Not written: say the measured rows, so that a long run's figures are not lost with it.
        print(f"not recorded; the rows measured for {subject!r}:", file=sys.stderr)
        for row in rows:
            print(json.dumps(row, ensure_ascii=False, default=str), file=sys.stderr)
        raise
    where = kwargs.get("path") or Path(kwargs.get("results_dir") or results_folder()) / f"{subject}.jsonl"
    print(f"appended {len(written)} rows to {where}; re-render the docs with .venv/bin/python bench/render_tables.py")
    return written


def problems(row: dict) -> list[str]:
    """What is wrong with a row (an empty list if nothing): missing or unknown fields, wrong types."""
    out = []
    missing = [f for f in FIELDS if f not in row and f not in _OPTIONAL]
    unknown = [f for f in row if f not in FIELDS]
    if missing:
        out.append(f"missing fields {missing}")
    if unknown:
        out.append(f"unknown fields {unknown}")

    def text(field: str, nullable: bool = False) -> None:
        value = row.get(field)
        if value is None and (nullable or field not in row):
            return
        if not isinstance(value, str) or not value.strip():
            out.append(f"{field} must be a non-empty string{' or null' if nullable else ''}, not {value!r}")

    for field in ("subject", "metric", "unit", "machine", "command", "source_section"):
        text(field)
    for field in ("ratio_to", "commit", "notes"):
        text(field, nullable=True)
    if isinstance(row.get("subject"), str) and not _SUBJECT.match(row["subject"]):
        out.append(f"subject {row['subject']!r} must be lowercase letters, digits and '-' (a file name)")
    value = row.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        out.append(f"value must be a number, not {value!r}")
    elif not (value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)):
        out.append(f"value must be finite, not {value!r}")
    date = row.get("date")
    try:
        if not (isinstance(date, str) and _DATE.match(date)):
            raise ValueError
        dt.date.fromisoformat(date)
    except ValueError:
        out.append(f"date must be YYYY-MM-DD, not {date!r}")
    for field in ("current", "headline"):
        if field in row and not isinstance(row[field], bool):
            out.append(f"{field} must be true or false, not {row[field]!r}")
    return out + _provenance(row)


def _provenance(row: dict) -> list[str]:
    """A row names the commit it measured and a machine with its CPU or GPU model."""
    out = []
    commit_, machine_, date = row.get("commit"), row.get("machine"), row.get("date")
    if not (isinstance(commit_, str) and _COMMIT.match(commit_)):
        out.append(f"commit must be a commit hash (or 'recorded at <hash>'), not {commit_!r}: run inside the "
                   "git checkout, or set K3POST_COMMIT=<hash> in a copy of the tree without git")
    if isinstance(machine_, str) and machine_.strip() and not _MODEL.search(machine_):
        legacy = isinstance(date, str) and date < TRANSCRIBED_BEFORE and "not recorded" in machine_
        if not legacy:
            out.append(f"machine {machine_!r} names no CPU or GPU model: describe it in K3POST_MACHINE "
                       "(e.g. '2-core AMD EPYC 9B14 with avx512f, 24 GiB')")
    return out


def dumps(row: dict) -> str:
    """One JSON line; a Decimal value is written with its digits as they are (0.260 stays 0.260)."""
    value = row.get("value")
    if isinstance(value, Decimal):
        marker = "\x00value\x00"
        line = json.dumps({**row, "value": marker}, ensure_ascii=False)
        return line.replace(json.dumps(marker), str(value), 1)
    return json.dumps(row, ensure_ascii=False)


def loads(line: str) -> dict:
    return json.loads(line, parse_float=Decimal)


def read(path: Path) -> list[dict]:
    """The rows of one results file (blank lines skipped)."""
    return [loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def commit() -> str | None:
    """K3POST_COMMIT when set (a copy of the tree sent to another machine may carry a stale .git,
    whose HEAD is not the code that ran); else the checkout's HEAD as a short hash; else None."""
    given = os.environ.get("K3POST_COMMIT", "").strip() or None
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _cpu() -> str:
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    import platform  # noqa: PLC0415

    model = model or platform.processor() or platform.machine() or "unknown CPU"
    vector = [name for name, flag in (("avx2", "avx2"), ("avx512f", "avx512f"), ("amx", "amx_tile")) if flag in flags]
    cores = os.cpu_count() or 1
    text = f"{cores}-core {model}" + (f" with {', '.join(vector)}" if vector else "")
    try:
        kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        text += f", {kib / 2**20:.0f} GiB"
    except (OSError, AttributeError):
        pass
    return text


def _gpus() -> str | None:
    names, driver = [], None
    torch = sys.modules.get("torch")  # only if the bench loaded it: importing torch here costs seconds
    if torch is not None and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        driver = f"CUDA {torch.version.cuda}" if torch.version.cuda else None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        lines = [line.split(",") for line in out.stdout.strip().splitlines()] if out.returncode == 0 else []
        if lines:
            names = names or [line[0].strip() for line in lines]
            driver = f"driver {lines[0][1].strip()}" + (f", {driver}" if driver else "")
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    if not names:
        return None
    kinds = {n: names.count(n) for n in names}
    return " + ".join(f"{count} × {name}" for name, count in kinds.items()) + (f" ({driver})" if driver else "")


def machine() -> str:
    """This machine in words: CPU model, vector extensions, cores and memory; GPUs and driver (or
    the text K3POST_MACHINE gives, where /proc/cpuinfo names no model)."""
    if os.environ.get("K3POST_MACHINE", "").strip():
        return os.environ["K3POST_MACHINE"].strip()
    gpus = _gpus()
    return _cpu() + (f"; {gpus}" if gpus else "")


def command() -> str:
    """The command line that is running, as one would type it from the repository root."""
    python = Path(sys.executable)
    argv = list(sys.argv)
    if argv and Path(argv[0]).is_absolute() and Path(argv[0]).resolve().is_relative_to(REPO):
        argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
    exe = str(python.relative_to(REPO)) if python.is_absolute() and python.is_relative_to(REPO) else "python"
    return f"{exe} {shlex.join(argv)}".strip()


def record(subject: str, rows: list[dict], path: Path | str | None = None, *, source_section: str | None = None,
           commit_: str | None = "auto", machine_: str | None = None, command_: str | None = None,
           results_dir: Path | str | None = None) -> list[dict]:
    """Append `rows` (each at least metric, value, unit) to <results_dir>/<subject>.jsonl (or `path`);
    results_dir defaults to results_folder(): K3POST_BENCH_RESULTS, else bench/results.

    Fills subject, date (today, UTC), commit, machine, command and source_section where a row
    does not give them; raises ValueError naming the row and field if any row is invalid (nothing
    is written then). Rows already in the file with the same subject and metric are marked
    `"current": false`. Returns the rows written."""
    folder = Path(results_dir) if results_dir is not None else results_folder()
    path = Path(path) if path is not None else folder / f"{subject}.jsonl"
    filled = {"subject": subject, "date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
              "commit": commit() if commit_ == "auto" else commit_, "machine": machine_ or machine(),
              "command": command_ or command(), "source_section": source_section, **_OPTIONAL}
    out, bad = [], []
    for i, row in enumerate(rows):
        full = {field: row.get(field, filled.get(field)) for field in FIELDS}
        full.update({k: v for k, v in row.items() if k not in full})  # unknown fields: reported below
        if full["subject"] != subject:
            bad.append(f"row {i} ({row.get('metric')!r}): subject {full['subject']!r} is not {subject!r}")
        bad += [f"row {i} ({row.get('metric')!r}): {p}" for p in problems(full)]
        out.append(full)
    metrics = [r["metric"] for r in out]
    bad += [f"metric {m!r} twice in one record() call" for m in sorted({m for m in metrics if metrics.count(m) > 1})]
    if bad:
        raise ValueError(f"bench results for {subject!r} not written: " + "; ".join(bad))
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    new = set(metrics)
    said = {r["metric"] for r in rows if "headline" in r}
    for i, line in enumerate(lines):
        if line.strip():
            old = loads(line)
            if old.get("subject") == subject and old.get("metric") in new and old.get("current", True):
                lines[i] = dumps({**old, "current": False})
                for r in out:  # a headline stays one when it is re-measured
                    if r["metric"] == old["metric"] and old.get("headline") and r["metric"] not in said:
                        r["headline"] = True
    lines += [dumps(r) for r in out]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out
