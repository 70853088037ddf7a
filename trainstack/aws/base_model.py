"""`model.init_from`'s config.json against the recipe, before anything is paid (plan and launch).

The trainer checks the base model's config.json against the recipe's shape at step 0 (trainer.hf.conversion),
but by then the nodes are paid for and, on a mismatch, the run fails a job per retry. `plan` and `launch`
read the same config.json first, from where the job would: a local folder as it is, an s3:// prefix
through S3 (GetObject of `<prefix>/config.json`: the emulator's S3 with --local, AWS's otherwise; never
on an instance), and compare it with the pure `trainstack.recipes.hf_config.shape_mismatch`: one line
naming the field, the recipe's value and the base's.

    base_problem(shape, config, where)   -> the one line, or None (pure)
    read_base_config(init_from, s3)      -> (config, where), or TrainstackError saying why it cannot be read
    check_init_from(recipe, s3)          -> raises TrainstackError (exit 2) on a mismatch or a missing base
    check_for_launch(recipe, s3, local)  -> check_init_from, but not for a stand-in the emulator would train
    check_for_plan(recipe, local)        -> the same for `plan`, which notes (stderr) a base it cannot read
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from trainstack.errors import TrainstackError
from trainstack.recipes.hf_config import MAX_CONFIG_BYTES, HfConfigError, read_hf_config, shape_mismatch
from trainstack.recipes.schema import ModelShape, Recipe

WHAT = "model.init_from"


class BaseUnreadable(TrainstackError):
    """The base could not be read here (no AWS access, access denied, no network)."""


def config_key(init_from: str) -> tuple[str, str]:
    """(bucket, key) of config.json under an s3:// prefix: the prefix names a folder, with or without
    its trailing slash (the `base` channel copies the folder's files, config.json at its top)."""
    bucket, _, prefix = init_from.removeprefix("s3://").partition("/")
    return bucket, (prefix.rstrip("/") + "/config.json").lstrip("/")


def base_problem(shape: ModelShape, config: dict[str, Any], where: str) -> str | None:
    """The one line a recipe whose base model differs from it is refused with, or None (pure)."""
    try:
        return shape_mismatch(shape, config, f"{WHAT}: {where}")
    except HfConfigError as error:  # a base the trainer cannot hold at all
        return f"{WHAT}: {error}"


def read_base_config(init_from: str, s3: Any | None) -> tuple[dict[str, Any], str]:
    """The base model's config.json and where it was read; TrainstackError (one line) when it cannot be.
    `s3`: a boto3 S3 client for an s3:// base (None: only a local folder can be read)."""
    if not init_from.startswith("s3://"):
        try:
            return read_hf_config(init_from)
        except HfConfigError as error:
            raise TrainstackError(f"{WHAT}: {error}") from None
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.session import explain

    bucket, key = config_key(init_from)
    where = f"s3://{bucket}/{key}"
    if s3 is None:
        raise BaseUnreadable(f"{WHAT}: {where}: cannot be read without AWS access")
    try:
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{MAX_CONFIG_BYTES}")["Body"].read()
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404"):
            raise TrainstackError(
                f"{WHAT}: {where}: no such object (the base model's folder needs its config.json; "
                "copy the whole Hugging Face folder there)"
            ) from None
        if code == "NoSuchBucket":
            raise TrainstackError(f"{WHAT}: {where}: bucket {bucket} does not exist") from None
        raise BaseUnreadable(f"{WHAT}: {where}: cannot be read ({explain(error)})") from None
    except BotoCoreError as error:  # no credentials, no region, no network
        raise BaseUnreadable(f"{WHAT}: {where}: cannot be read ({explain(error)})") from None
    if len(body) > MAX_CONFIG_BYTES:
        raise TrainstackError(f"{WHAT}: {where}: over {MAX_CONFIG_BYTES:,} bytes; is this a config.json?")
    try:
        config = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise TrainstackError(
            f"{WHAT}: {where}: not valid JSON ({' '.join(str(error).split())[:160]})"
        ) from None
    if not isinstance(config, dict):
        raise TrainstackError(f"{WHAT}: {where}: expected a JSON object")
    return config, where


def check_init_from(recipe: Recipe, s3: Any | None) -> None:
    """Refuse (TrainstackError, exit 2) a recipe whose base model cannot be read or differs from it."""
    init_from = recipe.model.init_from
    if not init_from:
        return
    config, where = read_base_config(init_from, s3)
    _refuse(base_problem(recipe.model, config, where))


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise TrainstackError(
            f"{problem}: the trainer would refuse it at step 0, after the nodes are paid for "
            "(`trainstack recipe from-hf` prints the base's model block)"
        )


def trains_a_stand_in(recipe: Recipe) -> bool:
    """EMULATOR: whether the emulator would train a stand-in of `recipe` on this machine, which starts
    from random weights (trainstack.emulator.stand_in drops model.init_from): its base is never read."""
    import os

    from trainstack.emulator import stand_in
    from trainstack.emulator.jobs import RANKS_PER_NODE
    from trainstack.recipes.schema import to_hyperparameters

    decided = stand_in.decide(
        to_hyperparameters(recipe),
        recipe.compute.instance_count,
        RANKS_PER_NODE,
        stand_in.host_memory_bytes(),
        os.cpu_count() or 1,
    )
    return decided.note is not None


def check_for_launch(recipe: Recipe, s3: Any, local: bool) -> None:
    """`launch`'s check: every base the run's first job would read (on the emulator, not a stand-in's)."""
    if local and recipe.model.init_from and trains_a_stand_in(recipe):
        return
    check_init_from(recipe, s3)


def _to_stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def check_for_plan(
    recipe: Recipe,
    local: bool,
    environ: Mapping[str, str] | None = None,
    note: Callable[[str], None] = _to_stderr,
) -> None:
    """`plan`'s check: a local folder always; an s3:// base through the emulator's S3 with --local, else
    through AWS when this machine has access. A plan needs no AWS: a base that cannot be read here (no
    access, another account's bucket, not uploaded yet) is a `note` (the command's stderr; the API's
    on_warning) and the plan stands (`launch` refuses it); a base that differs from the recipe refuses
    the plan (exit 2)."""
    init_from = recipe.model.init_from
    if not init_from or (local and trains_a_stand_in(recipe)):
        return
    s3 = None
    if init_from.startswith("s3://"):
        from botocore.exceptions import BotoCoreError

        from trainstack.aws.session import Aws

        try:
            s3 = Aws(local=local, environ=environ).client("s3")  # environ: trainstack.api's region=
        except (TrainstackError, BotoCoreError) as error:  # no AWS configuration: nothing to read it with
            note(f"note: {WHAT}: {init_from}: not checked ({' '.join(str(error).split())})")
            return
    try:
        config, where = read_base_config(init_from, s3)
    except TrainstackError as error:
        note(f"note: {error}; not checked (`launch` refuses a base it cannot read)")
        return
    _refuse(base_problem(recipe.model, config, where))
