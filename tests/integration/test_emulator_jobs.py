"""The emulator runs the jobs it is given (trainstack.emulator.jobs), as SageMaker would.

One emulator for the module (xdist group "emulator-jobs"). Most jobs here run a small container script
(the job's own ContainerEntrypoint, as any SageMaker job may name) that reports what the container
contract gave it: cheap, and each contract file and variable is checked against what the request asked.
One job runs the real trainer, on two "nodes" of one CPU rank each, until its MaxRuntimeInSeconds.

SageMaker's documented behaviour pinned here (API reference, fetched with the search tool):
- SecondaryStatusTransition / DescribeTrainingJob.SecondaryStatus: InProgress is Starting, Downloading
  ("an optional stage ... data is being downloaded"), Training, Uploading ("model artifacts are being
  uploaded"); then Completed, Failed ("the reason ... in the FailureReason field"), Stopped (Stopped, or
  MaxRuntimeExceeded: "the job stopped because it exceeded the maximum allowed runtime"), Stopping;
- StopTrainingJob: "SageMaker sends the algorithm the SIGTERM signal, which delays job termination for
  120 seconds ... changes the status of the job to Stopping. After SageMaker stops the job, it sets the
  status to Stopped";
- MetricDefinition.Regex: "A regular expression that searches the output of a training job and gets the
  value of the metric" (Name at most 255 characters, Regex at most 500);
- logs: group /aws/sagemaker/TrainingJobs, one stream per host `<job>/algo-<n>-<epoch seconds>`
  (../../shared/README.md section 15; what `trainstack logs` reads, trainstack.aws.runs.log_streams).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from pathlib import Path

import pytest

from trainstack.aws.runs import LogCursor, log_streams, read_new_lines
from trainstack.emulator import events
from trainstack.emulator.endpoint import Emulator
from trainstack.protocol.metrics import metric_definitions

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator-jobs")]

ROLE = "arn:aws:iam::123456789012:role/trainstack-sagemaker"
BUCKET = "jobs-bucket"
TINY = Path(__file__).parents[1] / "trainer" / "fixtures" / "tiny.yaml"

# The job's own container: reports what the contract gave it, prints metric lines, then behaves as told.
CONTAINER = r"""
import json, os, signal, sys, time
from pathlib import Path

root = Path(os.environ["TRAINSTACK_OPT_ML"])
mode = sys.argv[1]
host = os.environ["SM_CURRENT_HOST"]
config = root / ("config" if mode == "processing" else "input/config")
report = {
    "argv": sys.argv[1:],
    "resourceconfig": json.loads((config / "resourceconfig.json").read_text()),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("SM_", "TRAINING_JOB", "MY_", "OMP_"))},
}
if mode == "processing":
    data = root / "processing" / "input"
else:
    data = root / "input" / "data"
    report["hyperparameters"] = json.loads((config / "hyperparameters.json").read_text())
    report["inputdataconfig"] = json.loads((config / "inputdataconfig.json").read_text())
report["files"] = sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.is_file())
if mode == "processing":
    out = root / "processing" / "output"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{host}.json").write_text(json.dumps(report))
    (root / "output" / "message").write_text(f"{host} done. ")
(root / "checkpoints" / f"{host}.json").write_text(json.dumps(report))
(root / "model" / "report.json").write_text(json.dumps(report))
print("step=1 loss=2.5", flush=True)
print("step=2 loss=1.25 val_loss=nan", flush=True)
if mode == "fail":
    (root / "output" / "failure").write_text("trainstack-fatal exit=2: recipe.yaml: training.lr: too high")
    sys.exit(2)
if mode == "wait-for-stop":
    def stop(signum, frame):
        (root / "checkpoints" / "saved-on-sigterm").write_text("step 2")
        print("saved on SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
if mode == "ignore-stop":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode in ("wait-for-stop", "ignore-stop"):
    print("ready", flush=True)
    while True:
        time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    (root / "container.py").write_text(CONTAINER)
    with Emulator(log_path=root / "moto.log").start(timeout_s=180) as emu:
        emu.client("s3").create_bucket(Bucket=BUCKET)
        emu.container = str(root / "container.py")  # type: ignore[attr-defined]
        yield emu


def script_job(emu, name: str, mode: str, *, count: int = 1, **extra) -> None:
    request = {
        "TrainingJobName": name,
        "RoleArn": ROLE,
        "AlgorithmSpecification": {
            "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
            "TrainingInputMode": "File",
            "ContainerEntrypoint": ["python", emu.container],
            "ContainerArguments": [mode],
            "MetricDefinitions": metric_definitions(()),
        },
        "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": count, "VolumeSizeInGB": 10},
        "StoppingCondition": {"MaxRuntimeInSeconds": 600},
        "OutputDataConfig": {"S3OutputPath": f"s3://{BUCKET}/output/"},
        "CheckpointConfig": {"S3Uri": f"s3://{BUCKET}/checkpoints/{name}/"},
        "HyperParameters": {"mode": json.dumps(mode)},
        **extra,
    }
    emu.client("sagemaker").create_training_job(**request)


