#!/usr/bin/env python3
"""`make demo`: deploy a recipe into a local AWS emulator, then launch, stop, resume and list a run; no
AWS account needed.

1. start moto in server mode on localhost (trainstack.emulator.endpoint), jobs that run until ended
2. `npx cdk bootstrap`, then the real `npx cdk deploy --all -c recipe=RECIPE` against it
3b. `trainstack data prepare s3://... --tokenizer bytes --out s3://... --local`: the docs as a raw
   corpus in the emulator's S3, tokenized by the same entrypoint a Processing job runs
3. `trainstack launch RECIPE --local --name demo` (the run supervisor's StartJob, interpreted by the
   emulator, creates job 1 of run ts-<team>-<recipe>--demo)
4. `trainstack stop RUN --local`, and the job's Stopped event delivered to the deployed rule
   (EMULATOR: what EventBridge does on AWS), so the supervisor records the run stopped
5. `trainstack resume RUN --local`: job 2, same checkpoint prefix
6. `trainstack runs RECIPE --local`: the run, its two jobs, one checkpoint URI
7. `trainstack status RECIPE --local`
8. show the CreateTrainingJob request the emulator received for job 2
9. say what to try next; the emulator keeps running for it (`trainstack emulator stop` ends it,
   `--stop` stops it at the end instead). An emulator already running here is reused.

The emulator does not run containers: nothing trains; jobs end when the demo (or a test) ends them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.emulator import endpoint as emu  # noqa: E402
from trainstack.emulator import events as emulator_events  # noqa: E402
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator  # noqa: E402
from trainstack.errors import TrainstackError  # noqa: E402

NODE_NOISE = (
    "NodeVersionSupportWarning",
    "versions published after",
    "will require node",
    "To continue receiving",
    "and security updates",
    "More information can be found",
    "node --trace-warnings",
    "Node 20",
)


class DemoError(Exception):
    pass


def step(n: int, total: int, text: str) -> float:
    print(f"\n[{n}/{total}] {text}", flush=True)
    return time.monotonic()


def run(cmd: list[str], env: dict[str, str], *, quiet: bool = False, timeout: float = 600) -> str:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = "\n".join(
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip() and not any(noise in line for noise in NODE_NOISE)
    )
    if proc.returncode != 0:
        raise DemoError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{out[-4000:]}")
    if not quiet:
        print("    " + out.replace("\n", "\n    "), flush=True)
    print(f"    ({time.monotonic() - started:.1f} s)", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="30b-fp8")
    parser.add_argument("--team", default=None)
    parser.add_argument(
        "--keep",
        action="store_true",
        default=True,
        help="leave the emulator running at the end, for the next steps it prints (the default)",
    )
    parser.add_argument("--stop", dest="keep", action="store_false", help="stop the emulator at the end")
    args = parser.parse_args()

    npx = shutil.which("npx")
    if npx is None:
        print("error: npx not found: install Node.js 20+ and run `make setup`", file=sys.stderr)
        return 2
    trainstack = str(Path(sys.executable).parent / "trainstack")
    context = ["-c", f"recipe={args.recipe}"] + (["-c", f"team={args.team}"] if args.team else [])
    team = ["--team", args.team] if args.team else []
    state_file, log = ROOT / emu.STATE_FILE, ROOT / emu.LOG_FILE
    log.parent.mkdir(exist_ok=True)
    total = 9
    t0 = time.monotonic()
    reused = emu.running(state_file)
    emulator = Emulator(port=int(reused["endpoint"].rsplit(":", 1)[1])) if reused else Emulator(log_path=log)
    try:
        if reused:
            step(1, total, f"using the local AWS emulator already running on {emulator.endpoint}")
            print(f"    (pid {reused.get('pid')}; `trainstack emulator stop` stops it)", flush=True)
        else:
            step(1, total, f"starting the local AWS emulator (moto server; log: {log.relative_to(ROOT)})")
            start_recorded(emulator, state_file, log)
            print(f"    listening on {emulator.endpoint} (pid {emulator.pid})", flush=True)
        # EMULATOR: jobs stay InProgress until something ends them, as on AWS.
        emulator_events.configure(emulator.env(), jobs_run=True)
        env = {
            **os.environ,
            **emulator.env(),
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
            "CDK_DISABLE_CLI_TELEMETRY": "true",
        }

        step(2, total, f"npx cdk bootstrap aws://{ACCOUNT}/{REGION}")
        run(
            [npx, "cdk", "bootstrap", f"aws://{ACCOUNT}/{REGION}", *context, "-o", "cdk.out.demo"],
            env,
            quiet=True,
        )

        step(
            3,
            total,
            f"npx cdk deploy --all {' '.join(context)} --method=direct   "
            "(direct: the emulator loses exports on the change-set path)",
        )
        out = run(
            [
                npx,
                "cdk",
                "deploy",
                "--all",
                *context,
                "--method=direct",
                "--require-approval=never",
                "-o",
                "cdk.out.demo",
            ],
            env,
            quiet=True,
        )
        for line in out.splitlines():
            if "✅" in line or " = " in line:
                print("    " + line.strip(), flush=True)

        prepare_data(emulator, env, trainstack)

        # A run's name is unique; an emulator kept from an earlier demo already has run `demo`.
        name = "demo" if not reused else f"demo-{time.strftime('%H%M%S')}"
        step(4, total, f"trainstack launch {args.recipe} --local --name {name} --wait")
        launched = run([trainstack, "launch", args.recipe, *team, "--local", "--name", name, "--wait"], env)
        # "launched run <run>: job <job> (...)"
        words = launched.splitlines()[0].split()
        run_name, first_job = words[2].rstrip(":"), words[4]

        step(5, total, f"trainstack stop {run_name} --local")
        run([trainstack, "stop", run_name, "--local"], env)
        print(
            "    EMULATOR: delivering the job's Stopped event to the deployed rule, as EventBridge would",
            flush=True,
        )
        decision = deliver(emulator.env(), first_job, run_name)
        print(
            f"    the supervisor decided: {decision['Outcome']} ({decision['Why']}); next: {decision['Next']}"
        )

        step(6, total, f"trainstack resume {run_name} --local")
        resumed = run([trainstack, "resume", run_name, "--local"], env)
        # "resuming run <run> (...): job <job> resumes from <checkpoints>" / "execution: <arn>"
        second_job = re.search(r"job (\S+) resumes", resumed).group(1)
        second_execution = resumed.splitlines()[1].split()[-1]
        wait_for_job(emulator.env(), second_job)

        step(7, total, f"trainstack runs {args.recipe} --local")
        run([trainstack, "runs", args.recipe, *team, "--local"], env)

        step(8, total, f"trainstack status {args.recipe} --local")
        run([trainstack, "status", args.recipe, *team, "--local", "--runs", "2"], env)

        step(9, total, f"the training job the emulator received: {second_job}")
        show_job(emulator.env(), second_job, second_execution, first_job)
    except (DemoError, TrainstackError, subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        print(f"\nerror: {exc or 'interrupted'}", file=sys.stderr)
        print(f"(emulator log: {log})", file=sys.stderr)
        if not reused:  # ours, and the demo did not get far enough to be worth keeping
            emu.stop_recorded(state_file)
            emulator.stop()
        return 1
    print(
        f"\ndone in {time.monotonic() - t0:.0f} s. The emulator does not run containers: its jobs run until "
        "something ends them, and nothing trained.",
        flush=True,
    )
    if not args.keep:
        if not reused:
            emu.stop_recorded(state_file)
        print("The emulator is stopped (--stop).", flush=True)
        return 0
    print(next_steps(args.recipe, args.team, emulator.endpoint, reused, log), flush=True)
    return 0


DEMO_DATA_BUCKET = "trainstack-demo-data"


def prepare_data(emulator: Emulator, env: dict[str, str], trainstack: str) -> None:
    """A small preparation on the emulator's S3: the repository's docs as raw text, tokenized to shards."""
    print(
        f"\n[3b] trainstack data prepare s3://{DEMO_DATA_BUCKET}/raw/ --tokenizer bytes "
        f"--out s3://{DEMO_DATA_BUCKET}/tokens/ --local",
        flush=True,
    )
    s3 = emulator.client("s3")
    s3.create_bucket(Bucket=DEMO_DATA_BUCKET)
    for doc in sorted((ROOT / "docs").glob("*.md")):
        s3.put_object(Bucket=DEMO_DATA_BUCKET, Key=f"raw/{doc.name}", Body=doc.read_bytes())
    # A demo kept from an earlier run already holds the dataset: the rerun finds every file done.
    run(
        [trainstack, "data", "prepare", f"s3://{DEMO_DATA_BUCKET}/raw/", "--tokenizer", "bytes"]
        + [
            "--out",
            f"s3://{DEMO_DATA_BUCKET}/tokens/",
            "--local",
            "--validation-fraction",
            "0.1",
            "--workers",
            "1",
        ],
        env,
    )


def deliver(env: dict[str, str], job: str, run_name: str) -> dict:
    """Deliver the job's state-change event to the deployed rules and wait for the supervisor's decision."""
    (sfn,) = emu.clients(env, "stepfunctions")
    # SageMaker passes through Stopping (SIGTERM, the trainer saves) before Stopped; so does the emulator.
    emulator_events.wait_for_status(env, job, ("Stopped", "Completed", "Failed"), timeout_s=60)
    started = emulator_events.deliver_job_state_change(env, job)
    decisions = []
    deadline = time.monotonic() + 120
    for arn in started:
        while (described := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
            if time.monotonic() > deadline:
                raise DemoError(f"the supervisor did not decide within 2 minutes ({arn})")
            time.sleep(0.5)
        output = json.loads(described.get("output") or "{}")
        if "Outcome" in output:
            decisions.append(output)
    if not decisions:
        raise DemoError(f"no supervisor execution decided what run {run_name} does after {job}")
    return decisions[0]


def wait_for_job(env: dict[str, str], job: str, timeout_s: float = 60) -> None:
    (sagemaker,) = emu.clients(env, "sagemaker")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = sagemaker.describe_training_job(TrainingJobName=job)["TrainingJobStatus"]
            print(f"    training job {job}: {status}", flush=True)
            return
        except sagemaker.exceptions.ClientError:
            if time.monotonic() > deadline:
                raise DemoError(f"no training job {job} after {timeout_s:.0f} s") from None
            time.sleep(0.5)


def start_recorded(emulator: Emulator, state_file: Path, log: Path) -> None:
    """Start the emulator in its own session (it outlives this script) and record the server's PID."""
    from trainstack.emulator import mlflow_server

    emu.stop_recorded(state_file)  # a stale record: its server is gone
    # MLflow's own server beside moto, as `trainstack emulator start` runs it (runs of recipes that track
    # in MLflow are tracked there with --local); it comes up while moto and the deploy do.
    tracker = mlflow_server.launch_beside(ROOT / mlflow_server.STATE_DIR, ROOT / mlflow_server.LOG_FILE)
    try:
        emulator.start(timeout_s=120, detach=True)
    except BaseException:
        if tracker is not None:
            tracker.stop()
        raise
    emu.write_state(
        emulator.endpoint, emulator.pid or 0, state_file, log=log.relative_to(ROOT), mlflow=tracker
    )


