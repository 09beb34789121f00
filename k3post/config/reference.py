"""The recipe key reference, docs/reference/recipes.md, generated from the recipe schema.

Every recipe kind (distill, sft, rl, pipeline, eval, and teacher files) is walked from its
pydantic model down through every nested section: sub-models, `X | None` sections, lists of
models (`data.sources[]`), maps of models (`teachers.<name>`) and the variants of a
discriminated union (`tasks[]` by `kind`). Each section is one table whose rows are its keys:
the key path, the type, the default, the allowed values (Literal choices, numeric bounds from
ge/gt/le/lt, lengths, patterns) and the field's own `description`. The output is deterministic.

    .venv/bin/python -m k3post.config.reference > docs/reference/recipes.md
    .venv/bin/python -m k3post.config.reference --check   # exit 1, with a diff summary, when stale
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from k3post.config.eval_schema import EvalRecipe
from k3post.config.kinds import RECIPE_KINDS
from k3post.config.pipeline_schema import PipelineRecipe

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "recipes.md"
COMMAND = ".venv/bin/python -m k3post.config.reference > docs/reference/recipes.md"
NONE = type(None)

# (kind, section title, one line about it): the page's order.
KINDS: tuple[tuple[str, str, str], ...] = (
    ("distill", "Distillation recipes (`kind: distill`)",
     "On-policy distillation: the student samples, its teachers score every token "
     "([recipes.md](../recipes.md#distillation-recipes-kind-distill), [losses.md](../losses.md))."),
    ("sft", "SFT recipes (`kind: sft`)",
     "Supervised fine-tuning on chat examples, loss on the reply tokens only, optionally with FP8 QAT "
     "and LoRA ([learner.md](../learner.md#sft))."),
    ("rl", "RL recipes (`kind: rl`)",
     "RL from rewards: n samples per prompt, group-relative advantages, a clipped policy-gradient "
     "step ([recipes.md](../recipes.md#rl-recipes-kind-rl), [rewards.md](../rewards.md))."),
    ("pipeline", "Pipelines (`kind: pipeline`)",
     "Training and evaluation stages run in order, each stage's final student handed to the next "
     "([recipes.md](../recipes.md#pipelines-kind-pipeline-sft--opd--eval))."),
    ("eval", "Evaluation recipes (`kind: eval`)",
     "Students and teachers evaluated on tasks by `k3post eval` ([eval.md](../eval.md))."),
    ("teacher", "Teacher files (`kind: teacher`)",
     "One teacher per file (recipes/teachers/*.yaml), named by a recipe's `teachers:` map; its keys "
     "are also those of an inline teacher, `teachers.<name>.*`."),
)


def recipe_models() -> dict[str, type[BaseModel]]:
    """Every recipe kind's model, by its `kind:` value."""
    return {**RECIPE_KINDS, "eval": EvalRecipe, "pipeline": PipelineRecipe}


@dataclass(frozen=True)
class Row:
    path: str
    type: str
    default: str
    allowed: str
    description: str


