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

pytestmark = pytest.mark.fast

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
    # A small corpus's size reads in kB, not as 0.00 GB.
    total = sum(p.stat().st_size for p in inputs.iterdir())
    assert total < 1e6 and f"4 input files ({total / 1e3:,.2f} kB)" in err and "0.00 GB" not in err
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
        r"2 bad records \(not UTF-8, not JSON objects, too deep or too long\), more than --max-bad-records 1 "
        r"\(first: line 2: not UTF-8 \(byte 11 of the line\)\)",
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


# --- issue 29 item 10: what an interrupted preparation leaves is not trained on -----------------------


def train_main(data: Path, checkpoints: Path, monkeypatch) -> int:
    """The trainer's own main in this process (a world of one) on `data`, a few CPU steps."""
    import socket

    import torch
    from trainer.__main__ import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    for name, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    ).items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(
            [
                "--recipe",
                str(Path(__file__).parent / "fixtures" / "tiny.yaml"),
                "--device",
                "cpu",
                "--set",
                "model.vocab=300",
                "--set",
                "training.seq_len=16",
                "--max-steps",
                "2",
                "--data-dir",
                str(data),
                "--checkpoint-dir",
                str(checkpoints),
            ]
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_killed_preparation_is_refused_by_the_trainer_and_a_rerun_finishes_it(
    tmp_path, tokenizer_file, monkeypatch, capsys
):
    """A real `python -m trainer.prepare` process, SIGKILLed after its first files: its output (shards,
    markers, no index or manifest) is refused by the trainer in one line (exit 2), which says to run the
    preparation again; the rerun finishes it, with nothing of the killed run left over."""
    import os
    import signal
    import time

    inputs = tmp_path / "in"
    inputs.mkdir()
    for f in range(30):  # tens of ms of tokenizing each: the kill lands long before the last
        (inputs / f"part{f:02d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in documents(300, 100 + f))
        )
    out = tmp_path / "out"
    args = [
        str(inputs),
        "--tokenizer",
        str(tokenizer_file),
        "--out",
        str(out),
        "--validation-fraction",
        "0.1",
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'training_image'}:{REPO}"}
    process = subprocess.Popen(  # as a user runs it: a pool of 2 worker processes
        [sys.executable, "-m", "trainer.prepare", *args, "--workers", "2"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    done = out / "_prepare" / "done"
    deadline = time.monotonic() + 120
    while not (done.is_dir() and len(list(done.glob("*.json"))) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "prepare ended before it was killed"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    finished = len(list(done.glob("*.json")))
    time.sleep(1)  # the pool's workers die with it (PR_SET_PDEATHSIG): no file is finished after the kill
    assert len(list(done.glob("*.json"))) == finished
    assert 2 <= finished < 30 and not (out / "manifest.json").exists() and not (out / "index.json").exists()
    assert list((out / "validation" / "shards").glob("*.idx"))  # held-out shards a Megatron scan would find

    capsys.readouterr()
    assert train_main(out, tmp_path / "ck", monkeypatch) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert f"an unfinished `trainstack data prepare` output ({finished} input file(s) done" in errors[0]
    assert "run the same prepare command again to finish it" in errors[0]
    # ... also when it lies below the directory given (a folder of several datasets).
    with pytest.raises(TrainstackError, match=r"--data-dir .*: .*/out: an unfinished"):
        open_source(tmp_path, 16, 300, 0)

    capsys.readouterr()
    assert prepare_main([*args, "--workers", "1"]) == 0
    assert f"{finished} already done" in capsys.readouterr().err
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    index = json.loads((out / "index.json").read_text())
    listed = {e["file"] for e in index["shards"]} | {
        f"validation/{e['file']}"
        for e in json.loads((out / "validation" / "index.json").read_text())["shards"]
    }
    written = {p.relative_to(out).as_posix() for p in out.rglob("*.bin")}
    assert written == listed  # no shard of the killed run lies unlisted beside the dataset


def test_a_prepared_datasets_validation_split_is_never_read_as_training_data(tmp_path, tokenizer_file):
    from trainer.data.shard_index import read_dataset

    inputs = tmp_path / "in"
    inputs.mkdir()
    for f in range(3):
        (inputs / f"p{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(80, f)))
    out = tmp_path / "sets" / "web"
    manifest = prepare([str(inputs)], str(tokenizer_file), str(out), validation_fraction=0.2, workers=1)
    assert manifest["validation"]["documents"] > 0
    held_out = set(decode_split(out, "validation", tokenizer_file))
    # The dataset itself: the training shards only.
    train = read_dataset(out)
    assert train.shards and all(s.name.startswith("shards/") for s in train.shards)
    # A folder holding it, read as a Megatron dataset (no index.json there): the split is skipped too.
    scanned = read_dataset(tmp_path / "sets")
    assert scanned.kind == "megatron" and scanned.tokens == manifest["tokens"]
    assert not [s for s in scanned.shards if "/validation/" in f"/{s.name}"]
    # What those windows hold decodes to training documents only.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    stream = np.concatenate([np.fromfile(s.path, dtype=np.uint16) for s in scanned.shards])
    eos = tokenizer.token_to_id("<|endoftext|>")
    bounds = np.flatnonzero(stream == eos)
    read = {
        tokenizer.decode(stream[a:b].tolist()) for a, b in zip(np.r_[0, bounds[:-1] + 1], bounds, strict=True)
    }
    assert read and not read & held_out
    # An index.json edited to list a held-out shard is refused in one line.
    index = json.loads((out / "index.json").read_text())
    held = json.loads((out / "validation" / "index.json").read_text())["shards"][0]
    index["shards"].append({**held, "file": f"validation/{held['file']}"})
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        TrainstackError, match=r"shards\[\d+\]\.file: validation/shards/.* is in the validation"
    ):
        read_dataset(out)


# --- issue 29 item 11: damaged input is one line naming the file, never a traceback -------------------


def gz_truncated(d: Path) -> None:
    data = gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in documents(400, 7)))
    (d / "a.jsonl.gz").write_bytes(data[: len(data) // 2])


def gz_corrupt(d: Path) -> None:
    data = bytearray(
        gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in documents(400, 8)))
    )
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    (d / "a.jsonl.gz").write_bytes(bytes(data))


def symlink_cycle(d: Path) -> None:
    (d / "a.jsonl").symlink_to(d / "b.jsonl")
    (d / "b.jsonl").symlink_to(d / "a.jsonl")


def dangling(d: Path) -> None:
    (d / "a.jsonl").symlink_to(d / "gone.jsonl")


def big_record(d: Path) -> None:
    """One JSONL line past the record bound (built in pieces: never held whole here either)."""
    from trainer.prepare.inputs import MAX_RECORD_BYTES

    piece = ("word " * 200_000).encode()
    with open(d / "a.jsonl", "wb") as stream:
        stream.write(GOOD + b"\n" + b'{"text": "')
        for _ in range(MAX_RECORD_BYTES // len(piece) + 1):
            stream.write(piece)
        stream.write(b'"}\n' + GOOD + b"\n")


# (id, what is written in the input folder, extra arguments, expected message: None = it prepares, and
# the message is then the skipped-record line on stderr naming the file).
DAMAGED = [
    ("truncated .jsonl.gz", gz_truncated, [], r"a\.jsonl\.gz: the gzip stream ends early \(line \d+\)"),
    # Zeroed deflate data may still inflate (to garbage, caught by the CRC at the end) or not: one line
    # naming the file either way.
    ("corrupt .jsonl.gz", gz_corrupt, [], r"a\.jsonl\.gz: (corrupt gzip data|the gzip stream|line \d+: )"),
    (
        ".gz that is not gzip",
        lambda d: (d / "a.jsonl.gz").write_bytes(GOOD + b"\n"),
        [],
        r"a\.jsonl\.gz: not a gzip file \(line 1\)",
    ),
    (
        ".txt.gz that is not gzip",
        lambda d: (d / "a.txt.gz").write_bytes(b"plain text"),
        [],
        r"a\.txt\.gz: not a gzip file",
    ),
    (
        "a line nested 100,000 deep",
        lambda d: write_jsonl(d / "a.jsonl", [b"[" * 100_000 + b"]" * 100_000, GOOD]),
        ["--max-bad-records", "0"],
        r"a\.jsonl: 1 bad records .* \(first: line 1: nested deeper than the JSON parser allows\)",
    ),
    (
        "an object nested 100,000 deep",
        lambda d: write_jsonl(d / "a.jsonl", [GOOD, b'{"text":' * 100_000 + b'"x"' + b"}" * 100_000]),
        None,
        r"a\.jsonl: 1 bad record\(s\) skipped \(first: line 2: nested deeper than the JSON parser allows\)",
    ),
    (
        "non-UTF-8 .txt",
        lambda d: (d / "a.txt").write_bytes(b"caf\xe9 au lait"),
        [],
        r"no document to train on \(1 bad record\(s\) skipped; first: .*a\.txt: byte 4: not UTF-8",
    ),
    (
        "non-UTF-8 .txt beside a good one",
        lambda d: [(d / "a.txt").write_bytes(b"ok\n" * 10 + b"\x80"), (d / "b.txt").write_text("fine")],
        None,
        r"a\.txt: 1 bad record\(s\) skipped \(first: byte 31: not UTF-8",
    ),
    ("a file-symlink cycle", symlink_cycle, [], r"a\.jsonl: a symbolic link that loops back on itself"),
    ("a dangling symlink", dangling, [], r"a\.jsonl: a symbolic link to .*gone\.jsonl, which does not exist"),
    (
        "one record past the bound",
        big_record,
        None,
        r"a\.jsonl: 1 bad record\(s\) skipped \(first: line 2: a record of more than 64 MiB",
    ),
    (
        "a lone surrogate escape",
        lambda d: write_jsonl(
            d / "a.jsonl", [GOOD, b'{"text": "ab\\ud800cd"}', b'{"text": "\\u00e9t\\u00e9"}']
        ),
        None,
        r"a\.jsonl: 1 bad record\(s\) skipped \(first: line 2: field 'text' holds a lone surrogate",
    ),
    (
        "a byte-order mark, then a non-object",
        lambda d: write_jsonl(d / "a.jsonl", [b"\xef\xbb\xbf" + GOOD, b"[1, 2]"]),
        None,
        r"a\.jsonl: 1 bad record\(s\) skipped \(first: line 2: not a JSON object\)",
    ),
    (
        "a Parquet file that is not one",
        lambda d: (d / "a.parquet").write_bytes(b"PAR1 not really"),
        [],
        r"a\.parquet: not a Parquet file",
    ),
]


@pytest.mark.parametrize(
    ("damage", "extra", "message"), [c[1:] for c in DAMAGED], ids=[c[0] for c in DAMAGED]
)
def test_damaged_input_is_one_line_naming_the_file_and_nothing_half_written(
    tmp_path, tokenizer_file, capsys, damage, extra, message
):
    inputs = tmp_path / "in"
    inputs.mkdir()
    damage(inputs)
    out = tmp_path / "out"
    capsys.readouterr()
    code = prepare_main(
        [str(inputs), "--tokenizer", str(tokenizer_file), "--out", str(out), "--workers", "1", *(extra or [])]
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if extra is None:  # one bad record among good ones: skipped, counted, named; the rest prepared
        assert code == 0, lines
        assert any(__import__("re").search(message, line) for line in lines), lines
        manifest = json.loads((out / "manifest.json").read_text())
        assert sum(s["skipped_records"] for s in manifest["sources"]) == 1 and manifest["documents"] >= 1
    else:
        assert code == 2 and lines[-1].startswith("error: "), lines
        assert __import__("re").search(message, lines[-1]), lines[-1]
        assert not (out / "manifest.json").exists()
        # Nothing a later run would trust: no half-written file, no shard, no index (the preparation's own
        # state in _prepare/ says what it did; a marker there is a file read to its end).
        left = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()] if out.exists() else []
        assert all(p.startswith("_prepare/") and not p.endswith(".tmp") for p in left), left


def test_a_long_document_is_tokenized_in_pieces_with_bounded_memory(tmp_path):
    """A 6 MiB JSONL record and a 6 MiB text file without a line break: the worker's peak memory stays
    within what a few copies of the text need, not the ~100 bytes per byte the tokenizer needs for one
    whole text (issue 29 item 11: 200 MB in one record peaked at 2.1 GB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "word": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    inputs = tmp_path / "in"
    inputs.mkdir()
    words = 6 * (1 << 20) // 5
    (inputs / "a.jsonl").write_text(json.dumps({"text": "word " * words}) + "\n")
    (inputs / "b.txt").write_text("word " * words)
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would include this test process's
    # size when it was forked; VmHWM is the new program's own peak.
    probe = (
        "import re, sys\n"
        "from trainer.prepare.pipeline import main\n"
        "code = main(sys.argv[1:])\n"
        "peak = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "print('PEAK', int(peak) // 1024, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    args = [str(inputs), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out")]
    env = {**__import__("os").environ, "PYTHONPATH": f"{REPO / 'training_image'}:{REPO}"}
    done = subprocess.run(
        [sys.executable, "-c", probe, *args, "--workers", "1", "--validation-fraction", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stderr.split("PEAK ")[1].split()[0])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == 2 and manifest["tokens"] == 2 * (words + 1)
    # Whole, each would take ~600 MiB in the tokenizer (measured: 470 MB for 4 MiB of text).
    assert peak < 300, f"peak RSS {peak} MiB for 6 MiB documents"


@pytest.mark.parametrize("shard_tokens", [1, 7, 50, 333, 10_000])
def test_batched_documents_cut_shards_exactly_where_one_by_one_writing_does(tmp_path, shard_tokens):
    """The batch path (one array per batch, issue 32's speed work) against the per-document path."""
    from trainer.prepare.shard_writer import ShardWriter
    from trainer.prepare.store import LocalStore

    rng = np.random.default_rng(shard_tokens)
    docs = [rng.integers(0, 300, int(rng.integers(0, 40))) for _ in range(120)]
    one = ShardWriter(LocalStore(tmp_path / "one"), "s/x", "uint16", 299, shard_tokens)
    for ids in docs:
        one.add(ids)
        one.end_document()
    batched = ShardWriter(LocalStore(tmp_path / "batch"), "s/x", "uint16", 299, shard_tokens)
    for start in range(0, len(docs), 17):  # batches that straddle shard boundaries
        chunk = docs[start : start + 17]
        flat = np.concatenate([np.r_[d, 299] for d in chunk]).astype(np.uint16)
        batched.add_documents(flat, np.array([d.size + 1 for d in chunk]))
    assert one.close() == batched.close()
    for path in (tmp_path / "one" / "s").iterdir():
        assert path.read_bytes() == (tmp_path / "batch" / "s" / path.name).read_bytes(), path.name


def test_a_long_document_cut_into_pieces_keeps_a_byte_level_bpes_ids(tmp_path):
    """Pieces end after a line break between two non-spaces: the ids are the whole text's. (A cut after
    any line break would split the line-break-and-indent tokens this tokenizer learns, one after trailing
    spaces would join them to the line break; bench/data_prepare.py checks this on Python sources.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from trainer.prepare.inputs import TEXT_PIECE_BYTES

    rng = np.random.default_rng(5)
    lines, size = [], 0
    while size < 1.3 * TEXT_PIECE_BYTES:  # one cut
        # Code-like: indented lines ending in a space before the line break (which this tokenizer learns
        # to merge with it), and every 50th line a clean break before an unindented line: the only
        # places where a piece may end without changing the ids.
        clean = len(lines) % 50 == 0
        indent = "" if clean or len(lines) % 50 == 1 else " " * (4 * int(rng.integers(0, 3)))
        line = indent + " ".join(rng.choice(WORDS, int(rng.integers(1, 9))))
        lines.append(line + ("\n" if clean else str(rng.choice([" \n", " \n\n", "\n    \n"]))))
        size += len(lines[-1])
    text = "".join(lines)
    indented = "".join("    " + line.lstrip() for line in lines)  # no clean line break: cut between words
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    # Line by line (" \n" ends many: merged) and an indented run (line break + indent: merged).
    tokenizer.train_from_iterator([*lines[:3000], indented[:30_000]], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in (text, indented))
    )
    prepare(
        [str(tmp_path / "in")],
        str(tmp_path / "tokenizer.json"),
        str(tmp_path / "out"),
        validation_fraction=0,
        workers=1,
    )
    (shard,) = json.loads((tmp_path / "out" / "index.json").read_text())["shards"]
    written = np.fromfile(tmp_path / "out" / shard["file"], dtype=np.uint16).tolist()
    eos = [tokenizer.token_to_id("<|endoftext|>")]
    expected = [i for t in (text, indented) for i in tokenizer.encode(t, add_special_tokens=False).ids + eos]
    assert written == expected


@pytest.mark.parametrize(
    "count, shown",
    [
        (812, "812 B"),
        (145_700, "145.70 kB"),
        (5_000_000, "5.00 MB"),  # 0.005 GB: under 0.01 GB reads in MB
        (9_990_000, "9.99 MB"),
        (4_120_000_000, "4.12 GB"),
        (2.5e12, "2.50 TB"),
    ],
)
def test_data_sizes_read_in_the_largest_decimal_unit_that_is_at_least_one(count, shown):
    from trainstack.units import data_size

    assert data_size(count) == shown


def test_the_preparation_pipeline_imports_neither_numpy_nor_the_recipe_schema_until_it_encodes():
    """`data prepare`'s parent process (which, with a pool, only lists inputs, hands them out and writes
    the indexes) and every spawned worker import the pipeline and print sizes as the planner does. That
    must not pull in numpy or the planner's recipe schema (pydantic): 0.15 and 0.2-0.3 CPU-s per process,
    the gap to the plain-tokenizers baseline at 2 workers (bench/data_prepare.py)."""
    import os

    code = (
        "import sys, trainer.prepare.pipeline as p; p.data_size(10**9); print(sorted(m for m in sys.modules "
        "if m in {'numpy', 'pydantic'} or m.startswith('trainstack.recipes')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": f"{REPO / 'training_image'}:{REPO}"},
    )
    assert done.stdout.strip() == "[]", done.stdout
