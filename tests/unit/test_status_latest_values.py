"""`trainstack status` shows loss and val_loss as the trainer last printed them (issue 40 item 6): the
newest value of each in the job's log lines, read with the MetricDefinitions' own regexes."""

from __future__ import annotations

import pytest

from trainstack.cli.commands.status import latest_values

pytestmark = pytest.mark.fast


def test_the_newest_loss_and_the_newest_val_loss_are_taken_each_from_its_own_line():
    lines = [
        "step=18 loss=2.9000 lr=0.003 tokens_per_sec=10.0",
        "step=20 loss=2.8000 lr=0.003 tokens_per_sec=10.0 val_loss=3.1000",
        "checkpoint: saved step 20",
        "step=21 loss=2.7000 lr=0.003 tokens_per_sec=10.0",
        "step=22 loss=2.6500 lr=0.003 tokens_per_sec=10.0",
    ]
    assert latest_values(lines) == {"loss": 2.65, "val_loss": 3.1}


def test_val_loss_is_never_read_as_loss_and_a_nan_is_skipped():
    assert latest_values(["step=5 val_loss=3.5000"]) == {"val_loss": 3.5}
    assert latest_values(["step=4 loss=2.0", "step=5 loss=nan"]) == {"loss": 2.0}
    assert latest_values(["EMULATOR: algo-1: python -m trainer.entrypoint train"]) == {}
