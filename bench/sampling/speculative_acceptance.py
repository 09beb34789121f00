"""Speculative rollouts on the quickstart: how many tokens the MTP draft head buys per student
forward as OPD moves the student, and what a speculative round costs against a decode step on a CPU.

One OPD run instead of one per head: the quickstart (recipes/quickstart.yaml) with
`draft: {kind: mtp}` trains its online head beside the student and checkpoints both every
`--every` steps. Then, offline, on the same held-out prompts and with the real speculative decoder
(model/generation/fast_speculation.py; seeded, it draws exactly what model/generation/speculative_sampling.py draws),
each (student checkpoint, head, K) is measured:

- frozen:     the head as it starts (its block a copy of the step-0 student's last block), never trained;
- pretrained: that head trained once before OPD, on the step-0 student's own samples of training
              prompts (`--pretrain-steps` head steps of 8 prompts), then frozen;
- online:     the head the OPD run trained, from the same checkpoint as the student.

A head shares the student's embedding, final norm and LM head, so a frozen head follows the
student there and goes stale only in its own weights. Acceptance length = tokens a row gets per
student verify forward; target forwards per generated token = (prefills + verify forwards) /
tokens (plain decoding: 1).

The cost phase takes the last checkpoint and its online head: the seconds of a student forward of
one position (a decode step) against K + 1 positions (a verify) at batch 1, 8 and 32, over the
plain engine's dynamic cache and the static engine's per-row cache; and rollout tokens/s of both
engines with and without speculation, with the decision algo/speculation_rule.py makes from those
same measured seconds.

    .venv/bin/python bench/sampling/speculative_acceptance.py all        # every checkpoint: ~90 min on 2 cores
    .venv/bin/python bench/sampling/speculative_acceptance.py measure --steps 0,4,16,28   # fewer students (~8 min each)
    .venv/bin/python bench/sampling/speculative_acceptance.py report [--no-record]        # tables, plot, rows again
    .venv/bin/python bench/sampling/speculative_acceptance.py pretrain --pretrain-steps 336 --pretrain-from 168  # a saved head on to 336

The train phase takes ~12 min and pretrain ~4; measure ~50 s per (student, head, K) at 64 rows;
measure resumes from the rows it has saved.

Phases (each writes runs/speculative-acceptance/<phase>.json): train, pretrain, measure, cost, report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402
from bench.teachers.cross_tokenizer_cost import median_seconds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SECTION = ("Speculative rollouts: acceptance against OPD step, and the cost on a CPU "
           "(`bench/sampling/speculative_acceptance.py`)")
WORK = REPO / "runs" / "speculative-acceptance"  # --work moves it (a trial run)
FIGURE = REPO / "docs" / "figures" / "speculative-acceptance.png"
HEADS = ("frozen", "pretrained", "online")
KS = (1, 2, 3)
BATCHES = (1, 8, 32)
SEED = 1234


def recipe(every: int):
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415

    return load_distill_recipe(REPO / "recipes" / "quickstart.yaml", overrides(every))


def overrides(every: int) -> list[str]:
    return ["draft.kind=mtp", f"train.checkpoint_every={every}", "train.keep_checkpoints=16", "train.eval_every=0"]


def prompts(rec, heldout: bool, batches: int = 0):
    """The run's held-out prompts (its data split) rendered as the sampler renders them, or the
    first `batches` batches of training prompts (prompts_per_step each, as the run draws them)."""
    from k3post.launch.distill import build_data  # noqa: PLC0415
    from k3post.model.loading.load import load_tokenizer  # noqa: PLC0415
    from k3post.model.generation.sampling import render_prompts  # noqa: PLC0415

    tokenizer = load_tokenizer(rec.student)
    mixture = build_data(rec, tokenizer)
    if heldout:
        return render_prompts(tokenizer, mixture.heldout(), rec.sampling.system_prompt)
    return [render_prompts(tokenizer, mixture.next_batch(rec.data.prompts_per_step), rec.sampling.system_prompt)
            for _ in range(batches)]


def students(every: int) -> list[tuple[int, Path | None]]:
    """(step, checkpoint) of every student measured: step 0 is the recipe's own initial student."""
    from k3post.track.atomic import list_checkpoints  # noqa: PLC0415

    return [(0, None), *list_checkpoints(WORK / "opd" / "checkpoints")]


