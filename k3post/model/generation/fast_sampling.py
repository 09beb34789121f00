"""Fast batched sampling on transformers: a static KV cache and a compiled decode step.

Why. `generate` with the default dynamic cache grows every layer's keys and values by
concatenation, re-plans the attention mask and checks its stopping criteria with a host sync at
every token. On a GPU a small student's decode step is a few hundred tiny kernels, so that
Python and allocation overhead *is* the step: on an H200 a 0.40B Qwen2 student made 1,280
tokens/s at batch 32 that way and 7,807 with a static cache and torch.compile
(../shared/REFERENCE.md §1.7).

How. `StaticSampler` owns one `StaticCache` per (batch, cache length) bucket. The cache's
tensors are allocated once and updated in place, so their addresses never change and the decode
step - one token per row, with the pick of its token - can be compiled with the CUDA graphs of
`mode="reduce-overhead"`: the whole forward and the draw replay as one launch, with the
projections that read one input as one GEMM each (model/generation/fused_projections.py). Prompt lengths
are padded on the left up to a bucket (powers of two, at least `min_bucket`, 128 by default:
chat prompts with a system prompt straddle 64), so a run compiles once per batch size instead of
once per prompt length; the masked pad columns cost little beside the step's fixed cost. The
prefill runs eagerly (its shape changes with every bucket and it runs once per call). A decode
step attends the grouped cache without copying it per query head
(model/generation/grouped_decode_attention.py).

What it returns is what `model/generation/sampling.py` returns: completion ids, loss mask, and
log μ(y_t) = log_softmax(logits / temperature)[y_t] over the full vocabulary, taken from the
logits that drew the token - no second forward. Top-p only truncates what is drawn. The
semantics are the plain path's: the recipe's temperature and top-p only, none of the model's
generation_config processors (this engine never reads them), and the logits are the model's own
forward's (a family's soft-cap or logit scale included, as the learner applies them).

Equal to the plain path. The layout is the one `generate` uses (left padding, position ids
from the mask), the draw on a CPU is `torch.multinomial` on the same probabilities, and the
seed is set the same way, so on a CPU the tokens and logprobs equal `sample_completions`
(tests/unit/test_fast_sampling.py). On a GPU the draw is an exponential race
(argmax p / E, E ~ Exp(1), which picks i with probability p_i) because multinomial can sync
the host; the samples then follow the same distribution but not the same random stream.

Speculative rounds (`draft.speculate`) run over caches of this layout in model/generation/fast_speculation.py.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from k3post.algo.token_draws import draw, top_p_filter
from k3post.model.batch_invariant import batch_invariant, token_logprobs
from k3post.model.generation.fused_projections import fuse_projections, step_compile_options
from k3post.model.generation.graphed_step import GraphedStep
from k3post.model.generation.grouped_decode_attention import use_grouped_decode_attention
from k3post.model.generation.sampling import Completions, completion_mask, distinct_rows
from k3post.types import SamplingParams

# How often (in decode steps) the loop asks whether every row has stopped: each ask is a
# device→host sync, which would otherwise stall the GPU queue at every token.
STOP_CHECK_EVERY = 32
# Compiled decode steps one process may hold: (batch size, prompt bucket, cache length) shapes.
COMPILED_SHAPES = 64


def prompt_bucket(length: int, min_bucket: int) -> int:
    """The padded prompt length: the smallest power of two ≥ length, and at least min_bucket."""
    bucket = max(1, min_bucket)
    while bucket < length:
        bucket *= 2
    return bucket


def pick_tokens(logits_BV: torch.Tensor, params: SamplingParams, greedy: bool = False, bitwise: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, log μ(token)) per row from one step's raw logits; `bitwise`: log μ by the learner's
    own function (model/batch_invariant.py: `token_logprobs`), inside the batch-invariant mode."""
    scores_BV = logits_BV.float() / params.temperature
    if greedy:
        tokens_B = torch.argmax(scores_BV, dim=-1)
    else:
        # On a CPU the draw generate makes (same seed, same tokens); elsewhere no host sync.
        tokens_B = draw(torch.softmax(top_p_filter(scores_BV, params.top_p), dim=-1))
    if bitwise:
        return tokens_B, token_logprobs(logits_BV, tokens_B, params.temperature)
    return tokens_B, torch.log_softmax(scores_BV, dim=-1).gather(-1, tokens_B[:, None]).squeeze(-1)


