"""The protocol between a training job and the control plane that watches it.

The trainer's metric line (`metrics`: printed by the trainer, parsed by SageMaker's MetricDefinitions,
drawn by the dashboard) and how a job says why it ended (`exit_codes`: exit codes and the fatal marker
the supervisor reads in FailureReason), and where a run's checkpoints are and when one is complete
(`checkpoint_layout`). Standard library only (the training image imports both); may
import nothing else from trainstack.
"""
