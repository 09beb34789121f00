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

Over many forwards of differently padded batches (the learner's micro-batches), give
`skip_padding=True` instead: the recorder then also reads each forward's `attention_mask` and
keeps only the real tokens' rows as they come. `RouterBalancer` is the learner's use of it:
record the policy forwards of one step, log the balance, move the routing biases.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

from k3post.algo.moe import expert_load, load_balance_metrics, quantile_balancing_bias, sign_bias_update
from k3post.config.errors import UserError
from k3post.model.loading.prune import decoder_layers


def router_modules(model: PreTrainedModel) -> dict[int, KimiLinearTopkRouter]:
    """Decoder layer index -> its MoE router (`layers[i].mlp.gate`); dense layers have none."""
    routers = {}
    for i, layer in enumerate(decoder_layers(model)):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, KimiLinearTopkRouter):
            routers[i] = gate
    return routers


class RouterRecorder:
    """Records every router's choices (and raw scores) for the forwards run inside `with`.

    It can be entered again and again (the records add up: one `with` per micro-batch) until
    `clear()`. With `skip_padding`, a pre-hook on the decoder stack reads each forward's 2-D
    `attention_mask` and the routers' rows of padding positions are dropped when recorded
    (the router flattens [B, L] tokens to B·L rows in the mask's order)."""

    def __init__(self, model: PreTrainedModel, keep_scores: bool = False, skip_padding: bool = False):
        self.routers = router_modules(model)
        self.keep_scores = keep_scores
        self.indices: dict[int, list[torch.Tensor]] = {i: [] for i in self.routers}
        self.scores: dict[int, list[torch.Tensor]] = {i: [] for i in self.routers}
        self._decoder = getattr(model, model.base_model_prefix) if skip_padding else None
        self._mask_N: torch.Tensor | None = None  # the real tokens of the forward running now
        self._handles: list = []

    def clear(self) -> None:
        for recorded in (*self.indices.values(), *self.scores.values()):
            recorded.clear()

    def tokens(self) -> int:
        """Token rows recorded so far (per MoE layer; every layer sees the same tokens)."""
        first = next(iter(self.indices.values()), [])
        return sum(rows.shape[0] for rows in first)

    def _read_mask(self, module: nn.Module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"skip_padding needs a 2-D [B, L] attention_mask, got shape {tuple(mask.shape)}")
        self._mask_N = None if mask is None else mask.reshape(-1).bool()

    def _forget_mask(self, module: nn.Module, args, output) -> None:
        self._mask_N = None

    def _hook(self, layer: int):
        def record(module: nn.Module, args, output) -> None:
            router_logits_NE, _, topk_indices_NK = output
            keep_N = self._mask_N
            if keep_N is not None and keep_N.numel() != topk_indices_NK.shape[0]:
                raise ValueError(f"attention_mask has {keep_N.numel()} entries, router {layer} saw "
                                 f"{topk_indices_NK.shape[0]} tokens")
            self.indices[layer].append(topk_indices_NK.detach() if keep_N is None else topk_indices_NK.detach()[keep_N])
            if self.keep_scores:
                scores_NE = torch.sigmoid(router_logits_NE.detach().float())
                self.scores[layer].append(scores_NE if keep_N is None else scores_NE[keep_N])
        return record

    def __enter__(self) -> "RouterRecorder":
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in self.routers.items()]
        if self._decoder is not None:
            self._handles += [self._decoder.register_forward_pre_hook(self._read_mask, with_kwargs=True),
                              self._decoder.register_forward_hook(self._forget_mask)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._mask_N = None

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

    def metrics(self, token_mask: torch.Tensor | None = None, expert_loads: bool = False) -> dict[str, float]:
        """`moe/<metric>/layer<i>` for every MoE layer, plus the worst layer as `moe/<metric>/max`
        (entropy: `/min`); with `expert_loads`, each expert's share `moe/expert_load/layer<i>/e<j>`."""
        out: dict[str, float] = {}
        for layer, load in self.loads(token_mask).items():
            for name, value in load_balance_metrics(load).items():
                out[f"moe/{name}/layer{layer}"] = value
            if expert_loads:
                out.update({f"moe/expert_load/layer{layer}/e{j}": float(share) for j, share in enumerate(load)})
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


class RouterBalancer:
    """The learner's routing balance: record one step's policy forwards, log, update the biases.

        balancer.start_step()
        for micro_batch in step:
            with balancer.recording():      # the policy forward only: a reference forward
                policy_logprobs(...)        # through the same modules stays outside
        metrics = balancer.step_metrics()   # after the optimizer step:
        balancer.update_biases()

    `bias_update` (MoeSpec): "none" only measures; "sign" moves each router's
    `e_score_correction_bias` by ±sign_step toward the mean load (DeepSeek-V3); "quantile" sets
    it to −β_e, the (1 − k/E) quantile of expert e's scores over the step's real tokens, for
    the next step (Quantile Balancing as we read it; k3post/algo/moe.py). The recorded scores
    and choices are those of the weights *before* the optimizer step, i.e. the ones the step's
    samples were routed with.
    """

    def __init__(self, model: PreTrainedModel, bias_update: str = "none", sign_step: float = 0.01, bins: int = 256,
                 log_expert_load: bool = False):
        if bias_update not in ("none", "sign", "quantile"):
            raise ValueError(f"bias_update must be none, sign or quantile (got {bias_update!r})")
        self.model, self.bias_update, self.sign_step, self.bins = model, bias_update, sign_step, bins
        self.log_expert_load = log_expert_load
        self.recorder = RouterRecorder(model, keep_scores=bias_update == "quantile", skip_padding=True)

    @classmethod
    def for_model(cls, model: PreTrainedModel, bias_update: str = "none", sign_step: float = 0.01, bins: int = 256,
                  log_expert_load: bool = False) -> "RouterBalancer | None":
        """A balancer for a MoE model; None for a model without routers (nothing to record) if
        bias_update is none, a UserError if the recipe asks to balance routers it does not have."""
        if router_modules(model):
            return cls(model, bias_update, sign_step, bins, log_expert_load)
        if bias_update != "none":
            raise UserError(f"moe.bias_update: {bias_update} needs a MoE student with routers "
                            f"(Kimi Linear); {type(model).__name__} has none. Use moe.bias_update: none.")
        return None

    def start_step(self) -> None:
        self.recorder.clear()

    def recording(self) -> RouterRecorder:
        return self.recorder

    def step_metrics(self) -> dict[str, float]:
        """Balance of the step's routed real tokens, the token count, and the spread of the
        biases the step was routed with (`moe/bias_range/max`: max over layers of max − min)."""
        if not self.recorder.tokens():
            return {}
        metrics = self.recorder.metrics(expert_loads=self.log_expert_load)
        metrics["moe/tokens"] = float(self.recorder.tokens())
        metrics["moe/bias_range/max"] = max(float(r.e_score_correction_bias.max() - r.e_score_correction_bias.min())
                                            for r in self.recorder.routers.values())
        return metrics

    def update_biases(self) -> None:
        """Move the routing biases from this step's records (nothing for none or an empty step)."""
        if self.bias_update == "none" or not self.recorder.tokens():
            return
        if self.bias_update == "sign":
            biases = {i: sign_bias_update(self.recorder.routers[i].e_score_correction_bias, load, self.sign_step)
                      for i, load in self.recorder.loads().items()}
        else:
            biases = self.recorder.quantile_biases(num_bins=self.bins)
        set_router_biases(self.model, biases)