def wait(emu, name: str, statuses=("Completed", "Failed", "Stopped"), timeout_s: float = 120) -> dict:
    return events.wait_for_status(emu.env(), name, statuses, timeout_s=timeout_s)


def log_lines(emu, name: str) -> dict[str, list[str]]:
    logs = emu.client("logs")
    found: dict[str, list[str]] = {}
    for stream, _, message in read_new_lines(logs, log_streams(logs, name), LogCursor()):
        found.setdefault(stream, []).append(message)
    return found


def s3_json(emu, key: str) -> dict:
    return json.loads(emu.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_a_job_gets_the_container_contract_its_channels_outputs_logs_and_metrics(emulator):
    s3 = emulator.client("s3")
    for i in range(4):
        s3.put_object(Bucket=BUCKET, Key=f"data/shards/part{i}.bin", Body=b"x" * (i + 1))
    s3.put_object(Bucket=BUCKET, Key="data/whole/sub/one.txt", Body=b"1")
    channels = [
        {
            "ChannelName": "shard",
            "DataSource": {
                "S3DataSource": {
                    "S3DataType": "S3Prefix",
                    "S3Uri": f"s3://{BUCKET}/data/shards/",
                    "S3DataDistributionType": "ShardedByS3Key",
                }
            },
        },
        {
            "ChannelName": "whole",
            "InputMode": "FastFile",
            "DataSource": {
                "S3DataSource": {
                    "S3DataType": "S3Prefix",
                    "S3Uri": f"s3://{BUCKET}/data/whole/",
                    "S3DataDistributionType": "FullyReplicated",
                }
            },
        },
    ]
    name = "contract-1"
    script_job(
        emulator, name, "ok", count=2, InputDataConfig=channels, Environment={"MY_VAR": "from the job"}
    )
    described = wait(emulator, name)
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Completed", "Completed")
    seen = [t["Status"] for t in described["SecondaryStatusTransitions"]]
    assert seen == ["Starting", "Downloading", "Training", "Uploading", "Completed"]
    assert all("EndTime" in t for t in described["SecondaryStatusTransitions"][:-1])

    reports = {h: s3_json(emulator, f"checkpoints/{name}/{h}.json") for h in ("algo-1", "algo-2")}
    for host, report in reports.items():
        assert report["resourceconfig"]["current_host"] == host
        assert report["resourceconfig"]["hosts"] == ["algo-1", "algo-2"]
        assert report["hyperparameters"] == {"mode": '"ok"'}  # not a recipe: as given
        assert report["inputdataconfig"] == {
            "shard": {
                "TrainingInputMode": "File",
                "S3DistributionType": "ShardedByS3Key",
                "RecordWrapperType": "None",
            },
            "whole": {
                "TrainingInputMode": "FastFile",
                "S3DistributionType": "FullyReplicated",
                "RecordWrapperType": "None",
            },
        }
        env = report["env"]
        assert env["MY_VAR"] == "from the job" and env["TRAINING_JOB_NAME"] == name
        assert env["SM_CURRENT_HOST"] == host and json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"]
        assert env["SM_CHANNEL_SHARD"].endswith(f"/{name}/{host}/input/data/shard")
        assert env["SM_NUM_GPUS"] == "0" and int(env["OMP_NUM_THREADS"]) >= 1
    # ShardedByS3Key: every other sorted key per host; FullyReplicated (FastFile): all of it on each
    assert reports["algo-1"]["files"] == ["shard/part0.bin", "shard/part2.bin", "whole/sub/one.txt"]
    assert reports["algo-2"]["files"] == ["shard/part1.bin", "shard/part3.bin", "whole/sub/one.txt"]

    model = s3.get_object(Bucket=BUCKET, Key=f"output/{name}/output/model.tar.gz")["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(model)) as tar:
        assert json.loads(tar.extractfile("report.json").read())["resourceconfig"]["current_host"] == "algo-1"

    # The regexes: the last value of each metric; nan is no value (CloudWatch takes none)
    final = {m["MetricName"]: m["Value"] for m in described["FinalMetricDataList"]}
    assert final == {"train:step": 2.0, "train:loss": 1.25}
    listed = emulator.client("cloudwatch").list_metrics(
        Namespace="/aws/sagemaker/TrainingJobs", Dimensions=[{"Name": "TrainingJobName", "Value": name}]
    )["Metrics"]
    assert {m["MetricName"] for m in listed} == {"train:step", "train:loss"}

    lines = log_lines(emulator, name)
    assert len(lines) == 2 and all(re.fullmatch(rf"{name}/algo-[12]-\d{{10}}", s) for s in lines)
    for stream, text in lines.items():
        assert "step=2 loss=1.25 val_loss=nan" in text, stream


def test_a_processing_job_runs_on_its_instances_with_its_inputs_and_outputs(emulator):
    s3 = emulator.client("s3")
    for i in range(3):
        s3.put_object(Bucket=BUCKET, Key=f"raw/part{i}.jsonl", Body=b"{}\n")
    name = "prep-1"
    emulator.client("sagemaker").create_processing_job(
        ProcessingJobName=name,
        RoleArn=ROLE,
        AppSpecification={
            "ImageUri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
            "ContainerEntrypoint": ["python", emulator.container],
            "ContainerArguments": ["processing", "/opt/ml/processing/input/src0"],
        },
        ProcessingInputs=[
            {
                "InputName": "src0",
                "S3Input": {
                    "S3Uri": f"s3://{BUCKET}/raw/",
                    "LocalPath": "/opt/ml/processing/input/src0",
                    "S3DataType": "S3Prefix",
                    "S3InputMode": "File",
                    "S3DataDistributionType": "ShardedByS3Key",
                },
            }
        ],
        ProcessingOutputConfig={
            "Outputs": [
                {
                    "OutputName": "out",
                    "S3Output": {
                        "S3Uri": f"s3://{BUCKET}/prepared/",
                        "LocalPath": "/opt/ml/processing/output",
                        "S3UploadMode": "EndOfJob",
                    },
                }
            ]
        },
        ProcessingResources={
            "ClusterConfig": {"InstanceCount": 2, "InstanceType": "ml.m5.xlarge", "VolumeSizeInGB": 10}
        },
        StoppingCondition={"MaxRuntimeInSeconds": 600},
        Environment={"MY_VAR": "processing"},
    )
    sagemaker = emulator.client("sagemaker")
    deadline = time.monotonic() + 120
    while (job := sagemaker.describe_processing_job(ProcessingJobName=name))["ProcessingJobStatus"] not in (
        "Completed",
        "Failed",
        "Stopped",
    ):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert job["ProcessingJobStatus"] == "Completed", job.get("FailureReason")
    assert job["ExitMessage"] == "algo-1 done. algo-2 done. "  # each container's /opt/ml/output/message
    reports = {h: s3_json(emulator, f"prepared/{h}.json") for h in ("algo-1", "algo-2")}
    assert reports["algo-1"]["files"] == ["src0/part0.jsonl", "src0/part2.jsonl"]
    assert reports["algo-2"]["files"] == ["src0/part1.jsonl"]
    # an argument written against /opt/ml names the instance's own folder standing in for it
    assert reports["algo-1"]["argv"][1].endswith(f"/{name}/algo-1/processing/input/src0")
    assert reports["algo-2"]["env"]["MY_VAR"] == "processing"
    logs = emulator.client("logs")
    streams = logs.describe_log_streams(logGroupName="/aws/sagemaker/ProcessingJobs")["logStreams"]
    assert sorted(re.sub(r"-\d{10}$", "", s["logStreamName"]) for s in streams) == [
        f"{name}/algo-1",
        f"{name}/algo-2",
    ]


def test_a_failing_container_fails_the_job_with_its_failure_file_as_the_reason(emulator):
    script_job(emulator, "fails-1", "fail")
    described = wait(emulator, "fails-1")
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Failed", "Failed")
    assert described["FailureReason"] == "trainstack-fatal exit=2: recipe.yaml: training.lr: too high"
    assert "Uploading" not in [t["Status"] for t in described["SecondaryStatusTransitions"]]
    # A channel that cannot be downloaded fails the job before its container starts, as a client error.
    missing = [
        {
            "ChannelName": "train",
            "DataSource": {
                "S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": "s3://no-such-bucket-x/data/"}
            },
        }
    ]
    script_job(emulator, "no-data-1", "ok", InputDataConfig=missing)
    described = wait(emulator, "no-data-1")
    assert described["TrainingJobStatus"] == "Failed"
    assert described["FailureReason"].startswith("ClientError: Data download failed: ")
    assert "Training" not in [t["Status"] for t in described["SecondaryStatusTransitions"]]


def test_stop_training_job_sends_sigterm_and_the_job_goes_stopping_then_stopped(emulator):
    name = "stop-me-1"
    script_job(emulator, name, "wait-for-stop")
    deadline = time.monotonic() + 120
    while not any("ready" in lines for lines in log_lines(emulator, name).values()):
        assert time.monotonic() < deadline, "the container never started"
        time.sleep(0.5)
    sagemaker = emulator.client("sagemaker")
    sagemaker.stop_training_job(TrainingJobName=name)
    assert sagemaker.describe_training_job(TrainingJobName=name)["TrainingJobStatus"] in (
        "Stopping",
        "Stopped",
    )
    described = wait(emulator, name)
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Stopped", "Stopped")
    assert "Stopping" in [t["Status"] for t in described["SecondaryStatusTransitions"]]
    # What the container saved in its SIGTERM window is synced to CheckpointConfig.S3Uri
    body = emulator.client("s3").get_object(Bucket=BUCKET, Key=f"checkpoints/{name}/saved-on-sigterm")["Body"]
    assert body.read() == b"step 2"
    with pytest.raises(sagemaker.exceptions.ClientError):  # a stopped job cannot be stopped again
        sagemaker.stop_training_job(TrainingJobName=name)


def test_a_container_that_ignores_sigterm_is_killed_after_the_grace_period(emulator):
    events.configure(emulator.env(), kill_after_seconds=2)  # SageMaker's is 120 s
    try:
        name = "stubborn-1"
        script_job(emulator, name, "ignore-stop")
        deadline = time.monotonic() + 120
        while not any("ready" in lines for lines in log_lines(emulator, name).values()):
            assert time.monotonic() < deadline, "the container never started"
            time.sleep(0.5)
        stopped_at = time.monotonic()
        emulator.client("sagemaker").stop_training_job(TrainingJobName=name)
        described = wait(emulator, name, timeout_s=60)
        assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == ("Stopped", "Stopped")
        assert 2 <= time.monotonic() - stopped_at < 30
    finally:
        events.configure(emulator.env(), kill_after_seconds=120)


def test_the_trainer_on_two_nodes_trains_until_max_runtime_then_saves_and_stops(emulator):
    """The real trainer (the image's entry point) on two "nodes" of one rank each: torchrun's rendezvous
    on algo-1, metric lines into FinalMetricDataList and CloudWatch, one log stream per node, and at
    MaxRuntimeInSeconds SIGTERM: the trainer saves to the run's S3 prefix, the job is Stopped /
    MaxRuntimeExceeded."""
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.schema import to_hyperparameters

    recipe = resolve(
        str(TINY),
        overrides=(
            "compute.instance_count=2",
            "training.global_batch=32",
            # more steps than 75 s hold on any machine: tiny.yaml's own 60 finish first on 2 idle cores
            "training.steps=20000",
            "checkpointing.interval_steps=1000",
        ),
    ).recipe
    events.configure(emulator.env(), ranks_per_node=1)
    try:
        name = "tiny-two-nodes-1"
        checkpoints = f"s3://{BUCKET}/checkpoints/platform/tiny-cpu/run-1/"
        emulator.client("sagemaker").create_training_job(
            TrainingJobName=name,
            RoleArn=ROLE,
            AlgorithmSpecification={
                "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
                "TrainingInputMode": "File",
                "MetricDefinitions": metric_definitions(()),
            },
            ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 50},
            StoppingCondition={"MaxRuntimeInSeconds": 75},
            OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/output/"},
            HyperParameters=to_hyperparameters(recipe),
            Environment={"TRAINSTACK_CHECKPOINT_URI": checkpoints, "TRAINSTACK_RUN": "run-1"},
        )
        described = wait(emulator, name, timeout_s=400)
    finally:
        events.configure(emulator.env(), ranks_per_node=2)
    lines = log_lines(emulator, name)
    assert (described["TrainingJobStatus"], described["SecondaryStatus"]) == (
        "Stopped",
        "MaxRuntimeExceeded",
    ), (
        described.get("FailureReason"),
        {s: text[-15:] for s, text in lines.items()},
    )
    assert [t["Status"] for t in described["SecondaryStatusTransitions"]][-3:] == [
        "Stopping",
        "Uploading",
        "MaxRuntimeExceeded",
    ]
    final = {m["MetricName"]: m["Value"] for m in described["FinalMetricDataList"]}
    assert final["train:step"] >= 1 and 0 < final["train:loss"] < 10
    assert len(lines) == 2  # one stream per node
    text = "\n".join(lines[min(lines)])
    assert "--nnodes=2" in text and "--master-addr=127.0.0.1" in text  # the rendezvous on algo-1's address
    listed = emulator.client("s3").list_objects_v2(
        Bucket=BUCKET, Prefix="checkpoints/platform/tiny-cpu/run-1/"
    )
    complete = [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith("COMPLETE.json")]
    assert complete, "the trainer saved nothing on SIGTERM"
    step = int(re.search(r"step-(\d+)/", complete[-1]).group(1))
    assert step == final["train:step"]  # saved at the last step it logged


