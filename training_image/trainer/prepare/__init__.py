"""`python -m trainer.prepare`: raw text -> token shards on every core (`pipeline`; `__main__` runs it as
the processing job's entrypoint), its inputs and tokenizers (`inputs`), local or S3 output (`store`),
the shard files (`shard_writer`), and the older text-file command (`make_shards`); conversations ->
tokens and a loss mask by the base model's chat template (`chat`) and the chat dataset (`chat_prepare`).

May import `trainer.data` (the formats it writes), nothing else of the trainer; nothing imports it.
"""