def load_student(rec, checkpoint: Path | None):
    from k3post.config.schema import ModelSpec  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    model, tokenizer = load_model(rec.student if checkpoint is None else ModelSpec(path=str(checkpoint)))
    return model, tokenizer


def train(args) -> dict:
    """The OPD run (in process: one process on two cores), checkpoints every `--every` steps."""
    from k3post.cli.run import run_recipe  # noqa: PLC0415

    start = time.perf_counter()
    code = run_recipe(REPO / "recipes" / "quickstart.yaml", overrides(args.every), WORK / "opd", in_process=True,
                      restart=True)
    if code != 0:
        raise SystemExit(f"the OPD run failed ({code})")
    from k3post.track.metrics import read_metrics  # noqa: PLC0415

    accept = {m["step"]: m["train/draft_accept"] for m in read_metrics(WORK / "opd" / "metrics.jsonl")
              if "train/draft_accept" in m}
    return {"wall_s": time.perf_counter() - start, "train_draft_accept": accept}


def pretrain(args) -> dict:
    """Head (b): the step-0 student samples a step's training prompts per head step; the head learns on
    them as the learner's DraftTrainer does (the student untouched), then is saved."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    from k3post.engine.learner.draft_trainer import DraftTrainer  # noqa: PLC0415
    from k3post.model.generation.sampling import sample_completions  # noqa: PLC0415
    from k3post.types import SamplingParams  # noqa: PLC0415

    rec = recipe(args.every)
    model, tokenizer = load_student(rec, None)
    lr = args.pretrain_lr or rec.draft.lr
    trainer = DraftTrainer(model, rec.draft.loss_coef, lr, rec.sampling.temperature, rec.train.seed)
    accept, mb, start = [], rec.optim.micro_batch_size, args.pretrain_from
    if start:  # go on from the saved head (a fresh AdamW), on the batches after its `start`
        trainer.head.load_state_dict(load_file(WORK / "head-pretrained.safetensors"))
        accept = json.loads((WORK / "pretrain.json").read_text())["accept"][:start]
    else:
        save_file({k: v.contiguous() for k, v in trainer.head.state_dict().items()}, WORK / "head-frozen.safetensors")
    for step, batch in enumerate(prompts(rec, heldout=False, batches=args.pretrain_steps)):
        if step < start:
            continue
        out = sample_completions(model, tokenizer, batch, SamplingParams(rec.sampling.max_new_tokens,
                                                                         rec.sampling.temperature, 1.0, seed=step))
        accept.append(head_step(trainer, model, tokenizer, batch, out, mb)["train/draft_accept"])
        print(f"pretrain step {step + 1}: teacher-forced acceptance {accept[-1]:.3f}", flush=True)
    save_file({k: v.contiguous() for k, v in trainer.head.state_dict().items()}, WORK / "head-pretrained.safetensors")
    return {"accept": accept}


def head_states(checkpoint: Path | None) -> dict:
    from safetensors.torch import load_file  # noqa: PLC0415

    online = WORK / "head-frozen.safetensors" if checkpoint is None else checkpoint / "mtp_head.safetensors"
    return {"frozen": load_file(WORK / "head-frozen.safetensors"),
            "pretrained": load_file(WORK / "head-pretrained.safetensors"), "online": load_file(online)}


def head_step(trainer, model, tokenizer, batch: list[list[int]], out, micro: int) -> dict:
    """One head step on the student's own completions `out` of `batch`, in micro-batches of `micro`
    rows, as the learner's DraftTrainer takes it (the student untouched); returns its figures."""
    import torch  # noqa: PLC0415

    from k3post.model.scoring.logprobs import hidden_states, pack_sequences  # noqa: PLC0415

    device = model.get_output_embeddings().weight.device
    completions_BT, mask_BT = out.completion_ids_BT.cpu(), out.loss_mask_BT.cpu()
    trainer.start_step(batch, mask_BT)
    for i in range(0, len(batch), micro):
        ids, mask, _ = pack_sequences(batch[i:i + micro], completions_BT[i:i + micro], mask_BT[i:i + micro],
                                      tokenizer.pad_token_id)
        with trainer.capturing(), torch.no_grad():
            hidden_states(model, ids.to(device), mask.to(device))
        trainer.learn(batch[i:i + micro], mask_BT[i:i + micro])
    return trainer.step()


