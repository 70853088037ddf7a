"""Input channels of a training job that are not the token data: the base model a run starts from."""

from __future__ import annotations

from typing import Any

BASE_CHANNEL = "base"  # the trainer reads SM_CHANNEL_BASE (trainer.hf.conversion.base_folder)


def base_channel(init_from: str) -> dict[str, Any]:
    """The input channel that brings `model.init_from` (an S3 prefix) onto every node before the job
    starts. File mode (per channel: Channel.InputMode overrides the job's TrainingInputMode): the base is
    copied to local disk whole, so the ranks' reads of their own rows are local reads."""
    return {
        "ChannelName": BASE_CHANNEL,
        "InputMode": "File",
        "DataSource": {
            "S3DataSource": {
                "S3DataType": "S3Prefix",
                "S3Uri": init_from,
                "S3DataDistributionType": "FullyReplicated",
            }
        },
    }
