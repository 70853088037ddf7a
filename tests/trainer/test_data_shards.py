"""Token shards are validated before use (issue 18 item 6): every mistake is one line naming the file
and field (TrainstackError, exit 2), and no path outside the data directory is ever opened. Plus the
data identity a checkpoint records (issue 18 item 5) and the tokenizer checks (issue 21)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from trainer.data.loader import open_source, same_data
from trainer.data.manifest import require_tokenizer
from trainer.data.megatron_index import index_bytes
from trainer.prepare.pipeline import prepare

from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

TEXT = "the quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A valid dataset (bytes tokenizer, 3 documents), copied by each case before it damages it."""
    root = tmp_path_factory.mktemp("prepared")
    inputs = root / "in"
    inputs.mkdir()
    for i in range(3):
        (inputs / f"doc{i}.txt").write_text(TEXT + str(i))
    prepare([str(inputs)], "bytes", str(root / "data"), validation_fraction=0.0, workers=1)
    return root / "data"


def edit_index(change):
    def apply(data: Path) -> None:
        index = json.loads((data / "index.json").read_text())
        changed = change(index)
        (data / "index.json").write_text(json.dumps(index if changed is None else changed))

    return apply


def first_bin(data: Path) -> Path:
    return data / json.loads((data / "index.json").read_text())["shards"][0]["file"]


def write_outside(data: Path) -> Path:
    outside = data.parent / "outside.bin"
    outside.write_bytes(first_bin(data).read_bytes())
    return outside


def symlink_outside(data: Path) -> None:
    os.symlink(write_outside(data), data / "shards" / "link.bin")
    edit_index(lambda i: i["shards"][0].update(file="shards/link.bin"))(data)


def absolute_outside(data: Path) -> None:
    path = write_outside(data)
    edit_index(lambda i: i["shards"][0].update(file=str(path)))(data)


def append_byte(data: Path) -> None:
    with open(first_bin(data), "ab") as stream:
        stream.write(b"\0")


def big_ids_with_a_valid_index(data: Path) -> None:
    shard = first_bin(data)
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[5] = 300  # above model.vocab 257, which the index still says
    ids.tofile(shard)
    edit_index(lambda i: [s.pop("max_token_id") for s in i["shards"]] and None)(data)


def megatron_only(data: Path) -> Path:
    """The dataset without trainstack's index, manifest and preparation state: its shards are a Megatron
    dataset (of another tool); returns the first shard's .bin. (With `_prepare/` left, it reads as an
    unfinished preparation, refused: test_data_prepare.py.)"""
    shard = first_bin(data)
    (data / "index.json").unlink()
    (data / "manifest.json").unlink()
    shutil.rmtree(data / "_prepare", ignore_errors=True)
    return shard