def decoder(model, tokenizer, state: dict, K: int, static: bool, min_bucket: int = 16, compile: bool = False,
            hidden: str = "final_norm"):
    """A speculative decoder drafting K tokens with a head holding `state` (in the student's dtype):
    over the static engine's caches (`compile`: its steps compiled, on a GPU) or the plain one's."""
    from k3post.model.generation.draft_head import MtpHead  # noqa: PLC0415
    from k3post.model.generation.fast_sampling import StaticSampler  # noqa: PLC0415
    from k3post.model.generation.fast_speculation import StaticSpeculativeDecoder  # noqa: PLC0415
    from k3post.model.generation.sampling import eos_ids  # noqa: PLC0415
    from k3post.model.generation.speculative_sampling import SpeculativeDecoder  # noqa: PLC0415

    head = MtpHead(model, 0, hidden=hidden).to(model.dtype)
    head.load_state_dict(state)
    stops = eos_ids(tokenizer, model.generation_config)
    if static:
        sampler = StaticSampler(model, tokenizer.pad_token_id, stops, compile=compile, min_bucket=min_bucket)
        return StaticSpeculativeDecoder(sampler, head, K)
    return SpeculativeDecoder(model, head, tokenizer.pad_token_id, stops, K)


def measure(args) -> dict:
    """Acceptance of every (student step, head, K) on the held-out prompts × `--samples`, for the
    students of `--steps` (default: every checkpoint). Each row is saved as it is measured, and rows
    already in measure.json are kept, not measured again: a stopped phase resumes."""
    from k3post.types import SamplingParams  # noqa: PLC0415

    rec = recipe(args.every)
    rows = [p for p in prompts(rec, heldout=True) for _ in range(args.samples)]
    params = SamplingParams(rec.sampling.max_new_tokens, rec.sampling.temperature, 1.0, seed=SEED)
    saved = WORK / "measure.json"
    found = json.loads(saved.read_text())["rows"] if saved.exists() else []
    done = {(m["step"], m["head"], m["K"]) for m in found}
    wanted = None if args.steps is None else {int(s) for s in args.steps.split(",")}
    for step, checkpoint in students(args.every):
        # The online head at step 0 is the frozen one; a student with nothing left is not loaded.
        pending = [(head, state, K) for head, state in head_states(checkpoint).items() for K in KS
                   if not (step == 0 and head == "online") and (step, head, K) not in done]
        if not pending or (wanted is not None and step not in wanted):
            continue
        model, tokenizer = load_student(rec, checkpoint)
        for head, state, K in pending:
            start = time.perf_counter()
            out, stats = decoder(model, tokenizer, state, K, static=True).sample(rows, params)
            tokens = int(out.loss_mask_BT.sum())
            found.append({"step": step, "head": head, "K": K, "rows": len(rows), "tokens": tokens,
                          "row_rounds": stats.row_rounds, "accepted": stats.accepted, "drafted": stats.drafted,
                          "acceptance_length": stats.acceptance_length,
                          "forwards_per_token": (len(rows) + stats.row_rounds) / tokens,
                          "seconds": time.perf_counter() - start})
            print(json.dumps(found[-1]), flush=True)
            saved.write_text(json.dumps({"rows": found}))
    return {"rows": found}


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    fn()
    return median_seconds(fn, repeats)


CONTEXT = 24  # completion tokens already in the cache when a forward is timed (mid-rollout)


