"""Per-expert load of a Kimi Linear model's MoE layers, read from its routers during a forward.

What is hooked (transformers 5.19, models/kimi_linear/modeling_kimi_linear.py): every sparse
decoder layer has `model.layers[i].mlp.gate`, a `KimiLinearTopkRouter`, whose forward returns
`(router_logits [N, E], topk_weights [N, k], topk_indices [N, k])` for the N = B·L flattened
tokens of the forward. It scores with sigmoid(logits), picks top-k of
`scores + e_score_correction_bias` (DeepSeek-V3's loss-free balancing bias, a buffer), and
mixes the chosen experts with the raw scores. A forward hook records the indices (and the raw
scores, for Quantile Balancing); the maths is in `k3post.algo.moe`.

    with RouterRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    rec.metrics(token_mask=mask)   # {"moe/load_max_over_mean/layer3": 1.4, ...}
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

from k3post.algo.moe import expert_load, load_balance_metrics, quantile_balancing_bias
from k3post.model.prune import decoder_layers


def router_modules(model: PreTrainedModel) -> dict[int, KimiLinearTopkRouter]:
    """Decoder layer index -> its MoE router (`layers[i].mlp.gate`); dense layers have none."""
    routers = {}
    for i, layer in enumerate(decoder_layers(model)):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, KimiLinearTopkRouter):
            routers[i] = gate
    return routers


class RouterRecorder:
    """Records every router's choices (and raw scores) for the forwards run inside `with`."""

    def __init__(self, model: PreTrainedModel, keep_scores: bool = False):
        self.routers = router_modules(model)
        self.keep_scores = keep_scores
        self.indices: dict[int, list[torch.Tensor]] = {i: [] for i in self.routers}
        self.scores: dict[int, list[torch.Tensor]] = {i: [] for i in self.routers}
        self._handles: list = []

    def _hook(self, layer: int):
        def record(module: nn.Module, args, output) -> None:
            router_logits_NE, _, topk_indices_NK = output
            self.indices[layer].append(topk_indices_NK.detach())
            if self.keep_scores:
                self.scores[layer].append(torch.sigmoid(router_logits_NE.detach().float()))
        return record

    def __enter__(self) -> "RouterRecorder":
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in self.routers.items()]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _rows(self, recorded: list[torch.Tensor], token_mask: torch.Tensor | None) -> torch.Tensor:
        rows = torch.cat(recorded)
        if token_mask is None:
            return rows
        mask_N = token_mask.reshape(-1).bool()
        if mask_N.numel() != rows.shape[0]:
            raise ValueError(f"token_mask has {mask_N.numel()} entries, the routers saw {rows.shape[0]} tokens")
        return rows[mask_N]

    def loads(self, token_mask: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        """Layer -> fraction of the routed assignments per expert, [E] (padding left out if the
        [B, L] attention mask of a single recorded forward is given)."""
        return {i: expert_load(self._rows(self.indices[i], token_mask), self.routers[i].num_experts)
                for i in self.routers if self.indices[i]}

    def metrics(self, token_mask: torch.Tensor | None = None) -> dict[str, float]:
        """`moe/<metric>/layer<i>` for every MoE layer, plus the worst layer as `moe/<metric>/max`
        (entropy: `/min`)."""
        out: dict[str, float] = {}
        for layer, load in self.loads(token_mask).items():
            for name, value in load_balance_metrics(load).items():
                out[f"moe/{name}/layer{layer}"] = value
        for name, worst in (("load_max_over_mean", max), ("load_cv", max), ("load_entropy", min)):
            values = [v for k, v in out.items() if k.startswith(f"moe/{name}/layer")]
            if values:
                out[f"moe/{name}/{worst.__name__}"] = worst(values)
        return out

    def quantile_biases(self, token_mask: torch.Tensor | None = None, num_bins: int = 256
                        ) -> dict[int, torch.Tensor]:
        """Quantile Balancing biases (−β per expert, k3post.algo.moe) from the recorded scores;
        needs keep_scores=True. Apply them to the next batch with `set_router_biases`."""
        if not self.keep_scores:
            raise ValueError("RouterRecorder(keep_scores=True) is needed for quantile biases")
        return {i: quantile_balancing_bias(self._rows(self.scores[i], token_mask), self.routers[i].top_k, num_bins)
                for i in self.routers if self.scores[i]}


@torch.no_grad()
def set_router_biases(model: PreTrainedModel, biases: dict[int, torch.Tensor]) -> None:
    """Write per-layer routing biases into the routers' `e_score_correction_bias` buffers (added
    to the scores for the choice of experts only; the mixing weights stay the raw scores)."""
    routers = router_modules(model)
    for layer, bias_E in biases.items():
        buffer = routers[layer].e_score_correction_bias
        buffer.copy_(bias_E.to(buffer.dtype))


@torch.no_grad()
def moe_load_metrics(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
    """One forward of a right- or left-padded batch; balance metrics over its real tokens."""
    with RouterRecorder(model) as recorder:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return recorder.metrics(token_mask=attention_mask)
