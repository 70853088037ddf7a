"""Reading prepared token data: the token sources, window order and micro-batches (`loader`), blends of
several datasets (`blend`), the shard index and its formats (`shard_index`, `megatron_index`), the
dataset manifest (`manifest`), chat datasets' loss masks (`chat_shards`) and the packing of their
examples into sequences that keep them apart (`packing`).

May import nothing else of the trainer; `trainer.prepare` (which writes these formats) and
`trainer.validation` import it.
"""