def forward_costs(model, tokenizer, state: dict, rows: list[list[int]], repeats: int) -> dict:
    """Seconds of one student forward and its logits over J = 1 (a decode step) and J = K + 1 (a
    verify) positions after the prompts and CONTEXT tokens: over the plain engine's dynamic cache
    and the static engine's per-row cache; and one head draft step (J = 1 and the LM head)."""
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    torch.set_grad_enabled(False)  # the phases that time run without autograd
    dec = decoder(model, tokenizer, state, max(KS), static=True)
    ids_BP, positions_BP, mask_BL, lengths_B = dec.sampler._layout(rows, CONTEXT + 2 * max(KS) + 2)
    B, P = ids_BP.shape
    rowcache = dec._cache(len(dec.base.layers), B, mask_BL.shape[1])
    dec.sampler._prefill(ids_BP, positions_BP, mask_BL, rowcache, groups=False, hidden=True)
    headcache = dec._cache(1, B, mask_BL.shape[1])
    dynamic = DynamicCache(config=model.config)
    context = torch.randint(100, 10000, (B, CONTEXT))
    dec.base(input_ids=torch.cat([ids_BP, context], 1), attention_mask=mask_BL[:, :P + CONTEXT],
             position_ids=torch.cat([positions_BP, lengths_B[:, None] + torch.arange(CONTEXT)], 1),
             past_key_values=dynamic, use_cache=True)
    out = {}
    for J in (1, *(K + 1 for K in KS)):
        ids_BJ = torch.randint(100, 10000, (B, J))
        cols_BJ, pos_BJ = P + CONTEXT + torch.arange(J).expand(B, -1), lengths_B[:, None] + CONTEXT + torch.arange(J)

        def plain():
            h = dec.base(input_ids=ids_BJ, attention_mask=mask_BL[:, :P + CONTEXT + J], position_ids=pos_BJ,
                         past_key_values=dynamic, use_cache=True).last_hidden_state
            dec.head.student_logits(h)
            dynamic.crop(P + CONTEXT)

        def static():
            rowcache.columns.at = cols_BJ
            dec.head.student_logits(dec.base(input_ids=ids_BJ, attention_mask=dec._mask(cols_BJ, mask_BL),
                                             position_ids=pos_BJ, past_key_values=rowcache).last_hidden_state)

        out[f"plain {J}"], out[f"static {J}"] = timed(plain, repeats), timed(static, repeats)
    g_B1H = torch.randn(B, 1, model.config.hidden_size)
    draft_cols, draft_pos = P + CONTEXT + torch.zeros(B, 1, dtype=torch.long), lengths_B[:, None] + CONTEXT

    def head_step():
        headcache.columns.at = draft_cols
        dec.head.logits(dec.head(g_B1H, ids_BP[:, -1:], draft_pos, dec._mask(draft_cols, mask_BL), headcache)[:, 0])

    out["head step"] = timed(head_step, repeats)
    return out


def rollout_rates(model, tokenizer, state: dict, rows: list[list[int]], batch: int, params) -> dict:
    """Tokens/s of each engine without and with speculation (K = 1..3) over `rows` in calls of
    `batch`, the seconds the engine's rule compares (a plain call's seconds per decode step, a
    speculative call's per round) and its verdict at draft.speculate.min_accept's default."""
    from k3post.algo.speculation_rule import speculation_pays, steps_per_round  # noqa: PLC0415
    from k3post.config.draft_schema import SpeculateSpec  # noqa: PLC0415
    from k3post.model.generation.fast_sampling import StaticSampler  # noqa: PLC0415
    from k3post.model.generation.sampling import eos_ids, sample_completions  # noqa: PLC0415

    calls = [rows[i:i + batch] for i in range(0, len(rows), batch)]
    static = StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config), min_bucket=16)
    plain_fns = {"plain": lambda r: sample_completions(model, tokenizer, r, params),
                 "static": lambda r: static.sample(r, params)}
    floor, out = SpeculateSpec().min_accept, {}
    for engine, plain_fn in plain_fns.items():
        plain_fn(calls[0][:1])  # warm-up
        start, tokens, steps = time.perf_counter(), 0, 0
        for call in calls:
            done = plain_fn(call)
            tokens, steps = tokens + int(done.loss_mask_BT.sum()), steps + done.completion_ids_BT.shape[1]
        seconds = time.perf_counter() - start
        decode_step_s = seconds / steps
        out[f"{engine} K=0"] = {"tokens_per_s": tokens / seconds, "decode_step_s": decode_step_s}
        for K in KS:
            dec = decoder(model, tokenizer, state, K, static=engine == "static")
            dec.sample(calls[0][:1], params)  # warm-up
            start, tokens, rounds, row_rounds, emitted, longest = time.perf_counter(), 0, 0, 0, 0, 0
            for call in calls:
                done, stats = dec.sample(call, params)
                tokens, emitted = tokens + int(done.loss_mask_BT.sum()), emitted + stats.emitted
                longest += done.completion_ids_BT.shape[1]
                row_rounds += stats.row_rounds
                rounds += stats.rounds  # the batched rounds the call ran
            seconds = time.perf_counter() - start
            length, round_s = emitted / row_rounds, seconds / rounds
            out[f"{engine} K={K}"] = {"tokens_per_s": tokens / seconds, "round_s": round_s, "acceptance_length": length,
                                      "pays": speculation_pays(length, steps_per_round(longest, rounds), round_s,
                                                               decode_step_s, floor)}
    return out


