"""What a run reports besides the metric line: experiment tracking (`tracking`, MLflow) with its
background delivery (`delivery`), TensorBoard event files (`tensorboard`), and throughput, MFU and
straggler figures (`throughput`).

May import nothing else of the trainer.
"""
