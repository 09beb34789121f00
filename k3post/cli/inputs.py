"""`check_inputs(recipe, file)`: everything a training run reads from the user, checked before any
cluster starts, any weight loads, or anything is written to the run directory.

What `k3post run` does with it (DESIGN "Recipes"; docs/recipes.md "Errors"):

    recipe = load_run_recipe(...)        # the recipe: schema, finite numbers, teacher files
    inputs = check_inputs(recipe, file)  # reward functions and built-in sets named, model directories
                                         # (headers only) and every data row
    prepare_run_dir(recipe, run_dir, …)  # the first write into the run directory
    ... start Ray / the engines ...      # the builders take inputs.rows instead of re-reading files

It opens every data file of the recipe (UTF-8, JSON, rows, chat roles), checks every model
directory the recipe names (config.json, tokenizer, each safetensors header; model/loading/checks.py),
and applies the prompt-length policy with the student's tokenizer (data/prompt_length.py). The
tokenizer is the only thing loaded; it is needed to count tokens the way the samplers will.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from k3post.config.errors import UserError, located
from k3post.config.schema import ModelSpec
from k3post.cli.references import check_references
from k3post.config.text_files import check_readable_file
from k3post.data.prompt_length import LengthReport, length_metrics, limit_prompt_lengths
from k3post.data.sft import as_sft_rows
from k3post.data.sources import HELDOUT_MARK, load_prompt_rows, load_source_rows, prerendered_rows
from k3post.model.loading.checks import check_model_dir


@dataclass
class CheckedInputs:
    """The data of every source, read, checked and length-limited: what the builders train on."""

    rows: dict[str, list[dict]] = field(default_factory=dict)
    lengths: dict[str, LengthReport] = field(default_factory=dict)

    def metrics(self) -> dict[str, int]:
        """data/long_prompts_dropped/<source> and data/long_prompts_truncated/<source>, for step 0."""
        return length_metrics(self.lengths)


def student_of(recipe) -> ModelSpec:
    """The model a training recipe trains (`student`; `model` in SFT recipes of earlier versions)."""
    return getattr(recipe, "student", None) or recipe.model


def model_specs(recipe) -> dict[str, ModelSpec]:
    """Every model spec a recipe names, by its key path (student, teachers.<name>.model, ...)."""
    specs = {"student": student_of(recipe)}
    for name, teacher in (getattr(recipe, "teachers", None) or {}).items():
        specs[f"teachers.{name}.model"] = teacher.model
    pending = list(specs.items())
    while pending:  # nested specs (a Kimi student's sources, a transplant's base), at any depth
        where, spec = pending.pop(0)
        nested = {}
        if spec.kimi is not None:
            nested[f"{where}.kimi.tokenizer_from"] = spec.kimi.tokenizer_from
            if spec.kimi.init_embeddings_from is not None:
                nested[f"{where}.kimi.init_embeddings_from"] = spec.kimi.init_embeddings_from
        if spec.transplant is not None:
            nested[f"{where}.transplant.base"] = spec.transplant.base
            if spec.transplant.tokenizer_from is not None:
                nested[f"{where}.transplant.tokenizer_from"] = spec.transplant.tokenizer_from
        specs.update(nested)
        pending.extend(nested.items())
    return specs


def transplant_files(spec: ModelSpec) -> dict[str, str]:
    """The tokenizer directory and corpus files a transplant spec names, by key (relative to the spec)."""
    if spec.transplant is None:
        return {}
    found = {"transplant.tokenizer": spec.transplant.tokenizer} if spec.transplant.tokenizer else {}
    for i, path in enumerate(spec.transplant.corpus or []):
        found[f"transplant.corpus[{i}]"] = path
    return found


def check_models(recipe) -> None:
    """Each model directory (path:), GGUF file (gguf:), transplant tokenizer directory and corpus
    file, and reward-model directory the recipe names, from headers only."""
    for where, spec in model_specs(recipe).items():
        try:
            if spec.path is not None:
                check_model_dir(Path(spec.path))
            elif spec.gguf is not None and not Path(spec.gguf).is_file():
                raise UserError(located(spec.gguf, "GGUF file not found"))
            for key, path in transplant_files(spec).items():
                if key != "transplant.tokenizer":
                    check_readable_file(Path(path), "corpus file")
                elif not Path(path).is_dir():
                    raise UserError(located(path, "tokenizer directory not found"))
        except UserError as err:
            raise UserError(f"{err}\n  (named by the recipe's {where})") from None
    for name, rm in (getattr(recipe, "reward_models", None) or {}).items():
        if rm.path is not None:
            try:
                check_model_dir(Path(rm.path))
            except UserError as err:
                raise UserError(f"{err}\n  (named by the recipe's reward_models.{name}.path)") from None


def _source_rows(recipe, source) -> tuple[list[dict], bool]:
    """(normalised rows of one data source, whether they are SFT examples)."""
    if recipe.kind == "sft":
        rows = load_prompt_rows(source.examples, Path.cwd())
        return as_sft_rows(rows, source.completion_field, source.examples), True
    return load_source_rows(source.prompts, source.heldout_prompts, Path.cwd()), False


def read_data(recipe) -> dict[str, list[dict]]:
    """Every data source's rows, read and checked (files, JSON, rows, roles); no tokenizer needed."""
    return {source.name: _source_rows(recipe, source)[0] for source in recipe.data.sources}