def next_steps(recipe: str, team: str | None, endpoint: str, reused: dict | None, log: Path) -> str:
    """What to try next, against the emulator the demo leaves running (every line works as printed)."""
    ts = ".venv/bin/trainstack"
    t = f" --team {team}" if team else ""
    pid = (reused or emu.read_state(ROOT / emu.STATE_FILE) or {}).get("pid")
    rows = [
        (f"{ts} runs {recipe}{t} --local", "the demo's run: its jobs, state, checkpoints"),
        (f"{ts} status {recipe}{t} --local", "its newest job against the plan"),
        (f"{ts} logs {recipe}{t} --local", "its logs (none: no container ran)"),
        (f"{ts} launch {recipe}{t} --local --max-steps 50 --wait", "a short tuning run"),
        (f"{ts} plan {recipe}{t}", "memory, speed, cost (no AWS)"),
        ('eval "$(.venv/bin/trainstack emulator env)"', "point npx cdk here too"),
        (f"{ts} emulator stop", "when you are done"),
    ]
    width = max(len(cmd) for cmd, _ in rows)
    lines = [
        "",
        f"The emulator keeps running on {endpoint} (pid {pid}, log {log.relative_to(ROOT)}). Try next:",
        *(f"  {cmd:<{width}}  # {why}" for cmd, why in rows),
        "On a real AWS account: README.md, section 'On a real AWS account'.",
    ]
    return "\n".join(lines)


