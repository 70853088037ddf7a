"""`trainstack data prepare` / `python -m trainer.prepare`: formats, the validation split, resuming, bad
input (one line, exit 2), the emulator's S3 (what `--local` and each Processing-job instance do), and the
CreateProcessingJob request against botocore's model."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from trainer.data.loader import open_source
from trainer.prepare.pipeline import main as prepare_main
from trainer.prepare.pipeline import prepare

from trainstack.errors import TrainstackError

REPO = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(5, 60)))) + f" #{seed}-{i}" for i in range(count)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A real tokenizer.json, trained here by the `tokenizers` library (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(documents(200, 0), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def decode_split(out: Path, split: str, tokenizer_file: Path) -> list[str]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    base = out / split if split else out
    texts = []
    for entry in json.loads((base / "index.json").read_text())["shards"]:
        ids = np.fromfile(base / entry["file"], dtype=np.uint16)
        bounds = np.flatnonzero(ids == tokenizer.token_to_id("<|endoftext|>"))
        assert len(bounds) == entry["documents"] and bounds[-1] == ids.size - 1
        for start, end in zip(np.r_[0, bounds[:-1] + 1], bounds, strict=True):
            texts.append(tokenizer.decode(ids[start:end].tolist()))
    return texts


def test_jsonl_parquet_and_text_become_shards_with_a_manifest(tmp_path, tokenizer_file):
    import pyarrow as pa
    import pyarrow.parquet as pq

    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    a, b, c = documents(60, 1), documents(50, 2), documents(1, 3)
    (inputs / "a.jsonl").write_text("".join(json.dumps({"content": t, "n": 1}) + "\n" for t in a))
    with gzip.open(inputs / "sub" / "b.jsonl.gz", "wt") as stream:
        stream.writelines(json.dumps({"content": t}) + "\n" for t in b)
    pq.write_table(
        pa.table({"content": a[:10] + b[:5], "x": list(range(15))}), inputs / "c.parquet", row_group_size=4
    )
    (inputs / "d.txt").write_text(c[0] + "\n" + c[0])
    (inputs / "ignored.csv").write_text("not an input format")
    out = tmp_path / "out"
    manifest = prepare(
        [str(inputs)], str(tokenizer_file), str(out), text_field="content", validation_fraction=0.2, workers=2
    )

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    assert (
        manifest["tokenizer"]["identity"]
        == "sha256:" + __import__("hashlib").sha256(tokenizer_file.read_bytes()).hexdigest()
    )
    assert manifest["tokenizer"]["vocab_size"] == tokenizer.get_vocab_size() and manifest["dtype"] == "uint16"
    by_source = {Path(s["uri"]).name: s for s in manifest["sources"]}
    assert set(by_source) == {"a.jsonl", "b.jsonl.gz", "c.parquet", "d.txt"}
    held = manifest["validation"]
    assert manifest["documents"] + held["documents"] == 60 + 50 + 15 + 1 and held["documents"] > 0
    expected = a + b + a[:10] + b[:5] + [c[0] + "\n" + c[0]]
    train, validation = decode_split(out, "", tokenizer_file), decode_split(out, "validation", tokenizer_file)
    assert sorted(train + validation) == sorted(expected)
    # By a hash of the document: the copies in c.parquet land where their originals did; none in both.
    assert not set(train) & set(validation)
    total = sum(len(tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in expected)
    assert manifest["tokens"] + held["tokens"] == total
    assert json.loads((out / "validation" / "manifest.json").read_text())["split"] == "validation"
    assert open_source(
        out / "validation", 8, 300, 0, tokenizer=manifest["tokenizer"]["identity"]
    ).total_windows


def test_an_interrupted_preparation_resumes_and_ends_identical(tmp_path, tokenizer_file, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for f in range(4):
        (inputs / f"part{f}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in documents(30, 10 + f))
        )
    args = [
        str(inputs),
        "--tokenizer",
        str(tokenizer_file),
        "--out",
        str(tmp_path / "out"),
        "--shard-tokens",
        "500",
    ]
    assert prepare_main([*args, "--workers", "2"]) == 0
    first = (tmp_path / "out" / "index.json").read_bytes()
    # A file whose marker is missing (the run died before writing it) is done again; the others are not.
    (marker,) = [
        m
        for m in (tmp_path / "out" / "_prepare" / "done").iterdir()
        if json.loads(m.read_text())["uri"].endswith("part2.jsonl")
    ]
    marker.unlink()
    for shard in (tmp_path / "out" / "shards").glob("part2-*"):
        shard.write_bytes(b"half")  # what a killed writer left behind
    capsys.readouterr()
    assert prepare_main(args) == 0
    err = capsys.readouterr().err
    assert "4 input files" in err and "3 already done" in err and "1/1 files" in err
    assert (tmp_path / "out" / "index.json").read_bytes() == first
    assert len(json.loads(first)["shards"]) > 4  # several shards per file at --shard-tokens 500


def write_jsonl(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


GOOD = json.dumps({"text": "alpha beta"}).encode()
BAD_INPUT = [
    (
        "missing text field",
        [json.dumps({"body": "x", "id": 3}).encode()],
        [],
        r"line 1: no field 'text' \(the record has: body, id\); "
        "pass --text-field",
    ),
    (
        "text not a string",
        [json.dumps({"text": 5}).encode()],
        [],
        r"line 1: field 'text' is a int, not a string",
    ),
    (
        "too many non-UTF-8",
        [GOOD, b'{"text": "\xff\xfe"}', b'{"text": "\xc3"}'],
        ["--max-bad-records", "1"],
        r"2 records are not UTF-8 or not JSON objects, more than --max-bad-records 1 "
        r"\(first: line 2: not UTF-8\)",
    ),
    (
        "not a tokenizer",
        [GOOD],
        ["--tokenizer-file", '{"version": "1.0"}'],
        r"--tokenizer .*: not a tokenizer.json the tokenizers library reads",
    ),
    (
        "tokenizer missing",
        [GOOD],
        ["--tokenizer", "/nonexistent/tokenizer.json"],
        r"--tokenizer /nonexistent/tokenizer.json: not found",
    ),
    (
        "out holds another dataset",
        [GOOD],
        ["--out-holds", "index.json"],
        r"already holds a dataset \(index.json\) not made by this preparation",
    ),
    ("out holds shards", [GOOD], ["--out-holds", "x.idx"], r"already holds a dataset \(x.idx\)"),
    (
        "bad fraction",
        [GOOD],
        ["--validation-fraction", "1.5"],
        r"--validation-fraction 1.5: expected 0 <= F < 1",
    ),
    ("no inputs", None, [], r"no such file or directory"),
]


@pytest.mark.parametrize(
    ("lines", "extra", "message"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, tokenizer_file, capsys, lines, extra, message):
    inputs = tmp_path / "in"
    inputs.mkdir()
    if lines is not None:
        write_jsonl(inputs / "a.jsonl", lines)
    source = str(inputs if lines is not None else tmp_path / "nothing")
    out = tmp_path / "out"
    tokenizer = str(tokenizer_file)
    if "--tokenizer-file" in extra:
        (tmp_path / "tokenizer.json").write_text(extra[1])
        tokenizer, extra = str(tmp_path / "tokenizer.json"), []
    if "--tokenizer" in extra:
        tokenizer, extra = extra[1], []
    if "--out-holds" in extra:
        out.mkdir()
        (out / extra[1]).write_text("{}")
        extra = []
    capsys.readouterr()
    code = prepare_main([source, "--tokenizer", tokenizer, "--out", str(out), "--workers", "1", *extra])
    errors = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and errors[-1].startswith("error: "), errors
    assert __import__("re").search(message, errors[-1]), errors[-1]
    assert not (out / "manifest.json").exists()


def test_non_utf8_records_within_the_limit_are_skipped_and_counted(tmp_path, tokenizer_file):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "a.jsonl", [GOOD, b'{"text": "\xff"}', b"not json", GOOD])
    manifest = prepare(
        [str(inputs)], str(tokenizer_file), str(tmp_path / "out"), validation_fraction=0, workers=1
    )
    assert manifest["documents"] == 2 and manifest["sources"][0]["skipped_records"] == 2


def test_a_rerun_with_other_settings_is_refused(tmp_path, tokenizer_file):
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "a.jsonl", [GOOD])
    with pytest.raises(TrainstackError, match="no field 'body'"):  # a first try that finished no file
        prepare([str(inputs)], str(tokenizer_file), str(tmp_path / "out"), text_field="body", workers=1)
    prepare([str(inputs)], str(tokenizer_file), str(tmp_path / "out"), workers=1)
    with pytest.raises(TrainstackError, match="prepared with tokenizer 'sha256:.*', not 'bytes'"):
        prepare([str(inputs)], "bytes", str(tmp_path / "out"), workers=1)


# --- S3: the emulator --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulator_s3(tokenizer_file):
    pytest.importorskip("boto3")
    from trainstack.emulator.endpoint import Emulator

    with Emulator() as emulator:
        s3 = emulator.client("s3")
        for bucket in ("corpus", "tokens"):
            s3.create_bucket(Bucket=bucket)
        for f in range(4):
            body = "".join(json.dumps({"text": t}) + "\n" for t in documents(25, 20 + f))
            s3.put_object(Bucket="corpus", Key=f"web/part{f}.jsonl", Body=body.encode())
        s3.put_object(Bucket="corpus", Key="tokenizer.json", Body=tokenizer_file.read_bytes())
        yield emulator, s3


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_sharded_instances_then_local_finalize_on_the_emulators_s3(emulator_s3, tmp_path, monkeypatch):
    """Two Processing-job instances, each with its share of the objects copied locally (as
    ShardedByS3Key does) and --no-finalize; then `trainstack data prepare --local` sees every file done and
    writes the index and manifest in S3. The shards train: every token is where the manifest says."""
    import os

    emulator, s3 = emulator_s3
    env = {**os.environ, **emulator.env()}
    for name, value in emulator.env().items():
        monkeypatch.setenv(name, value)
    for instance, parts in enumerate(((0, 2), (1, 3))):  # in this process: what each instance runs
        share = tmp_path / f"instance{instance}"
        share.mkdir()
        for p in parts:
            s3.download_file("corpus", f"web/part{p}.jsonl", str(share / f"part{p}.jsonl"))
        args = [
            f"{share}=s3://corpus/web/",
            "--tokenizer",
            "s3://corpus/tokenizer.json",
            "--out",
            "s3://tokens/web/",
        ]
        assert prepare_main([*args, "--no-finalize", "--workers", "1"]) == 0
    assert "Contents" not in s3.list_objects_v2(Bucket="tokens", Prefix="web/manifest.json")
    trainstack = str(Path(sys.executable).parent / "trainstack")
    final = run(
        [
            trainstack,
            "data",
            "prepare",
            "s3://corpus/web/",
            "--tokenizer",
            "s3://corpus/tokenizer.json",
            "--out",
            "s3://tokens/web/",
            "--local",
        ],
        env,
    )
    assert final.returncode == 0, final.stderr[-2000:]
    assert "4 already done" in final.stderr and "prepared s3://tokens/web/: " in final.stdout
    local = tmp_path / "dataset"
    for item in s3.list_objects_v2(Bucket="tokens", Prefix="web/")["Contents"]:
        path = local / item["Key"].removeprefix("web/")
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file("tokens", item["Key"], str(path))
    manifest = json.loads((local / "manifest.json").read_text())
    assert [s["uri"] for s in manifest["sources"]] == [f"s3://corpus/web/part{p}.jsonl" for p in range(4)]
    assert manifest["documents"] + manifest["validation"]["documents"] == 100
    source = open_source(
        local, 16, 300, 0, tokenizer=manifest["tokenizer"]["identity"], uri="s3://tokens/web/"
    )
    assert source.total_windows == (manifest["tokens"] - 1) // 16 and source.name.endswith(
        "@s3://tokens/web/"
    )


# --- the Processing job request ------------------------------------------------------------------------


def processing_request(**changes):
    import datetime

    from trainstack.aws.processing import create_processing_job_request, job_name
    from trainstack.aws.request_check import PLACEHOLDERS
    from trainstack.planner.data_prep import plan_prepare

    plan = plan_prepare({"jsonl": 3 * 10**12}, 3000, **changes.pop("plan", {}))
    return plan, create_processing_job_request(
        job_name=job_name("abcdefghijklmnop", "r" * 22, datetime.datetime(2026, 12, 1)),
        role_arn=PLACEHOLDERS["role_arn"],
        image_uri=PLACEHOLDERS["image_uri"],
        sources=changes.pop("sources", ["s3://corpus/web/", "s3://corpus/code/"]),
        tokenizer="s3://corpus/tokenizers/tokenizer.json",
        out="s3://tokens/llama3/",
        plan=plan,
        region="us-west-2",
        kms_key_arn=PLACEHOLDERS["kms_key_arn"],
        tags={"project": "trainstack", "team": "nlp"},
    )


def test_the_processing_request_passes_botocores_model_and_shards_by_key():
    from trainstack.aws.processing import check_processing_request

    plan, request = processing_request()
    assert check_processing_request(request) == []
    assert len(request["ProcessingJobName"]) <= 63  # the longest team and recipe names
    inputs = {i["InputName"]: i["S3Input"] for i in request["ProcessingInputs"]}
    assert (
        inputs["src0"]["S3DataDistributionType"]
        == inputs["src1"]["S3DataDistributionType"]
        == "ShardedByS3Key"
    )
    assert inputs["tokenizer"]["S3DataDistributionType"] == "FullyReplicated"
    assert (
        plan.instance_count > 1
        and request["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == plan.instance_count
    )
    args = request["AppSpecification"]["ContainerArguments"]
    assert args[0] == "/opt/ml/processing/input/src0=s3://corpus/web/" and "--no-finalize" in args
    assert args[args.index("--tokenizer") + 1] == "/opt/ml/processing/input/tokenizer/tokenizer.json"


def test_the_processing_request_limits_aws_documents():
    """Limits from botocore's model of CreateProcessingJob (ProcessingInputs at most 10, InstanceCount
    1-100, VolumeSizeInGB 1-16384) and the API reference (ProcessingS3Input.LocalPath "must begin with
    /opt/ml/processing/"), none of which the emulator enforces."""
    from trainstack.aws.processing import check_processing_request

    _, many = processing_request(sources=[f"s3://corpus/p{i}/" for i in range(10)])
    assert any(
        "ProcessingInputs" in str(f) and "maximum of 10" in str(f) for f in check_processing_request(many)
    )
    _, request = processing_request(plan={"instance_count": 101})
    assert any("InstanceCount" in str(f) for f in check_processing_request(request))
    request["ProcessingInputs"][0]["S3Input"]["LocalPath"] = "/data/in"
    assert any("does not begin with /opt/ml/processing/" in str(f) for f in check_processing_request(request))
    request["ProcessingResources"]["ClusterConfig"]["VolumeSizeInGB"] = 20000
    assert any("VolumeSizeInGB" in str(f) for f in check_processing_request(request))


def test_the_aws_path_plans_and_checks_the_request_on_a_dry_run(emulator_s3, monkeypatch):
    """`trainstack data prepare s3://... --recipe R --dry-run`: lists the inputs (here in the emulator's
    S3, through AWS_ENDPOINT_URL), prints the plan and a request that passes botocore's model."""
    from typer.testing import CliRunner

    from trainstack.aws.processing import check_processing_request
    from trainstack.cli.main import app

    emulator, _ = emulator_s3
    args = ["data", "prepare", "s3://corpus/web/", "--tokenizer", "s3://corpus/tokenizer.json"]
    args += ["--out", "s3://tokens/aws/", "--recipe", "8b-fp8", "--team", "nlp", "--dry-run"]
    result = CliRunner().invoke(app, args, env=emulator.env())
    assert result.exit_code == 0, result.output
    plan_line, _, request_text = result.stdout.partition("\n")
    assert plan_line.startswith("plan: 1 x ml.c5.18xlarge") and "4 files" in plan_line
    request = json.loads(request_text[request_text.index("{") :])
    assert check_processing_request(request) == []
    assert request["ProcessingJobName"].startswith("ts-prep-nlp-8b-fp8--")
    missing = CliRunner().invoke(app, args[:-5] + ["--out", "s3://tokens/aws/"], env=emulator.env())
    assert missing.exit_code == 2 and "--recipe: needed to run on AWS" in missing.output
