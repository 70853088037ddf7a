"""A fine-tuning recipe's prepared chat set, read for the plan: its manifest.json, where the job reads it.

`plan` of a `training.objective: sft` recipe prices the run in epochs over the set
(trainstack.planner.fine_tuning), from `<data.train_s3_uri>/manifest.json` as `data prepare --format
chat` wrote it: through the emulator's S3 with --local, AWS's otherwise (GetObject, capped at
MAX_MANIFEST_BYTES). A plan needs no AWS and no data: a manifest it cannot read here (no access, not
prepared yet) leaves the epochs unpriced in one line and the rest of the plan stands; a manifest that is
not a chat set's refuses the plan in one line (the trainer would refuse it at step 0, after the nodes
are paid for).

The set was rendered with one chat template (the manifest's `chat.template_sha256`); the export ships the
template of `export.tokenizer`, else of the base (`model.init_from`). When they differ the model learns
one format and is served with another: `plan` says so in a note (read as the set's template was chosen:
chat_template.jinja, else tokenizer_config.json's `chat_template`, as trainer.prepare.chat.find_template).

    read_manifest(uri, s3)               -> (manifest, where), or TrainstackError / ManifestUnreadable
    fine_tuning_for_plan(recipe, plan, local) -> (the `fine_tuning` JSON block, the lines to print)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainstack.errors import TrainstackError
from trainstack.planner.fine_tuning import ManifestProblem, plan_fine_tuning, summary_lines, unpriced_line
from trainstack.recipes.schema import Recipe

WHAT = "data.train_s3_uri"
MANIFEST = "manifest.json"
# A chat set's manifest is a few KB (its first 20 skipped lines are its longest part); a megabyte
# bounds what a wrong URI can make the CLI read.
MAX_MANIFEST_BYTES = 2**20


class ManifestUnreadable(TrainstackError):
    """The manifest could not be read here (no AWS access, not prepared yet, access denied)."""


def manifest_key(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, (prefix.rstrip("/") + "/" + MANIFEST).lstrip("/")


def read_manifest(uri: str, s3: Any | None) -> tuple[dict[str, Any], str]:
    """The set's manifest.json and where it was read. ManifestUnreadable when it cannot be read here;
    TrainstackError (one line) when what is there is not JSON."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.session import explain

    bucket, key = manifest_key(uri)
    where = f"s3://{bucket}/{key}"
    if s3 is None:
        raise ManifestUnreadable(f"{where}: cannot be read without AWS access")
    try:
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{MAX_MANIFEST_BYTES}")["Body"].read()
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404"):
            raise ManifestUnreadable(f"{where}: no such object (not prepared yet?)") from None
        if code == "NoSuchBucket":
            raise ManifestUnreadable(f"{where}: bucket {bucket} does not exist") from None
        raise ManifestUnreadable(f"{where}: cannot be read ({explain(error)})") from None
    except BotoCoreError as error:  # no credentials, no region, no network
        raise ManifestUnreadable(f"{where}: cannot be read ({explain(error)})") from None
    if len(body) > MAX_MANIFEST_BYTES:
        raise TrainstackError(f"{WHAT}: {where}: over {MAX_MANIFEST_BYTES:,} bytes; is this a manifest.json?")
    try:
        return json.loads(body), where
    except (ValueError, RecursionError) as error:
        raise TrainstackError(
            f"{WHAT}: {where}: not valid JSON ({' '.join(str(error).split())[:160]})"
        ) from None


TEMPLATE_FILE, CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"
# Some tokenizer_config.json files list every added token (a few MB); a folder's template file is small.
MAX_TOKENIZER_CONFIG_BYTES = 32 * 2**20


def template_source(read: Any) -> str | None:
    """The chat template of a tokenizer folder (`read(name)`: the file's bytes or None), picked as
    transformers and trainer.prepare.chat.find_template pick it; None when it has none."""
    raw = read(TEMPLATE_FILE)
    if raw is not None:
        return raw.decode("utf-8")
    raw = read(CONFIG_FILE)
    if raw is None:
        return None
    template = json.loads(raw).get("chat_template")
    if isinstance(template, list):  # named templates: [{name, template}, ...], `default` used
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) and template.strip() else None