# (id, damage, expected message, model vocab). Each must raise TrainstackError with the message.
CASES = [
    ("index.json not JSON", lambda d: (d / "index.json").write_text("{"), r"index.json: not valid JSON", 257),
    (
        "index.json a list",
        lambda d: (d / "index.json").write_text("[]"),
        r"expected a JSON object, got a list",
        257,
    ),
    ("format", edit_index(lambda i: i.update(format="v0")), r"format: expected 'trainstack-tokens-v1'", 257),
    ("dtype", edit_index(lambda i: i.update(dtype="float32")), r"dtype: expected one of", 257),
    ("vocab_size missing", edit_index(lambda i: i.pop("vocab_size") and None), r"vocab_size: missing", 257),
    (
        "vocab_size text",
        edit_index(lambda i: i.update(vocab_size="257")),
        r"vocab_size: expected an integer",
        257,
    ),
    (
        "vocab_size bool",
        edit_index(lambda i: i.update(vocab_size=True)),
        r"vocab_size: expected an integer",
        257,
    ),
    (
        "eos_id past vocab",
        edit_index(lambda i: i.update(eos_id=300)),
        r"eos_id: 300 is not below vocab_size",
        257,
    ),
    (
        "shards not a list",
        edit_index(lambda i: i.update(shards={"a": 1})),
        r"shards: expected a non-empty list",
        257,
    ),
    ("shards empty", edit_index(lambda i: i.update(shards=[])), r"shards: expected a non-empty list", 257),
    (
        "entry not an object",
        edit_index(lambda i: i.update(shards=["a.bin"])),
        r"shards\[0\]: expected an object",
        257,
    ),
    (
        "entry without tokens",
        edit_index(lambda i: i["shards"][0].pop("tokens") and None),
        r"shards\[0\]: tokens: missing",
        257,
    ),
    (
        "entry without file",
        edit_index(lambda i: i["shards"][0].pop("file") and None),
        r"shards\[0\]: file: missing",
        257,
    ),
    (
        "tokens text",
        edit_index(lambda i: i["shards"][0].update(tokens="9")),
        r"shards\[0\]\.tokens: expected an integer",
        257,
    ),
    (
        "tokens negative",
        edit_index(lambda i: i["shards"][0].update(tokens=-1)),
        r"shards\[0\]\.tokens: -1 is below 0",
        257,
    ),
    ("absolute file", absolute_outside, r"is an absolute path", 257),
    (
        "/etc/passwd",
        edit_index(lambda i: i["shards"][0].update(file="/etc/passwd")),
        r"'/etc/passwd' is an absolute path",
        257,
    ),
    (
        "parent dir",
        edit_index(lambda i: i["shards"][0].update(file="../outside.bin")),
        r"leaves the data directory",
        257,
    ),
    ("symlink outside", symlink_outside, r"resolves to .*outside the data directory", 257),
    (
        "listed but missing",
        edit_index(lambda i: i["shards"][0].update(file="shards/gone.bin")),
        r"gone.bin is listed but missing",
        257,
    ),
    ("listed twice", edit_index(lambda i: i["shards"].append(dict(i["shards"][0]))), r"is listed twice", 257),
    ("odd byte count", append_byte, r"bytes is not a whole number of uint16 token ids", 257),
    (
        "truncated shard",
        lambda d: first_bin(d).write_bytes(first_bin(d).read_bytes()[:-4]),
        r"holds \d+ tokens, index.json says",
        257,
    ),
    (
        "vocab above the model's",
        lambda d: None,
        r"vocab_size: the shards use 257 token ids but model.vocab is 200",
        200,
    ),
    (
        "max_token_id past the model's",
        edit_index(lambda i: i["shards"][0].update(max_token_id=400)),
        r"max_token_id: the shards hold token id 400",
        257,
    ),
    ("no full window", lambda d: None, r"fewer than one window of 100001", 257),
    ("megatron idx without bin", lambda d: megatron_only(d).unlink(), r"its data file .* is missing", 257),
    (
        "megatron idx truncated",
        lambda d: megatron_only(d).with_suffix(".idx").write_bytes(index_bytes("uint16", [5, 5])[:40]),
        r"truncated copy",
        257,
    ),
    (
        "megatron bin short",
        lambda d: megatron_only(d).write_bytes(b"\0\0"),
        r"its .idx lists \d+ uint16 tokens",
        257,
    ),
    (
        "nothing to read",
        lambda d: megatron_only(d) and shutil.rmtree(d / "shards"),
        r"no token-shard index \(index.json\) and no Megatron .idx",
        257,
    ),
]


@pytest.fixture
def opened_paths():
    """Every path this process opens while the test runs (an audit hook; it cannot be removed, so it
    records only while armed)."""
    seen: list[str] = []
    armed = [True]

    def hook(event: str, args: tuple) -> None:
        if armed[0] and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            seen.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)
    yield seen
    armed[0] = False


