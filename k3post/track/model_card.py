"""Model cards: the README.md of every HF-format checkpoint and FP8 export.

A Hugging Face model card is Markdown with YAML front matter. The front matter is what the Hub
and tools read: `base_model`, `library_name`, `pipeline_tag`, `tags`, `datasets`, and
`model-index` (evaluation results: one entry per task/dataset/metric). k3post adds `teachers`
(name and model of each) and `k3post` (recipe kind, step). The body says how the model was made:
the student, the teachers, the data, the loss and optimiser, the resolved recipe inlined, and the
latest held-out evaluation next to the one before training.

The training loop builds the card (loops/common.py `checkpoint`) and hands it to the learner in
the checkpoint's run_state under `model_card`; `k3post export-fp8` writes its own from the
checkpoint's (`fp8_card`); `k3post eval --card` appends its report's table (`append_section`).
"""

from __future__ import annotations

from typing import Any

import yaml

CARD_FILE = "README.md"
# Hub ids of the models k3post ships (config/model_schema.py `builtin`).
BUILTIN_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
_KIND_TAGS = {"distill": ["on-policy-distillation", "reverse-kl"], "sft": ["sft"], "rl": ["reinforcement-learning"]}
_METRIC_NAMES = {"eval/kl/": "reverse KL(student‖teacher {}) on the student's samples, nats/token",
                 "eval/fkl/": "forward KL(teacher {}‖student) on the teacher's samples, nats/token",
                 "eval/response_len/": "mean answer length on {}'s held-out prompts, tokens"}


def model_name(spec: dict | None) -> str | None:
    """What a ModelSpec (as a dict) names: a Hub id for a builtin, else its path/file; None for
    models k3post builds from a config (tiny, kimi)."""
    if not spec:
        return None
    if spec.get("builtin"):
        return BUILTIN_HUB_IDS.get(spec["builtin"], spec["builtin"])
    return spec.get("path") or spec.get("gguf")


def _data_name(spec: str) -> str:
    """`builtin:chat` as it is; a file by its name (absolute paths say where the run was, not what)."""
    return spec if spec.startswith("builtin:") else spec.replace("\\", "/").rsplit("/", 1)[-1]


def _sources(recipe: dict) -> list[dict]:
    return list((recipe.get("data") or {}).get("sources") or [])


def _tags(recipe: dict, extra: tuple[str, ...]) -> list[str]:
    kind = recipe.get("kind", "")
    tags = ["k3post", *_KIND_TAGS.get(kind, [])]
    if kind == "distill" and len(recipe.get("teachers") or {}) > 1:
        tags.append("multi-teacher-distillation")
    if (recipe.get("qat") or {}).get("enabled"):
        tags.append("fp8-qat")
    if (recipe.get("lora") or {}).get("rank"):
        tags.append("lora")
    return tags + [t for t in extra if t not in tags]


def metric_label(key: str) -> str:
    for prefix, text in _METRIC_NAMES.items():
        if key.startswith(prefix):
            return text.format(key[len(prefix):])
    return key


def _model_index(title: str, evaluation: dict[str, float]) -> list[dict]:
    """The Hub's evaluation-results format: one result per held-out metric."""
    results = [{"task": {"type": "text-generation"},
                "dataset": {"name": "held-out prompts of the run", "type": "k3post-heldout"},
                "metrics": [{"type": key, "value": float(f"{float(value):.6g}"), "name": metric_label(key)}]}
               for key, value in evaluation.items()]
    return [{"name": title, "results": results}]


def front_matter(recipe: dict, title: str, step: int | None, evaluation: dict[str, float],
                 extra_tags: tuple[str, ...] = ()) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    base = model_name(recipe.get("student") or recipe.get("model"))
    if base:
        meta["base_model"] = base
    meta.update({"library_name": "transformers", "pipeline_tag": "text-generation",
                 "tags": _tags(recipe, extra_tags)})
    datasets = [_data_name(s.get("prompts") or s.get("examples") or "") for s in _sources(recipe)]
    if datasets:
        meta["datasets"] = datasets
    teachers = recipe.get("teachers") or {}
    if teachers:
        meta["teachers"] = [{"name": n, "model": model_name(t.get("model")) or "built from a config"}
                            for n, t in teachers.items()]
    meta["k3post"] = {"recipe_kind": recipe.get("kind", "unknown"), **({"step": step} if step is not None else {})}
    if evaluation:
        meta["model-index"] = _model_index(title, evaluation)
    return meta


