"""Rule rewards that recipes name as "rewards.<module>:<function>".

Every function here follows one signature (k3post/rewards/protocol.py):

    score(prompt: str, completion: str, meta: dict, **kwargs) -> float | dict[str, float]

A dict must contain "reward"; its other keys are logged as `rl/reward/<name>/<key>`. Keyword
arguments are bound from the recipe. Copy a file, change it, and name it in your recipe; a
file `rewards/<module>.py` in the directory you run from wins over the shipped one.

- math.correctness   1.0 iff math-verify finds the completion's answer equal to meta["answer"]
- format.boxed       1.0 iff the completion contains a non-empty \\boxed{...} answer
- format.answer_tag  1.0 iff the completion has a non-empty <answer>...</answer>
- length.penalty     0 up to a target length, then linearly down to −max_penalty
- code.tests_pass    fraction of meta["tests"] (assert statements) that pass, run in the sandbox
"""
