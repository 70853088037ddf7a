"""The model: the Llama-style decoder (`model`, Transformer Engine or pure PyTorch), its loss (`loss`),
activation checkpointing (`activation_checkpointing`), mixed precision and FP8 (`precision`), and the
image build's check of the Transformer Engine API they call (`te_requirements`).

May import nothing else of the trainer (torch, Transformer Engine and trainstack's recipes/planner only).
"""
