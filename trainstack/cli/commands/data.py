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

The work is trainstack.api.data_prepare's; this parses the options and prints what it reports.
"""

from __future__ import annotations

from typing import Annotated

import typer

data_app = typer.Typer(
    help="Prepare training data: tokenize raw text into token shards.", no_args_is_help=True
)


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
    from trainstack import api

    def stderr(line: str) -> None:
        typer.echo(line, err=True)

    done = api.data_prepare(
        sources,
        tokenizer=tokenizer,
        out=out,
        text_field=text_field,
        fmt=fmt,
        seq_len=seq_len,
        validation_fraction=validation_fraction,
        eos_token=eos_token,
        shard_tokens=shard_tokens,
        workers=workers,
        max_bad_records=max_bad_records,
        local=local,
        here=here,
        recipe=recipe,
        team=team,
        instance_type=instance_type,
        instance_count=instance_count,
        usd_per_instance_hour=usd_per_instance_hour,
        image_uri=image_uri,
        dry_run=dry_run,
        wait=not no_wait,
        overwrite=overwrite,
        on_step=typer.echo,
        on_progress=stderr,
    )
    if dry_run and done.where == "aws":
        typer.echo(done.to_json())  # the CreateProcessingJob request, checked, not sent
        return
    if done.where == "here" or done.started and not no_wait:
        raise typer.Exit(done.exit_code)
