"""One-process compute objects: the learner, the samplers, the teachers, the evaluators. No Ray.

Each engine is a plain class the Ray layer wraps at launch (`ray.remote(**opts)(Engine)`) and the
tests call in process. Rooms, lowest first (a room imports only from rooms below it;
`lint-imports` checks it):

    common.py, host_memory.py   process set-up every engine shares (threads, device, allocator)
    transport/    weights between processes: the broadcast group and CUDA IPC handles, the
                  interface gloo binds to, and the check that every synced tensor landed
    vllm/         the vLLM engine core, the one place vLLM is imported (lazily)
    samplers/     the student generating: HF, static-cache compiled, speculative, vLLM
    teachers/     teachers scoring the student's tokens: HF (prefix-cached), vLLM, and a teacher
                  of another tokenizer reading the student's text
    learner/      one learner step of any objective, its reference strategies, draft head and
                  checkpoints
    sharded/      the learner as a group of `torch.distributed` ranks (FSDP2)
    evaluation/   the models an evaluation talks to, the FP8 export check, reward models

`samplers` never import the learner or the teachers; `learner` and `teachers` never import each
other; `evaluation` and `sharded` sit at the top, side by side.
"""