@pytest.mark.parametrize(("damage", "message", "vocab"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_damaged_or_wrong_dataset_is_one_line_and_nothing_outside_is_opened(
    prepared, tmp_path, damage, message, vocab, opened_paths
):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    damage(data)
    seq_len = 100_000 if "100001" in message else 16
    opened_paths.clear()
    with pytest.raises(TrainstackError, match=message) as caught:
        open_source(data, seq_len, vocab, seed=0)
    assert "\n" not in str(caught.value)
    outside = [p for p in opened_paths if not Path(p).resolve().is_relative_to(data.resolve())]
    assert not [p for p in outside if "outside" in p or p == "/etc/passwd"], outside


def test_a_data_dir_that_is_missing_or_a_file_is_one_line(tmp_path):
    with pytest.raises(TrainstackError, match="does not exist"):
        open_source(tmp_path / "nope", 16, 257, 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainstackError, match="not a directory"):
        open_source(tmp_path / "file", 16, 257, 0)


def test_token_ids_outside_the_vocabulary_are_refused_when_read(prepared, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    big_ids_with_a_valid_index(data)
    source = open_source(data, 16, 257, seed=0)  # the index says nothing wrong
    with pytest.raises(TrainstackError, match=r"-00000.bin: token 5 is id 300, outside model.vocab 257"):
        for i in range(source.total_windows):
            source.sample(i)


@pytest.fixture
def one_thread():
    """One intra-op thread, as the torchrun tests give each rank (OMP_NUM_THREADS=1): on the 2 shared
    cores, torch's default pool spends most of a tiny model's step waiting for the other thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("case", ["data dir is a file", "ids past the vocab"])
def test_the_trainer_exits_2_with_one_line(prepared, tmp_path, monkeypatch, capsys, case, one_thread):
    """Through the trainer's own main (in this process: a world of one), not just the loader."""
    from trainer.__main__ import main

    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    if case == "data dir is a file":
        data = first_bin(data)
    else:
        big_ids_with_a_valid_index(data)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", _free_port())
    tiny = Path(__file__).parent / "fixtures" / "tiny.yaml"
    args = [
        "--recipe",
        str(tiny),
        "--device",
        "cpu",
        "--set",
        "model.vocab=257",
        "--set",
        "training.seq_len=16",
    ]
    code = main(
        [*args, "--max-steps", "8", "--data-dir", str(data), "--checkpoint-dir", str(tmp_path / "ck")]
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, errors
    assert (
        "not a directory" if case == "data dir is a file" else "is id 300, outside model.vocab"
    ) in errors[0]
    assert not list((tmp_path / "ck").glob("step-*/COMPLETE.json"))


def test_data_identity_is_the_content_hash_and_uri_not_the_mount_path(prepared, tmp_path):
    """Issue 18 item 5: the same bytes at another path are the same data; re-prepared or appended
    shards under the same path are not; the S3 URI is part of the name."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(prepared, a)
    shutil.copytree(prepared, b)
    name = open_source(a, 16, 257, 0).name
    assert name.startswith("shards:sha256=") and str(a) not in name
    assert open_source(b, 16, 257, 0).name == name  # moved or remounted: the same
    assert open_source(a, 16, 257, 0, uri="s3://bucket/x/").name == f"{name}@s3://bucket/x/"
    extra = a / "more.txt"
    extra.write_text(TEXT)
    changed = tmp_path / "changed"
    prepare(
        [str(extra), str(prepared.parent / "in")], "bytes", str(changed), validation_fraction=0.0, workers=1
    )
    shutil.rmtree(a)
    shutil.copytree(changed, a)  # appended shards under the same path
    assert open_source(a, 16, 257, 0).name != name
    assert not same_data(name, open_source(a, 16, 257, 0).name)
    assert same_data("shards:/opt/ml/input/data/train", name)  # checkpoints from before: as before


def test_the_tokenizer_must_match_the_recipe_or_the_base(prepared, tmp_path):
    assert open_source(prepared, 16, 257, 0, tokenizer="bytes")
    other = "sha256:" + "0" * 64
    with pytest.raises(
        TrainstackError, match=r"manifest.json: tokenizer: the shards were made with bytes .* is sha256:0"
    ):
        open_source(prepared, 16, 257, 0, tokenizer=other)
    with pytest.raises(TrainstackError, match="model.init_from is sha256:0"):
        require_tokenizer(prepared, other, "model.init_from")


def test_resuming_on_changed_shards_under_the_same_path_is_refused(
    prepared, tmp_path, monkeypatch, capsys, one_thread
):
    """Issue 18 item 5 end to end: a checkpoint of data A, then the same --data-dir (as SageMaker's mount
    always is) holding re-prepared shards: the trainer refuses in one line, exit 2."""
    from trainer.__main__ import main

    data = tmp_path / "train"
    shutil.copytree(prepared, data)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    tiny = Path(__file__).parent / "fixtures" / "tiny.yaml"
    args = [
        "--recipe",
        str(tiny),
        "--device",
        "cpu",
        "--set",
        "model.vocab=257",
        "--set",
        "training.seq_len=16",
    ]
    args += [
        "--set",
        "data.train_s3_uri=s3://bucket/tokens/",
        "--data-dir",
        str(data),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    ]

    def train(steps: int) -> tuple[int, list[str]]:
        monkeypatch.setenv("MASTER_PORT", _free_port())
        code = main([*args, "--max-steps", str(steps)])
        return code, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]

    assert train(2) == (0, [])
    more = tmp_path / "more.txt"
    more.write_text(TEXT * 2)
    shutil.rmtree(data)
    prepare([str(prepared.parent / "in"), str(more)], "bytes", str(data), validation_fraction=0.0, workers=1)
    code, errors = train(4)
    assert code == 2 and len(errors) == 1, errors
    assert (
        "was trained on shards:sha256=" in errors[0] and "@s3://bucket/tokens/, this run reads" in errors[0]
    )
