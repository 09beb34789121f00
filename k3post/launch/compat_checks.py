"""Start-up checks that a student and its teachers can work together, one clear message each.

On-policy distillation hands the *student's* completion token ids to every teacher, and the
samplers, the learner and vLLM engines each assume something about the models. What must hold,
and why (each check below raises a `UserError` naming the file and the key and saying what was
found and what was expected):

- **Which path a teacher takes** (`teacher_route`): a teacher with the student's tokenizer (the same
  vocabulary, normaliser, pre-tokenizer and merges: model/tokenizers/token_text.py `same_tokenizer`) scores the
  student's ids directly, rendering its own prompt when its chat template differs
  (engine/teachers/teacher.py). Any other teacher reads the student's *text* (engine/teachers/cross_teacher.py): both
  tokenizers must be fast ones whose tokens' bytes k3post can read (`check_cross_teacher`), the
  teacher needs a chat template, and its loss must be sampled_token or a topk_* one on the tokens
  both vocabularies hold (full_vocab compares distributions over one vocabulary). Its end-of-turn
  token pairs with the student's, so the EOS and output-vocabulary checks below are for
  same-tokenizer teachers.
- **A common end token** (`check_eos`): the student's end-of-sequence ids (its tokenizer's EOS
  and its generation_config's) must share at least one id with the teacher's. Otherwise the
  token the student ends on is, to the teacher, an ordinary token in the middle of an answer:
  the teacher rates stopping as unlikely and OPD teaches the student to never stop (runaway
  lengths: a base student with an instruct teacher is the usual case).
  Pad ids are *not* compared: a pad id is never a real input anywhere in k3post (every engine
  pads with its own id under an attention mask, and the loss mask drops positions after the end
  token), so two models padding with different ids agree on every token that counts.
- **Equal output vocabularies where a loss compares distributions** (`check_output_vocab`):
  `config.vocab_size` (the rows of the output head) often exceeds `len(tokenizer)` (padded for
  kernels: Qwen2 has 151,936 rows for 151,665 tokens). The sampled-token loss reads one logprob
  per position and does not care; full_vocab ([B, T, V] or hidden states through the teacher's
  head) and top-k (teacher ids gathered from the student's distribution) compare whole
  distributions over V, so both sides need the same V.
- **Room in a vLLM engine** (`check_max_model_len`): `vllm.max_model_len` must hold the longest
  prompt (as that engine renders it) plus the longest completion (+1 for a teacher, which scores
  by generating one token after prompt + completion).
- **A chat template** (`check_chat_template`): every prompt is rendered through the tokenizer's
  chat template; a tokenizer without one (a base checkpoint) cannot render them.
"""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig

from k3post.config.errors import UserError, located
from k3post.config.loss_schema import TOPK_KINDS
from k3post.config.schema import DistillRecipe, ModelSpec, TeacherSpec
from k3post.data.mixture import PromptMixture
from k3post.data.prompt_length import prompt_tokens
from k3post.model.loading.load import load_tokenizer, model_directory
from k3post.model.generation.sampling import eos_ids
from k3post.model.tokenizers.token_text import backend_spec, decoder_family, describe, same_tokenizer

# Losses that compare the teachers' and the student's whole distributions over the vocabulary.
WHOLE_DISTRIBUTION_LOSSES = ("full_vocab", "topk_forward", "topk_reverse", "topk_jsd")


def check_chat_template(tokenizer, file: str | Path, key: str, who: str) -> None:
    """Prompts are rendered through the chat template: a tokenizer needs one."""
    if not tokenizer.chat_template:
        raise UserError(located(file, f"the {who}'s tokenizer has no chat template, and every prompt is rendered "
                                      f"through one (tokenizer.apply_chat_template); use an instruct checkpoint or add "
                                      f"a `chat_template` to its tokenizer_config.json", key=key))


def renders_own_prompt(student_tokenizer, teacher_tokenizer) -> bool:
    """Whether the teacher must render prompts itself: its chat template differs from the student's."""
    return (teacher_tokenizer.chat_template or "") != (student_tokenizer.chat_template or "")


def teacher_route(student_tokenizer, tokenizer, teacher: TeacherSpec, file: str | Path, key: str) -> str:
    """"same" (the student's ids, the student's template), "own_template" (the student's ids, the
    teacher renders its prompt) or "cross" (another tokenizer: the teacher reads the text)."""
    settings = teacher.cross_tokenizer
    if settings.mode == "always" or not same_tokenizer(student_tokenizer, tokenizer):
        return "cross"
    # Keys away from their defaults (a resolved recipe writes every default out: fields_set is all).
    default = type(settings)()
    misplaced = sorted(k for k in type(settings).model_fields
                       if k != "mode" and getattr(settings, k) != getattr(default, k))
    if misplaced:
        raise UserError(located(file, f"the teacher has the student's tokenizer, so it scores the student's token ids "
                                      f"directly and `cross_tokenizer.{misplaced[0]}` does not apply; remove it, or set "
                                      f"`cross_tokenizer.mode: always` to read the text anyway",
                                key=f"{key}.cross_tokenizer.{misplaced[0]}"))
    return "own_template" if tokenizer.chat_template and renders_own_prompt(student_tokenizer, tokenizer) else "same"


