"""Teachers: log π_T of the student's own tokens (and top-k when the loss needs it).

`teacher.py` is the HF `TeacherScorer` (`teacher_prefix.py`: each distinct prompt encoded once,
its completions scored after the cached prefix); `vllm_teacher.py` scores with vLLM's prompt
logprobs; `cross_teacher.py` wraps either for a teacher of another tokenizer, reading the
student's text through `text_reading.py`. May import: `samplers/` (shared rendering), `vllm/`,
`model/`, `algo`; never the learner.
"""
