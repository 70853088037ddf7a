"""`trainstack data prepare` on AWS: the CreateProcessingJob request (one pure function) and its checks.

The job runs the training image's `python -m trainer.prepare` on N CPU instances. Each raw-corpus prefix
is a ProcessingInput with `S3DataDistributionType: ShardedByS3Key`, so every instance gets a disjoint
share of the input objects copied to its volume before the container starts (File mode); the tokenizer,
when in S3, is an input every instance gets whole (FullyReplicated). The container writes shards and
per-file completion markers straight to the output prefix (no ProcessingOutput: an upload at the end
would lose a failed job's finished files, and Continuous upload does not order markers after shards),
so a rerun resumes; `--no-finalize` leaves the index to the CLI, the one place that sees every marker.

Conversations (`--format chat`, trainer.prepare.chat_prepare) run the same way, one process per
instance: the container renders them with the base model's chat template, so it needs the base's
tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...) and not its weights.
The CLI stages those few files under the output (`<out>/_prepare/base/`: the processing role may read
and write there) and they are an input every instance gets whole (FullyReplicated); a ProcessingInput
of the base's own prefix would copy its weights, tens of GB, onto every instance.

Why the training image: it already carries the entrypoint, numpy, s3torchconnector (S3 without boto3)
and the trainstack core, and is the image the deployment builds and pins; a second image would be a
second build, registry and pin to keep in step with the trainer's shard format. It adds `tokenizers`
and `pyarrow` (pinned in its Dockerfile). Its CUDA libraries are dead weight on a CPU instance (a
larger pull at start, counted in the planner's START_MINUTES).

`check_processing_request` checks the request against botocore's model of CreateProcessingJob
(ParamValidator, then every member's documented min/max, pattern and enum, via
trainstack.aws.request_check), and the rules the model cannot state.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from trainstack.aws.request_check import Finding, check_against_model
from trainstack.planner.data_prep import PreparePlan

OPERATION = "CreateProcessingJob"
INPUT_ROOT = "/opt/ml/processing/input"
ENTRYPOINT = ["python", "-m", "trainer.prepare"]
# The model's own limits, kept here for messages and tests (botocore's sagemaker service model:
# ProcessingInputs 0-10 items, ContainerArguments 1-100 items of at most 256 characters,
# ProcessingJobName 1-63 characters of [a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}).
MAX_INPUTS = 10
MAX_ARGUMENT_CHARS = 256
JOB_NAME_MAX = 63
CHAT_BASE_INPUT = "base"  # --format chat: the base's tokenizer files, at /opt/ml/processing/input/base
CHAT_BASE_STAGING = "_prepare/base/"  # where the CLI stages them, under the output prefix
# What trainer.prepare.chat reads of a base folder (the template, the special tokens, the tokenizer).
CHAT_BASE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def job_name_prefix(team: str, recipe: str) -> str:
    """`ts-prep-<team>-<recipe>--`: every preparation job of this deployment, and no other's (the
    processing role may be assumed only by these; names as in trainstack.recipes.naming)."""
    return f"ts-prep-{team}-{recipe}--"


def job_name(team: str, recipe: str, now: datetime.datetime) -> str:
    return f"{job_name_prefix(team, recipe)}{now:%y%m%d%H%M%S}"


def create_processing_job_request(
    *,
    job_name: str,
    role_arn: str,
    image_uri: str,
    sources: Sequence[str],
    tokenizer: str,
    out: str,
    plan: PreparePlan,
    region: str,
    kms_key_arn: str | None,
    tags: Mapping[str, str],
    text_field: str = "text",
    validation_fraction: float = 0.005,
    shard_tokens: int | None = None,
    eos_token: str | None = None,
    fmt: str = "text",
    seq_len: int | None = None,
) -> dict[str, Any]:
    """`fmt` "chat": `tokenizer` is the S3 prefix the base's tokenizer files are staged under (module
    doc) and `seq_len` the training sequence length; `text_field` and `eos_token` do not apply."""
    inputs, arguments = [], []
    for i, source in enumerate(sources):
        local = f"{INPUT_ROOT}/src{i}"
        inputs.append(_input(f"src{i}", source, local, "ShardedByS3Key"))
        arguments.append(f"{local}={source}")  # names each file by its S3 URI (markers, manifest)
    if fmt == "chat":
        base = f"{INPUT_ROOT}/{CHAT_BASE_INPUT}"
        inputs.append(_input(CHAT_BASE_INPUT, tokenizer.rstrip("/") + "/", base, "FullyReplicated"))
        arguments = ["--format", "chat", *arguments, "--tokenizer", base, "--out", out]
        arguments += ["--seq-len", str(seq_len), "--validation-fraction", repr(validation_fraction)]
        arguments += ["--no-finalize"] + (["--shard-tokens", str(shard_tokens)] if shard_tokens else [])
        return _request(job_name, role_arn, image_uri, inputs, arguments, plan, region, kms_key_arn, tags)
    tokenizer_argument = tokenizer
    if tokenizer.startswith("s3://"):
        prefix, _, name = tokenizer.rpartition("/")
        inputs.append(_input("tokenizer", f"{prefix}/", f"{INPUT_ROOT}/tokenizer", "FullyReplicated"))
        tokenizer_argument = f"{INPUT_ROOT}/tokenizer/{name}"
    arguments += ["--tokenizer", tokenizer_argument, "--out", out, "--text-field", text_field]
    arguments += ["--validation-fraction", repr(validation_fraction), "--no-finalize"]
    if shard_tokens:
        arguments += ["--shard-tokens", str(shard_tokens)]
    if eos_token:
        arguments += ["--eos-token", eos_token]
    return _request(job_name, role_arn, image_uri, inputs, arguments, plan, region, kms_key_arn, tags)


def _request(job_name, role_arn, image_uri, inputs, arguments, plan, region, kms_key_arn, tags) -> dict:
    cluster: dict[str, Any] = {
        "InstanceCount": plan.instance_count,
        "InstanceType": plan.instance.name,
        "VolumeSizeInGB": plan.volume_gb,
    }
    if kms_key_arn:
        cluster["VolumeKmsKeyId"] = kms_key_arn
    return {
        "ProcessingJobName": job_name,
        "ProcessingInputs": inputs,
        "ProcessingResources": {"ClusterConfig": cluster},
        "StoppingCondition": {"MaxRuntimeInSeconds": plan.max_runtime_s},
        "AppSpecification": {
            "ImageUri": image_uri,
            "ContainerEntrypoint": list(ENTRYPOINT),
            "ContainerArguments": arguments,
        },
        # The container's own S3 client (s3torchconnector) needs the region; one worker per core.
        "Environment": {"AWS_REGION": region, "TOKENIZERS_PARALLELISM": "false"},
        "RoleArn": role_arn,
        "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
    }


def _input(name: str, uri: str, local: str, distribution: str) -> dict[str, Any]:
    return {
        "InputName": name,
        "S3Input": {
            "S3Uri": uri,
            "LocalPath": local,
            "S3DataType": "S3Prefix",
            "S3InputMode": "File",
            "S3DataDistributionType": distribution,
        },
    }


def check_processing_request(request: Mapping[str, Any]) -> list[Finding]:
    """What SageMaker would refuse: botocore's model of CreateProcessingJob, then cross-field rules."""
    found = check_against_model("sagemaker", OPERATION, request)
    inputs = request.get("ProcessingInputs") or []
    names = [i.get("InputName") for i in inputs]
    if len(set(names)) != len(names):
        # Not in the model; our own rule: each input is named for the instance's logs and describe output.
        found.append(Finding("ProcessingInputs", "input names must be unique"))
    for i, item in enumerate(inputs):
        local = (item.get("S3Input") or {}).get("LocalPath", "")
        # "LocalPath is an absolute path to the input data and must begin with /opt/ml/processing/"
        # (API reference, ProcessingS3Input.LocalPath; the model's pattern is only `.*`).
        if not local.startswith("/opt/ml/processing/"):
            where = f"ProcessingInputs[{i}].S3Input.LocalPath"
            found.append(Finding(where, f"{local!r} does not begin with /opt/ml/processing/"))
    shared = [i for i in inputs if (i.get("S3Input") or {}).get("S3DataDistributionType") == "ShardedByS3Key"]
    count = request.get("ProcessingResources", {}).get("ClusterConfig", {}).get("InstanceCount", 1)
    if count > 1 and not shared:
        found.append(
            Finding(
                "ProcessingInputs", "several instances but no ShardedByS3Key input: each would redo all of it"
            )
        )
    return found