def cost(args) -> dict:
    """Forward costs and rollout rates of the last checkpoint's student with its online head."""
    import torch  # noqa: PLC0415

    from k3post.types import SamplingParams  # noqa: PLC0415

    torch.manual_seed(0)
    rec = recipe(args.every)
    step, checkpoint = students(args.every)[-1]
    model, tokenizer = load_student(rec, checkpoint)
    state = head_states(checkpoint)["online"]
    held = prompts(rec, heldout=True)
    params = SamplingParams(rec.sampling.max_new_tokens, rec.sampling.temperature, 1.0, seed=SEED)
    found = {"step": step}
    for batch in BATCHES:
        found[f"forward {batch}"] = forward_costs(model, tokenizer, state, (held * 2)[:batch], args.repeats)
        print(batch, json.dumps(found[f"forward {batch}"]), flush=True)
        found[f"rollout {batch}"] = rollout_rates(model, tokenizer, state, held[:max(batch, 8)], batch, params)
        print(batch, json.dumps(found[f"rollout {batch}"]), flush=True)
    return found


def by_step(measured: list[dict], key: str) -> dict[tuple[str, int], dict[int, float]]:
    """(head, K) -> step -> the figure; the online head's step 0 is the frozen head's."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for m in measured:
        out.setdefault((m["head"], m["K"]), {})[m["step"]] = m[key]
    for K in KS:
        if ("frozen", K) in out and 0 in out[("frozen", K)]:
            out.setdefault(("online", K), {})[0] = out[("frozen", K)][0]
    return out


def acceptance_table(measured: list[dict], key: str = "acceptance_length") -> str:
    table = by_step(measured, key)
    steps = sorted({m["step"] for m in measured})
    head = "| OPD step | " + " | ".join(f"{h}, K={K}" for K in KS for h in HEADS) + " |"
    lines = [head, "|" + "---|" * (1 + len(KS) * len(HEADS))]
    for s in steps:
        lines.append(f"| {s} | " + " | ".join(f"{table.get((h, K), {}).get(s, float('nan')):.3f}"
                                             for K in KS for h in HEADS) + " |")
    return "\n".join(lines)


def cost_tables(found: dict) -> str:
    lines = ["| batch | engine | decode step (1 position) | verify K=1 | verify K=2 | verify K=3 | head draft step |",
             "|---|---|---|---|---|---|---|"]
    for batch in BATCHES:
        f = found[f"forward {batch}"]
        for engine in ("plain", "static"):
            d = f[f"{engine} 1"]
            lines.append(f"| {batch} | {engine} | {d * 1e3:.1f} ms | " + " | ".join(
                f"{f[f'{engine} {K + 1}'] * 1e3:.1f} ms ({f[f'{engine} {K + 1}'] / d:.2f}×)" for K in KS)
                + f" | {f['head step'] * 1e3:.1f} ms |")
    lines += ["", "| batch | engine | no speculation | K=1 | K=2 | K=3 |", "|---|---|---|---|---|---|"]
    for batch in BATCHES:
        r = found[f"rollout {batch}"]
        for engine in ("plain", "static"):
            base = r[f"{engine} K=0"]["tokens_per_s"]
            cells = [f"{r[f'{engine} K={K}']['tokens_per_s']:.1f} ({r[f'{engine} K={K}']['tokens_per_s'] / base:.2f}×, "
                     f"ℓ {r[f'{engine} K={K}']['acceptance_length']:.2f}, rule: "
                     f"{'on' if r[f'{engine} K={K}']['pays'] else 'off'})" for K in KS]
            lines.append(f"| {batch} | {engine} | {base:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(measured: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    table = by_step(measured, "acceptance_length")
    fig, axes = plt.subplots(1, len(KS), figsize=(12, 3.6), sharey=True)
    for ax, K in zip(axes, KS):
        for head, style in zip(HEADS, ("o-", "s--", "^-")):
            points = sorted(table.get((head, K), {}).items())
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=head)
        ax.set_title(f"K = {K} draft tokens")
        ax.set_xlabel("OPD step (student checkpoint)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance length (tokens / verify)")
    axes[0].legend()
    fig.suptitle("MTP head on the quickstart student: held-out acceptance length against OPD step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def result_rows(measured: list[dict], found: dict) -> list[dict]:
    """bench/results rows: acceptance length at the first and last student of each (head, K); the
    online head's target forwards per token at the last; per batch and engine the verify (K = 3)
    against decode cost, and the rollout tokens/s of the best K against none, with the rule's verdict."""
    table, forwards = by_step(measured, "acceptance_length"), by_step(measured, "forwards_per_token")
    last = max(m["step"] for m in measured)
    rows = []
    for K in KS:
        for head in HEADS:
            for step in (0, last):
                if step == 0 and head == "online":
                    continue
                rows.append({"metric": f"acceptance length, {head} head, K={K}, student of OPD step {step}",
                             "value": rounded(table[(head, K)][step], 2), "unit": "tokens/verify"})
    for K in KS:
        rows.append({"metric": f"target forwards per generated token, online head, K={K}, OPD step {last}",
                     "value": rounded(forwards[("online", K)][last], 3), "unit": "forwards/token"})
    for batch in BATCHES:
        f, r = found[f"forward {batch}"], found[f"rollout {batch}"]
        for engine in ("plain", "static"):
            rows.append({"metric": f"CPU: verify of 4 positions ÷ decode step, batch {batch}, {engine} engine",
                         "value": rounded(f[f"{engine} 4"] / f[f"{engine} 1"], 2), "unit": "×",
                         "ratio_to": "decode step (1 position)", "notes": f"decode step {f[f'{engine} 1'] * 1e3:.1f} ms"})
            best = max(KS, key=lambda K: r[f"{engine} K={K}"]["tokens_per_s"])
            cell, base = r[f"{engine} K={best}"], r[f"{engine} K=0"]["tokens_per_s"]
            rows.append({"metric": f"CPU: rollout tokens/s, speculation (best K) ÷ none, batch {batch}, {engine} engine",
                         "value": rounded(cell["tokens_per_s"] / base, 2), "unit": "×", "ratio_to": "no speculation",
                         "notes": f"K={best}, ℓ {cell['acceptance_length']:.2f}, {cell['tokens_per_s']:.1f} against "
                                  f"{base:.1f} tokens/s; the rule: {'on' if cell['pays'] else 'off'}"})
    return rows