def test_a_job_a_state_machine_creates_runs_with_nobodys_help(emulator):
    """What the deployed launcher does (an aws-sdk createTrainingJob task, which moto's interpreter
    runs inside the server): the job it creates runs, with nothing called by hand."""
    sfn = emulator.client("stepfunctions")
    name = "from-a-state-machine-1"
    definition = {
        "StartAt": "Create",
        "States": {
            "Create": {
                "Type": "Task",
                "Resource": "arn:aws:states:::aws-sdk:sagemaker:createTrainingJob",
                "Parameters": {
                    "TrainingJobName": name,
                    "RoleArn": ROLE,
                    "AlgorithmSpecification": {
                        "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
                        "TrainingInputMode": "File",
                        "ContainerEntrypoint": ["python", emulator.container],
                        "ContainerArguments": ["ok"],
                        "MetricDefinitions": metric_definitions(()),
                    },
                    "ResourceConfig": {
                        "InstanceType": "ml.m5.xlarge",
                        "InstanceCount": 1,
                        "VolumeSizeInGB": 10,
                    },
                    "StoppingCondition": {"MaxRuntimeInSeconds": 600},
                    "OutputDataConfig": {"S3OutputPath": f"s3://{BUCKET}/output/"},
                    "HyperParameters": {"mode": '"ok"'},
                },
                "End": True,
            }
        },
    }
    machine = sfn.create_state_machine(name="creates-a-job", definition=json.dumps(definition), roleArn=ROLE)
    sfn.start_execution(stateMachineArn=machine["stateMachineArn"], name="once")
    deadline = time.monotonic() + 60
    while name not in [
        j["TrainingJobName"]
        for j in emulator.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]
    ]:
        assert time.monotonic() < deadline, "the state machine created no job"
        time.sleep(0.5)
    described = wait(emulator, name)
    assert described["TrainingJobStatus"] == "Completed", described.get("FailureReason")
    assert {m["MetricName"]: m["Value"] for m in described["FinalMetricDataList"]}["train:loss"] == 1.25


