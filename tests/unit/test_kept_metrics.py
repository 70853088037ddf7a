"""The kept-records format the trainer writes and the next job and the CLI read (pure)."""

from __future__ import annotations

import pytest

from trainstack.protocol.kept_metrics import decode, encode, is_kept_name, keepable, kept_name

pytestmark = pytest.mark.fast


def test_kept_names_sort_in_the_order_written_and_say_whose():
    names = [kept_name(1_700_000_000_000 + i, "2") for i in (5, 40, 300)]
    assert names == sorted(names) and all(is_kept_name(n) for n in names)
    assert kept_name(1, "run a/1") == "0000000000001-run-a-1.jsonl"  # never a path separator
    assert not is_kept_name("0000000000001-1.jsonl.tmp") and not is_kept_name("notes.txt")


def test_a_job_keeps_its_metrics_and_own_tags_never_the_runs_state_or_end():
    records = [
        ("metrics", 3, {"loss": 2.5, "lr": 1e-3}, 1000),
        ("tags", {"trainstack.job.1.exit": "completed", "trainstack.state": "completed"}),
        ("end", "FINISHED"),
    ]
    lines = [line for r in records if (line := keepable(r)) is not None]
    assert lines == [
        {"step": 3, "values": {"loss": 2.5, "lr": 1e-3}, "wall_ms": 1000},
        {"tags": {"trainstack.job.1.exit": "completed"}},
    ]


def test_decode_puts_steps_in_order_and_skips_a_line_cut_short():
    data = encode(
        [
            {"step": 5, "values": {"loss": 1.0}, "wall_ms": 50},
            {"step": 2, "values": {"loss": 3.0}, "wall_ms": 20},
            {"tags": {"trainstack.job.1.exit": "failed"}},
        ]
    )
    metrics, tags = decode(data + b'{"step": 9, "values": {"lo')  # the last write did not finish
    assert metrics == [(2, {"loss": 3.0}, 20), (5, {"loss": 1.0}, 50)]
    assert tags == {"trainstack.job.1.exit": "failed"}
