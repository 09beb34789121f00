"""An MTP-1 draft head in DeepSeek-V3's layout, grafted onto the student.

At position t the head sees the student's last hidden state h_t (after its final norm: what the
student's forward returns, and what a serving engine hands a draft) and the embedding of the
next token x_{t+1}, and predicts x_{t+2}:

    g_t = Block( W_proj [ RMSNorm_e(E x_{t+1}) ; RMSNorm_h(h_t) ] )      W_proj: 2d → d
    q(x_{t+2} | x_≤t+1) = softmax( f(Head(FinalNorm(g_t))) / T )

E, FinalNorm and Head are the student's own (used with detached weights: no gradient flows into
the student, and nothing of them is stored twice); f is the family's logit transform. Block starts
as a copy of the student's last decoder block (so g_t begins as "one more layer of the student"),
W_proj from its own seeded generator (drawing it must not move the global RNG the student's run
uses), the two norms at 1. The concatenation order (embedding first) and the names (enorm, hnorm,
eh_proj) are DeepSeek-V3's MTP module's (docs/engines.md: serving it).

Drafting K > 1 tokens chains the head: the draft for x_{t+3} uses g_t in place of h_{t+1} (the
student has not seen x_{t+2} yet), as MTP serving does with one module. Only depth 1 is trained;
deeper drafts are less often accepted, never wrong (algo/speculative.py).

Which hidden state (`draft.hidden`). `final_norm` (above): h_t after the student's final norm.
`residual`: the residual stream h̃_t before it (FinalNorm(h̃_t) = h_t), with the embedding at
position 0 zeroed, and the head's output normalised by FinalNorm itself (the logits are Head of
it; a chained draft feeds that normalised output back):

    g̃_t = FinalNorm( Block( W_proj [ RMSNorm_e(E x_{t+1} · [t > 0]) ; RMSNorm_h(h̃_t) ] ) )
    q(x_{t+2} | x_≤t+1) = softmax( f(Head(g̃_t)) / T )

which is, operation for operation, the MTP layer vLLM's `mtp` method runs for a MiMo checkpoint
(`vllm/model_executor/models/mimo_mtp.py`: token_layernorm, hidden_layernorm, input_proj over
[hidden; embedding], a Qwen2 block, final_layernorm; its target hands it the pre-norm states), so
`k3post export-draft` serves this head exactly (model/export/mimo_export.py). No normalisation of h_t can
be undone, so a `final_norm` head has no exact vLLM layout (docs/engines.md).

Families: any whose base model has `embed_tokens`, `layers`, `norm` and `rotary_emb` (Llama,
Qwen2/3, Mistral, Gemma-style decoders); others are refused at construction (`draft_support`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from torch import nn
from torch.func import functional_call
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from k3post.model.families import model_logit_transform

REQUIRED_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
Hidden = Literal["final_norm", "residual"]


def draft_support(model: PreTrainedModel) -> str | None:
    """None when an MTP head can be grafted onto `model`, else why not (one sentence)."""
    base = getattr(model, model.base_model_prefix, None)
    missing = [name for name in REQUIRED_PARTS if base is None or not hasattr(base, name)]
    if missing:
        return (f"{type(model).__name__} has no {', '.join(missing)} in its base model; the MTP draft head "
                f"supports decoders with {', '.join(REQUIRED_PARTS)} (Llama, Qwen2, Qwen3, Mistral)")
    if len(set(getattr(model.config, "layer_types", None) or ["full_attention"])) > 1:
        return f"{type(model).__name__} mixes attention kinds across layers; the MTP draft head supports one kind"
    return None


def last_block(student: PreTrainedModel) -> nn.Module:
    """The student's last decoder block (the head's block starts as a copy of it)."""
    return getattr(student, student.base_model_prefix).layers[-1]


class RMSNorm(nn.Module):
    """x / rms(x) · w (the head's own enorm and hnorm; float32 inside, as the student's norms)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _detached(module: nn.Module, *args):
    """`module(*args)` with its parameters detached: gradient reaches the inputs, never the module."""
    params = {name: p.detach() for name, p in module.named_parameters()}
    return functional_call(module, params, args)