def prerendered_warning(label: str, rows: list[dict]) -> str | None:
    """A warning when a source's prompts look like already rendered chat templates."""
    found, marker = prerendered_rows(rows)
    if not found:
        return None
    return (f"warning: {label}: {len(found)} of {len(rows)} rows contain chat-template tokens ({marker!r} in row "
            f"{found[0]}): they look already rendered. k3post renders every prompt through the chat template itself, "
            f"so the model would see this markup as the user's text; give the plain text (`prompt`) or the turns "
            f"(`messages`) instead")


def describe_data(recipe) -> list[str]:
    """One line per data source (rows, held-out and training counts, the fields of the rows) and
    the warnings about its prompts, for `k3post validate`. Splits each source as the run will
    (the same held-out rows), so `heldout` >= the row count fails here, not at `run`."""
    from k3post.data.mixture import PromptMixture, PromptSource  # noqa: PLC0415

    lines, sources = [], []
    for source in recipe.data.sources:
        rows, sft = _source_rows(recipe, source)
        label = source.examples if sft else source.prompts
        sources.append(PromptSource(source.name, rows, getattr(source, "teacher", ""), source.weight, source.heldout))
        fields = sorted({k for row in rows for k in row if k not in ("id", HELDOUT_MARK)})
        lines.append((source.name, label, getattr(source, "heldout_prompts", None), len(rows), fields))
    mixture = PromptMixture(sources, recipe.train.seed)  # raises on heldout >= rows, as the run would
    out = []
    for (name, label, heldout_file, count, fields), source in zip(lines, sources):
        held = len(mixture.heldout(name))
        where = f"held out: {held} rows of {heldout_file}" if heldout_file else f"held out: {held}"
        out.append(f"  data {name}: {label}: {count - held} training rows, {where}; fields: {', '.join(fields)}")
        warning = prerendered_warning(label, source.rows)
        if warning:
            out.append("  " + warning)
    per_source = getattr(getattr(recipe, "eval", None), "prompts_per_source", None)
    if per_source is not None and any(per_source > len(mixture.heldout(s.name)) for s in sources):
        out.append(f"  note: eval.prompts_per_source={per_source} is more than some sources hold out; those are "
                   "evaluated on all their held-out rows")
    return out


def check_data(recipe, tokenizer=None) -> CheckedInputs:
    """Read every data source and apply the prompt-length policy (the student's tokenizer counts)."""
    if tokenizer is None:
        from k3post.model.loading.load import load_tokenizer  # noqa: PLC0415 - transformers: only when counting

        tokenizer = load_tokenizer(student_of(recipe))
    data, checked = recipe.data, CheckedInputs()
    for source in data.sources:
        rows, sft = _source_rows(recipe, source)
        label = source.examples if sft else source.prompts
        warning = prerendered_warning(label, rows)
        if warning:
            print(f"k3post: {warning}")
        rows, report = limit_prompt_lengths(rows, tokenizer, data.max_prompt_tokens, data.long_prompts, label, sft)
        checked.rows[source.name], checked.lengths[source.name] = rows, report
        changed = len(report.dropped) + len(report.truncated)
        if changed:
            verb = "dropped" if report.dropped else "truncated on the left"
            print(f"k3post: {label}: {changed} row(s) longer than data.max_prompt_tokens={data.max_prompt_tokens} "
                  f"{verb} (first: row {(report.dropped or report.truncated)[0]})")
    return checked


def check_inputs(recipe, file: str | Path | None = None) -> CheckedInputs:
    """The names the recipe gives (reward functions, built-in prompt sets; cli/references.py),
    models (headers) then data (every row): cheap, no weights loaded, nothing written. `file`: the
    recipe's file, named by the errors about its keys."""
    check_references(recipe, file)
    check_models(recipe)
    return check_data(recipe)
