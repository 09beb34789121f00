"""Weight transport: the learner's weights into the samplers, and the proof that they landed.

`weight_broadcast.py` is both halves of a torch.distributed broadcast group (NCCL, or gloo on
CPUs) and of CUDA IPC handles when the two share a GPU; `gloo_interface.py` picks the network
interface gloo binds to; `weight_check.py` hashes a rotating window of tensors on both sides after
every sync. May import: `model/` (the FP8 sync's layout), `config`; no engine room.
"""
