"""Batched sampling that returns the sampler's own per-token log-probabilities.

`generate` runs on left-padded prompts (what batched decoding needs); its raw logits at every
step give log μ(y_t | s_t) = log_softmax(logits / temperature)[y_t] — the same distribution the
learner models — without a second forward pass. Top-p only truncates what is drawn; the
recorded logprob stays the temperature-scaled full-vocabulary one, so it matches the learner's
(importance ratios are then exactly 1 at equal weights).

Sampling semantics: the recipe's `SamplingParams` define μ; a model's own processors are never
applied. Checkpoints ship a `generation_config.json` (Qwen instruct: repetition_penalty 1.05,
top_k 20, top_p 0.8, temperature 0.7) and `generate` merges every field the caller leaves unset
from it — in transformers 5 even when a `generation_config` is passed, since its `None` fields are
filled from `model.generation_config`. A repetition penalty drawn but not recorded would make
every importance ratio silently off-policy. So `sample_completions` hands `generate` a config
built from the recipe alone (`recipe_generation_config`: temperature, top_p, top_k 0, the stop
and pad ids; everything else transformers' neutral defaults) and, for the call, makes it the
model's too, so nothing is merged in: the tokens are drawn from exactly softmax(top_p(logits/T)).
`load_model` logs one warning naming what a model's generation_config sets that k3post does not
apply (`warn_model_processors`). tests/unit/test_family_parity.py observes the probabilities
each draw is made from.

"Exactly 1" above is up to rounding: `generate`'s decode steps and the learner's whole-sequence
forward use other kernels, in other reduction orders (~1e-7 nats in fp32). With `bitwise`
(sampling.on_policy: bitwise) both run in the batch-invariant mode and log μ is recorded by the
function the learner recomputes log π with (model/batch_invariant.py): then it is exactly 1.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from k3post.model.batch_invariant import batch_invariant, token_logprobs
from k3post.types import Prompt, SamplingParams


logger = logging.getLogger("k3post.model.generation.sampling")

# Generation-config fields that change the distribution `generate` draws from, with their
# neutral values (a field at None or a neutral value changes nothing).
PROCESSOR_FIELDS: dict[str, tuple[Any, ...]] = {
    "temperature": (1.0,), "top_k": (0,), "top_p": (1.0,), "min_p": (0.0,), "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,), "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,),
    "bad_words_ids": (), "sequence_bias": (), "min_length": (0,), "min_new_tokens": (0,), "suppress_tokens": (),
    "begin_suppress_tokens": (), "forced_bos_token_id": (), "forced_eos_token_id": (),
    "exponential_decay_length_penalty": (), "guidance_scale": (1.0,), "watermarking_config": (),
    "renormalize_logits": (False,),
}
_warned: set[str] = set()


def model_processors(generation_config: GenerationConfig | None) -> dict[str, Any]:
    """The distribution-changing fields a model's generation_config sets to a non-neutral value."""
    if generation_config is None:
        return {}
    found = {}
    for name, neutral in PROCESSOR_FIELDS.items():
        value = getattr(generation_config, name, None)
        if value is not None and value != [] and value not in neutral:
            found[name] = value
    return found


def warn_model_processors(generation_config: GenerationConfig | None, where: str) -> None:
    """One warning per model (per process) naming the processors k3post does not apply."""
    found = model_processors(generation_config)
    if found and where not in _warned:
        _warned.add(where)
        settings = ", ".join(f"{name}={value}" for name, value in found.items())
        logger.warning("%s: the model's generation_config sets %s; k3post samples from the recipe's sampling "
                       "parameters only (temperature, top_p) and records log μ of that distribution",
                       where, settings)


def recipe_generation_config(params: SamplingParams, stop_ids: list[int], pad_id: int | None) -> GenerationConfig:
    """The config `generate` samples with: the recipe's temperature and top-p, no top-k, every
    other processor at transformers' neutral default."""
    return GenerationConfig(
        do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0, repetition_penalty=1.0,
        max_new_tokens=params.max_new_tokens, pad_token_id=pad_id, eos_token_id=stop_ids,
        output_logits=True, return_dict_in_generate=True,
    )


@contextmanager
def generating_with(model: PreTrainedModel, config: GenerationConfig) -> Iterator[None]:
    """`config` as the model's generation_config for the call (restored after), so `generate`
    finds nothing of the model's own to merge into it."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved


@dataclass
class Completions:
    completion_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    logprobs_BT: torch.Tensor
    prefill_tokens: int = 0  # prompt tokens (pads included) the prefill ran: each distinct prompt once


def distinct_rows(rows_BP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each distinct row [U] and each row's index among them [B] (first-seen order)."""
    index: dict[tuple[int, ...], int] = {}
    of_row = [index.setdefault(tuple(r), len(index)) for r in rows_BP.tolist()]
    firsts = {u: b for b, u in reversed(list(enumerate(of_row)))}
    return torch.tensor([firsts[u] for u in range(len(index))], dtype=torch.long), torch.tensor(of_row)


