"""Hugging Face weights: the state-dict mapping both ways and loading a base model into the shards
(`conversion`), and Hugging Face folders, local or in S3 (`files`).

May import `trainer.storage` (its S3 settings), nothing else of the trainer.
"""
