"""OPD loss families side by side: per-step bytes moved and step time at a large vocabulary.

One teacher and one student with tiny dimensions (a Llama from a config, random weights) but a
real vocabulary (152,064, Qwen's) and long completions (2,048 tokens), B rows. For every loss the
teacher scores the rows as its actor would (engine/teachers/teacher.py's payloads) and the learner runs the
loss through `PerTeacherOPD` (algo/objectives.py) with a forward and a backward, one row per
micro-batch. Bytes are counted with types.tensor_bytes:

    driver      what the driver receives per step: the rollouts' [B, T] tensors and the teacher's
                [B, T] sampled-token logprobs (the same for every loss: O(B·T))
    T→learner   the teacher's payload, sent actor → learner by reference (never via the driver)
    old driver  what the driver received for this loss before teacher payloads went by reference
                (full-vocab: [B, T, V])

    .venv/bin/python bench/opd/opd_losses.py                  # 2 rows × 2,048 tokens, V = 152,064
    .venv/bin/python bench/opd/opd_losses.py --rows 4 --tokens 512

Each loss's bytes and seconds are appended to bench/results/opd-losses.jsonl (`results.record`);
`--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from k3post.algo.objectives import PerTeacherOPD, TeacherTerm
from k3post.algo.topk import complement_logsumexp
from k3post.types import TeacherFull, TeacherHidden, TeacherPart, TeacherTopK, TrainBatch, tensor_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "OPD loss families at a 152k vocabulary: bytes per step and step time (`bench/opd/opd_losses.py`)"
# The losses as docs/benchmarks.md's table names them.
TITLES = {"sampled_token": "sampled_token", "topk k=32": "topk_reverse k = 32", "topk k=128": "topk_reverse k = 128",
          "full_vocab": "full_vocab (logprobs)", "full_vocab hidden": "full_vocab (hidden_states)"}

LOSSES = (("sampled_token", TeacherTerm("sampled_token")), ("topk k=32", TeacherTerm("topk_reverse", k=32)),
          ("topk k=128", TeacherTerm("topk_reverse", k=128)), ("full_vocab", TeacherTerm("full_vocab")),
          ("full_vocab hidden", TeacherTerm("full_vocab", send="hidden_states")))


def tiny_llama(vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


def completion_hidden(model, ids_BL: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Final hidden states that predict each completion token, [B, T, H]."""
    h = model.model(input_ids=ids_BL).last_hidden_state
    return h[:, prompt_len - 1:-1]


@torch.no_grad()
def teacher_payload(teacher, ids_BL, prompt_len, term: TeacherTerm):
    """What the teacher actor returns for the rows, one row at a time: [B, T] logprobs of the sampled
    tokens (to the driver) and the loss's payload (to the learner)."""
    tokens, payloads = [], []
    head_VH = teacher.get_output_embeddings().weight
    for row in ids_BL.split(1):
        h_1TH = completion_hidden(teacher, row, prompt_len)
        full = (h_1TH @ head_VH.T).log_softmax(-1)
        tokens.append(full.gather(-1, row[:, prompt_len:, None]).squeeze(-1))
        if term.kind.startswith("topk_"):
            values, ids = full.topk(term.k, dim=-1)
            payloads.append(TeacherTopK(ids.int(), values, complement_logsumexp(full, ids)))
        elif term.kind == "full_vocab" and term.send == "hidden_states":
            payloads.append(TeacherHidden(h_1TH.clone(), 1.0))
        elif term.kind == "full_vocab":
            payloads.append(TeacherFull(full))
        del full
    payload = type(payloads[0]).cat(payloads) if payloads else None
    return torch.cat(tokens), payload


def learner_step(student, batch: TrainBatch, objective: PerTeacherOPD, prompt_ids_BP: torch.Tensor) -> float:
    """Forward, loss and backward, one row per micro-batch; returns the summed loss."""
    total, N = 0.0, float(batch.loss_mask_BT.sum())
    for i, mb in enumerate(batch.micro_batches(1)):
        ids = torch.cat([prompt_ids_BP[i:i + 1], mb.completion_ids_BT], dim=1)
        h = completion_hidden(student, ids, prompt_ids_BP.shape[1])
        s_BTV = (h @ student.get_output_embeddings().weight.T).log_softmax(-1)
        s_BT = s_BTV.gather(-1, mb.completion_ids_BT[..., None]).squeeze(-1)
        loss = objective.loss(mb, s_BT, s_BTV if objective.needs_student_distributions else None, N)
        loss.backward()
        total += float(loss.detach())
        del s_BTV, h, loss
    return total


