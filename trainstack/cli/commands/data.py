"""`trainstack data prepare`: raw text in (JSONL, Parquet, plain text), token shards out (docs/data.md).

Where it runs:
- here, when the inputs or the output are local, or with `--here`: `python -m trainer.prepare` (the
  training image's entrypoint, installed with this checkout) with one worker process per core;
- here against the local emulator's S3 with `--local` (s3:// paths are the emulator's);
- on AWS otherwise (every SRC and --out are s3://): a SageMaker Processing job over N CPU instances of
  the deployment's training image, run by the data stack's processing role (deploy the recipe with
  `data.corpus_s3_uris` set). N and the instance type come from the input's size
  (trainstack.planner.data_prep); the plan is printed first, the request checked against botocore's
  model (trainstack.aws.processing). When the job ends this command writes the dataset's index and
  manifest from the files' completion markers; rerunning it resumes an interrupted preparation.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from typing import Annotated, Any

import typer

from trainstack.errors import TrainstackError

data_app = typer.Typer(
    help="Prepare training data: tokenize raw text into token shards.", no_args_is_help=True
)
POLL_S = 30


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


@data_app.command("prepare")
def prepare(
    sources: Annotated[
        list[str], typer.Argument(metavar="SRC...", help="files, directories or s3:// prefixes")
    ],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", help="tokenizer.json (local path or s3://), or 'bytes' (byte level)")
    ],
    out: Annotated[
        str, typer.Option("--out", help="output directory or s3:// prefix (empty, or this dataset's)")
    ],
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL field / Parquet column")] = "text",
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="text (documents) or chat (JSONL conversations, rendered by the chat template of the base "
            "model folder given as --tokenizer; docs/sft.md)",
        ),
    ] = "text",
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="chat: the training sequence length (longer ones dropped)")
    ] = None,
    validation_fraction: Annotated[
        float, typer.Option("--validation-fraction", help="share of documents held out (by hash); 0: none")
    ] = 0.005,
    eos_token: Annotated[str | None, typer.Option("--eos-token", help="end-of-document token")] = None,
    shard_tokens: Annotated[int | None, typer.Option("--shard-tokens", help="tokens per shard file")] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", help="worker processes here (default: cores)")
    ] = None,
    max_bad_records: Annotated[
        int,
        typer.Option(
            "--max-bad-records", help="per file: non-UTF-8/non-JSON records skipped before it stops"
        ),
    ] = 100,
    local: Annotated[bool, typer.Option("--local", help="run here against the local emulator's S3")] = False,
    here: Annotated[bool, typer.Option("--here", help="run here even when every path is s3://")] = False,
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", help="AWS: the deployment (recipe) whose processing role runs it"),
    ] = None,
    team: Annotated[str | None, typer.Option("--team", help="AWS: the deployment's team")] = None,
    instance_type: Annotated[
        str | None, typer.Option("--instance-type", help="AWS: processing instance type")
    ] = None,
    instance_count: Annotated[
        int | None, typer.Option("--instance-count", help="AWS: instances (default: planned)")
    ] = None,
    usd_per_instance_hour: Annotated[
        float | None, typer.Option("--usd-per-instance-hour", help="AWS: price for the estimate")
    ] = None,
    image_uri: Annotated[
        str | None, typer.Option("--image-uri", help="AWS: image (default: the deployment's)")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="AWS: print the plan and the request; start nothing")
    ] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="AWS: start the job and return")] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="replace a dataset of other files already in a local --out"),
    ] = False,
) -> None:
    """Tokenize SRC... into token shards at --out: JSONL (--text-field), Parquet (a column) or plain text.

    Writes a Megatron .bin/.idx per shard, index.json and manifest.json (tokenizer hash, documents and
    tokens per source, the validation split under <out>/validation/). Rerun the same command to resume.

    Examples:

      trainstack data prepare README.md docs/ --tokenizer bytes --out /tmp/shards

      trainstack data prepare s3://corpus/web/ --tokenizer s3://corpus/t.json --out s3://d/t/ --recipe 8b-fp8

      trainstack data prepare s3://demo-corpus/ --tokenizer bytes --out s3://demo-data/tokens/ --local
    """
    if workers is not None and workers < 1:
        raise TrainstackError(f"--workers {workers}: expected at least 1 (default: one per core)")
    remote = all(s.startswith("s3://") for s in sources) and out.startswith("s3://")
    options = dict(
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
        raise typer.Exit(code)
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
    run_on_aws(
        sources,
        tokenizer,
        out,
        recipe=recipe,
        team=team,
        instance_type=instance_type,
        instance_count=instance_count,
        usd_per_instance_hour=usd_per_instance_hour,
        image_uri=image_uri,
        dry_run=dry_run,
        wait=not no_wait,
        **options,
    )


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
    if on_aws:
        raise TrainstackError(
            "--format chat: a SageMaker Processing job for conversations is not built yet; pass --here (or "
            "--local for the emulator) to prepare them on this machine"
        )
    return {"format": "chat", "seq_len": seq_len}


def entrypoint_args(sources: list[str], tokenizer: str, out: str, **options: Any) -> list[str]:
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
        import os
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was in place
            os._exit(1)

    return preexec


def run_here(sources: list[str], tokenizer: str, out: str, *, local: bool, **options: Any) -> int:
    """The training image's entrypoint, `python -m trainer.prepare`, in this environment."""
    from trainstack.aws.session import environment

    env = environment(local)
    if local:  # the emulator only: never a real profile
        env = {**env, "AWS_ENDPOINT_URL_S3": env["AWS_ENDPOINT_URL"]}
    import os

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
    sources: list[str], tokenizer: str, out: str, *, recipe: str, team: str | None, **opts: Any
) -> None:
    from trainstack.aws.processing import check_processing_request, create_processing_job_request, job_name
    from trainstack.aws.request import tags
    from trainstack.aws.request_check import PLACEHOLDERS
    from trainstack.aws.session import Aws
    from trainstack.planner.data_prep import format_of, plan_prepare
    from trainstack.recipes import naming
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe, team=team).recipe
    team_name = team or resolved.tags.team
    aws = Aws()
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
    planned = plan_prepare(
        by_format,
        len(sizes),
        instance_type=opts["instance_type"],
        instance_count=opts["instance_count"],
        usd_per_instance_hour=opts["usd_per_instance_hour"],
    )
    typer.echo(f"plan: {planned.describe()}")
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
        typer.echo(f"(not deployed in {aws.where}: placeholders stand for the role, key and image)", err=True)
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
    region = aws.region
    name = job_name(team_name, resolved.name, datetime.datetime.now(datetime.UTC))
    request = create_processing_job_request(
        job_name=name,
        role_arn=role,
        image_uri=image,
        sources=sources,
        tokenizer=tokenizer,
        out=out,
        plan=planned,
        region=region,
        kms_key_arn=key,
        tags=tags(resolved, team),
        text_field=opts["text_field"],
        validation_fraction=opts["validation_fraction"],
        shard_tokens=opts["shard_tokens"],
        eos_token=opts["eos_token"],
    )
    findings = check_processing_request(request)
    if findings:
        raise TrainstackError(f"the CreateProcessingJob request would be refused: {findings[0]}")
    if opts["dry_run"]:
        typer.echo(json.dumps(request, indent=2))
        return
    sagemaker = aws.client("sagemaker")
    sagemaker.create_processing_job(**request)
    typer.echo(f"started processing job {name} in {aws.where}")
    if not opts["wait"]:
        typer.echo("rerun this command when it has ended: it then writes the dataset's index and manifest")
        return
    _wait(sagemaker, aws.client("s3"), name, out, len(sizes))
    code = run_here(sources, tokenizer, out, local=False, workers=1, **{k: opts[k] for k in _ENTRY})
    raise typer.Exit(code)


_ENTRY = ("text_field", "validation_fraction", "eos_token", "shard_tokens", "max_bad_records")


def _wait(sagemaker: Any, s3: Any, name: str, out: str, files: int) -> None:
    """Poll the job; show files done (their markers), tokens, tokens/s and ETA until it ends."""
    started = time.monotonic()
    while True:
        job = sagemaker.describe_processing_job(ProcessingJobName=name)
        status = job["ProcessingJobStatus"]
        done = [u for u in _listing(s3, out.rstrip("/") + "/_prepare/done/") if u.endswith(".json")]
        elapsed = time.monotonic() - started
        eta = (files - len(done)) * elapsed / len(done) if done else float("nan")
        shown = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        typer.echo(f"{name}: {status}, {len(done)}/{files} files done, ETA {shown}", err=True)
        if status in ("Completed", "Failed", "Stopped"):
            break
        time.sleep(POLL_S)
    if status != "Completed":
        raise TrainstackError(
            f"processing job {name} {status.lower()}: {job.get('FailureReason', 'no reason given')}; files "
            "finished so far are kept, rerun this command to resume"
        )
