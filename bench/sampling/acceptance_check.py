"""What acceptance length a head's teacher-forced acceptance predicts, against what the engines realise
(bench/sampling/speculation_gpu.py --check-acceptance).

A held-out acceptance α = mean Σ_v min(p, q) over positions is not the acceptance length a rollout
gets, even at K = 1 where a round emits 2 tokens with probability a (the draft accepted) and 1
otherwise. Rounds do not sample positions evenly: a round that accepts skips the next position, so
easy stretches take fewer rounds a token than hard ones, and the rounds' mean acceptance sits below
the positions' mean. With a_k the acceptance of the draft of completion token k + 1 (its context:
tokens 0..k emitted), the expected rounds to finish a row of n tokens, the first drawn by the
prefill, satisfy

    E(k) = 1 + a_k E(k + 2) + (1 − a_k) E(k + 1),   E(k) = 0 for k ≥ n − 1,

and the predicted acceptance length is Σ (n − 1) / Σ E(0) over the rows. It equals 1 + α when every
a_k is the same, and falls below it the more a_k varies (a row of long stretches of a = 1 and of
a = 0 has α = 0.5 but ℓ = 4/3: a round for two tokens in the first, for one in the second). The
recursion treats each round's accept coin as independent of which token it emits; the real rule
correlates the two (an accepted token is drawn from min(p, q), a rejected one from the residual),
so the prediction is close, not exact.

`check` sets, on the same held-out prompts: the positions' α and 1 + α, the predicted ℓ, and the ℓ
each K = 1 engine realises, the compiled static engine (CUDA graphs) beside the eager one. An
engine whose realised ℓ falls clearly below the prediction, or below its eager twin, loses
acceptance in its loop (a head fed other inputs than in training), which no exactness test sees:
the samples stay exact whatever the draft.
"""

from __future__ import annotations

import torch


def expected_rounds(accept_N: list[float]) -> float:
    """E(0) of the recursion above for one row: `accept_N[k]` is a_k, k = 0..n − 2 (n − 1 drafts
    can be made for a row of n tokens)."""
    n = len(accept_N) + 1
    later = [0.0] * (n + 1)  # later[k] = E(k); E(n − 1) = E(n) = 0
    for k in range(n - 2, -1, -1):
        a = accept_N[k]
        later[k] = 1.0 + a * later[k + 2] + (1.0 - a) * later[k + 1]
    return later[0]


def predicted_length(rows: list[list[float]]) -> float:
    """Σ (n − 1) / Σ E(0): the K = 1 acceptance length the rows' position acceptances predict."""
    emitted = sum(len(a) for a in rows)
    rounds = sum(expected_rounds(a) for a in rows)
    return emitted / rounds if rounds else 1.0


@torch.no_grad()
def position_acceptance(model, head, prompts: list[list[int]], completions, temperature: float, pad_id: int,
                        chunk: int = 8) -> list[list[float]]:
    """Per row, Σ_v min(p, q) at each draft of its completion (a_0..a_{n−2}), teacher-forced: the
    head on the student's hidden states of the row, as the learner trains it (engine/learner/draft_trainer.py)."""
    from k3post.engine.learner.draft_trainer import draft_positions  # noqa: PLC0415
    from k3post.model.scoring.logprobs import hidden_states, pack_sequences  # noqa: PLC0415

    device = model.get_output_embeddings().weight.device
    found: list[list[float]] = []
    for s in range(0, len(prompts), chunk):
        prompts_b = prompts[s:s + chunk]
        mask_BT = completions.loss_mask_BT[s:s + chunk].cpu()
        ids_BL, mask_BL, _ = pack_sequences(prompts_b, completions.completion_ids_BT[s:s + chunk].cpu(),
                                            mask_BT, pad_id)
        ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
        with head.reading():  # a `residual` head reads the states before the final norm
            h_BLH = hidden_states(model, ids_BL, mask_BL)
        B, L = ids_BL.shape
        g_BLH = head(h_BLH[:, :-1], ids_BL[:, 1:], torch.arange(L - 1, device=device)[None].expand(B, -1))
        rows_N, cols_N = draft_positions([len(p) for p in prompts_b], mask_BT)
        rows_N, cols_N = rows_N.to(device), cols_N.to(device)
        p_NV = torch.softmax(head.student_logits(h_BLH[rows_N, cols_N + 1]) / temperature, -1)
        q_NV = torch.softmax(head.logits(g_BLH[rows_N, cols_N]) / temperature, -1)
        a_N = torch.minimum(p_NV, q_NV).sum(-1).cpu()
        found += [a_N[rows_N.cpu() == b].tolist() for b in range(B)]  # draft_positions lists a row's in order
    return found


def speculative_pass(decoder, calls: list, params):
    """(the rows' completions, tokens a row gets per round) of one pass of `calls`."""
    from k3post.model.generation.sampling import Completions  # noqa: PLC0415

    outs, emitted, rounds = [], 0, 0
    for call in calls:
        out, stats = decoder.sample(call, params)
        outs.append(out)
        emitted, rounds = emitted + stats.emitted, rounds + stats.row_rounds
    width = max(o.completion_ids_BT.shape[1] for o in outs)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731 (masked out)
    samples = Completions(torch.cat([pad(o.completion_ids_BT) for o in outs]),
                          torch.cat([pad(o.loss_mask_BT) for o in outs]), None)
    return samples, emitted / max(rounds, 1)


def check(model, tokenizer, state: dict, rows: list, batch: int, args, rec, ks: tuple[int, ...] = (1,)) -> dict:
    """The figures of the module docstring at K = 1, and the realised ℓ at each K of `ks`, over
    `rows` in calls of `batch` (model: the rollouts' student). The prediction is made on the eager
    engine's own samples (distributed as the student's, whatever the draft) with that engine's
    head, so it and that engine's realised ℓ share their rows."""
    from bench.sampling.speculative_acceptance import decoder  # noqa: PLC0415

    from k3post.types import SamplingParams  # noqa: PLC0415

    T, calls = rec.sampling.temperature, [rows[i:i + batch] for i in range(0, len(rows), batch)]
    params = SamplingParams(args.new_tokens, T, 1.0, seed=11)
    engine = lambda K, compile_: decoder(model, tokenizer, state, K, static=True, min_bucket=256,  # noqa: E731
                                         compile=compile_, hidden=rec.draft.hidden)
    eager_k1 = engine(1, False)
    samples, eager = speculative_pass(eager_k1, calls, params)
    a_rows = position_acceptance(model, eager_k1.head, rows, samples, T, tokenizer.pad_token_id)
    alpha = sum(map(sum, a_rows)) / max(sum(map(len, a_rows)), 1)
    found = {"alpha": alpha, "predicted": predicted_length(a_rows), (1, "eager"): eager}
    print(f"\nbatch {batch}: teacher-forced α {alpha:.3f} (1 + α = {1 + alpha:.3f}); predicted ℓ at K = 1 "
          f"{found['predicted']:.3f}; realised ℓ at K = 1, eager: {eager:.3f}", flush=True)
    for K in ks:
        for name, compile_ in (("eager", False), ("compiled", True)) if args.device == "cuda" else (("eager", False),):
            if (K, name) not in found:  # compiled: CUDA graphs, a GPU's engine
                found[K, name] = speculative_pass(engine(K, compile_), calls, params)[1]
                print(f"batch {batch}: realised ℓ at K = {K}, {name}: {found[K, name]:.3f}", flush=True)
    return found