def check_cross_teacher(student_tokenizer, tokenizer, name: str, loss_kind: str, file: str | Path, key: str) -> None:
    """What the cross-tokenizer path needs: fast tokenizers it can read, the teacher's chat template
    (it renders its own prompt), and a loss it can compute across vocabularies: sampled_token, or
    a topk_* on the mapped support (an HF teacher maps its whole distribution, a vLLM teacher its
    top 4·k: engine/teachers/cross_teacher.py)."""
    sides = (("student", student_tokenizer, "student"), (f"teacher '{name}'", tokenizer, f"{key}.model"))
    for who, side, where in sides:
        try:
            decoder_family(backend_spec(side))
        except UserError as err:
            raise UserError(located(file, f"teacher '{name}' has another tokenizer than the student, and the "
                                          f"{who}'s cannot be read as text: {err}", key=where)) from None
    check_chat_template(tokenizer, file, f"{key}.model", f"teacher '{name}'")
    across = f"teacher '{name}' has another tokenizer than the student ({describe(tokenizer)} against " \
             f"{describe(student_tokenizer)})"
    if loss_kind == "full_vocab":
        raise UserError(located(file, f"{across}; full_vocab compares distributions over one vocabulary; across "
                                      f"tokenizers use topk_reverse (or topk_forward / topk_jsd): the same KL on the "
                                      f"tokens both vocabularies hold, at 1:1 chunks, with a large `k` for all of "
                                      f"them, or sampled_token", key=f"{key}.loss.kind", got=loss_kind))


def check_dense_support(dense_support: str, loss_kind: str, file: str | Path, key: str) -> None:
    """`cross_tokenizer.dense_support` chooses the support of a topk_* loss; with any other it is ignored."""
    if dense_support != "exact" and loss_kind not in TOPK_KINDS:
        raise UserError(located(file, f"`cross_tokenizer.dense_support: {dense_support}` sets the support of a topk_* "
                                      f"loss, and this teacher's loss is {loss_kind}; remove it, or give the teacher "
                                      f"a topk_forward / topk_reverse / topk_jsd loss",
                                key=f"{key}.cross_tokenizer.dense_support", got=dense_support))


def check_eos(student_eos: list[int], teacher_eos: list[int], tokenizer, file: str | Path, key: str) -> None:
    """The student's end-of-sequence ids and the teacher's must share an id (module docstring)."""
    if set(student_eos) & set(teacher_eos):
        return

    def named(ids: list[int]) -> str:
        return ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in ids) or "none"

    raise UserError(located(file, f"the student ends its completions with {named(student_eos)} but the teacher ends "
                                  f"with {named(teacher_eos)}: the teacher would score the student's end token as an "
                                  f"ordinary token and teach it never to stop (runaway lengths); expected at least "
                                  f"one common EOS id (tokenizer eos_token / generation_config.json eos_token_id)",
                            key=key))


def check_output_vocab(student_vocab: int, teacher_vocab: int, num_tokens: int, loss_kind: str,
                       file: str | Path, key: str) -> None:
    """Losses over whole distributions need one V on both sides; sampled_token does not."""
    if loss_kind not in WHOLE_DISTRIBUTION_LOSSES or student_vocab == teacher_vocab:
        return
    padding = " (the tokenizers agree; the heads differ only by padding rows)" if min(
        student_vocab, teacher_vocab) >= num_tokens else ""
    raise UserError(located(file, f"loss kind {loss_kind} compares whole distributions over the vocabulary, but the "
                                  f"teacher's output head has {teacher_vocab:,} rows and the student's "
                                  f"{student_vocab:,} (config.vocab_size; {num_tokens:,} tokens){padding}; expected "
                                  f"equal sizes: use `loss: {{kind: sampled_token}}` for this teacher or models with "
                                  f"the same config.vocab_size", key=key))


def check_max_model_len(max_model_len: int, longest_prompt: int, max_new_tokens: int, extra: int,
                        file: str | Path, key: str, who: str) -> None:
    """A vLLM engine must hold prompt + completion (+ `extra`: 1 for a scoring teacher)."""
    needed = longest_prompt + max_new_tokens + extra
    if max_model_len >= needed:
        return
    raise UserError(located(file, f"the {who}'s vLLM engine holds {max_model_len:,} tokens, but the longest prompt "
                                  f"({longest_prompt:,} tokens) plus {max_new_tokens:,} completion tokens"
                                  + (f" plus {extra}" if extra else "") + f" need {needed:,}; expected "
                                  f"max_model_len >= {needed:,} (or a smaller data.max_prompt_tokens / max_new_tokens)",
                            key=key, got=max_model_len))


# -- gathering what the checks need from a recipe (loads tokenizers and configs, no weights) --

