"""The trainstack trainer: a Llama-style decoder trained with FSDP2 and Transformer Engine.

Run as `python -m trainer --recipe FILE` (or through `trainer.entrypoint` on SageMaker, which starts
torchrun on every node); `python -m trainer.export` and `python -m trainer.prepare` are the export and
data-preparation jobs of the same image. Packages by concern; each imports only those below it
(tests/test_architecture.py TRAINER_ALLOWED enforces it, docs/architecture.md draws the data flow):

    __main__.py      `python -m trainer`: arguments, exit codes, the fatal marker
    entrypoint.py    the image's ENTRYPOINT: torchrun across the job's hosts
    train.py         the training loop: recipe -> model, mesh, data, checkpoints, metrics
    validation.py    the validation pass over each held-out split
    export/          checkpoint -> Hugging Face folder (`python -m trainer.export`)
    prepare/         raw text -> token shards (`python -m trainer.prepare`)
    trace/           train.py's own step at full size on fake tensors (`python -m trainer.trace`)
    checkpoint/      save, load, prune, verify, discover and resume from checkpoints
    hf/              Hugging Face weights in (a base model) and out, HF folders locally or in S3
    distributed/     device mesh, FSDP2 sharding, EFA/NCCL checks
    models/          the decoder, its loss, activation checkpointing, precision, the TE API check
    data/            token sources, blends, shard indexes and the dataset manifest
    metrics/         MLflow tracking, TensorBoard files, throughput and MFU
    runtime/         stopping, capacity notices, non-finite losses, test-only fault injection
    config.py        the recipe and its parallel layout as the trainer reads them
    optim.py         optimizer and learning-rate schedule
    storage.py       checkpoint storage, a local directory or S3 (shared by checkpoint/, hf/, export/)

See docs/trainer.md.
"""
