"""One MLflow run per trainstack run, for real: the CPU trainer runs as two jobs of one run (2 ranks each,
the second resuming the first's checkpoint) against MLflow's own server, the one the emulator starts
(trainstack.emulator.mlflow_server: SQLite, local artifacts). What arrived is read back through MLflow's
own client and its REST API, and compared with the metric lines the jobs printed, never with our code.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_helpers import TINY, metric_lines, trainer_ranks  # noqa: E402

from trainstack.aws import tracking  # noqa: E402
from trainstack.emulator.mlflow_server import MlflowServer  # noqa: E402
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


def test_runs_mlflow_finds_the_run_and_writes_the_registrys_final_word(server, two_jobs):
    """`trainstack runs --mlflow`'s per-run step (trainstack.cli.commands.mlflow_access.describe) on a run
    record as the registry holds it: a stopped run, its two jobs' ends as SageMaker reported them."""
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
        current_job=f"{RUN}-2", job_index=2, jobs=jobs, checkpoint_uri="s3://b/c/", steps=60,
        tokens_per_step=512,
        usd_per_hour=1.0, overrides={}, keep_alive=0, stop_requested=True, why="trainstack stop was asked",
        next_step="trainstack resume", recipe_hash="0", max_jobs=20, creator="", created=now, updated=now,
        mlflow_run_id=launched.run_id,
    )  # fmt: skip
    line, found = describe(view(record, {}, 6, now), server.url, resolve(str(TINY)).recipe, None)
    assert found.run_id == launched.run_id and line == f"mlflow: {found.url}"
    tags = MlflowClient(tracking_uri=server.url).get_run(launched.run_id).data.tags
    assert (tags["trainstack.state"], tags["trainstack.why"]) == ("stopped", "trainstack stop was asked")
    assert tags["trainstack.job.1.status"] == "Stopped (MaxRuntimeExceeded)"


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