def show_job(env: dict[str, str], job_name: str, execution_arn: str, first_job: str | None = None) -> None:
    from trainstack.aws.session import training_job_request_sent

    sagemaker, sfn = emu.clients(env, "sagemaker", "stepfunctions")
    job = sagemaker.describe_training_job(TrainingJobName=job_name)
    sent = training_job_request_sent(sfn, execution_arn) or {}
    resources = job["ResourceConfig"]
    hyper = job.get("HyperParameters", {})
    print("    as SageMaker (the emulator) stored it:")
    print(f"      status           {job['TrainingJobStatus']}")
    print(
        f"      instances        {resources['InstanceCount']} x {resources['InstanceType']}, "
        f"{resources.get('VolumeSizeInGB')} GB volume"
    )
    checkpoints = job["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
    print(f"      checkpoints      {checkpoints} (TRAINSTACK_CHECKPOINT_URI; every rank writes there)")
    if first_job:
        first = sagemaker.describe_training_job(TrainingJobName=first_job)
        same = first["Environment"]["TRAINSTACK_CHECKPOINT_URI"] == checkpoints
        print(
            f"      run              {job['Environment']['TRAINSTACK_RUN']}; job {first_job} had "
            f"{'the same' if same else 'ANOTHER'} checkpoint prefix"
        )
    print(f"      image            {job['AlgorithmSpecification']['TrainingImage']}")
    print(f"      hyperparameters  {len(hyper)} keys (the resolved recipe), e.g.")
    for key in (
        "model.layers",
        "model.hidden",
        "precision.dtype",
        "precision.fp8_recipe",
        "training.steps",
        "training.global_batch",
        "parallelism.shard_group",
        "compute.instance_count",
    ):
        if key in hyper:
            print(f"        {key} = {hyper[key]}")
    if sent:
        print("    the rest of the request the state machine sent (from the execution history):")
        print(
            f"      metrics          {len(sent['AlgorithmSpecification']['MetricDefinitions'])} definitions "
            f"({', '.join(m['Name'] for m in sent['AlgorithmSpecification']['MetricDefinitions'][:3])}, ...)"
        )
        for field in ("StoppingCondition", "RetryStrategy", "InfraCheckConfig", "OutputDataConfig"):
            print(f"      {field:<16} {json.dumps(sent.get(field))}")
        print(
            "      warm pool        KeepAlivePeriodInSeconds="
            f"{sent['ResourceConfig'].get('KeepAlivePeriodInSeconds')}"
        )
        environment = sent["Environment"]
        shown = ", ".join(
            f"{k}={environment[k]}" for k in ("FI_EFA_USE_HUGE_PAGE", "PYTORCH_CUDA_ALLOC_CONF")
        )
        tags = ", ".join(f"{t['Key']}={t['Value']}" for t in sent.get("Tags", []))
        print(f"      environment      {shown}, ...")
        print(f"      tags             {tags}")


if __name__ == "__main__":
    sys.exit(main())