def _how_trained(recipe: dict) -> list[str]:
    lines = ["## How it was trained", ""]
    student = recipe.get("student") or recipe.get("model") or {}
    kept = student.get("keep_layers")
    lines.append(f"- Recipe kind: `{recipe.get('kind', 'unknown')}`"
                 + (f" — {recipe['description']}" if recipe.get("description") else ""))
    lines.append(f"- Student: {model_name(student) or 'built from a config (tiny/kimi)'}"
                 + (f", keeping {len(kept)} layers ({kept})" if kept else ""))
    for name, teacher in (recipe.get("teachers") or {}).items():
        system = teacher.get("system_prompt")
        lines.append(f"- Teacher `{name}`: {model_name(teacher.get('model')) or 'built from a config'}"
                     + (f", system prompt: {system!r}" if system else ""))
    for source in _sources(recipe):
        held = _data_name(source["heldout_prompts"]) if source.get("heldout_prompts") else f"{source.get('heldout')} rows"
        routed = f" → teacher `{source['teacher']}`" if source.get("teacher") else ""
        lines.append(f"- Data `{source.get('name')}`: {_data_name(source.get('prompts') or source.get('examples') or '')}"
                     f"{routed}, held out: {held}")
    loss, optim, train = recipe.get("loss") or {}, recipe.get("optim") or {}, recipe.get("train") or {}
    if loss.get("kind"):
        lines.append(f"- Loss: `{loss['kind']}`")
    if optim:
        lines.append(f"- Optimiser: AdamW, lr {optim.get('lr')}, {train.get('steps')} steps")
    if recipe:
        lines += ["", "<details><summary>The resolved recipe</summary>", "", "```yaml",
                  yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True).rstrip(), "```", "", "</details>"]
    return lines


def evaluation_table(evaluation: dict[str, float], baseline: dict[str, float] | None, step: int | None) -> list[str]:
    """A Markdown table of the held-out metrics, before training (step 0) and now."""
    before = baseline or {}
    head = ["| metric | before training | " + (f"step {step} |" if step is not None else "now |"),
            "|---|---:|---:|"]
    rows = [f"| {metric_label(k)} (`{k}`) | {_num(before.get(k))} | {_num(v)} |" for k, v in evaluation.items()]
    return head + rows


def _num(value: Any) -> str:
    return "–" if value is None else f"{float(value):.4g}"


def model_card(recipe: dict, step: int | None, evaluation: dict[str, float] | None = None,
               baseline: dict[str, float] | None = None, title: str | None = None,
               extra_tags: tuple[str, ...] = ()) -> str:
    """The README.md text of a checkpoint of `recipe` (the resolved recipe as a dict) at `step`,
    with the latest held-out evaluation (`eval/*` metrics) and the one before training."""
    evaluation = {k: v for k, v in (evaluation or {}).items() if k.startswith("eval/") and v is not None}
    title = title or f"k3post {recipe.get('kind', 'model')} checkpoint" + (f", step {step}" if step is not None else "")
    meta = front_matter(recipe, title, step, evaluation, extra_tags)
    body = [f"# {title}", "", "Trained with k3post (post-training after the Kimi K3 recipe).", ""]
    body += _how_trained(recipe)
    if evaluation:
        body += ["", "## Held-out evaluation" + (f" (step {step})" if step is not None else ""), ""]
        body += evaluation_table(evaluation, baseline, step)
    return render(meta, "\n".join(body))


def render(meta: dict, body: str) -> str:
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n" + body.rstrip() + "\n"


def split_card(text: str) -> tuple[dict, str]:
    """(front matter, body) of a card; ({}, text) when it has no front matter."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            return yaml.safe_load(text[4:end]) or {}, text[end + 5:].lstrip("\n")
    return {}, text


def fp8_card(source_card: str | None, source: str, counts: dict[str, int], kept_dtype: str) -> str:
    """The card of an FP8 export: the checkpoint's card (if it had one) with the `fp8` tag, the
    checkpoint as base model, and a section on the quantisation."""
    meta, body = split_card(source_card or "")
    meta = meta or {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": ["k3post"]}
    meta["tags"] = list(dict.fromkeys([*(meta.get("tags") or []), "fp8", "compressed-tensors"]))
    meta.setdefault("base_model", source)
    meta["base_model_relation"] = "quantized"
    section = ["## FP8 export", "",
               f"Exported by `k3post export-fp8` from `{source}`: {counts['fp8_layers']} Linear layers in FP8 e4m3 "
               f"with one scale per output row and dynamic per-token FP8 activations (compressed-tensors, served by "
               f"vLLM); {counts['kept_layers']} layers kept in {kept_dtype}."]
    body = (body or "# FP8 export").rstrip() + "\n\n" + "\n".join(section)
    return render(meta, body)


def append_section(card_text: str, heading: str, lines: list[str]) -> str:
    """The card with a `## heading` section added at the end (front matter kept as it is)."""
    return card_text.rstrip() + "\n\n" + "\n".join([f"## {heading}", "", *lines]) + "\n"
