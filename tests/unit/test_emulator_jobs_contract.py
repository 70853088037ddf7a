"""The pure parts of the emulator's jobs: SageMaker's container contract as files, variables and commands
(trainstack.emulator.jobs), and which recipe a job trains on this machine (trainstack.emulator.stand_in).
No emulator, no training: tests/integration/test_emulator_jobs.py runs the jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from trainstack.emulator import jobs, stand_in
from trainstack.protocol.container import map_opt_ml, opt_ml
from trainstack.protocol.metrics import format_line, metric_definitions
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import from_hyperparameters, to_hyperparameters

pytestmark = pytest.mark.fast

TINY = Path(__file__).parents[1] / "trainer" / "fixtures" / "tiny.yaml"
GIB = 1024**3


def test_the_image_entry_point_runs_unless_the_job_names_its_own():
    python = "/venv/bin/python"
    assert jobs.container_command({}, python) == [python, "-m", "trainer.entrypoint", "train"]
    export = {
        "ContainerEntrypoint": ["python", "-m", "trainer.export"],
        "ContainerArguments": ["--step", "0"],
    }
    assert jobs.container_command(export, python) == [python, "-m", "trainer.export", "--step", "0"]
    assert jobs.container_command({"ContainerEntrypoint": ["/bin/sh", "-c", "true"]}, python)[0] == "/bin/sh"


def test_opt_ml_paths_move_under_the_jobs_folder_and_nothing_else_does(tmp_path):
    assert map_opt_ml("/opt/ml/processing/input/src0", tmp_path) == f"{tmp_path}/processing/input/src0"
    assert map_opt_ml("/opt/ml", tmp_path) == str(tmp_path)
    for untouched in ("/opt/mlx/a", "s3://b/opt/ml/x", "--out", "/tmp/opt/ml"):
        assert map_opt_ml(untouched, tmp_path) == untouched
    assert opt_ml("input/config/hyperparameters.json", {}) == Path(
        "/opt/ml/input/config/hyperparameters.json"
    )
    env = {"TRAINSTACK_OPT_ML": str(tmp_path)}
    assert opt_ml("output/failure", env) == tmp_path / "output" / "failure"


def test_sharded_by_s3_key_gives_each_host_every_nth_sorted_key_and_replicated_all():
    keys = ["p/c", "p/a", "p/d", "p/b", "p/e"]
    assert jobs.keys_for_host(keys, "ShardedByS3Key", 0, 2) == ["p/a", "p/c", "p/e"]
    assert jobs.keys_for_host(keys, "ShardedByS3Key", 1, 2) == ["p/b", "p/d"]
    assert jobs.keys_for_host(keys, "FullyReplicated", 1, 2) == sorted(keys)


def test_an_objects_place_in_the_channel_is_its_key_below_the_prefixs_folder():
    assert jobs.relative_key("data/train/a/b.bin", "data/train/") == "a/b.bin"
    assert jobs.relative_key("data/train/a/b.bin", "data/train") == "train/a/b.bin"
    assert jobs.relative_key("tokenizer.json", "tokenizer.json") == "tokenizer.json"


def test_threads_per_rank_never_oversubscribe_and_never_reach_zero():
    assert jobs.threads_per_rank(16, 2) == 8
    assert jobs.threads_per_rank(2, 2) == 1
    assert jobs.threads_per_rank(2, 6) == 1  # more ranks than cores: one thread each, not zero
    assert jobs.threads_per_rank(3, 2) == 1


def test_inputdataconfig_has_each_channels_mode_with_the_channels_own_mode_first():
    channels = [
        {
            "ChannelName": "train",
            "DataSource": {"S3DataSource": {"S3DataDistributionType": "ShardedByS3Key"}},
        },
        {"ChannelName": "base", "InputMode": "File", "DataSource": {"S3DataSource": {}}},
    ]
    assert jobs.input_data_config(channels, "FastFile") == {
        "train": {
            "TrainingInputMode": "FastFile",
            "S3DistributionType": "ShardedByS3Key",
            "RecordWrapperType": "None",
        },
        "base": {
            "TrainingInputMode": "File",
            "S3DistributionType": "FullyReplicated",
            "RecordWrapperType": "None",
        },
    }


def test_resourceconfig_names_this_host_all_hosts_and_the_loopback_interface():
    config = jobs.resource_config("algo-2", jobs.host_names(3), "ml.p5.48xlarge")
    assert config["current_host"] == "algo-2" and config["hosts"] == ["algo-1", "algo-2", "algo-3"]
    assert config["instance_groups"][0]["hosts"] == config["hosts"]
    assert config["network_interface_name"].startswith("lo")


def test_the_metric_definitions_read_the_trainers_line_as_sagemaker_would():
    """The request's own regexes (trainstack.protocol.metrics) on a line the trainer prints: the last
    value of each metric is kept; nan is no value (CloudWatch takes none)."""
    scanner = jobs.MetricScanner(metric_definitions(()))
    first, last = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)
    values = dict(
        step=10, loss=2.5, lr=3e-4, tokens_per_sec=100.0, tflops_per_gpu=1.0, mfu=0.3, mem_gib=1.0,
        step_time_s=0.5, straggler_host=1, straggler_rank=0, straggler_compute_s=0.1, straggler_skew=0.0,
    )  # fmt: skip
    scanner.scan(format_line(**values), first)
    found = scanner.scan(format_line(**{**values, "step": 20, "loss": float("nan")}) + " val_loss=2.75", last)
    assert ("train:loss", 2.5) not in found and ("train:val_loss", 2.75) in found
    final = {m["MetricName"]: (m["Value"], m["Timestamp"]) for m in scanner.final_metric_data_list()}
    assert final["train:step"] == (20.0, last) and final["train:loss"] == (2.5, first)
    assert final["train:val_loss"] == (2.75, last)
    assert scanner.scan("entrypoint: host algo-1", last) == []


def test_an_mlflow_arn_becomes_the_emulators_server_and_a_url_is_kept():
    arn = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-app/placeholder"
    assert jobs.tracking_uri_for_job(arn, "http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert jobs.tracking_uri_for_job(arn, None) is None  # no server: the job does not track
    assert jobs.tracking_uri_for_job("http://x:1", "http://127.0.0.1:5000") == "http://x:1"


def test_the_launching_shells_aws_and_tracking_settings_do_not_reach_a_job():
    env = jobs.inherited_environment({"PATH": "/bin", "AWS_PROFILE": "prod", "MLFLOW_TRACKING_URI": "x"})
    assert env == {"PATH": "/bin"}


def test_a_recipe_that_fits_the_machine_trains_as_written():
    recipe = resolve(str(TINY)).recipe
    given = to_hyperparameters(recipe)
    decided = stand_in.decide(given, 1, 2, 8 * GIB)
    assert decided.hyperparameters == given and decided.note is None and decided.ranks_per_node == 2


def test_a_base_recipe_trains_a_stand_in_with_everything_but_the_model_and_step_as_given():
    recipe = resolve("8b-fp8", overrides=("checkpointing.interval_steps=50",)).recipe
    ok, need, budget = stand_in.fits(recipe, 2, 64 * GIB)
    assert not ok and need > budget == 32  # the planner's arithmetic: hundreds of GiB
    decided = stand_in.decide(to_hyperparameters(recipe), 1, 2, 64 * GIB)
    assert decided.note.startswith("stand-in: recipe 8b-fp8 needs ") and "32.0 GiB budget" in decided.note
    small = from_hyperparameters(decided.hyperparameters)
    assert (small.model.layers, small.model.hidden, small.model.vocab) == (2, 32, recipe.model.vocab)
    assert small.precision.dtype == "bf16" and small.training.seq_len == 32
    assert small.training.global_batch == 8 and small.training.micro_batch == 1
    for same in ("steps", "lr", "warmup_steps", "log_every", "seed"):
        assert getattr(small.training, same) == getattr(recipe.training, same), same
    for section in ("checkpointing", "validation", "tracking", "data", "compute", "export", "tags"):
        assert getattr(small, section) == getattr(recipe, section), section
    assert small.name == recipe.name
    # the stand-in itself fits, so a run's every job (and its export) trains the same one
    assert stand_in.fits(small, 2, 64 * GIB)[0]
    again = stand_in.decide(to_hyperparameters(recipe), 1, 2, 64 * GIB)
    assert again == decided


def test_a_many_node_stand_in_runs_one_rank_a_node_on_a_small_machine():
    recipe = resolve("64b-fp8").recipe
    nodes = recipe.compute.instance_count
    decided = stand_in.decide(to_hyperparameters(recipe), nodes, 2, 16 * GIB, cpus=2)
    assert nodes > 2 and decided.ranks_per_node == 1 and decided.note
    export = stand_in.decide(to_hyperparameters(recipe), 1, 2, 16 * GIB, cpus=2)  # its export job: 1 node
    assert export.hyperparameters == decided.hyperparameters


def test_hyperparameters_that_are_not_a_recipe_go_through_unchanged():
    decided = stand_in.decide({"epochs": "3"}, 2, 2, 8 * GIB)
    assert decided.hyperparameters == {"epochs": "3"} and decided.note is None


@pytest.mark.parametrize(
    ("ranks", "nodes", "expected"),
    [(2, 1, 2), (2, 2, 2), (4, 1, 4)],
)
def test_ranks_per_node_keep_the_trainers_layout_valid(ranks, nodes, expected):
    recipe = resolve(str(TINY)).recipe  # global_batch 16, micro_batch 2
    assert stand_in.ranks_per_node(recipe, nodes, ranks) == expected
    odd = recipe.model_copy(update={"training": recipe.training.model_copy(update={"global_batch": 6})})
    assert stand_in.ranks_per_node(odd, 1, 2) == 1  # 6 is not a multiple of 2 x 2


def test_the_entrypoint_takes_its_ranks_and_rendezvous_from_the_emulator(tmp_path):
    config = tmp_path / "resourceconfig.json"
    config.write_text(json.dumps({"current_host": "algo-2", "hosts": ["algo-1", "algo-2"]}))
    env = {"TRAINSTACK_NPROC_PER_NODE": "1", "TRAINSTACK_RENDEZVOUS": "127.0.0.1:41234", "PATH": "/usr/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "trainer.entrypoint", "train", "--resource-config", str(config), "--dry-run"],
        env={**env, "PYTHONPATH": ":".join(sys.path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    command = json.loads(done.stdout)["command"]
    assert "--nproc-per-node=1" in command and "--node-rank=1" in command
    assert "--master-addr=127.0.0.1" in command and "--master-port=41234" in command


def test_status_and_runs_read_the_stand_in_from_the_jobs_environment():
    from trainstack.aws.runs import job_from_description

    described = {
        "TrainingJobName": "ts-platform-8b-fp8--abc-r1-1",
        "TrainingJobStatus": "InProgress",
        "SecondaryStatus": "Training",
        "CreationTime": datetime(2026, 1, 1, tzinfo=UTC),
        "Environment": {"TRAINSTACK_RUN": "r1", jobs.STAND_IN_ENV: "stand-in: recipe 8b-fp8 needs ..."},
    }
    assert job_from_description(described).stand_in == "stand-in: recipe 8b-fp8 needs ..."
    del described["Environment"][jobs.STAND_IN_ENV]
    assert job_from_description(described).stand_in is None  # on SageMaker: never set


def test_nodes_together_run_no_more_ranks_than_the_cpus_unless_asked():
    recipe = resolve(str(TINY), overrides=("compute.instance_count=2", "training.global_batch=32")).recipe
    given = to_hyperparameters(recipe)
    assert stand_in.decide(given, 2, 2, 8 * GIB, cpus=2).ranks_per_node == 1  # 2 nodes on 2 cores
    assert stand_in.decide(given, 2, 2, 8 * GIB, cpus=16).ranks_per_node == 2
    assert stand_in.decide(given, 2, 4, 8 * GIB, cpus=2).ranks_per_node == 2  # configured 4: 4 ranks in all


def test_log_lines_go_in_batches_within_put_log_events_limits():
    """PutLogEvents (CloudWatch Logs API reference): at most 10,000 events and 1,048,576 bytes a batch,
    each message's bytes plus 26; an event at most 256 KiB. moto enforces none of them."""
    lines = [{"timestamp": i, "message": "x" * 250} for i in range(12_000)]
    batches = jobs.log_batches(lines)
    assert [e for b in batches for e in b] == lines  # all of them, in order
    assert all(len(b) <= 10_000 and sum(len(e["message"]) + 26 for e in b) <= 1_048_576 for b in batches)
    (huge,) = jobs.log_batches([{"timestamp": 0, "message": "y" * 300_000}])
    assert len(huge[0]["message"]) + 26 == 256 * 1024
    assert len(jobs.log_batches([{"timestamp": 0, "message": "z"}] * 10_001)) == 2  # the count limit


def test_a_nodes_process_tree_is_found_below_its_entry_point():
    """torchrun starts each worker in a session of its own: killing the node's process group would
    leave them training, so the emulator kills every descendant of the node's entry point."""
    parents = {10: 1, 11: 10, 12: 11, 13: 11, 20: 1, 21: 20}  # 10 -> torchrun 11 -> workers 12, 13
    assert jobs.descendants(10, parents) == [11, 12, 13]
    assert jobs.descendants(12, parents) == []
