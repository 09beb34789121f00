"""The learner: one optimisation step of any objective on the student, in one process.

`learner_base.py` is the step itself (micro-batches, a global token count, the objective's
loss, drift between sampler and learner measured and acted on); `learner.py` the one-process
`Learner` (optimizer, schedule, QAT switch-on, weight export); `reference.py` the reference
strategies (a copy, the gradient buffers, LoRA's disabled adapters); `draft_trainer.py` trains
the draft head on the learner's own forward; `sft_batch.py` tokenises SFT examples;
`sharded_checkpoint.py` writes the resumable checkpoints (DCP, atomic) both learners use.
May import: `transport/`, `model/`, `algo`, `track`; never samplers, teachers or `sharded/`.
"""
