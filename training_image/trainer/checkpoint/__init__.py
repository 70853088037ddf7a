"""Checkpoints: saving, loading and pruning them (`manager`, CheckpointManager, over `write` and `read`:
one checkpoint written, one loaded), what they hold besides the shards (`state`), their digests
(`integrity`), finding the newest intact one (`discovery`) and resuming a run from it with the
recipe's changes (`resume`).

May import `trainer.storage` (where checkpoints live), `trainer.runtime` (fault injection) and
`trainer.optim` (the schedule a resumed run follows); nothing else of the trainer.
"""