def measure(name: str, term: TeacherTerm, teacher, student, ids_BL, prompt_len: int, vocab: int) -> dict:
    B, T = ids_BL.shape[0], ids_BL.shape[1] - prompt_len
    started = time.perf_counter()
    token_BT, payload = teacher_payload(teacher, ids_BL, prompt_len, term)
    score_s = time.perf_counter() - started
    if isinstance(payload, TeacherHidden):
        payload.head_VH = teacher.get_output_embeddings().weight.detach()  # sent once per run, not per step
    mask_BT = torch.ones(B, T)
    rollouts = (ids_BL[:, prompt_len:], mask_BT, torch.zeros(B, T))  # completion ids, mask, sampler logprobs
    advantages_BT = -(torch.zeros(B, T) - token_BT)
    batch = TrainBatch([row.tolist() for row in ids_BL[:, :prompt_len]], *rollouts, advantages_BT,
                       teacher_parts=(TeacherPart("t", tuple(range(B)), payload),))
    started = time.perf_counter()
    learner_step(student, batch, PerTeacherOPD((("t", term),)), ids_BL[:, :prompt_len])
    train_s = time.perf_counter() - started
    student.zero_grad(set_to_none=True)
    to_learner = 0 if payload is None else tensor_bytes(payload) - (
        tensor_bytes(payload.head_VH) if isinstance(payload, TeacherHidden) else 0)
    driver = tensor_bytes(rollouts) + tensor_bytes(token_BT)
    before = driver + (B * T * vocab * 4 if term.kind == "full_vocab" else 0)
    return {"loss": name, "driver": driver, "to_learner": to_learner, "before": before, "score_s": score_s,
            "train_s": train_s}


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def scaled(n: float) -> tuple:
    """(value, unit) of a byte count as the table prints it (human(): 1,000-based, one decimal)."""
    value, unit = human(n).split()
    return (int(value) if unit == "B" else rounded(float(value), 1)), unit


def result_rows(measured: list[dict], rows: int, tokens: int, vocab: int) -> list[dict]:
    """Per loss: the bytes a step to the driver, teacher → learner and to the driver before payloads
    went by reference; the score, train and step seconds (one decimal, as the table)."""
    out = []
    for r in measured:
        head = f"B = {rows} × T = {tokens:,}, V = {vocab:,}, {TITLES.get(r['loss'], r['loss'])}"
        for key, what in (("driver", "to the driver"), ("to_learner", "teacher → learner"),
                          ("before", "to the driver before payloads went by reference")):
            value, unit = scaled(r[key])
            out.append({"metric": f"{head}: bytes a step {what}", "value": value, "unit": unit})
        out += [{"metric": f"{head}: score time", "value": rounded(r["score_s"], 1), "unit": "s"},
                {"metric": f"{head}: train time", "value": rounded(r["train_s"], 1), "unit": "s"},
                {"metric": f"{head}: step time", "value": rounded(r["score_s"] + r["train_s"], 1), "unit": "s"}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--prompt", type=int, default=16)
    add_no_record(parser)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    teacher, student = tiny_llama(args.vocab, 0).eval(), tiny_llama(args.vocab, 1)
    g = torch.Generator().manual_seed(2)
    ids_BL = torch.randint(0, args.vocab, (args.rows, args.prompt + args.tokens), generator=g)
    print(f"# B={args.rows} T={args.tokens} V={args.vocab:,} H=64, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'loss':<18} {'driver/step':>12} {'T→learner/step':>15} {'old driver':>11} {'score s':>8} "
          f"{'train s':>8} {'step s':>7}")
    for name, term in LOSSES:  # warm-up: every path once on a few tokens
        measure(name, term, teacher, student, ids_BL[:, :args.prompt + 8], args.prompt, args.vocab)
    measured = []
    for name, term in LOSSES:
        r = measure(name, term, teacher, student, ids_BL, args.prompt, args.vocab)
        measured.append(r)
        print(f"{r['loss']:<18} {human(r['driver']):>12} {human(r['to_learner']):>15} {human(r['before']):>11} "
              f"{r['score_s']:>8.2f} {r['train_s']:>8.2f} {r['score_s'] + r['train_s']:>7.2f}", flush=True)
    record_and_say("opd-losses", result_rows(measured, args.rows, args.tokens, args.vocab), args.no_record,
                   source_section=SECTION)


if __name__ == "__main__":
    main()
