"""The checkpoint folder's format (trainstack.protocol.checkpoint_format): what the cheap checks accept.

Folders are built as dictionaries {name: bytes}, with the format's own document builders, so each test
says exactly which file is wrong and how; the trainer's writer is tested against the same rules in
tests/trainer (test_trainer_checkpoints.py, test_trainer_faults.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from trainstack.protocol.checkpoint_format import (
    COMPLETE,
    DAMAGED,
    INCOMPLETE,
    MARKER,
    FileRecord,
    extras_name,
    inspect,
    manifest_document,
    manifest_name,
    marker_document,
    owner_rank,
    record_of,
)

pytestmark = pytest.mark.fast

STEP = 20


def folder(world: int = 2, step: int = STEP, **marker_fields) -> dict[str, bytes]:
    """A complete format-2 folder of `world` ranks, as the trainer writes one."""
    files: dict[str, bytes] = {".metadata": b"index" * 10}
    for rank in range(world):
        files[f"__{rank}_0.distcp"] = bytes([rank]) * 1000
        files[extras_name(rank)] = b"state" * (rank + 3)
    table = {}
    for rank in range(world):
        own = {n: record_of(b) for n, b in files.items() if owner_rank(n) == rank}
        files[manifest_name(rank)] = manifest_document(step=step, rank=rank, world_size=world, files=own)
        table.update(own, **{manifest_name(rank): record_of(files[manifest_name(rank)])})
    fields = {"world_size": world, "samples_consumed": step * 16, "data_source": "synthetic", "run": "r1"}
    fields.update(marker_fields)
    files[MARKER] = marker_document(step=step, files=table, **fields)
    return files


def check(files: dict[str, bytes], step: int = STEP):
    return inspect(step, {n: len(b) for n, b in files.items()}, files.get)


def rewrite_marker(folder_files: dict[str, bytes], **changes) -> None:
    values = json.loads(folder_files[MARKER])
    values.update(changes)
    folder_files[MARKER] = json.dumps(values).encode()


def test_a_folder_as_the_trainer_writes_it_is_complete_and_lists_every_file_with_its_sha256():
    files = folder()
    found = check(files)
    assert found.state == COMPLETE and found.problem is None
    assert set(found.files) == set(files) - {MARKER}
    for name, record in found.files.items():  # hashlib itself, not the module's helper
        assert record == FileRecord(len(files[name]), hashlib.sha256(files[name]).hexdigest()), name
    assert found.size == sum(len(b) for n, b in files.items() if n != MARKER)


def test_no_marker_is_an_interrupted_save_that_says_which_ranks_had_finished():
    files = folder(world=3)
    del files[MARKER], files[manifest_name(2)]
    found = check(files)
    assert found.state == INCOMPLETE
    assert found.problem == "no COMPLETE.json (interrupted while writing; manifests of ranks 0, 1 written)"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"world_size": 0}, "world_size: 0 is out of range"),  # once switched the check off
        ({"world_size": -1}, "world_size: -1 is out of range"),
        ({"world_size": True}, "world_size: expected an integer"),
        ({"world_size": "2"}, "world_size: expected an integer"),
        ({"world_size": 3}, "rank-00002.pt is not listed (world_size 3)"),
        ({"world_size": 1}, "does not belong to a world of 1 ranks"),
        ({"step": 30}, "step: 30, but the folder is step-000000020"),
        ({"samples_consumed": -5}, "samples_consumed: -5 is out of range"),
        ({"data_source": ""}, "data_source: expected the name"),
        ({"format": 3}, "format 3 with digest 'sha256'"),
        ({"digest": "md5"}, "format 2 with digest 'md5'"),
        ({"files": []}, "files: expected an object"),
    ],
)
def test_an_inconsistent_marker_is_damaged_and_says_which_field(change, problem):
    files = folder()
    rewrite_marker(files, **change)
    found = check(files)
    assert found.state == DAMAGED and problem in found.problem and found.problem.startswith(MARKER)


def test_marker_file_records_must_be_sizes_and_hex_digests_of_files_the_format_has():
    for bad_table, problem in (
        ({"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}, "'../../etc/passwd' is not a file"),
        ({".metadata": {"size": -1, "sha256": "0" * 64}}, ".metadata: size: expected a size"),
        ({".metadata": {"size": 50, "sha256": "xyz"}}, ".metadata: sha256: expected 64 hex digits"),
    ):
        files = folder()
        table = json.loads(files[MARKER])["files"]
        table.update(bad_table)
        rewrite_marker(files, files=table)
        assert problem in check(files).problem


@pytest.mark.parametrize("garbage", [b"", b"{", b"\x00" * 300, b"[1, 2]"])
def test_a_marker_that_is_not_a_json_object_is_damaged(garbage):
    files = folder()
    files[MARKER] = garbage
    found = check(files)
    assert found.state == DAMAGED
    assert found.problem in ("COMPLETE.json: not valid JSON", "COMPLETE.json: not a JSON object")


def test_missing_files_are_reported_manifest_first_with_the_rank_that_had_not_finished():
    files = folder()
    for name in ("__1_0.distcp", extras_name(1), manifest_name(1)):
        del files[name]  # rank 1's node never uploaded (node-local directories merged)
    found = check(files)
    assert found.state == DAMAGED
    assert found.problem == (
        "manifest-rank00001.json is missing (rank 1 had not finished, or its files were lost) "
        "(3 files missing)"
    )


def test_a_file_of_another_size_is_damaged_truncated_or_grown():
    files = folder()
    files["__0_0.distcp"] = files["__0_0.distcp"][:400]
    assert check(files).problem == "__0_0.distcp has 400 bytes, expected 1000 (truncated)"
    files["__0_0.distcp"] = b"x" * 1200
    assert check(files).problem == "__0_0.distcp has 1200 bytes, expected 1000 (grown)"


def test_same_size_garbage_passes_the_cheap_checks_and_fails_its_digest():
    files = folder()
    files["__1_0.distcp"] = b"\xff" * 1000  # what only a digest can tell
    found = check(files)
    assert found.state == COMPLETE
    record = found.files["__1_0.distcp"]
    garbage = hashlib.sha256(files["__1_0.distcp"]).hexdigest()
    assert record.problem("__1_0.distcp", 1000, garbage) == (
        "__1_0.distcp: sha256 mismatch (its bytes changed after it was written)"
    )
    assert record.problem("__1_0.distcp", 1000, record.sha256) is None


def format1_folder() -> dict[str, bytes]:
    """What the trainer wrote before digests: sizes in the manifests, no files table in the marker."""
    files = {".metadata": b"m" * 30, "__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 80}
    files |= {extras_name(0): b"s" * 7, extras_name(1): b"t" * 7}
    for rank in (0, 1):
        own = {n: len(b) for n, b in files.items() if owner_rank(n) == rank}
        files[manifest_name(rank)] = json.dumps({"step": STEP, "rank": rank, "files": own}).encode()
    marker = {"step": STEP, "samples_consumed": 320, "world_size": 2, "data_source": "synthetic", "run": None}
    files[MARKER] = json.dumps(marker).encode()
    return files


def test_format_1_checkpoints_are_still_read_by_sizes_only():
    files = format1_folder()
    found = check(files)
    assert found.state == COMPLETE and found.marker.format == 1
    assert all(record.sha256 is None for record in found.files.values())
    files["__1_0.distcp"] = b"b" * 40
    assert check(files).problem == "__1_0.distcp has 40 bytes, expected 80 (truncated)"


def test_format_1_with_world_size_0_or_a_missing_manifest_is_damaged():
    files = format1_folder()
    rewrite_marker(files, world_size=0)
    assert "world_size: 0 is out of range" in check(files).problem
    files = format1_folder()
    del files[manifest_name(1)]
    assert check(files).problem.startswith("manifest-rank00001.json is missing")
    files = format1_folder()
    files[manifest_name(1)] = json.dumps({"step": STEP, "rank": 1, "files": {"__0_0.distcp": 100}}).encode()
    assert "__0_0.distcp is not rank 1's" in check(files).problem


def test_each_file_belongs_to_the_rank_that_wrote_it():
    assert owner_rank(".metadata") == 0
    assert owner_rank("__12_3.distcp") == 12
    assert owner_rank("rank-00007.pt") == 7 and owner_rank("manifest-rank00007.json") == 7
    assert owner_rank(MARKER) is None and owner_rank("notes.txt") is None
