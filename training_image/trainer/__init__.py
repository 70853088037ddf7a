"""The trainstack trainer: a Llama-style decoder trained with FSDP2 and Transformer Engine.

Run as `python -m trainer --recipe FILE` (or through `trainer.entrypoint` on SageMaker, which starts
torchrun on every node). One module per job: model, parallel, precision, activation_checkpointing,
loss, data, optim, checkpoint, metrics, train; see docs/trainer.md.
"""
