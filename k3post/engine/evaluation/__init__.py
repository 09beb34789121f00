"""Evaluation and reward models: engines that judge a student rather than train it.

`eval_model.py` builds every model an evaluation talks to (student, checkpoint, FP8 export,
teacher) as a scorer that samples and scores; `fp8_check.py` measures what an FP8 export changed
(held-out NLL, paired reply by reply); `reward_model.py` scores completions with a sequence
classifier for RL. May import: `teachers/`, `learner/` (SFT tokenising), `model/`.
"""
