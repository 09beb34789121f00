"""The learner step alone, before/after the one-forward change (one decoder forward instead of two).

Quickstart student (recipes/bench/speed-chat.yaml), a synthetic batch of 8 rows (40-54 prompt
tokens + 48 completion tokens), full-vocabulary reverse KL against random teacher distributions;
one warm-up step, then 3 rounds of (after, before) in alternating order; median wall and CPU s.

    .venv/bin/python bench/learner_one_forward.py
"""
import contextlib
import statistics
import sys
import time

import torch

sys.path.insert(0, "bench")
from k3post.config.load import load_distill_recipe
from k3post.engine.learner import Learner, LearnerConfig
from k3post.algo.objectives import FullVocabReverseKL
from k3post.types import TrainBatch
from opd_vs_trl_step import two_forward_learner
r = load_distill_recipe("recipes/bench/speed-chat.yaml")
lrn = Learner(LearnerConfig(student=r.student, optim=r.optim, total_steps=10, objective=FullVocabReverseKL()))
V = lrn.model.get_output_embeddings().weight.shape[0]
g = torch.Generator().manual_seed(0)
B, T = 8, 48
prompts = [torch.randint(100, 5000, (40 + 2 * i,), generator=g).tolist() for i in range(B)]
batch = TrainBatch(prompts, torch.randint(100, 5000, (B, T), generator=g), torch.ones(B, T), torch.zeros(B, T) - 2,
                   torch.zeros(B, T), torch.log_softmax(torch.randn(B, T, V, generator=g), -1))
lrn.train_step(batch)
res = {"after": [], "before": []}
for rep in range(3):
    order = ("before", "after") if rep % 2 else ("after", "before")
    for name in order:
        ctx = two_forward_learner() if name == "before" else contextlib.nullcontext()
        with ctx:
            w, c = time.perf_counter(), time.process_time()
            lrn.train_step(batch)
            res[name].append((time.perf_counter() - w, time.process_time() - c))
for k, v in res.items():
    print(k, "wall", [round(a, 2) for a, _ in v], "median", round(statistics.median(a for a, _ in v), 2),
          "cpu median", round(statistics.median(b for _, b in v), 2), flush=True)