def _folder_reader(location: str, s3: Any | None) -> Any:
    """read(name) for a local folder or an s3:// prefix (None where a file is absent)."""
    if not location.startswith("s3://"):
        folder = Path(location)
        return lambda name: (folder / name).read_bytes() if (folder / name).is_file() else None
    if s3 is None:
        raise ManifestUnreadable(f"{location}: cannot be read without AWS access")
    from botocore.exceptions import ClientError

    bucket, _, prefix = location.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""

    def read(name: str) -> bytes | None:
        try:
            ranged = f"bytes=0-{MAX_TOKENIZER_CONFIG_BYTES}"
            return s3.get_object(Bucket=bucket, Key=prefix + name, Range=ranged)["Body"].read()
        except ClientError as error:
            if error.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404"):
                return None
            raise

    return read


def template_note(
    recipe: Recipe, manifest: dict[str, Any], s3: Any | None
) -> tuple[dict[str, Any], str | None]:
    """(the `template` block of `fine_tuning`, a note line when the export would ship another chat
    template than the set was rendered with, or none). A folder that cannot be read is not compared."""
    expected = (manifest.get("chat") or {}).get("template_sha256")
    location = recipe.export.tokenizer or recipe.model.init_from
    block: dict[str, Any] = {"set_sha256": expected, "shipped_from": location, "shipped_sha256": None}
    if not isinstance(expected, str) or location is None:
        return {**block, "compared": False}, None
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        source = template_source(_folder_reader(location, s3))
    except (ManifestUnreadable, BotoCoreError, ClientError, OSError, ValueError, UnicodeDecodeError):
        return {**block, "compared": False}, None
    field = "export.tokenizer" if recipe.export.tokenizer else "model.init_from"
    if source is None:
        return {**block, "compared": True, "same": False}, (
            f"fine-tuning note: {field} {location} has no chat template: the export ships the template of "
            "that folder, and an sft export without one is refused (set export.tokenizer to the folder the "
            "set was prepared with)"
        )
    shipped = hashlib.sha256(source.encode("utf-8")).hexdigest()
    block = {**block, "shipped_sha256": shipped, "compared": True, "same": shipped == expected}
    if shipped == expected:
        return block, None
    return block, (
        f"fine-tuning note: the set was rendered with another chat template (sha256 {expected[:12]}...) than "
        f"the one the export ships from {field} {location} ({shipped[:12]}...): the model would learn one "
        "format and be served with another; prepare the set with that folder, or set export.tokenizer to "
        "the folder it was prepared with"
    )


def _s3(local: bool, environ: Mapping[str, str] | None = None) -> tuple[Any | None, str | None]:
    """An S3 client (the emulator's with --local), or None and why there is none."""
    from botocore.exceptions import BotoCoreError

    from trainstack.aws.session import Aws

    try:
        return Aws(local=local, environ=environ).client("s3"), None
    except (TrainstackError, BotoCoreError) as error:
        return None, " ".join(str(error).split())


def fine_tuning_for_plan(
    recipe: Recipe, plan: Any, local: bool, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """`plan`'s fine-tuning block: (the JSON `fine_tuning` value, the lines printed after the plan), or
    (None, []) for a pretraining recipe. Raises TrainstackError (exit 2, one line naming
    data.train_s3_uri) when the manifest there is not a chat set's."""
    uri = recipe.data.train_s3_uri
    if recipe.training.objective != "sft" or uri is None:
        return None, []
    bucket, key = manifest_key(uri)
    where = f"s3://{bucket}/{key}"
    s3, why = _s3(local, environ)  # environ: trainstack.api's region=
    try:
        if s3 is None:
            raise ManifestUnreadable(f"{where}: not read ({why})")
        manifest, where = read_manifest(uri, s3)
    except ManifestUnreadable as error:
        reason = str(error).removeprefix(f"{where}: ")
        return {"manifest": where, "priced": False, "reason": reason}, [unpriced_line(recipe, where, reason)]
    run = plan.run
    try:
        figures = plan_fine_tuning(
            recipe, manifest, where, run.hours + run.validation_hours, plan.cost.total_usd
        )
    except ManifestProblem as problem:
        raise TrainstackError(f"{WHAT}: {problem}") from None
    template, note = template_note(recipe, manifest, s3)
    lines = summary_lines(figures, recipe) + ([note] if note else [])
    return {**figures.to_dict(), "priced": True, "template": template}, lines
