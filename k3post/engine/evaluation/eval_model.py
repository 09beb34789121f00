"""The models an evaluation talks to, built by one factory: `build_eval_model(...)`.

Every evaluated model — a student, a checkpoint, an FP8 export, a teacher — is a
`TeacherScorer` underneath (engine/teachers/teacher.py): it samples its own answers, scores given
tokens, and returns full next-token distributions, each through its own view of the prompt (a
teacher's system prompt, its temperature). A student is a teacher without a system prompt at
temperature 1. `HFEvalModel` adds what evaluation needs on top: tokenising reference replies for
NLL, and the one warm-up forward that a transformers-loaded FP8 export needs.

Engines are a name → builder table (`ENGINES`). The vLLM engine plugs in as another entry with
the same methods (sample, score, score_full, encode_examples, vocab_fingerprint).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import torch

from k3post.config.errors import UserError
from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec
from k3post.data.sft import as_sft_rows
from k3post.engine.learner.sft_batch import sft_batch
from k3post.engine.teachers.text_reading import TextReader, TextSide
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # vLLM itself is imported only when an engine is built
from k3post.model.export.fp8_export import export_fp8
from k3post.model.loading.checks import check_model_dir, declares_quantization
from k3post.model.loading.load import load_model
from k3post.types import Prompt, Rollouts


def is_fp8_export(spec: ModelSpec) -> bool:
    """A HF directory whose config declares a quantization scheme (our compressed-tensors export).
    A config.json that is not a JSON object is a UserError naming the file (model/loading/checks.py)."""
    return spec.path is not None and declares_quantization(spec.path)


class HFEvalModel(TeacherScorer):
    """A model under evaluation on the Hugging Face engine."""

    def __init__(self, name: str, spec: TeacherSpec, num_threads: int | None = None):
        super().__init__(name, spec, num_threads)
        if is_fp8_export(spec.model):
            # compressed-tensors sets its layers up on the first forward of the *whole* model;
            # k3post's logprob path calls the decoder directly, and without this forward the FP8
            # weights would reach F.linear unconverted (bench/fp8/qat_vs_ptq.py, docs/learner.md).
            device = self.model.get_input_embeddings().weight.device
            with torch.no_grad():
                self.model(input_ids=torch.tensor([[self.tokenizer.eos_token_id]], device=device))

    def encode_examples(self, examples: list[Prompt], max_tokens: int) -> Rollouts:
        return encode_examples(self.tokenizer, examples, max_tokens)

    def reader_for(self, teacher) -> TextReader:
        return reader_between(self, teacher)


def reader_between(model, teacher) -> TextReader:
    """How `teacher` (another eval model) reads `model`'s text: its tokenizer, its system prompt
    (engine/teachers/text_reading.py). For a per-byte KL between models of different tokenizers."""
    return TextReader(TextSide.of(model.tokenizer, model.spec.model), TextSide.of(teacher.tokenizer, teacher.spec.model),
                      teacher.spec.system_prompt)


def encode_examples(tokenizer, examples: list[Prompt], max_tokens: int) -> Rollouts:
    """Reference replies as Rollouts (prompt ids in the shared view, the reply as the completion),
    so `score` gives their log-probabilities; at most `max_tokens` reply tokens, EOS included."""
    batch = sft_batch(tokenizer, examples, max_tokens)
    # The prompts without the reply: a teacher with a system prompt re-renders them in its view.
    contexts = [Prompt(e.uid, e.source, e.teacher, e.messages[:-1]) for e in examples]
    return Rollouts(contexts, batch.prompt_ids, batch.completion_ids_BT, batch.loss_mask_BT,
                    torch.zeros_like(batch.loss_mask_BT))


def reference_examples(rows: list[dict], completion_field: str, label: str) -> list[Prompt]:
    """NLL rows → chat examples ending in the reply (a missing reply names the file and row)."""
    rows = as_sft_rows(rows, completion_field, label)
    return [Prompt(row["id"], label, "", tuple(tuple(m) for m in row["messages"])) for row in rows]


def _quiet_fp8(spec: ModelSpec):
    """compressed-tensors draws a progress bar on stderr for every FP8 save and load; tqdm was
    imported (by torch) long before we could switch it off, so its stderr is swallowed here."""
    return contextlib.redirect_stderr(io.StringIO()) if is_fp8_export(spec) else contextlib.nullcontext()


def _build_hf(name: str, spec: TeacherSpec, num_threads: int | None) -> HFEvalModel:
    with _quiet_fp8(spec.model):
        return HFEvalModel(name, spec, num_threads)


class VLLMEvalModel(VLLMTeacher):
    """A model under evaluation on vLLM: samples and scores through vLLM; full distributions
    (and the FP8 warm-up forward) from an `HFEvalModel` copy made on first use, on the CPU
    (VLLMTeacher._full: never beside vLLM on its GPU)."""

    full_engine = HFEvalModel

    def encode_examples(self, examples: list[Prompt], max_tokens: int) -> Rollouts:
        return encode_examples(self.tokenizer, examples, max_tokens)

    def reader_for(self, teacher) -> TextReader:
        return reader_between(self, teacher)


def _build_vllm(name: str, spec: TeacherSpec, num_threads: int | None) -> VLLMEvalModel:
    return VLLMEvalModel(name, spec.model_copy(update={"engine": "vllm"}), num_threads)


ENGINES: dict[str, Callable[[str, TeacherSpec, int | None], HFEvalModel | VLLMEvalModel]] = {"hf": _build_hf, "vllm": _build_vllm}


def ensure_fp8_export(source: ModelSpec, out_dir: Path) -> Path:
    """Write `source`'s FP8 (compressed-tensors) export to `out_dir` once; reuse it afterwards."""
    if not (out_dir / "config.json").is_file():
        model, tokenizer = load_model(source)
        with contextlib.redirect_stderr(io.StringIO()):  # compressed-tensors' progress bar
            export_fp8(model, tokenizer, out_dir)
        del model
    return out_dir


def build_eval_model(name: str, spec: TeacherSpec, engine: str = "hf", num_threads: int | None = None,
                     export_from: ModelSpec | None = None, vllm: VllmSpec | None = None) -> HFEvalModel:
    """The model `spec` describes on `engine` (`vllm`: with these engine options). With
    `export_from`, spec.model.path is an FP8 export of that model, written first if it is not
    there yet."""
    if vllm is not None:
        spec = spec.model_copy(update={"vllm": vllm})
    if engine not in ENGINES:
        raise UserError(f"model {name}: engine {engine!r} is not available (engines: {', '.join(ENGINES)})")
    if export_from is not None:
        assert spec.model.path is not None
        ensure_fp8_export(export_from, Path(spec.model.path))
    if spec.model.path is not None:  # config, tokenizer, weight headers: errors that name the file
        check_model_dir(Path(spec.model.path))
    return ENGINES[engine](name, spec, num_threads)
