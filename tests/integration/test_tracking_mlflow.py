"""One MLflow run per trainstack run, for real: the CPU trainer runs as two jobs of one run (2 ranks each,
the second resuming the first's checkpoint) against MLflow's own server, the one the emulator starts
(trainstack.emulator.mlflow_server: SQLite, local artifacts). What arrived is read back through MLflow's
own client and its REST API, and compared with the metric lines the jobs printed, never with our code.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_helpers import TINY, metric_lines, trainer_ranks  # noqa: E402

from trainstack.aws import tracking  # noqa: E402
from trainstack.emulator.mlflow_server import MlflowServer, free_port  # noqa: E402
from trainstack.protocol.kept_metrics import KEPT_DIR, encode, is_kept_name, kept_name  # noqa: E402
from trainstack.protocol.metrics import parse_line  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mlflow")]
RUN = "ts-platform-tiny-cpu--mlflow1"
EXPERIMENT = "platform/tiny-cpu"
STEPS = (3, 6)  # job 1 trains steps 1-3 and saves; job 2 resumes and trains 4-6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    with MlflowServer(root, log_path=root / "server.log").start(timeout_s=240) as started:
        yield started


@pytest.fixture(scope="module")
def two_jobs(server, tmp_path_factory):
    """The run's MLflow run created as `trainstack launch` does, then its two jobs; their outputs."""
    work = tmp_path_factory.mktemp("run")
    launched = tracking.create_run(server.url, EXPERIMENT, RUN, {"trainstack.team": "platform"})
    outputs = []
    for index, steps in enumerate(STEPS, start=1):
        env = {
            "MLFLOW_TRACKING_URI": server.url,
            "TRAINSTACK_RUN": RUN,
            "TRAINING_JOB_NAME": f"{RUN}-{index}",  # SageMaker sets it in every container
            "TRAINSTACK_PREVIOUS_JOB_END": "MaxRuntime" if index > 1 else "",
            "TRAINSTACK_TENSORBOARD_DIR": str(work / "tensorboard"),
        }
        done = trainer_ranks(
            2,
            "--recipe",
            str(TINY),
            "--set",
            "tracking.tensorboard=true",
            "--max-steps",
            str(steps),
            "--checkpoint-dir",
            str(work / "checkpoints"),
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done)
    return launched, outputs, work


def test_two_jobs_append_to_one_mlflow_run_in_step_order(server, two_jobs):
    from mlflow.tracking import MlflowClient

    launched, outputs, _ = two_jobs
    client = MlflowClient(tracking_uri=server.url)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    found = client.search_runs([experiment.experiment_id], filter_string=f"tags.`trainstack.run` = '{RUN}'")
    assert [r.info.run_id for r in found] == [launched.run_id]  # one run: the launch's, not one per job/rank
    (run,) = found
    printed = [parse_line(line) for out in outputs for line in metric_lines(out.stdout)]
    assert [int(p["step"]) for p in printed] == [1, 2, 3, 4, 5, 6]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]  # each step once: rank 0 only, both jobs
    assert [m.value for m in history] == pytest.approx([p["loss"] for p in printed], rel=1e-5)
    for key in ("lr", "grad_norm", "tokens_per_sec", "mfu", "mem_gib"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2, 3, 4, 5, 6], key

    tags, params = run.data.tags, run.data.params
    assert run.info.status == "FINISHED" and tags["trainstack.state"] == "completed"
    assert tags["trainstack.job"] == "2" and tags["trainstack.job.2.name"] == f"{RUN}-2"
    assert tags["trainstack.job.1.ended"] == "MaxRuntime"  # the supervisor's reason, tagged by job 2
    assert tags["trainstack.job.1.exit"] == tags["trainstack.job.2.exit"] == "completed"
    assert params["recipe.training.lr"] == "0.003" and params["recipe.model.hidden"] == "64"
    assert float(params["plan.mfu.low"]) <= float(params["plan.mfu"]) <= float(params["plan.mfu.high"])
    assert params["data.source"].startswith("synthetic")
    for out in outputs:  # what was delivered is counted in the job's log (3 steps, the tags, the end)
        assert "tracking mlflow: 5 of 5 records delivered, 0 dropped" in out.stderr


