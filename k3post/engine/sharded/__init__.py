"""The sharded learner: N processes in one `torch.distributed` group running FSDP2.

`rank.py` brings a rank up (NCCL on GPUs, gloo on CPUs); `sharded_learner.py` is the learner
step on FSDP2-sharded weights, with its reference (`sharded_reference.py`: each rank's host
shard into its own gradient buffers), draft head (`sharded_draft.py`) and bucketed gathers for
the weight sync (`sharded_sync.py`); `learner_rank.py` picks the one-process or the sharded
learner for a rank. May import: `learner/`, `transport/`, `model/`.
"""