def test_no_job_outlives_its_emulator(tmp_path):
    """Each node runs in its own process group, and torchrun starts each worker in a session of its own;
    stopping the emulator (SIGTERM, as Emulator.stop and `trainstack emulator stop` send) takes every
    process of every node along. The container here starts a worker in a new session, as torchrun does."""
    import subprocess

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import subprocess, sys, time\n"
        "if sys.argv[1:] != ['worker']:\n"
        "    subprocess.Popen([sys.executable, __file__, 'worker'], start_new_session=True)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    emu = Emulator(log_path=tmp_path / "moto.log").start(timeout_s=180)
    try:
        emu.client("sagemaker").create_training_job(
            TrainingJobName="outlives-1",
            RoleArn=ROLE,
            AlgorithmSpecification={
                "TrainingImage": "x",
                "TrainingInputMode": "File",
                "ContainerEntrypoint": ["python", str(sleeper)],
            },
            ResourceConfig={"InstanceType": "ml.m5.large", "InstanceCount": 2, "VolumeSizeInGB": 1},
            StoppingCondition={"MaxRuntimeInSeconds": 600},
            OutputDataConfig={"S3OutputPath": "s3://nowhere/out/"},
        )
        deadline = time.monotonic() + 120
        while not any("ready" in lines for lines in log_lines(emu, "outlives-1").values()):
            assert time.monotonic() < deadline, "the container never started"
            time.sleep(0.5)

        def running() -> list[str]:
            return subprocess.run(
                ["pgrep", "-f", str(sleeper)], capture_output=True, text=True
            ).stdout.split()

        deadline = time.monotonic() + 90
        while len(running()) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(running()) == 4  # a container and its worker on each of the two nodes
    finally:
        emu.stop()
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running() == []