def report(args) -> dict:
    measured = json.loads((WORK / "measure.json").read_text())["rows"]
    found = json.loads((WORK / "cost.json").read_text())
    print("Acceptance length (tokens per student verify forward), held-out prompts:\n")
    print(acceptance_table(measured))
    print("\nTarget forwards per generated token:\n")
    print(acceptance_table(measured, "forwards_per_token"))
    print(f"\nCPU costs, student of OPD step {found['step']} with its online head:\n")
    print(cost_tables(found))
    plot(measured, FIGURE)
    print(f"\nwrote {FIGURE.relative_to(REPO)}")
    record_and_say("speculative-acceptance", result_rows(measured, found), args.no_record, source_section=SECTION)
    return {}


PHASES = {"train": train, "pretrain": pretrain, "measure": measure, "cost": cost, "report": report}


def main() -> int:
    global WORK
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=[*PHASES, "all"])
    parser.add_argument("--every", type=int, default=4, help="OPD steps between checkpoints")
    parser.add_argument("--pretrain-steps", type=int, default=28, help="head steps of the pretrained head")
    parser.add_argument("--pretrain-from", type=int, default=0,
                        help="go on training the saved pretrained head from this head step (its optimizer anew)")
    parser.add_argument("--pretrain-lr", type=float, default=None, help="the pretrained head's learning rate "
                                                                         "(default: the recipe's draft.lr)")
    parser.add_argument("--samples", type=int, default=2, help="samples per held-out prompt when measuring")
    parser.add_argument("--steps", default=None, help="the OPD steps whose students `measure` takes, e.g. 0,12,28 "
                                                     "(default: every checkpoint)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each forward")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=WORK, help="where the phases keep the run and their results")
    add_no_record(parser)
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    WORK = args.work
    WORK.mkdir(parents=True, exist_ok=True)
    for phase in PHASES if args.phase == "all" else [args.phase]:
        start = time.perf_counter()
        found = PHASES[phase](args)
        if phase != "report":
            (WORK / f"{phase}.json").write_text(json.dumps({**found, "phase_s": time.perf_counter() - start}))
        print(f"{phase}: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
