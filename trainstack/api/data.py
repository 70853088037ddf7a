"""`data_prepare`: raw text in (JSONL, Parquet, plain text), token shards out (docs/data.md).

Where it runs:
- here, when the inputs or the output are local, or with `here=True`: `python -m trainer.prepare` (the
  training image's entrypoint, installed with this checkout) with one worker process per core;
- here against the local emulator's S3 with `local=True` (s3:// paths are the emulator's);
- on AWS otherwise (every source and `out` are s3://): a SageMaker Processing job over N CPU instances
  of the deployment's training image, run by the data stack's processing role. N and the instance type
  come from the input's size (trainstack.planner.data_prep); the request is checked against botocore's
  model (trainstack.aws.processing). When the job ends the index and manifest are written here from the
  files' completion markers; running it again resumes an interrupted preparation.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainstack.api.results import OnProgress, Result, report
from trainstack.errors import TrainstackError

POLL_S = 30  # seconds between DescribeProcessingJob polls while waiting
_ENTRY = ("text_field", "validation_fraction", "eos_token", "shard_tokens", "max_bad_records")


@dataclass(frozen=True)
class DataPrepareResult(Result):
    """How a preparation went. `where`: "here" (trainer.prepare ran in this environment; `exit_code` is
    its status) or "aws" (a Processing job: `job`, `plan`; `request` is the CreateProcessingJob request,
    which a dry run only builds). `to_json()`: the request (what `--dry-run` prints after the plan)."""

    where: str
    exit_code: int = 0
    job: str | None = None
    plan: str | None = None  # the processing plan, in one line
    request: dict[str, Any] | None = None
    started: bool = False  # a Processing job was created

    def to_document(self) -> Any:
        return json.loads(json.dumps(self.request))


def data_prepare(
    sources: Sequence[str],
    *,
    tokenizer: str,
    out: str,
    text_field: str = "text",
    fmt: str = "text",
    seq_len: int | None = None,
    validation_fraction: float = 0.005,
    eos_token: str | None = None,
    shard_tokens: int | None = None,
    workers: int | None = None,
    max_bad_records: int = 100,
    local: bool = False,
    here: bool = False,
    recipe: str | None = None,
    team: str | None = None,
    region: str | None = None,
    instance_type: str | None = None,
    instance_count: int | None = None,
    usd_per_instance_hour: float | None = None,
    image_uri: str | None = None,
    dry_run: bool = False,
    wait: bool = True,
    timeout: float | None = None,
    overwrite: bool = False,
    on_step: OnProgress = None,
    on_progress: OnProgress = None,
) -> DataPrepareResult:
    """Tokenize `sources` into token shards at `out` (`trainstack data prepare`): a Megatron .bin/.idx
    per shard, index.json and manifest.json. `fmt` "chat": JSONL conversations rendered by the chat
    template of the base model folder given as `tokenizer`, `seq_len` tokens at most each.

    On AWS (every path s3://, neither `local` nor `here`): `recipe` names the deployment whose
    processing role and image run the job; `dry_run` builds and checks the request only; `wait` polls
    the job until it ends (at most `timeout` seconds: then one line, the job running on) and then writes
    the index here. `on_step` gets the lines the command prints on
    stdout as it goes (the plan, the job started), `on_progress` those on stderr (the job's progress)."""
    sources = list(sources)
    if workers is not None and workers < 1:
        raise TrainstackError(f"--workers {workers}: expected at least 1 (default: one per core)")
    remote = all(s.startswith("s3://") for s in sources) and out.startswith("s3://")
    options: dict[str, Any] = dict(
        text_field=text_field,
        validation_fraction=validation_fraction,
        eos_token=eos_token,
        shard_tokens=shard_tokens,
        max_bad_records=max_bad_records,
    )
    if fmt != "text":
        on_aws = remote and not (local or here)
        options.update(_chat_options(fmt, seq_len, on_aws, workers, text_field, eos_token))
    if local or here or not remote:
        code = run_here(sources, tokenizer, out, workers=workers, local=local, overwrite=overwrite, **options)
        return DataPrepareResult("here", code)
    if overwrite:
        raise TrainstackError(
            f"--overwrite: {out} is in S3, where data prepare deletes nothing; empty it first "
            f"(`aws s3 rm --recursive {out}`) or give another --out"
        )
    if recipe is None:
        raise TrainstackError(
            "--recipe: needed to run on AWS (its data stack's processing role and image run the job); "
            "or pass --here to run on this machine"
        )
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.session import explain

    try:
        return run_on_aws(
            sources,
            tokenizer,
            out,
            recipe=recipe,
            team=team,
            region=region,
            instance_type=instance_type,
            instance_count=instance_count,
            usd_per_instance_hour=usd_per_instance_hour,
            image_uri=image_uri,
            dry_run=dry_run,
            wait=wait,
            timeout=timeout,
            on_step=on_step,
            on_progress=on_progress,
            **options,
        )
    except (BotoCoreError, ClientError) as error:  # the line the command prints for an AWS refusal
        raise TrainstackError(f"AWS request failed: {explain(error)}") from None


def _chat_options(fmt: str, seq_len: int | None, on_aws: bool, workers, text_field, eos_token) -> dict:
    """`--format chat`'s options (trainer.prepare.chat_prepare), or one line for what it does not take."""
    if fmt != "chat":
        raise TrainstackError(f"--format {fmt}: expected text or chat")
    if seq_len is None or seq_len < 2:
        raise TrainstackError(
            f"--seq-len{'' if seq_len is None else f' {seq_len}'}: --format chat needs the training sequence "
            "length (at least 2 tokens): longer conversations are dropped, never cut"
        )
    given = {"--workers": workers is not None, "--text-field": text_field != "text", "--eos-token": eos_token}
    refused = next((name for name, used in given.items() if used), None)
    if refused:
        raise TrainstackError(
            f"{refused}: not taken with --format chat (one process; the conversation is `messages`, the end "
            "of turn is the base folder's)"
        )
    return {"format": "chat", "seq_len": seq_len}


def entrypoint_args(sources: list[str], tokenizer: str, out: str, **options: Any) -> list[str]:
    """trainer.prepare's command line for these options."""
    if options.get("format") == "chat":  # trainer.prepare.chat_prepare's command line
        args = ["--format", "chat", *sources, "--tokenizer", tokenizer, "--out", out]
        args += ["--seq-len", str(options["seq_len"])]
        args += ["--validation-fraction", repr(options["validation_fraction"])]
        if options.get("shard_tokens") is not None:
            args += ["--shard-tokens", str(options["shard_tokens"])]
        return args + (["--overwrite"] if options.get("overwrite") else [])
    args = [*sources, "--tokenizer", tokenizer, "--out", out, "--text-field", options["text_field"]]
    args += ["--validation-fraction", repr(options["validation_fraction"])]
    args += ["--max-bad-records", str(options["max_bad_records"])]
    for name in ("eos_token", "shard_tokens", "workers"):
        if options.get(name) is not None:
            args += [f"--{name.replace('_', '-')}", str(options[name])]
    if options.get("overwrite"):
        args.append("--overwrite")
    return args


def _dies_with(parent: int):
    """A preexec function: the child gets SIGKILL when this process ends, however it ends (Linux
    PR_SET_PDEATHSIG), so a `kill -9` of `trainstack data prepare` does not leave `trainer.prepare`
    writing shards and markers beside the rerun that resumes it (its own pool workers die with it the
    same way; trainer.prepare.pipeline)."""

    def preexec() -> None:
        if sys.platform != "linux":
            return
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was in place
            os._exit(1)

    return preexec


def run_here(sources: list[str], tokenizer: str, out: str, *, local: bool, **options: Any) -> int:
    """The training image's entrypoint, `python -m trainer.prepare`, in this environment: its exit status
    (130 on Ctrl-C)."""
    from trainstack.aws.session import environment

    env = environment(local)
    if local:  # the emulator only: never a real profile
        env = {**env, "AWS_ENDPOINT_URL_S3": env["AWS_ENDPOINT_URL"]}
    command = [sys.executable, "-m", "trainer.prepare", *entrypoint_args(sources, tokenizer, out, **options)]
    try:
        return subprocess.run(command, env=env, preexec_fn=_dies_with(os.getpid())).returncode
    except KeyboardInterrupt:
        return 130


def _refuse_another_corpus(s3: Any, out: str, inputs: dict[str, int]) -> None:
    """`--out` holds files finished for inputs other than these (trainer.prepare's completion markers):
    another corpus prepared there. The processing job would write beside it and the final index replace
    it; refused in one line before the job, as trainer.prepare refuses it here."""
    bucket = out.removeprefix("s3://").partition("/")[0]
    foreign = []
    for uri in _listing(s3, out.rstrip("/") + "/_prepare/done/"):
        if uri.endswith(".json"):
            key = uri.removeprefix(f"s3://{bucket}/")
            marker = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
            if marker.get("uri") not in inputs:
                foreign.append(marker.get("uri"))
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise TrainstackError(
            f"--out {out}: holds a dataset prepared from other files ({sorted(foreign)[0]}{more}, not among "
            "the inputs given); give another --out, or empty it first (data prepare deletes nothing in S3)"
        )


def _listing(s3: Any, uri: str) -> dict[str, int]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[f"s3://{bucket}/{item['Key']}"] = item["Size"]
    return found


def run_on_aws(
    sources: list[str],
    tokenizer: str,
    out: str,
    *,
    recipe: str,
    team: str | None,
    region: str | None = None,
    timeout: float | None = None,
    on_step: OnProgress = None,
    on_progress: OnProgress = None,
    **opts: Any,
) -> DataPrepareResult:
    """A SageMaker Processing job over the planned instances, run by the deployment's processing role."""
    from trainstack.aws.processing import check_processing_request, create_processing_job_request, job_name
    from trainstack.aws.request import tags
    from trainstack.aws.request_check import PLACEHOLDERS
    from trainstack.aws.session import Aws
    from trainstack.planner.data_prep import format_of, plan_prepare
    from trainstack.recipes import naming
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe, team=team).recipe
    team_name = team or resolved.tags.team
    aws = Aws(environ=None if region is None else {**os.environ, "AWS_REGION": region})
    s3 = aws.client("s3")
    sizes: dict[str, int] = {}
    for source in sources:
        listed = {u: n for u, n in _listing(s3, source).items() if not u.endswith("/")}
        if not listed:
            raise TrainstackError(f"{source}: no objects under this prefix in {aws.where}")
        sizes.update(listed)
    _refuse_another_corpus(s3, out, sizes)  # before the instances are paid for, not at the finalize
    by_format: dict[str, int] = {}
    for uri, size in sizes.items():
        by_format[format_of(uri)] = by_format.get(format_of(uri), 0) + size
    chat = opts.get("format") == "chat"
    planned = plan_prepare(
        by_format,
        len(sizes),
        chat=chat,
        instance_type=opts["instance_type"],
        instance_count=opts["instance_count"],
        usd_per_instance_hour=opts["usd_per_instance_hour"],
    )
    report(on_step, f"plan: {planned.describe()}")
    prefix = naming.stack_prefix(resolved, team)
    hint = f"npx cdk deploy --all -c recipe={recipe}" + (f" -c team={team}" if team else "")
    try:
        data_outputs = aws.stack_outputs(f"{prefix}-Data", hint)
        image = opts["image_uri"] or aws.stack_outputs(f"{prefix}-Launcher", hint).get("ImageUri")
    except TrainstackError:
        if not opts["dry_run"]:
            raise
        data_outputs, image = {}, None
    role, key = data_outputs.get("ProcessingRoleArn"), data_outputs.get("KeyArn")
    if opts["dry_run"] and not (role and image):
        report(on_progress, f"(not deployed in {aws.where}: placeholders stand for the role, key and image)")
        role, key = role or PLACEHOLDERS["role_arn"], key or PLACEHOLDERS["kms_key_arn"]
        image = image or PLACEHOLDERS["image_uri"]
    if not role:
        raise TrainstackError(
            f"stack {prefix}-Data has no processing role: set data.corpus_s3_uris (and "
            f"data.train_s3_uri) in the recipe or team file and run {hint}"
        )
    if not image:
        raise TrainstackError(
            f"stack {prefix}-Launcher has no ImageUri output: redeploy it ({hint}), or pass --image-uri"
        )
    name = job_name(team_name, resolved.name, datetime.datetime.now(datetime.UTC))
    # --format chat: the base folder's tokenizer files go to the job (trainstack.aws.processing), not
    # its weights; staged only once the deployment is known to be there
    staged = _stage_chat_base(s3, tokenizer, out, opts["dry_run"]) if chat else ""
    request = create_processing_job_request(
        job_name=name,
        role_arn=role,
        image_uri=image,
        sources=sources,
        tokenizer=tokenizer if not chat else staged,
        out=out,
        plan=planned,
        region=aws.region,
        kms_key_arn=key,
        tags=tags(resolved, team),
        text_field=opts["text_field"],
        validation_fraction=opts["validation_fraction"],
        shard_tokens=opts["shard_tokens"],
        eos_token=opts["eos_token"],
        **({"fmt": "chat", "seq_len": opts["seq_len"]} if chat else {}),
    )
    findings = check_processing_request(request)
    if findings:
        raise TrainstackError(f"the CreateProcessingJob request would be refused: {findings[0]}")
    described = planned.describe()
    if opts["dry_run"]:
        return DataPrepareResult("aws", 0, name, described, request)
    sagemaker = aws.client("sagemaker")
    sagemaker.create_processing_job(**request)
    report(on_step, f"started processing job {name} in {aws.where}")
    if not opts["wait"]:
        report(
            on_step, "rerun this command when it has ended: it then writes the dataset's index and manifest"
        )
        return DataPrepareResult("aws", 0, name, described, request, started=True)
    wait_for_job(sagemaker, s3, name, out, len(sizes), on_progress, timeout)
    if chat:  # the indexes of a chat set, from the markers, with the same base folder
        finalize = {k: opts[k] for k in ("format", "seq_len", "validation_fraction", "shard_tokens")}
        code = run_here(sources, tokenizer, out, local=False, **finalize)
    else:
        code = run_here(sources, tokenizer, out, local=False, workers=1, **{k: opts[k] for k in _ENTRY})
    return DataPrepareResult("aws", code, name, described, request, started=True)


def _stage_chat_base(s3: Any, base: str, out: str, dry_run: bool) -> str:
    """Copy the base folder's tokenizer files (trainstack.aws.processing.CHAT_BASE_FILES) to
    `<out>/_prepare/base/`, where the job reads them; that prefix (a dry run copies nothing)."""
    from pathlib import Path

    from trainstack.aws.processing import CHAT_BASE_FILES, CHAT_BASE_STAGING

    folder = Path(base)
    if base.startswith("s3://") or not folder.is_dir():
        raise TrainstackError(
            f"--tokenizer {base}: --format chat takes the base model's folder on this machine (its "
            "tokenizer.json and tokenizer_config.json or chat_template.jinja); it is staged for the job"
        )
    files = [folder / name for name in CHAT_BASE_FILES if (folder / name).is_file()]
    if not any(f.name == "tokenizer.json" for f in files):
        raise TrainstackError(f"--tokenizer {base}: no tokenizer.json in the base folder")
    staged = out.rstrip("/") + "/" + CHAT_BASE_STAGING
    bucket, _, prefix = staged.removeprefix("s3://").partition("/")
    if not dry_run:
        for path in files:
            s3.upload_file(str(path), bucket, prefix + path.name)
    return staged


def wait_for_job(
    sagemaker: Any,
    s3: Any,
    name: str,
    out: str,
    files: int,
    on_progress: OnProgress = None,
    timeout: float | None = None,
) -> None:
    """Poll the job; report files done (their markers) and the ETA until it ends; one line if it failed
    or is still running after `timeout` seconds (it runs on: rerunning the command waits again)."""
    started = time.monotonic()
    while True:
        job = sagemaker.describe_processing_job(ProcessingJobName=name)
        status = job["ProcessingJobStatus"]
        done = [u for u in _listing(s3, out.rstrip("/") + "/_prepare/done/") if u.endswith(".json")]
        elapsed = time.monotonic() - started
        eta = (files - len(done)) * elapsed / len(done) if done else float("nan")
        shown = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        report(on_progress, f"{name}: {status}, {len(done)}/{files} files done, ETA {shown}")
        if status in ("Completed", "Failed", "Stopped"):
            break
        if timeout is not None and elapsed >= timeout:
            raise TrainstackError(
                f"processing job {name} still {status} after {timeout:.0f} s; it runs on: rerun this command "
                "to wait for it and write the dataset's index"
            )
        time.sleep(POLL_S)
    if status != "Completed":
        raise TrainstackError(
            f"processing job {name} {status.lower()}: {job.get('FailureReason', 'no reason given')}; files "
            "finished so far are kept, rerun this command to resume"
        )
