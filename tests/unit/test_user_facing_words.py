"""User-facing text speaks to users, not to the team: no work sessions ("session 9", "this
session"), no "this box" for the machine a figure was measured on, and no numbers of our own
issue tracker ("issue 17", "#16"), which users cannot see. A measurement names its date, the
machine in words ("a 2-core x86-64 CPU machine", "one NVIDIA H200") and the command; a reference
to our tracker says what the work was about instead.

Scanned: README.md, docs/**/*.md, recipes/**/*.yaml, bench/**/*.py, k3post/**/*.py,
rewards/**/*.py, tools/**/*.py, the Makefile, and the text files under cluster/ and examples/.

Allowed, explicitly:
- "session" in the technical senses below (SESSION_ALLOWED: exact phrases, nothing broader);
- "box" in the math-format sense below (BOX_ALLOWED); "\\boxed", "sandbox", "bbox", "checkbox"
  never match the machine phrases;
- citations of other projects' public trackers: "<project> #N", "<project> issue #N",
  "<project> PR #N" with the project in PROJECTS ("TRL #4719", "vLLM issue #42019",
  "slime PR #2085"). A bare "issue 17", "#16" or "PR #13949" is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# "session" where it means something other than a work session: the kernel's session keyring
# and setsid's new session (the sandbox), a systemd user session (cgroup delegation).
SESSION_ALLOWED = ("session keyring", "session key", "new session", "user session")
# "box" as the \boxed{} answer format of the math reward (docs/rewards.md, the RL recipe).
BOX_ALLOWED = ("the box rate", "the box instruction")
# Projects whose public trackers the code and docs cite by number.
PROJECTS = ("TRL", "vLLM", "NeMo-RL", "tinker-cookbook", "slime", "miles", "OpenRLHF", "verl",
            "PyTorch", "torch", "transformers", "Ray", "torchao", "fla", "DeepSpeed",
            "Megatron-LM", "SGLang", "accelerate", "peft", "math-verify", "nsjail", "bubblewrap",
            "Triton")

SESSION = re.compile(r"\bsessions?\b", re.I)
BOX = re.compile(r"(?:\b(?:this|the|its|that|same|idle|slower|faster|another|CPU)|-core|['’]s)\s+box(?:es)?\b",
                 re.I)
ISSUE = re.compile(r"\bissues?\s+#?\d+\b", re.I)
HASH = re.compile(r"(?<![\w&#/])#\d+\b")
_PROJECT = "|".join(re.escape(p) for p in PROJECTS)
CITED = re.compile(rf"(?:^|[^\w-])(?:{_PROJECT})\s+(?:(?:PR|pull request|issues?)\s+)?$", re.I)


def scanned() -> list[Path]:
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    files += [*(REPO / "recipes").rglob("*.yaml"), *(REPO / "recipes").rglob("*.yml")]
    for folder in ("bench", "k3post", "rewards", "tools"):
        files += (REPO / folder).rglob("*.py")
    for folder in ("cluster", "examples"):
        files += [p for p in (REPO / folder).rglob("*") if p.is_file()]
    files.append(REPO / "Makefile")
    return sorted(set(files))


def _covered(text: str, start: int, end: int, phrases: tuple[str, ...]) -> bool:
    """Whether an occurrence of one of `phrases` (case-insensitive) covers text[start:end]."""
    low = text.lower()
    for phrase in phrases:
        p = phrase.lower()
        i = low.find(p, max(0, start - len(p)), end + len(p))
        while i != -1 and i <= start:
            if i + len(p) >= end:
                return True
            i = low.find(p, i + 1, end + len(p))
    return False


def findings(rel: str, text: str) -> list[str]:
    found = []

    def report(m: re.Match, why: str) -> None:
        line = text.count("\n", 0, m.start()) + 1
        found.append(f"{rel}:{line}: {' '.join(m.group(0).split())!r} - {why}")

    for m in SESSION.finditer(text):
        if not _covered(text, m.start(), m.end(), SESSION_ALLOWED):
            report(m, "a work session; name the date, commit, machine and command instead")
    for m in BOX.finditer(text):
        if not _covered(text, m.start(), m.end(), BOX_ALLOWED):
            report(m, "say 'machine' and describe it (cores, CPU, GPU)")
    for m in ISSUE.finditer(text):
        if not CITED.search(text[max(0, m.start() - 40):m.start()]):
            report(m, "our issue tracker; say what the work was about, or cite '<project> issue #N'")
    for m in HASH.finditer(text):
        if not CITED.search(text[max(0, m.start() - 60):m.start()]):
            report(m, "a bare tracker number; cite it as '<project> #N' (PROJECTS) or drop it")
    return found


def test_no_sessions_boxes_or_our_issue_numbers_in_user_facing_text():
    files = scanned()
    assert len(files) > 150, "the scan found too few files: the repository layout moved?"
    for folder in ("tools", "examples", "cluster", "bench", "docs"):
        assert any(p.is_relative_to(REPO / folder) for p in files), f"nothing scanned under {folder}/"
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not a text file
        found += findings(str(path.relative_to(REPO)), text)
    assert not found, ("user-facing text speaks of work sessions, 'the box' or our issue numbers "
                       f"({len(found)}):\n" + "\n".join(found))


def test_the_rules_catch_what_they_should_and_allow_the_citations():
    bad = ("measured on session 9's box", "Session 6 (2026-12-02)", "this session", "on this box",
           "on its slower box", "issue 20's benchmark", "(issue 17)", "before issue\n21 wrote",
           "before #16", "PR #13949", "the idle 2-core box", "other sessions' tests")
    for text in bad:
        assert findings("x.md", text), text
    good = ("TRL #4719", "vLLM issue #42019", "NeMo-RL #1827", "tinker-cookbook #796",
            "slime PR #2085", "(miles #2362)", "a fresh session keyring", "new session, env scrubbed",
            "a systemd unit or user session", "the box rate goes up", r"\boxed{5}", "a sandbox",
            "A box holds 3 pens", "colour #1f77b4", "&#8212;", "the 2-core x86-64 CPU machine")
    for text in good:
        assert not findings("x.md", text), text
