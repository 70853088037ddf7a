"""The trainer's own training step at a recipe's full size, traced on fake tensors (no GPU, no memory).

`python -m trainer.trace --recipe FILE` builds the model the training run builds (trainer.train's
`lay_out_model`: the trainer's model code, context-parallel split, activation checkpointing, FSDP2 or
HSDP sharding over a fake process group of the recipe's world size), materializes it on
`FakeTensorMode` tensors, and runs the training loop's own micro-step and update (trainer.train's
`micro_step` and `update`, chunked loss and AdamW included) for two optimizer steps under torch's
`FSDPMemTracker`. It reports the peak bytes per GPU by category, where the peak falls, the FLOPs the
step ran (model and recompute apart) and the seconds the trace took. `trainstack plan --trace` runs
it as a subprocess (trainstack never imports the trainer) and adds what a trace cannot see
(trainstack.planner.traced; docs/planner.md, "The traced step").

Modules: `fake` (the fake world and the DTensor fake-mode trap), `step` (the trace), `__main__`.
May import `train` (the step's own functions), `config`, `distributed`, `models` and `optim`; of
trainstack, `recipes` and `errors`.
"""
