"""TRL GKDTrainer as an arm of bench/alternatives/opd_vs_alternatives.py (the optional `bench` extra: trl).

λ = 1 (every step trains on the student's own samples), β from the arm, sampling temperature,
new tokens, batch, learning rate and clipping from the task's distillation recipe. GKDTrainer gives
the teacher the student's own input ids; the task's teacher has a system prompt the student never
sees, so `SystemPromptTeacher` swaps the student's system turn for the teacher's in every row and
maps the teacher's logits back onto the student's positions - the teacher then scores exactly what
k3post's teacher scores.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.alternatives.bench_arms import Budget, Checkpoint, Clock


def trl_available() -> bool:
    try:
        import trl  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def system_prefixes(tokenizer, system_prompt: str) -> tuple[list[int], list[int]]:
    """The token ids the chat template puts before the user turn: by default, and with `system_prompt`."""
    user = [{"role": "user", "content": "x"}]

    def ids(chat):
        out = tokenizer.apply_chat_template(chat, tokenize=True)
        return list(out["input_ids"] if not isinstance(out, list) else out)

    plain, with_system = ids(user), ids([{"role": "system", "content": system_prompt}] + user)
    common = 0
    while common < min(len(plain), len(with_system)) and plain[-1 - common] == with_system[-1 - common]:
        common += 1
    return plain[:len(plain) - common], with_system[:len(with_system) - common]


class SystemPromptTeacher(torch.nn.Module):
    """The teacher model, fed each row with its own system turn in place of the student's.

    Row by row (no padding): find the student's prefix after the row's left padding, replace it
    by the teacher's, run the teacher, and put its logits at the student's positions (shifted by
    the prefix length difference). Positions inside the replaced prefix get zeros (GKD's labels
    mask them: they are prompt)."""

    def __init__(self, model, tokenizer, system_prompt: str):
        super().__init__()
        self.model, self.config = model, model.config
        self.plain, self.teacher = system_prefixes(tokenizer, system_prompt)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        B, L = input_ids.shape
        out = None
        for b in range(B):
            start = int((attention_mask[b] == 0).long().cumprod(0).sum()) if attention_mask is not None else 0
            row = input_ids[b, start:].tolist()
            end = start + len(row)
            if attention_mask is not None:
                end = start + int(attention_mask[b, start:].sum())
                row = input_ids[b, start:end].tolist()
            if row[:len(self.plain)] != self.plain:
                raise ValueError("a row does not start with the chat template's default system turn")
            ids = torch.tensor([self.teacher + row[len(self.plain):]], device=input_ids.device)
            logits = self.model(input_ids=ids).logits[0]
            if out is None:
                out = logits.new_zeros(B, L, logits.shape[-1])
            keep = end - start - len(self.plain)
            out[b, end - keep:end] = logits[len(self.teacher):len(self.teacher) + keep]
        return type("Out", (), {"logits": out})()


def run_trl(arm: str, recipe, out: Path, budget: Budget, beta: float) -> list[Checkpoint]:
    """GKDTrainer (λ = 1, β = `beta`) on the task until each mark; save_pretrained checkpoints."""
    from datasets import Dataset  # noqa: PLC0415
    from transformers import TrainerCallback  # noqa: PLC0415
    from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: PLC0415

    from k3post.data.sources import load_prompt_rows  # noqa: PLC0415
    from k3post.model.loading.load import load_model  # noqa: PLC0415

    student, tokenizer = load_model(recipe.student)
    teacher_spec = next(iter(recipe.teachers.values()))
    teacher, _ = load_model(teacher_spec.model)
    if teacher_spec.system_prompt is not None:
        teacher = SystemPromptTeacher(teacher, tokenizer, teacher_spec.system_prompt)
    rows = load_prompt_rows(recipe.data.sources[0].prompts, Path.cwd())
    data = Dataset.from_list([{"messages": [{"role": r, "content": c} for r, c in row["messages"]]
                               + [{"role": "assistant", "content": ""}]} for row in rows])
    tokens, kept, marks = [0.0], [], list(budget.marks)

    class Counted(GKDTrainer):
        @staticmethod
        def generate_on_policy_outputs(model, inputs, generation_config):
            result = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            tokens[0] += float((result[2] != -100).sum())
            return result

    class Marks(TrainerCallback):
        clock: Clock | None = None

        def on_step_begin(self, args, state, control, **kw):
            self.clock = self.clock or Clock()

        def on_step_end(self, args, state, control, model=None, **kw):
            if self.clock.elapsed() < marks[0] * budget.seconds:
                return
            while marks and self.clock.elapsed() >= marks[0] * budget.seconds:
                marks.pop(0)  # one step may pass several marks: one checkpoint
            with self.clock.pause():
                path = out / arm / f"step-{state.global_step}"
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)
                kept.append(Checkpoint(arm, path, self.clock.elapsed(), tokens[0], state.global_step))
            control.should_training_stop = not marks

    s = recipe.sampling
    with tempfile.TemporaryDirectory() as tmp:
        # gradient_checkpointing off: TRL 1.16's default (on) generates without the KV cache and
        # recomputes the forward in backward; k3post does neither on a CPU, so both sides do the same work.
        args = GKDConfig(output_dir=tmp, per_device_train_batch_size=recipe.data.prompts_per_step, max_steps=100_000,
                         learning_rate=recipe.optim.lr, max_grad_norm=recipe.optim.grad_clip,
                         warmup_steps=recipe.optim.warmup_steps, lmbda=1.0, beta=beta, temperature=s.temperature,
                         max_new_tokens=s.max_new_tokens, save_strategy="no", report_to=[], use_cpu=True,
                         logging_steps=100_000, disable_tqdm=True, seed=recipe.train.seed, dataloader_num_workers=0,
                         gradient_checkpointing=False)
        Counted(model=student, teacher_model=teacher, args=args, processing_class=tokenizer, train_dataset=data,
                callbacks=[Marks()]).train()
    return kept
