"""Reading prepared token data: the token sources, window order and micro-batches (`loader`), blends of
several datasets (`blend`), the shard index and its formats (`shard_index`, `megatron_index`) and the
dataset manifest (`manifest`).

May import nothing else of the trainer; `trainer.prepare` (which writes these formats) and
`trainer.validation` import it.
"""