def output_vocab_size(spec: ModelSpec, tokenizer) -> int:
    """config.vocab_size of a model (rows of its output head); built models use len(tokenizer)."""
    directory = model_directory(spec)
    if directory is None:
        return len(tokenizer)
    from transformers import AutoConfig  # noqa: PLC0415

    return int(AutoConfig.from_pretrained(directory).get_text_config().vocab_size)


def model_eos_ids(spec: ModelSpec, tokenizer) -> list[int]:
    """The ids that end a completion of this model: what the samplers stop on (model/generation/sampling.py),
    from the source directory's generation_config.json (a layer-pruned model keeps its source's;
    reading it there saves building the pruned copy that `generation_config` would save first)."""
    directory = model_directory(spec)
    found = None
    if directory is not None:
        try:
            found = GenerationConfig.from_pretrained(directory)
        except OSError:  # no generation_config.json: the tokenizer's EOS alone
            found = None
    return eos_ids(tokenizer, found)


def longest_prompt(tokenizer, data: PromptMixture, system_prompt: str | None) -> int:
    """The longest prompt of the run's rows as `tokenizer` renders it (with `system_prompt`)."""
    longest = 0
    for source in data.sources:
        for row in source.rows:
            messages = [tuple(m) for m in row["messages"]]
            if system_prompt is not None and not any(role == "system" for role, _ in messages):
                messages = [("system", system_prompt), *messages]
            longest = max(longest, prompt_tokens(tokenizer, messages))
    return longest


def teacher_tokenizers(recipe) -> dict:
    """Each teacher's tokenizer, loaded once per distinct model (teachers often share weights and
    differ only in their system prompt)."""
    loaded: dict[str, object] = {}
    by_name = {}
    for name, teacher in getattr(recipe, "teachers", {}).items():
        model = teacher.model.model_dump_json()
        if model not in loaded:
            loaded[model] = load_tokenizer(teacher.model)
        by_name[name] = loaded[model]
    return by_name


def check_distill_compat(recipe: DistillRecipe, student_tokenizer, loss_kinds: dict[str, str], file: str | Path,
                         tokenizers: dict | None = None) -> dict[str, str]:
    """Every check of a distillation recipe's student against each teacher (before any data is
    tokenised, so that a missing chat template is named as such). Returns each teacher's route
    (`teacher_route`). `tokenizers`: the teachers' (teacher_tokenizers)."""
    check_chat_template(student_tokenizer, file, "student", "student")
    student_eos = model_eos_ids(recipe.student, student_tokenizer)
    student_vocab = output_vocab_size(recipe.student, student_tokenizer)
    tokenizers = tokenizers if tokenizers is not None else teacher_tokenizers(recipe)
    routes: dict[str, str] = {}
    for name, teacher in recipe.teachers.items():
        key = f"teachers.{name}"
        tokenizer = tokenizers[name]
        routes[name] = teacher_route(student_tokenizer, tokenizer, teacher, file, key)
        if routes[name] == "cross":
            check_cross_teacher(student_tokenizer, tokenizer, name, loss_kinds[name], file, key)
            check_dense_support(teacher.cross_tokenizer.dense_support, loss_kinds[name], file, key)
            continue
        if routes[name] == "own_template" and teacher.engine == "vllm":
            raise UserError(located(file, f"teacher '{name}' has a chat template of its own; a vLLM teacher does not "
                                          f"render prompts itself yet, so it needs the student's chat template "
                                          f"(engine: hf renders its own)", key=f"{key}.engine", got="vllm"))
        if teacher.system_prompt is not None:  # it renders the prompt itself, through its template
            check_chat_template(tokenizer, file, f"{key}.system_prompt", f"teacher '{name}'")
        check_eos(student_eos, model_eos_ids(teacher.model, tokenizer), student_tokenizer, file, f"{key}.model")
        check_output_vocab(student_vocab, output_vocab_size(teacher.model, tokenizer), len(student_tokenizer),
                           loss_kinds[name], file, f"{key}.loss.kind")
    return routes


def check_vllm_lengths(recipe, data: PromptMixture, student_tokenizer, file: str | Path,
                       tokenizers: dict | None = None) -> None:
    """`max_model_len` of every vLLM engine of a distillation or RL recipe against the data
    (`tokenizers`: the teachers', loaded when a vLLM teacher needs one and none were given)."""
    completion = max(recipe.sampling.max_new_tokens, recipe.eval.max_new_tokens)
    if recipe.sampling.engine == "vllm":
        longest = longest_prompt(student_tokenizer, data, recipe.sampling.system_prompt)
        check_max_model_len(recipe.sampling.vllm.max_model_len, longest, completion, 0, file,
                            "sampling.vllm.max_model_len", "sampler")
    for name, teacher in getattr(recipe, "teachers", {}).items():
        if teacher.engine == "vllm":
            tokenizer = tokenizers[name] if tokenizers is not None else load_tokenizer(teacher.model)
            system = teacher.system_prompt if teacher.system_prompt is not None else recipe.sampling.system_prompt
            longest = longest_prompt(tokenizer, data, system)
            check_max_model_len(teacher.vllm.max_model_len, longest, completion, 1, file,
                                f"teachers.{name}.vllm.max_model_len", f"teacher '{name}'")
