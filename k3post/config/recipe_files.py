"""The pieces every recipe loader shares: reading YAML, validating with located errors, dotted
overrides, teacher files inlined, relative paths made absolute.

config/load.py (training and pipeline recipes) and config/eval_load.py (evaluation recipes)
both build on these; neither imports the other's loader for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3post.config.bounded_yaml import load_yaml_text, read_yaml_file
from k3post.config.errors import RecipeError, located, shorten
from k3post.config.schema import Strict, TeacherSpec


def read_yaml(path: Path, what: str = "recipe") -> dict[str, Any]:
    """Parse one YAML mapping (bounded: config/bounded_yaml.py); any failure is a RecipeError
    naming the file: missing, unreadable, not UTF-8, not YAML, duplicate keys, alias bombs."""
    path = Path(path)
    data = read_yaml_file(path, what)
    if not isinstance(data, dict):
        raise RecipeError(located(path, "expected a mapping of keys at the top level",
                                  got=f"a {type(data).__name__}" if data is not None else "an empty file"))
    return data


def format_validation_error(source: Path, err: ValidationError, prefix: str = "") -> str:
    """One line per problem: `file: key.path: what was expected (got ...)`."""
    lines = []
    for problem in err.errors():
        loc = _format_loc(problem["loc"], prefix)
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see docs/recipes.md for the keys)"
        got = problem.get("input")
        suffix = "" if problem["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {shorten(got)})"
        lines.append(f"{source}: {loc or '<top level>'}: {message}{suffix}")
    return "\n".join(lines)


def _format_loc(loc: tuple, prefix: str) -> str:
    parts = [prefix] if prefix else []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif not str(item).startswith("function-after"):
            parts.append(str(item))
    return ".".join(parts)


def validate(cls: type[Strict], data: dict, source: Path, prefix: str = "") -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(source, err, prefix)) from None


def apply_overrides(data: dict, overrides: list[str], source: Path) -> dict:
    """Set `a.b.c=value` entries (values parsed as YAML: `1e-5`, `true`, `[0, 1]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{item}': expected KEY.PATH=VALUE, e.g. optim.lr=1e-5")
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parents[: i + 1])
                raise RecipeError(f"{source}: override '{item}': {where} is a value, not a section")
            node = child
        try:
            node[leaf] = load_yaml_text(raw, source)
        except RecipeError:  # not YAML on its own (e.g. `a: b` inside): keep the text
            node[leaf] = raw
    return data


def absolute_model_paths(model: dict, base: Path) -> None:
    for key in ("path", "gguf"):
        if isinstance(model.get(key), str):
            model[key] = str((base / model[key]).resolve())
    kimi = model.get("kimi")
    for key in ("tokenizer_from", "init_embeddings_from"):  # nested model specs of a Kimi student
        if isinstance(kimi, dict) and isinstance(kimi.get(key), dict):
            absolute_model_paths(kimi[key], base)
    transplant = model.get("transplant")
    if isinstance(transplant, dict):  # a transplant's base spec, tokenizer directory and corpus files
        for key in ("base", "tokenizer_from"):
            if isinstance(transplant.get(key), dict):
                absolute_model_paths(transplant[key], base)
        if isinstance(transplant.get("tokenizer"), str):
            transplant["tokenizer"] = str((base / transplant["tokenizer"]).resolve())
        if isinstance(transplant.get("corpus"), list):
            transplant["corpus"] = [str((base / p).resolve()) if isinstance(p, str) else p
                                    for p in transplant["corpus"]]


def load_teacher(path: Path) -> dict:
    """Read and validate one teacher file; returns its data with absolute paths."""
    data = read_yaml(path, "teacher file")
    if isinstance(data.get("model"), dict):
        absolute_model_paths(data["model"], path.parent)
    validate(TeacherSpec, data, path)
    return data


def inline_teachers(data: dict, source: Path) -> None:
    teachers = data.get("teachers")
    if not isinstance(teachers, dict):
        return  # the schema reports the missing/ill-typed section
    for name, ref in teachers.items():
        if isinstance(ref, str):
            path = (source.parent / ref).resolve()
            if not path.is_file():
                raise RecipeError(located(source, f"teacher file '{shorten(ref)}' not found (resolved to {path})",
                                          key=f"teachers.{name}"))
            teachers[name] = load_teacher(path)
        elif isinstance(ref, dict) and isinstance(ref.get("model"), dict):
            absolute_model_paths(ref["model"], source.parent)


def absolute_data_paths(data: dict, source: Path) -> None:
    for key in ("student", "model"):
        if isinstance(data.get(key), dict):
            absolute_model_paths(data[key], source.parent)
    reward_models = data.get("reward_models")
    for spec in reward_models.values() if isinstance(reward_models, dict) else []:
        if isinstance(spec, dict) and isinstance(spec.get("path"), str):
            spec["path"] = str((source.parent / spec["path"]).resolve())
    sources = data["data"].get("sources") if isinstance(data.get("data"), dict) else None
    for entry in sources if isinstance(sources, list) else []:  # anything else: the schema says what is wrong
        for key in ("prompts", "examples", "heldout_prompts"):
            value = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(value, str) and not value.startswith("builtin:"):
                entry[key] = str((source.parent / value).resolve())