class StaticSampler:
    """Samples completions of `model` with static KV caches; `compile=True` compiles the decode
    step with CUDA graphs (only on a CUDA device: elsewhere it runs eagerly).

    `bitwise` (sampling.on_policy: bitwise): prefill and decode run in the batch-invariant mode
    and log μ is recorded with the learner's own function, so the learner recomputes it bit for
    bit (model/batch_invariant.py). The padded prompt columns are no key of any query there (the
    mode's attention gathers each query's valid keys), and the projections stay unfused: a fused
    q/k/v GEMM is another shape, whose kernel may add in another order. `compile` then does not
    call torch.compile (it would fuse and reorder the kernels): on a GPU the eager step is
    recorded as a CUDA graph instead, its kernels unchanged (model/generation/graphed_step.py;
    built, not yet run on a GPU).

    Not thread-safe, and CUDA graphs belong to the thread that recorded them: call it from one
    thread (engine/samplers/fast_sampler.py gives it a worker thread of its own)."""

    def __init__(self, model: PreTrainedModel, pad_id: int, stop_ids: list[int], compile: bool = False,
                 min_bucket: int = 128, grouped_attention: bool = True, bitwise: bool = False):
        self.model, self.pad_id, self.stop_ids, self.min_bucket = model, pad_id, stop_ids, min_bucket
        self.device = model.get_output_embeddings().weight.device
        self.bitwise = bitwise  # sampling.on_policy: bitwise (the class docstring)
        on_gpu = compile and self.device.type == "cuda"
        self.graphs = on_gpu and bitwise  # the mode's eager step recorded as a CUDA graph, not torch.compile'd
        self.compiled = on_gpu and not bitwise
        if grouped_attention:  # decode steps read the grouped cache as it lies (no repeat_kv copies)
            use_grouped_decode_attention(model)
        if self.compiled:
            # One graph per (batch, bucket) is the design; dynamo's default limit (8) would send
            # the ninth such shape, silently, to eager Python.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_SHAPES)
            fuse_projections(model)  # q/k/v and gate/up as one GEMM each in the compiled steps
        self._caches: dict[tuple[int, int], StaticCache] = {}
        self._step = (torch.compile(self._step_eager, dynamic=False, options=step_compile_options())
                      if self.compiled else GraphedStep(self._step_eager) if self.graphs else self._step_eager)

    def _cache(self, batch: int, length: int) -> StaticCache:
        key = (batch, length)
        if key not in self._caches:
            self._caches[key] = StaticCache(config=self.model.config, max_cache_len=length)
        cache = self._caches[key]
        cache.reset()
        return cache

    def _decode_eager(self, tokens_B1: torch.Tensor, positions_B1: torch.Tensor, mask_BL: torch.Tensor,
                      cache: StaticCache) -> torch.Tensor:
        out = self.model(input_ids=tokens_B1, attention_mask=mask_BL, position_ids=positions_B1,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1]

    def _step_eager(self, tokens_B1: torch.Tensor, positions_B1: torch.Tensor, mask_BL: torch.Tensor,
                    cache: StaticCache, params: SamplingParams, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step and its pick, (token, log μ(token)) per row: compiled, the two are one
        CUDA graph, so the pick's dozen small kernels are not launched one by one from Python."""
        return pick_tokens(self._decode_eager(tokens_B1, positions_B1, mask_BL, cache), params, greedy, self.bitwise)

    def _layout(self, prompt_ids: list[list[int]], max_new_tokens: int):
        """Left-padded prompts [B, P] and the attention mask over the whole cache [B, P + N]."""
        B, N = len(prompt_ids), max_new_tokens
        P = prompt_bucket(max(len(p) for p in prompt_ids), self.min_bucket)
        # One tensor built from Python lists (not a copy per row: batches of 10^5 rows in the tests).
        input_ids_BP = torch.tensor([[self.pad_id] * (P - len(p)) + list(p) for p in prompt_ids], dtype=torch.long)
        lengths_B = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
        mask_BL = torch.ones((B, P + N), dtype=torch.long)  # generated positions are always attended
        mask_BL[:, :P] = (torch.arange(P)[None] >= (P - lengths_B)[:, None]).long()
        # Positions count real tokens only (pads get 1, as generate does); causality over the
        # cache comes from the cache's own write position.
        positions_BP = (mask_BL[:, :P].cumsum(-1) - 1).masked_fill(mask_BL[:, :P] == 0, 1)
        to = self.device
        return input_ids_BP.to(to), positions_BP.to(to), mask_BL.to(to), lengths_B.to(to)

    def _prefill_forward(self, ids_BP, mask, positions_BP, cache, hidden: bool) -> torch.Tensor:
        """The last column's logits [B, V], or (`hidden`) the last hidden states [B, P, H]."""
        if hidden:
            base = getattr(self.model, self.model.base_model_prefix)
            return base(input_ids=ids_BP, attention_mask=mask, position_ids=positions_BP, past_key_values=cache,
                        use_cache=True).last_hidden_state
        return self.model(input_ids=ids_BP, attention_mask=mask, position_ids=positions_BP, past_key_values=cache,
                          use_cache=True, logits_to_keep=1).logits[:, -1]

    def _prefill(self, input_ids_BP: torch.Tensor, positions_BP: torch.Tensor, mask_BL: torch.Tensor,
                 cache: StaticCache, groups: bool, hidden: bool = False) -> tuple[torch.Tensor, int]:
        """The last prompt column's logits [B, V] (or, `hidden`, every column's last hidden state
        [B, P, H]: model/generation/fast_speculation.py) with the prompts' keys and values written into
        `cache`, and the prompt tokens run. With `groups` and a prompt that rows repeat, each
        distinct prompt is run once (eagerly, into a dynamic cache) and its keys and values copied
        into every row's slots of the static cache, whose tensors keep their addresses."""
        B, P = input_ids_BP.shape
        firsts_U, of_row_B = distinct_rows(input_ids_BP.cpu()) if groups else (torch.arange(B), None)
        plain = all(isinstance(layer, StaticLayer) and not layer.is_sliding for layer in cache.layers)
        if len(firsts_U) == B or not plain:
            return self._prefill_forward(input_ids_BP, mask_BL, positions_BP, cache, hidden), B * P
        firsts_U, of_row_B = firsts_U.to(self.device), of_row_B.to(self.device)
        dynamic = DynamicCache()
        out_U = self._prefill_forward(input_ids_BP[firsts_U], mask_BL[firsts_U, :P], positions_BP[firsts_U], dynamic,
                                      hidden)
        for layer, prompt in zip(cache.layers, dynamic.layers):
            keys_B, values_B = prompt.keys.index_select(0, of_row_B), prompt.values.index_select(0, of_row_B)
            if not layer.is_initialized:
                layer.lazy_initialization(keys_B, values_B)
            layer.keys[:, :, :P].copy_(keys_B)
            layer.values[:, :, :P].copy_(values_B)
            layer.cumulative_length.fill_(P)
        return out_U.index_select(0, of_row_B), len(firsts_U) * P

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool = False,
               groups: bool = True) -> Completions:
        """One completion per prompt; rows stop at a stop id and are padded after it. `groups`: a
        prompt that several rows repeat is prefilled once (`_prefill`)."""
        with batch_invariant(self.model) if self.bitwise else nullcontext():
            return self._sample(prompt_ids, params, greedy, groups)

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams, greedy: bool, groups: bool) -> Completions:
        if self.graphs:
            self._step.follow(self.model)  # weights rebound since the graphs were recorded: record again
        N = params.max_new_tokens
        input_ids_BP, positions_BP, mask_BL, lengths_B = self._layout(prompt_ids, N)
        B, P = input_ids_BP.shape
        cache = self._cache(B, P + N)
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        torch.manual_seed(params.seed)
        logits_BV, prefilled = self._prefill(input_ids_BP, positions_BP, mask_BL, cache, groups)
        step_params = replace(params, max_new_tokens=0, seed=0) if self.graphs else params  # a graph per temperature, top-p
        tokens_BN = torch.full((B, N), self.pad_id, dtype=torch.long, device=self.device)
        logprobs_BN = torch.zeros((B, N), dtype=torch.float32, device=self.device)
        running_B = torch.ones(B, dtype=torch.bool, device=self.device)
        for t in range(N):
            if t == 0:
                token_B, logprob_B = pick_tokens(logits_BV, params, greedy, self.bitwise)
            else:
                if self.compiled:  # the last step's outputs are consumed: the graph may reuse them
                    torch.compiler.cudagraph_mark_step_begin()
                token_B, logprob_B = self._step(tokens_BN[:, t - 1:t].clone(), (lengths_B + (t - 1))[:, None],
                                                mask_BL, cache, step_params, greedy)
            tokens_BN[:, t] = torch.where(running_B, token_B, self.pad_id)
            logprobs_BN[:, t] = logprob_B
            running_B &= ~torch.isin(tokens_BN[:, t], stops)
            if (t + 1) % STOP_CHECK_EVERY == 0 and not bool(running_B.any()):
                break
        return self._completions(tokens_BN.cpu(), logprobs_BN.cpu(), prefilled)

    def _completions(self, tokens_BN: torch.Tensor, logprobs_BN: torch.Tensor, prefilled: int = 0) -> Completions:
        """Trim columns after the last row's stop (what generate returns) and mask pads."""
        mask_BN = completion_mask(tokens_BN, self.stop_ids)
        width = max(1, int(mask_BN.sum(dim=1).max()))
        mask_BT = mask_BN[:, :width]
        return Completions(tokens_BN[:, :width].contiguous(), mask_BT, logprobs_BN[:, :width] * mask_BT, prefilled)