@dataclass
class Section:
    path: str  # "" for the recipe's top level
    model: type[BaseModel]
    variant: str | None = None  # the `kind` of a discriminated union's member
    rows: list[Row] = field(default_factory=list)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _strip(tp: Any) -> Any:
    """The type without its Annotated metadata."""
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _members(tp: Any) -> list[Any]:
    """A union's members (metadata stripped), or the type alone."""
    tp = _strip(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return [_strip(a) for a in get_args(tp)]
    return [tp]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def children(path: str, tp: Any) -> list[tuple[str, type[BaseModel]]]:
    """(key path, model) of every section a field of type `tp` at `path` opens."""
    found: list[tuple[str, type[BaseModel]]] = []
    for member in _members(tp):
        origin, args = get_origin(member), get_args(member)
        if _is_model(member):
            found.append((path, member))
        elif origin is list:
            found += children(f"{path}[]", args[0])
        elif origin is dict:
            found += children(f"{path}.<name>", args[1])
    return found


def variant_of(model: type[BaseModel]) -> str | None:
    """The `kind` a model has as a member of a discriminated union (its one Literal value)."""
    kind = model.model_fields.get("kind")
    values = get_args(kind.annotation) if kind and get_origin(kind.annotation) is Literal else ()
    return str(values[0]) if len(values) == 1 else None


def _plural(name: str) -> str:
    return name if name in ("any", "null") else f"{name}s"


def type_name(tp: Any) -> str:
    """A type as a recipe's author reads it: integer, number or null, list of strings, mapping."""
    members = _members(tp)
    if len(members) > 1:
        names = list(dict.fromkeys(type_name(m) for m in members if m is not NONE))
        return " or ".join(names + (["null"] if NONE in members else []))
    tp = members[0]
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " or ".join(dict.fromkeys(type_name(type(v)) for v in args))
    if origin is list:
        return f"list of {_plural(type_name(args[0]))}"
    if origin is dict:
        return f"map: name → {type_name(args[1])}"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if _is_model(tp):
        return "mapping"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", NONE: "null", Any: "any"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def yaml_value(value: Any) -> str:
    """A JSON-like value written as YAML flow text (quoted only where YAML would read it otherwise)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = value and not re.search(r"[:#{}\[\],&*!|>'\"%@`]", value) and yaml.safe_load(value) == value
        return value if plain else json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel) and value == type(value)():
        return "its keys' defaults"
    return f"`{yaml_value(to_jsonable_python(value))}`"


def _bound(item: Any, noun: str) -> str | None:
    """One constraint in words: `> 0`, `≤ 1`, `at least 1 item`, `non-empty`, `matches …`; `noun`:
    what a length counts (character, item, entry)."""
    for cls, attr, sign in ((at.Gt, "gt", ">"), (at.Ge, "ge", "≥"), (at.Lt, "lt", "<"), (at.Le, "le", "≤")):
        if isinstance(item, cls):
            return f"{sign} {yaml_value(getattr(item, attr))}"
    if isinstance(item, at.MinLen):
        if noun == "character" and item.min_length == 1:
            return "non-empty"
        plural = {"entry": "entries"}.get(noun, f"{noun}s") if item.min_length != 1 else noun
        return f"at least {item.min_length} {plural}"
    pattern = getattr(item, "pattern", None)
    return f"matches `{pattern}`" if isinstance(pattern, str) else None


def _constraints(tp: Any, metadata: tuple = (), prefix: str = "") -> list[str]:
    """The bounds on a value, from the field and from the Annotated types it is made of (PositiveInt);
    the bounds on a list's items prefixed by `each item`."""
    if get_origin(tp) is Annotated:
        return _constraints(get_args(tp)[0], (*metadata, *tp.__metadata__), prefix)
    members = list(get_args(tp)) if get_origin(tp) in (Union, types.UnionType) else [tp]
    kinds = {str: "character", dict: "entry"}
    nouns = {kinds.get(get_origin(_strip(m)) or _strip(m), "item") for m in members if m is not NONE}
    noun = nouns.pop() if len(nouns) == 1 else "item"
    found = [prefix + b for b in (_bound(item, noun) for item in metadata) if b]
    for member in members:
        if get_origin(member) is Annotated:
            found += _constraints(member, (), prefix)
        elif get_origin(member) is list and not prefix:
            found += _constraints(get_args(member)[0], (), "each item ")
    return list(dict.fromkeys(found))


def allowed_text(info: FieldInfo) -> str:
    choices = [v for m in _members(info.annotation) if get_origin(m) is Literal for v in get_args(m)]
    kinds = [variant_of(model) for _, model in children("", info.annotation)]
    parts = [", ".join(f"`{yaml_value(v)}`" for v in choices)] if choices else []
    if len(kinds) > 1 and all(kinds):
        parts.append("by `kind`: " + ", ".join(f"`{k}`" for k in kinds))
    return "; ".join(parts + _constraints(info.annotation, tuple(info.metadata)))


def make_row(path: str, info: FieldInfo, seen_at: str | None) -> Row:
    """One key; `seen_at`: the key path of the enclosing section of the same model (a recursive spec)."""
    kind = type_name(info.annotation)
    if seen_at is not None:
        kind += f" (the keys of `{seen_at}`)" if seen_at else " (the top-level keys)"
    return Row(path, kind, default_text(info), allowed_text(info), " ".join((info.description or "").split()))


def walk(model: type[BaseModel], path: str = "", ancestors: dict | None = None,
         variant: str | None = None) -> list[Section]:
    """The sections of `model` at `path` and of every model below it, depth first in field order.
    A model that is already an enclosing section (a model spec naming another model spec) is not
    expanded again: its row names the enclosing section instead."""
    ancestors = {**(ancestors or {}), model: path}
    section = Section(path, model, variant)
    sections = [section]
    for name, info in sorted(model.model_fields.items(), key=lambda item: item[0] != "kind"):  # kind first
        key = _join(path, name)
        opened = children(key, info.annotation)
        repeated = [ancestors[m] for _, m in opened if m in ancestors]
        section.rows.append(make_row(key, info, repeated[0] if repeated else None))
        members = [m for _, m in opened]
        for child_path, child in opened:
            if child not in ancestors:
                label = variant_of(child) if len(members) > 1 else None
                sections += walk(child, child_path, ancestors, label)
    return sections


PLACEHOLDER = re.compile(r"[\w:./-]*<[\w .-]+>[\w:./<>-]*")  # builtin:<name>, rewards.<module>:<function>


def _cell(text: str) -> str:
    """A table cell: `|` escaped; outside code spans, `<name>` placeholders put in code (HTML would
    swallow them) and `*` escaped (it would start emphasis)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = PLACEHOLDER.sub(lambda m: f"`{m.group(0)}`", parts[i].replace("*", "\\*"))
    return "`".join(parts).replace("|", "\\|")


def render_section(section: Section) -> list[str]:
    title = f"`{section.path}`" if section.path else "Top level"
    if section.variant is not None:
        title += f" with `kind: {section.variant}`"
    lines = [f"### {title}", "", "| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for row in section.rows:
        cells = (f"`{row.path}`", row.type, row.default, row.allowed, row.description)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (as tests/unit/test_docs_links.py computes it)."""
    text = re.sub(r"`|\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


HEADER = """# Recipe key reference

Every key of every recipe kind, generated from the recipe schema (`k3post/config/*.py`): do not edit
this page by hand; after changing the schema, regenerate it with

    {command}

(`--check` says whether it is stale; `tests/unit/test_recipe_reference.py` fails when it is). The
hand-written guide with examples is [recipes.md](../recipes.md).

Key paths: `a.b` is key `b` of section `a`; `a[]` is each entry of the list `a`; `a.<name>` is each
entry of the map `a`, under the name you give it. *required* keys have no default. *its keys'
defaults*: the section may be left out (or written `{{}}`), and each key below takes its default.
`allowed` lists the choices of a key that has them and the bounds a value must keep (`≥ 0`: zero or
more). A list whose entries differ by `kind` has one table per kind.
"""


def render() -> str:
    """The whole page."""
    models = recipe_models()
    lines = HEADER.format(command=COMMAND).splitlines() + [""]
    lines += [f"- [{title}](#{slug(title)})" for _, title, _ in KINDS] + [""]
    for kind, title, intro in KINDS:
        lines += [f"## {title}", "", intro, ""]
        for section in walk(models[kind]):
            lines += render_section(section)
    return "\n".join(lines).rstrip("\n") + "\n"


def all_rows() -> dict[str, list[Row]]:
    """Every row of the page, by recipe kind."""
    models = recipe_models()
    return {kind: [row for s in walk(models[kind]) for row in s.rows] for kind, _, _ in KINDS}


def check(page: Path) -> int:
    """0 when `page` is what the generator writes; else 1, with a summary of the difference."""
    current = page.read_text(encoding="utf-8") if page.is_file() else ""
    expected = render()
    if current == expected:
        print(f"{page}: up to date")
        return 0
    diff = list(difflib.unified_diff(current.splitlines(), expected.splitlines(), f"{page}", "generated",
                                     lineterm="", n=0))
    removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    print(f"{page} is stale: {removed} line(s) differ from the generated page, {added} line(s) are new "
          f"there; regenerate it with\n    {COMMAND}\n", file=sys.stderr)
    print("\n".join(diff[:40] + (["..."] if len(diff) > 40 else [])), file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3post.config.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the generated one")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page --check compares (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.page)
    sys.stdout.buffer.write(render().encode("utf-8"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
