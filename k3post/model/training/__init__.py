"""The learner's model surgery: what training does to a model that serving never needs.

`fsdp.py` shards a model with FSDP2 (`fully_shard` per decoder block) and `sharded_load.py`
builds a sharded student on the meta device; `sharded_weights.py` gathers full weights a bucket
at a time and `weights.py` takes an unsharded model's weights by name (both for the sync into
the samplers); `grad_buffer.py` holds the reference model in the idle gradient buffers;
`modes.py` sets eval mode for a block; `moe_stats.py` reads a Kimi Linear model's routers.
May import: `loading/`, `algo`, `config`; never an engine.
"""
