"""No metric lost at a job's end (issue 29, item 12), for real: the CPU trainer's first job of a run (4
steps) runs while its MLflow server is not up yet (nothing listens on its port); the second job (steps
5-8) runs once the server is up. MLflow's own server (trainstack.emulator.mlflow_server: SQLite) and
client say what arrived; the metric lines the jobs printed say what should have.

Then the same kept file is delivered again by both deliverers at once, the next job's
(trainer.tracking.KeptRecords) and the CLI's (`trainstack runs --mlflow`: trainstack.aws.tracking), from
the emulator's S3 (s3torchconnector on the trainer's side, boto3 on the CLI's): the history still holds
each step once.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_helpers import TINY, metric_lines, trainer_ranks  # noqa: E402

from trainstack.aws import tracking  # noqa: E402
from trainstack.emulator.mlflow_server import MlflowServer  # noqa: E402
from trainstack.protocol.kept_metrics import KEPT_DIR, is_kept_name  # noqa: E402
from trainstack.protocol.metrics import parse_line  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mlflow")]
RUN = "ts-platform-tiny-cpu--kept1"
EXPERIMENT = "platform/tiny-cpu"


def _job(index: int, steps: int, server: MlflowServer, checkpoints: Path):
    env = {
        "MLFLOW_TRACKING_URI": server.url,
        "MLFLOW_EXPERIMENT_NAME": EXPERIMENT,
        "TRAINSTACK_RUN": RUN,
        "TRAINING_JOB_NAME": f"{RUN}-{index}",
    }
    args = ("--recipe", str(TINY), "--max-steps", str(steps), "--checkpoint-dir", str(checkpoints))
    done = trainer_ranks(1, *args, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _history(server: MlflowServer, run_id: str) -> list[tuple[int, float, int]]:
    from mlflow.tracking import MlflowClient

    found = MlflowClient(tracking_uri=server.url).get_metric_history(run_id, "loss")
    return sorted((m.step, m.value, m.timestamp) for m in found)


def test_a_first_job_against_an_mlflow_not_yet_up_loses_no_point(tmp_path):
    server = MlflowServer(tmp_path / "mlflow", log_path=tmp_path / "server.log")  # its port, nobody on it
    checkpoints = tmp_path / "checkpoints"
    first = _job(1, 4, server, checkpoints)
    assert "records the tracker did not take are kept in" in first.stderr
    kept = [p for p in (checkpoints / KEPT_DIR).iterdir() if is_kept_name(p.name)]
    assert len(kept) == 1
    kept_bytes = kept[0].read_bytes()
    with server.start(timeout_s=240):
        second = _job(2, 8, server, checkpoints)
        printed = [parse_line(line) for out in (first, second) for line in metric_lines(out.stdout)]
        assert [int(p["step"]) for p in printed] == list(range(1, 9))
        found = tracking.find_run(server.url, EXPERIMENT, RUN)
        assert found is not None
        history = _history(server, found.run_id)
        # every step of both jobs, once, in step order, with the values the jobs printed
        assert [step for step, _, _ in history] == list(range(1, 9))
        assert [value for _, value, _ in history] == pytest.approx([p["loss"] for p in printed], rel=1e-6)
        timestamps = [t for _, _, t in history]
        assert timestamps == sorted(timestamps)  # job 1's points carry the time they were measured
        assert found.tags["trainstack.job.1.exit"] == "completed"  # job 1's own tag, delivered late
        assert not list((checkpoints / KEPT_DIR).iterdir())  # delivered, then deleted
        assert "delivered" in second.stderr and "earlier job kept" in second.stderr

        # Both deliverers at once on the same kept file, from the emulator's S3: nothing doubles.
        _deliver_twice_from_s3(found, kept_bytes)
        assert _history(server, found.run_id) == history


def _deliver_twice_from_s3(found, kept_bytes: bytes) -> None:
    import os

    from trainer.tracking import JobContext, KeptRecords, MlflowSink

    from trainstack.emulator.endpoint import Emulator

    with Emulator() as emulator:
        env, s3 = emulator.env(), emulator.client("s3")
        s3.create_bucket(Bucket="trainstack-checkpoints")
        location = "s3://trainstack-checkpoints/checkpoints/platform/tiny-cpu/kept1/"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            job = JobContext(
                tracking_uri=found.tracking_uri,
                run=RUN,
                run_id=found.run_id,
                experiment=EXPERIMENT,
                run_name=RUN,
                team="platform",
                job_index=3,
                job_name=None,
                previous_end=None,
                image=None,
            )
            trainer_side = KeptRecords(location, job)
            sink = MlflowSink(job, {}, {}, trainer_side)
            sink.client, sink.run_id = tracking.client(found.tracking_uri), found.run_id
            trainer_side.storage().write_run_file(f"{KEPT_DIR}/0000000000001-1.jsonl", kept_bytes)
            results: dict[str, int] = {}
            threads = [
                threading.Thread(target=lambda: results.update(trainer=trainer_side.deliver(sink.send))),
                threading.Thread(
                    target=lambda: results.update(cli=tracking.deliver_kept(found, location, s3))
                ),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert set(results) == {"trainer", "cli"} and results["trainer"] + results["cli"] >= 5
            assert trainer_side.storage().run_files(KEPT_DIR) == []
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
