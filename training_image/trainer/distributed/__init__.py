"""Distribution across GPUs and hosts: the device mesh, FSDP2 sharding and gradient sync (`parallel`),
and the EFA/NCCL checks and logs (`comms`).

May import `trainer.models` (the blocks it shards), nothing else of the trainer.
"""