class MtpHead(nn.Module):
    """The head's own parameters (enorm, hnorm, eh_proj, block); the student's parts by reference."""

    def __init__(self, student: PreTrainedModel, seed: int = 0, block: nn.Module | None = None,
                 dtype: torch.dtype | None = None, hidden: Hidden = "final_norm"):
        """`block`: the copy of the student's last block to start from (default: copied here; a
        sharded learner passes one it gathered, engine/sharded/sharded_draft.py); `dtype`: the head's
        (default the student's output head's); `hidden`: which state of the student it reads."""
        super().__init__()
        reason = draft_support(student)
        if reason is not None:
            raise ValueError(reason)
        config = student.config
        d, eps = config.hidden_size, getattr(config, "rms_norm_eps", 1e-6)
        weight = student.get_output_embeddings().weight
        self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        generator = torch.Generator().manual_seed(seed)
        std = getattr(config, "initializer_range", 0.02)
        with torch.no_grad():
            self.eh_proj.weight.copy_(torch.randn(d, 2 * d, generator=generator) * std)
        self.block = block if block is not None else copy.deepcopy(last_block(student))
        if hasattr(getattr(self.block, "self_attn", None), "layer_idx"):
            self.block.self_attn.layer_idx = 0  # the only layer of the head's own KV cache
        self.block.requires_grad_(True)
        self.to(device=weight.device, dtype=dtype or weight.dtype)
        self.hidden = hidden
        # Lists: not registered submodules (not in state_dict / parameters). The final norm is kept by
        # reference: `residual_stream` swaps the student's own out while the sampler drafts.
        self._student, self._final_norm = [student], [getattr(student, student.base_model_prefix).norm]

    @property
    def student(self) -> PreTrainedModel:
        return self._student[0]

    def reading(self):
        """A context inside which the student's `last_hidden_state` is the state this head reads:
        `residual_stream` for a `residual` head, nothing to change for a `final_norm` one."""
        return residual_stream(self.student) if self.hidden == "residual" else nullcontext()

    def forward(self, h_BLH: torch.Tensor, next_ids_BL: torch.Tensor, position_ids_BL: torch.Tensor,
                attention_mask_BL: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """g at every position: h_BLH[:, t] is h_t, next_ids_BL[:, t] is x_{t+1}, position_ids t's
        position; attention_mask (2D over the cached and new columns, 0 at holes and pads) None for
        unpadded causal rows; `cache`: the head's own KV cache (a DynamicCache) when drafting."""
        base = getattr(self.student, self.student.base_model_prefix)
        e_BLH = _detached(base.embed_tokens, next_ids_BL)
        if self.hidden == "residual":  # as vLLM's MTP layers: no embedding at position 0
            e_BLH = e_BLH.masked_fill((position_ids_BL == 0)[..., None], 0.0)
        x_BLH = self.eh_proj(torch.cat([self.enorm(e_BLH), self.hnorm(h_BLH.detach())], dim=-1))
        mask = create_causal_mask(config=self.student.config, inputs_embeds=x_BLH, attention_mask=attention_mask_BL,
                                  past_key_values=cache, position_ids=position_ids_BL)
        rotary = base.rotary_emb(x_BLH, position_ids_BL)
        out = self.block(x_BLH, attention_mask=mask, position_ids=position_ids_BL, position_embeddings=rotary,
                         past_key_values=cache, use_cache=cache is not None)
        g_BLH = out[0] if isinstance(out, tuple) else out
        return _detached(self._final_norm[0], g_BLH) if self.hidden == "residual" else g_BLH

    def logits(self, g_NH: torch.Tensor) -> torch.Tensor:
        """The student's head and logit transform on g after the student's final norm (which a
        `residual` head's forward applied already), weights detached, float32."""
        head = self.student.get_output_embeddings()
        normed_NH = g_NH if self.hidden == "residual" else _detached(self._final_norm[0], g_NH)
        z = normed_NH @ head.weight.detach().T
        return model_logit_transform(self.student)(z.float())

    def student_logits(self, h_NH: torch.Tensor) -> torch.Tensor:
        """The student's own logits from the hidden states this head reads, float32, no gradient."""
        with torch.no_grad():
            if self.hidden == "residual":
                h_NH = self._final_norm[0](h_NH)
            z = h_NH @ self.student.get_output_embeddings().weight.T
            return model_logit_transform(self.student)(z.float())


@contextmanager
def residual_stream(model: PreTrainedModel):
    """Inside, the base model's `last_hidden_state` is the residual stream before its final norm
    (the norm is swapped for the identity): what a `residual` head reads while drafting. The head
    keeps the norm itself (MtpHead._final_norm)."""
    base = getattr(model, model.base_model_prefix)
    norm = base.norm
    base.norm = nn.Identity()
    try:
        yield
    finally:
        base.norm = norm
