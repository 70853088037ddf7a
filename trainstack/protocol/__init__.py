"""The protocol between a training job and the control plane that watches it.

The trainer's metric line (`metrics`: printed by the trainer, parsed by SageMaker's MetricDefinitions,
drawn by the dashboard) and how a job says why it ended (`exit_codes`: exit codes and the fatal marker
the supervisor reads in FailureReason), the checkpoint folder's format (`checkpoint_format`: file
names, marker and manifest schema, digests; written by the trainer, read by it and by `trainstack
checkpoints` and `resume --from-step`), and how both ask MLflow (`tracking`: the run's tag; the
sagemaker-mlflow header provider consulted for ARNs only, importing mlflow only when called). Standard
library only at import (the training image imports them); may import nothing else from trainstack.
"""
