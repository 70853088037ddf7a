"""A run's checkpoints on S3, as `resume --from-step` needs them: which steps are there, and whether one
is complete (trainstack.protocol.checkpoint_layout's rule, read through a boto3 S3 client)."""

from __future__ import annotations

from typing import Any

from trainstack.protocol.checkpoint_layout import STEP_DIR, completeness_problem, step_dir_name


def _split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix if not prefix or prefix.endswith("/") else prefix + "/"


def steps(s3: Any, checkpoint_uri: str) -> list[int]:
    """Every step folder under the run's prefix (complete or not), newest first."""
    bucket, prefix = _split(checkpoint_uri)
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            match = STEP_DIR.match(common["Prefix"][len(prefix) :].rstrip("/"))
            if match:
                found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def step_problem(s3: Any, checkpoint_uri: str, step: int) -> str | None:
    """Why step `step` of the run is not a complete checkpoint to resume from, or None when it is."""
    bucket, prefix = _split(checkpoint_uri)
    folder = f"{prefix}{step_dir_name(step)}/"
    sizes: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder):
        for item in page.get("Contents", []):
            sizes[item["Key"][len(folder) :]] = item["Size"]
    if not sizes:
        return f"there is no checkpoint of step {step} under {checkpoint_uri}"

    def read(name: str) -> bytes | None:
        if name not in sizes:
            return None
        return s3.get_object(Bucket=bucket, Key=folder + name)["Body"].read()

    return completeness_problem(read, lambda: sizes)