def test_the_rest_api_serves_the_same_history(server, two_jobs):
    launched, _, _ = two_jobs
    query = urllib.parse.urlencode({"run_id": launched.run_id, "metric_key": "loss"})
    with urllib.request.urlopen(f"{server.url}/api/2.0/mlflow/metrics/get-history?{query}", timeout=30) as r:
        metrics = json.loads(r.read())["metrics"]
    assert sorted(int(m["step"]) for m in metrics) == [1, 2, 3, 4, 5, 6]


def test_tensorboard_reads_both_jobs_as_one_run(two_jobs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    _, _, work = two_jobs
    runs = EventMultiplexer().AddRunsFromDirectory(str(work / "tensorboard"))
    runs.Reload()
    assert list(runs.Runs()) == [RUN]  # one folder per trainstack run, one event file per job
    assert len(list((work / "tensorboard" / RUN).glob("events.out.tfevents.*"))) == 2
    assert [e.step for e in runs.Scalars(RUN, "loss")] == [1, 2, 3, 4, 5, 6]


def test_the_cli_records_the_final_state_and_registers_an_export(server, two_jobs):
    from mlflow.tracking import MlflowClient

    launched, _, _ = two_jobs
    found = tracking.find_run(server.url, EXPERIMENT, RUN)
    assert found is not None and found.run_id == launched.run_id
    assert found.url == f"{server.url}/#/experiments/{found.experiment_id}/runs/{found.run_id}"
    changed = tracking.record_state(
        found, "completed", "the steps are done", {"1": "Stopped", "2": "Completed"}
    )
    assert changed == {
        "trainstack.why": "the steps are done",
        "trainstack.job.1.status": "Stopped",
        "trainstack.job.2.status": "Completed",
    }  # the state itself was already completed
    uri = "s3://bucket/exports/platform/tiny-cpu/mlflow1/step-6/"
    version = tracking.register_export(server.url, found, "tiny-cpu", uri, {"step": "6"})
    again = tracking.register_export(server.url, found, "tiny-cpu", uri + "again/")
    model = MlflowClient(tracking_uri=server.url).get_model_version("tiny-cpu", version)
    assert (model.source, model.run_id, model.tags, int(again)) == (uri, launched.run_id, {"step": "6"}, 2)


def test_the_docs_comparison_example_runs_against_the_local_server(server, two_jobs, capsys):
    """docs/tracking.md's "Comparing two runs" block, as a reader runs it (a second run to compare with)."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.url)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    other = client.create_run(experiment.experiment_id, run_name="ts-platform-tiny-cpu--lr2")
    launched, _, _ = two_jobs
    params = {**client.get_run(launched.run_id).data.params, "recipe.training.lr": "0.001"}  # an lr sweep
    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(other.info.run_id, params=items[start : start + 100])
    client.log_batch(
        other.info.run_id,
        metrics=[Metric("loss", 5.0 - step, 0, step) for step in (1, 2)],
        tags=[RunTag("trainstack.run", "ts-platform-tiny-cpu--lr2")],
    )
    text = (Path(__file__).resolve().parents[2] / "docs" / "tracking.md").read_text()
    block = (
        text.split("<!-- tracking-example: compare -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    )
    exec(compile(block, "docs/tracking.md", "exec"), {"tracking_uri": server.url})
    printed = capsys.readouterr().out
    assert "ts-platform-tiny-cpu--lr2: lr 0.001, loss 4.000 -> 3.000 over 2 steps" in printed
    assert f"{RUN}: lr 0.003" in printed and "over 6 steps" in printed
    assert "recipe differences: {'recipe.training.lr': ('0.001', '0.003')}" in printed


def test_runs_mlflow_finds_the_run_and_writes_the_registrys_final_word(server, two_jobs, tmp_path):
    """`trainstack runs --mlflow`'s per-run step (trainstack.cli.commands.mlflow_access.describe) on a run
    record as the registry holds it: a stopped run, its two jobs' ends as SageMaker reported them, and a
    file of records its last job kept beside its checkpoints (here a local directory), delivered."""
    from datetime import UTC, datetime

    from mlflow.tracking import MlflowClient

    from trainstack.aws.registry import JobRecord, Run, view
    from trainstack.cli.commands.mlflow_access import describe
    from trainstack.recipes.loader import resolve

    launched, _, _ = two_jobs
    now = datetime.now(UTC)
    jobs = (
        JobRecord(f"{RUN}-1", 1, "Stopped", "MaxRuntimeExceeded"),
        JobRecord(f"{RUN}-2", 2, "Stopped", "Stopped"),
    )
    record = Run(
        run=RUN, run_id="mlflow1", recipe="tiny-cpu", team="platform", state="stopped",
        current_job=f"{RUN}-2", job_index=2, jobs=jobs, checkpoint_uri=str(tmp_path), steps=60,
        tokens_per_step=512,
        usd_per_hour=1.0, overrides={}, keep_alive=0, stop_requested=True, why="trainstack stop was asked",
        next_step="trainstack resume", recipe_hash="0", max_jobs=20, creator="", created=now, updated=now,
        mlflow_run_id=launched.run_id,
    )  # fmt: skip
    kept = tmp_path / KEPT_DIR / kept_name(1_700_000_000_000, "2")
    kept.parent.mkdir(parents=True)
    kept.write_bytes(
        encode(
            [{"step": s, "values": {"kept_probe": s / 10}, "wall_ms": 1_700_000_000_000 + s} for s in (7, 6)]
        )
    )
    line, found = describe(view(record, {}, 6, now), server.url, resolve(str(TINY)).recipe, None)
    assert found.run_id == launched.run_id and line == f"mlflow: {found.url} (2 kept records delivered)"
    probe = MlflowClient(tracking_uri=server.url).get_metric_history(launched.run_id, "kept_probe")
    assert sorted((m.step, m.value) for m in probe) == [(6, 0.6), (7, 0.7)] and not kept.exists()
    tags = MlflowClient(tracking_uri=server.url).get_run(launched.run_id).data.tags
    assert (tags["trainstack.state"], tags["trainstack.why"]) == ("stopped", "trainstack stop was asked")
    assert tags["trainstack.job.1.status"] == "Stopped (MaxRuntimeExceeded)"


# --- No metric lost at a job's end (issue 29, item 12) --------------------------------------------------
# The CPU trainer's first job of a run (4 steps) runs while its MLflow store is not up (nothing listens on
# the port it is given); the second (steps 5-8) runs against this module's server. Then the same kept file
# is delivered again by both deliverers at once, the next job's (trainer.metrics.tracking.KeptRecords) and the
# CLI's (`trainstack runs --mlflow`: trainstack.aws.tracking), from the emulator's S3 (s3torchconnector on
# the trainer's side, boto3 on the CLI's): the history still holds each step once.
KEPT_RUN = "ts-platform-tiny-cpu--kept1"


def _job(index: int, steps: int, url: str, checkpoints: Path):
    env = {
        "MLFLOW_TRACKING_URI": url,
        "MLFLOW_EXPERIMENT_NAME": EXPERIMENT,
        "TRAINSTACK_RUN": KEPT_RUN,
        "TRAINING_JOB_NAME": f"{KEPT_RUN}-{index}",
    }
    args = ("--recipe", str(TINY), "--max-steps", str(steps), "--checkpoint-dir", str(checkpoints))
    done = trainer_ranks(1, *args, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _history(server: MlflowServer, run_id: str) -> list[tuple[int, float, int]]:
    from mlflow.tracking import MlflowClient

    found = MlflowClient(tracking_uri=server.url).get_metric_history(run_id, "loss")
    return sorted((m.step, m.value, m.timestamp) for m in found)


def test_a_first_job_against_an_mlflow_not_yet_up_loses_no_point(server, tmp_path):
    down = f"http://127.0.0.1:{free_port()}"  # the store not up yet: nothing listens there
    checkpoints = tmp_path / "checkpoints"
    first = _job(1, 4, down, checkpoints)
    assert "records the tracker did not take are kept in" in first.stderr
    kept = [p for p in (checkpoints / KEPT_DIR).iterdir() if is_kept_name(p.name)]
    assert len(kept) == 1
    kept_bytes = kept[0].read_bytes()
    second = _job(2, 8, server.url, checkpoints)  # the store is up now
    printed = [parse_line(line) for out in (first, second) for line in metric_lines(out.stdout)]
    assert [int(p["step"]) for p in printed] == list(range(1, 9))
    found = tracking.find_run(server.url, EXPERIMENT, KEPT_RUN)
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

    from trainer.metrics.tracking import JobContext, KeptRecords, MlflowSink
    from trainer.storage import open_storage

    from trainstack.emulator.endpoint import Emulator

    with Emulator().start(timeout_s=180) as emulator:  # a loaded 2-core machine starts moto slowly
        env, s3 = emulator.env(), emulator.client("s3")
        s3.create_bucket(Bucket="trainstack-checkpoints")
        location = "s3://trainstack-checkpoints/checkpoints/platform/tiny-cpu/kept1/"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            job = JobContext(
                tracking_uri=found.tracking_uri,
                run=KEPT_RUN,
                run_id=found.run_id,
                experiment=EXPERIMENT,
                run_name=KEPT_RUN,
                team="platform",
                job_index=3,
                job_name=None,
                previous_end=None,
                image=None,
            )
            trainer_side = KeptRecords(location, job, open_storage)
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


def test_a_tuning_run_is_one_parent_run_with_a_child_per_candidate(server):
    """trainstack tune's record (trainstack.aws.tracking.record_tuning), read back with MLflow's client:
    the parent tagged with the tuning run and its choice, each candidate a child (mlflow.parentRunId) with
    its planned and measured figures as metrics, from the recorded tuning logs (tests/tuning/data)."""
    from mlflow.tracking import MlflowClient

    from trainstack.recipes.loader import resolve
    from trainstack.tuning.candidates import candidates
    from trainstack.tuning.choose import choose
    from trainstack.tuning.measure import measure

    data = Path(__file__).resolve().parents[1] / "tuning" / "data"
    recipe = resolve(str(TINY)).recipe
    found = candidates(recipe, 3, world=1, compile_choices=False)
    measured = {
        c.name: measure((data / f"{c.name}.log").read_text().splitlines(), warmup=2, final_step=15)
        for c in found
    }
    choice = choose(recipe, found, measured).to_dict()
    summary = {"chosen": choice["chosen"]["name"], "why": choice["chosen"]["why"]}
    parent = tracking.record_tuning(
        server.url,
        "platform/tuning",
        "tune-abc",
        {"trainstack.recipe": recipe.name},
        summary,
        choice["candidates"],
    )
    client = MlflowClient(server.url)
    got = client.get_run(parent.run_id)
    assert got.data.tags["trainstack.tuning"] == "tune-abc"
    assert got.data.tags["trainstack.chosen"] == choice["chosen"]["name"] and got.info.status == "FINISHED"
    children = client.search_runs(
        [parent.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'"
    )
    assert sorted(r.info.run_name for r in children) == ["tune-abc/c0", "tune-abc/c1", "tune-abc/c2"]
    for child in children:
        c = next(x for x in choice["candidates"] if child.info.run_name.endswith(x["name"]))
        assert child.data.tags["trainstack.status"] == "ok"
        assert child.data.metrics["measured.step_time_s"] == pytest.approx(c["measured"]["step_time_s"])
        assert child.data.metrics["planned.step_time_s"] == pytest.approx(c["planned"]["step_time_s"])
        assert child.data.params["overrides"] == (" ".join(c["overrides"]) or "(the recipe's own layout)")