def group_prefill(model: PreTrainedModel, input_ids_BP: torch.Tensor, attention_mask_BP: torch.Tensor
                  ) -> tuple[DynamicCache | None, int]:
    """With rows that repeat a prompt (sampling.n > 1): the keys and values of every prompt's
    first P − 1 columns, computed once per distinct prompt and selected for each row, as the
    cache `generate` continues (it then runs the last column and decodes). The layout is
    `generate`'s own: left padding, position ids counted over real tokens (pads at 1). None (and
    `generate` prefills every row) when no prompt repeats or the family keeps a recurrent state."""
    B, P = input_ids_BP.shape
    firsts_U, of_row_B = distinct_rows(input_ids_BP)
    if len(firsts_U) == B or P < 2 or model.config.model_type == "kimi_linear":
        return None, B * P
    device = model.get_output_embeddings().weight.device
    ids_U, mask_U = input_ids_BP[firsts_U, :P - 1].to(device), attention_mask_BP[firsts_U, :P - 1].to(device)
    positions_U = (mask_U.cumsum(-1) - 1).masked_fill(mask_U == 0, 1)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids_U, attention_mask=mask_U, position_ids=positions_U, past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    cache.batch_select_indices(of_row_B.to(device))
    return cache, len(firsts_U) * (P - 1) + B


def chat_of(prompt: Prompt, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The prompt's messages, after `system_prompt` as a system turn unless it has its own."""
    chat = prompt.as_chat()
    if system_prompt is not None and not any(m["role"] == "system" for m in chat):
        chat = [{"role": "system", "content": system_prompt}] + chat
    return chat


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], system_prompt: str | None = None
                   ) -> list[list[int]]:
    """Token ids of each prompt through the tokenizer's chat template, ready for the reply."""
    rendered = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(chat_of(prompt, system_prompt), add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        rendered.append(list(ids))
    return rendered


def eos_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None) -> list[int]:
    """The ids that end a completion: the generation config's EOS ids and the tokenizer's."""
    found = generation_config.eos_token_id if generation_config is not None else None
    ids = found if isinstance(found, list) else [found] if found is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def decode_completions(tokenizer: PreTrainedTokenizerBase, out: Completions) -> list[str]:
    """The text of each completion (up to and including its stop token, special tokens dropped)."""
    return [tokenizer.decode(ids[: int(mask.sum())], skip_special_tokens=True)
            for ids, mask in zip(out.completion_ids_BT, out.loss_mask_BT)]


def completion_mask(completion_ids_BT: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """1 up to and including the first stop token of each row, 0 after it."""
    is_stop = torch.isin(completion_ids_BT, torch.tensor(stop_ids, dtype=torch.long))
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    return (stops_before == 0).float()


@torch.no_grad()
def sample_completions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[list[int]],
                       params: SamplingParams, groups: bool = True, bitwise: bool = False) -> Completions:
    """Sample one completion per prompt; rows stop at EOS and are padded after it. `groups`: a
    prompt that several rows repeat is prefilled once (`group_prefill`). `bitwise`
    (sampling.on_policy: bitwise): the forwards run in the batch-invariant mode and log μ is
    recorded with the learner's own function (model/batch_invariant.py), so the learner's
    recomputation equals it bit for bit."""
    with batch_invariant(model) if bitwise else nullcontext():
        return _sample(model, tokenizer, prompt_ids, params, groups, bitwise)


def _sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[list[int]],
            params: SamplingParams, groups: bool, bitwise: bool) -> Completions:
    pad_id = tokenizer.pad_token_id
    P = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, prompt in enumerate(prompt_ids):
        input_ids[b, P - len(prompt):] = torch.tensor(prompt)
        attention_mask[b, P - len(prompt):] = 1
    stop_ids = eos_ids(tokenizer, model.generation_config)
    cache, prefilled = group_prefill(model, input_ids, attention_mask) if groups else (None, input_ids.numel())
    torch.manual_seed(params.seed)
    device = model.get_output_embeddings().weight.device  # the results come back on the host
    config = recipe_generation_config(params, stop_ids, pad_id)
    with generating_with(model, config):
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=config, **({} if cache is None else {"past_key_values": cache}))
    completion_ids_BT = out.sequences[:, P:]
    if bitwise:
        logits_BTV = torch.stack(out.logits, dim=1)
        logprobs_BT = token_logprobs(logits_BTV.flatten(0, 1), completion_ids_BT.flatten(),
                                     params.temperature).view(completion_ids_BT.shape).cpu()
    else:
        logits_BTV = torch.stack(out.logits, dim=1).float() / params.temperature
        logprobs_BT = torch.log_softmax(logits_BTV, dim=-1).gather(-1, completion_ids_BT[..., None]).squeeze(-1).cpu()
    completion_ids_BT = completion_ids_BT.cpu()
    mask_BT = completion_mask(completion_ids_BT, stop_ids)
    return Completions(completion_ids_BT, mask_BT, logprobs_BT * mask_BT, prefilled)
