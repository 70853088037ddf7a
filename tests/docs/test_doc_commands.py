"""Every command README.md and docs/*.md show, run as a reader would, so a documented command cannot
silently break again (tests/docs/doc_commands.py says what counts as a command and how a doc marks one
that cannot run here).

How they run:
- in a copy of this checkout (tracked and untracked, not ignored, files with their timestamps, so
  `make setup` finds its stamps fresh; `.venv` and `node_modules` linked), made a git repository with a
  `main` branch, so the docs' `cp`, `rm` and `git` commands touch nothing real;
- with that copy first on PYTHONPATH and PATH (`trainstack`, `python`, `torchrun` are the venv's), a
  private HOME (`--install-completion` writes there), 120 columns, no colour;
- block by block, in document order (README.md first), each block in one shell environment (an
  `export` or `eval` carries to the block's next commands); a command must exit 0 without a traceback;
- blocks that use AWS (`npx cdk bootstrap|deploy|destroy|diff`, `trainstack launch|status|logs|runs|
  stop|resume|emulator`, `make demo`) run against one shared local emulator (started with
  `trainstack emulator start`, stopped with `trainstack emulator stop` at the end), its AWS_* variables
  exported; before such a block, every recipe/team its trainstack commands name is deployed if it is
  not yet (with `npx cdk deploy --all -c recipe=R [-c team=T]`, as docs/cdk.md shows). Others run with
  no AWS credentials at all (AWS_REGION us-west-2, for synthesis).
- every command runs exactly as the doc writes it: nothing is added, dropped or rewritten
  (test_the_walkthrough_adds_nothing_to_a_documented_command; the emulator takes the CDK CLI's default
  change-set deploy, trainstack.emulator.cloudformation). `npx cdk deploy` runs in a terminal (a
  pseudo-terminal), as a reader's does, and the CLI's own question before IAM changes ("Do you wish to
  deploy these changes (y/n)?") is answered `y`, as the reader answers it; any other question fails
  the command.
- a command already run successfully in the same group, with the same words in any order (comments
  aside), is not run again; the set-up's bootstrap and deploys (the commands docs/cdk.md shows) count.
After `make demo`, the "Try next" commands it prints are run too (its last, `emulator stop`, at the end).
All of it is one test (the blocks depend on each other's deployments); it reports every failing block.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from doc_commands import ROOT, Command, all_commands, all_markers

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]
TIMEOUT_S = 1200
AWS_COMMAND = re.compile(
    r"\bnpx cdk (bootstrap|deploy|destroy|diff)\b"
    r"|\btrainstack (launch|status|logs|runs|stop|resume|emulator)\b"
    r"|\bmake demo\b"
)
RECIPE_COMMAND = re.compile(
    # a recipe or run name, not a recipe file's path (`runs scripts/demo-tiny.yaml`: the demo deploys it)
    r"\btrainstack (?:launch|status|logs|runs|stop|resume) (?P<recipe>[a-z0-9][a-z0-9-]*)(?![\w./-])"
)
TEAM = re.compile(r"--team[ =](?P<team>[a-z][a-z0-9]*)")
STOP_COMMAND = re.compile(r"\btrainstack stop (?P<run>ts-[a-z0-9-]+)")
TRY_NEXT = re.compile(r"^  (?P<command>\S.*?)\s+# ")
IN_A_TERMINAL = re.compile(r"\bnpx cdk deploy\b")  # the CLI asks before IAM changes, in a terminal only
APPROVAL = "Do you wish to deploy these changes"  # the CDK CLI's question (aws-cdk, deploy)


def grouped() -> list[tuple[str, list[Command]]]:
    """Commands in document order, one group per fenced block (named by its first command's place)."""
    groups: dict[tuple[str, int], list[Command]] = {}
    for command in all_commands():
        key = (command.doc, _block_of(command))
        groups.setdefault(key, []).append(command)
    return [(cmds[0].where, cmds) for cmds in groups.values()]


def _block_of(command: Command) -> int:
    """The opening fence line above a command (commands of one block share it)."""
    lines = (ROOT / command.doc).read_text(encoding="utf-8").splitlines()
    for number in range(command.line - 1, 0, -1):
        if lines[number - 1].lstrip().startswith("```"):
            return number
    return 0


@dataclass
class Workspace:
    repo: Path
    home: Path
    base_env: dict[str, str]
    aws_env: dict[str, str] = field(default_factory=dict)
    done: dict[tuple, str] = field(default_factory=dict)  # (words, aws) -> where it ran
    deployed: set[tuple[str, str | None]] = field(default_factory=set)
    demo_output: str = ""
    failures: list[str] = field(default_factory=list)
    timings: list[tuple[float, str]] = field(default_factory=list)  # (seconds, command): where time goes

    executed: list[str] = field(default_factory=list)  # every text given to bash, in order, setup included
    ran: list[tuple[Command, int]] = field(default_factory=list)  # a documented command, its executed index

    def shell(self, text: str, env: dict[str, str], timeout: float = TIMEOUT_S) -> tuple[int, str, dict]:
        """Run one command in bash; returns (exit status, output, the environment it left). `npx cdk
        deploy` runs in a pseudo-terminal (see the module docstring)."""
        import time

        started = time.monotonic()
        self.executed.append(text)
        env_file = self.home / ".docs-test-env"
        script = f"set -o pipefail\n{text}\nstatus=$?\nenv -0 > {shlex.quote(str(env_file))}\nexit $status\n"
        returncode, output = self.execute(text, script, env, timeout)
        after = env
        if env_file.exists():
            pairs = env_file.read_text().split("\0")
            after = dict(p.split("=", 1) for p in pairs if "=" in p)
            env_file.unlink()
        self.timings.append((time.monotonic() - started, text.strip().splitlines()[0][:100]))
        return returncode, output, after

    def execute(self, text: str, script: str, env: dict[str, str], timeout: float) -> tuple[int, str]:
        """Run `script` (which runs `text`) in bash: (exit status, output)."""
        if IN_A_TERMINAL.search(text):
            return in_a_terminal(["bash", "-c", script], self.repo, env, timeout)
        done = subprocess.run(
            ["bash", "-c", script], cwd=self.repo, env=env, capture_output=True, text=True, timeout=timeout
        )
        return done.returncode, done.stdout + done.stderr


def in_a_terminal(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run `argv` with a pseudo-terminal as its stdin, stdout and stderr, answering `y` to the CDK CLI's
    approval question each time it asks, as a reader at a terminal does. Any other (y/n) question is
    not answered: the command is ended and fails, naming it. Returns (exit status, output)."""
    import pty
    import select
    import time

    leader, follower = pty.openpty()
    process = subprocess.Popen(
        argv, cwd=cwd, env={**env, "TERM": "dumb"}, stdin=follower, stdout=follower, stderr=follower
    )
    os.close(follower)
    output, answered, deadline = b"", 0, time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                process.kill()
                raise subprocess.TimeoutExpired(argv, timeout)
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: every writer has exited
                break
            if not chunk:
                break
            output += chunk
            asked = output.count(b"(y/n)")
            if asked > answered:
                question = output.decode(errors="replace").rsplit("(y/n)", 1)[0][-300:]
                if APPROVAL not in question:
                    process.kill()
                    process.wait()
                    return 1, output.decode(errors="replace") + "\n[docs test: a question it does not answer]"
                os.write(leader, b"y\n")
                answered = asked
    finally:
        os.close(leader)
    return process.wait(), output.decode(errors="replace").replace("\r\n", "\n")


def _copy_checkout(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (p.decode() for p in listed)):
        source = ROOT / name
        if not source.is_file():
            continue  # deleted in the working tree
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)  # keeps mtimes: make's stamps stay newer than the pins
    for linked in (".venv", "node_modules"):
        (dest / linked).symlink_to(ROOT / linked)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        [
            "git",
            "-c",
            "user.name=docs-test",
            "-c",
            "user.email=docs-test@example.com",
            "-c",
            "commit.gpgsign=false",
            *args,
        ],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@contextmanager
def workspace(top: Path) -> Iterator[Workspace]:
    """The checkout copy, its shared emulator (started here, stopped on the way out)."""
    # The copy links this checkout's .venv and node_modules: stamps older than their pins would have the
    # copy's `make setup` (README's `make demo`) rebuild them through the link, which fails.
    stamps = [".venv/.stamp", "node_modules/.stamp"]
    if subprocess.run(["make", "-q", *stamps], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.fail(
            "this checkout's .venv or node_modules is older than its pins (pyproject.toml, "
            "requirements.lock, Makefile, package*.json): run `make setup` here first"
        )
    repo, home = top / "trainstack", top / "home"
    repo.mkdir()
    home.mkdir()
    _copy_checkout(repo)
    _git(repo, "init", "--quiet", "--initial-branch=main")
    (repo / ".git" / "info" / "exclude").write_text(".venv\nnode_modules\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "--quiet", "-m", "docs test checkout")
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "LOGNAME", "SHELL")
    base = {k: v for k, v in os.environ.items() if k in keep}
    base |= {
        "HOME": str(home),
        "PATH": f"{repo / '.venv' / 'bin'}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{repo}:{repo / 'training_image'}",
        "PYTHONDONTWRITEBYTECODE": "1",
        "COLUMNS": "120",
        "NO_COLOR": "1",
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_REGION": "us-west-2",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    ws = Workspace(repo, home, base)
    status, out, _ = ws.shell(".venv/bin/trainstack emulator start --timeout 300", base)
    assert status == 0, out
    status, out, _ = ws.shell(".venv/bin/trainstack emulator env", base)
    assert status == 0, out
    ws.aws_env = {**base, **dict(p.split("=", 1) for p in out.strip().removeprefix("export ").split())}
    try:
        yield ws
    finally:
        status, out, _ = ws.shell(".venv/bin/trainstack emulator stop", base)
        ws.failures += (
            [] if status == 0 and "stopped the local AWS emulator" in out else [f"emulator stop: {out}"]
        )


def _ensure_deployed(ws: Workspace, commands: list[Command]) -> str | None:
    """Deploy every recipe/team the block's trainstack commands name, unless deployed already."""
    from trainstack.emulator.endpoint import ACCOUNT, REGION, clients
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import parse_run_name, stack_prefix

    env = ws.aws_env
    (cfn,) = clients(env, "cloudformation")
    existing = {s["StackName"] for s in cfn.describe_stacks()["Stacks"]}
    if "CDKToolkit" not in existing:  # a doc may run `status` before any doc bootstraps
        bootstrap = f"npx cdk bootstrap aws://{ACCOUNT}/{REGION}"  # docs/cdk.md's command
        status, out, _ = ws.shell(bootstrap, env)
        if status != 0:
            return f"setting up: `{bootstrap}` failed:\n{out[-3000:]}"
        ws.done[(_words(bootstrap), True)] = "setting up"  # a doc's same command later has nothing to do
    for command in commands:
        named = RECIPE_COMMAND.search(command.text)
        if named is None:
            continue
        team_match = TEAM.search(command.text)
        recipe, team = named.group("recipe"), team_match.group("team") if team_match else None
        if (run := parse_run_name(recipe)) is not None:  # `stop RUN`, `resume RUN`: the run names both
            has_dir = (ws.repo / "recipes" / "teams" / run.team).is_dir()
            recipe, team = run.recipe, run.team if has_dir else None
        if (recipe, team) in ws.deployed:
            continue
        resolved = resolve(recipe, team, recipes_dir=ws.repo / "recipes").recipe
        prefix = stack_prefix(resolved, team)
        existing = {s["StackName"] for s in cfn.describe_stacks()["Stacks"]}
        if f"{prefix}-Launcher" not in existing:
            context = f"-c recipe={recipe}" + (f" -c team={team}" if team else "")
            deploy = f"npx cdk deploy --all {context}"  # docs/cdk.md's command
            status, out, _ = ws.shell(deploy, env)
            if status != 0:
                return f"setting up for {command.where}: `{deploy}` failed:\n{out[-3000:]}"
            ws.done[(_words(deploy), True)] = f"setting up for {command.where}"
        if problem := _seed_data(ws, resolved.data.uris):
            return f"setting up for {command.where}: {problem}"
        ws.deployed.add((recipe, team))
    return None


def _seed_data(ws: Workspace, uris: tuple[str, ...]) -> str | None:
    """Put token shards where the recipe's data channels point, if nothing is there yet: a team's recipe
    names its own prepared corpus (docs/data.md prepares one), which the emulator does not have. The
    shards are this checkout's docs, byte-tokenized (every recipe's vocabulary holds 257 ids)."""
    from trainstack.emulator.endpoint import clients

    (s3,) = clients(ws.aws_env, "s3")
    shards = ws.home / "seed-shards"
    for uri in uris:
        bucket, _, key_prefix = uri.removeprefix("s3://").partition("/")
        existing = {b["Name"] for b in s3.list_buckets()["Buckets"]}
        if bucket in existing and s3.list_objects_v2(Bucket=bucket, Prefix=key_prefix, MaxKeys=1)["KeyCount"]:
            continue
        if not shards.is_dir():
            texts = " ".join(shlex.quote(str(p)) for p in sorted((ws.repo / "docs").glob("*.md")))
            prepare = f"python -m trainer.prepare.make_shards --tokenizer bytes --out {shards} {texts}"
            status, out, _ = ws.shell(prepare, ws.base_env)
            if status != 0:
                return f"`{prepare}` failed:\n{out[-3000:]}"
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
        for path in sorted(p for p in shards.rglob("*") if p.is_file()):
            s3.upload_file(str(path), bucket, key_prefix + path.relative_to(shards).as_posix())
    return None


def _run_block(ws: Workspace, commands: list[Command]) -> None:
    """Run a block's commands in order, in one environment; a failure is recorded and ends the block."""
    aws = any(AWS_COMMAND.search(c.text) for c in commands if c.skip is None)
    env = dict(ws.aws_env if aws else ws.base_env)
    if aws and (problem := _ensure_deployed(ws, [c for c in commands if c.skip is None])):
        ws.failures.append(problem)
        return
    for command in commands:
        if command.skip is not None:
            continue
        text = command.text  # as written (test_the_walkthrough_adds_nothing_to_a_documented_command)
        key = (_words(text), aws)
        if key in ws.done and "export " not in text and "eval " not in text:
            continue  # ran already, with the same words, at ws.done[key]
        ws.ran.append((command, len(ws.executed)))
        status, out, env = ws.shell(text, env)
        if status != 0 or "Traceback (most recent call last)" in out:
            ws.failures.append(f"{command.where}: `{text}` exited {status}:\n{out[-4000:]}")
            return
        ws.done[key] = command.where
        if re.search(r"\bmake demo\b", text):
            ws.demo_output = out
            _demo_trained_a_whole_run(ws)
        if aws and (stopped := STOP_COMMAND.search(text)):
            _wait_for_job_ends(ws, stopped.group("run"))


def _wait_for_job_ends(ws: Workspace, run: str) -> None:
    """After `trainstack stop`: the emulator ends the job (SIGTERM, Stopping, Stopped) and delivers its
    state change to the deployed rules itself, as EventBridge does on AWS; wait until the supervisor has
    recorded the run's new state, so a documented `resume` next finds it stopped, as it would on AWS."""
    import time

    from trainstack.aws.registry import read_run
    from trainstack.emulator.endpoint import clients
    from trainstack.recipes.naming import parse_run_name

    cfn, dynamodb = clients(ws.aws_env, "cloudformation", "dynamodb")
    (stack,) = cfn.describe_stacks(StackName=f"{parse_run_name(run).stack_prefix}-Data")["Stacks"]
    table = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}["RunTableName"]
    deadline = time.monotonic() + 180
    while (record := read_run(dynamodb, table, run)) is not None and record.state == "running":
        if time.monotonic() > deadline:
            ws.failures.append(f"trainstack stop {run}: the run is still running 180 s later ({record.why})")
            return
        time.sleep(1)


def _demo_trained_a_whole_run(ws: Workspace) -> None:
    """`make demo` trained a whole run with nothing run by hand, read back from the emulator itself: the run
    completed in two jobs or more, job 1 ended at its max runtime, job 2 resumed from a checkpoint job 1
    saved (its log says so), the export job completed, and MLflow holds one run with both jobs' steps."""
    from trainstack.aws import tracking
    from trainstack.aws.registry import scan_runs
    from trainstack.emulator.endpoint import clients, read_state
    from trainstack.protocol.tracking import run_filter

    cfn, dynamodb, sagemaker, logs = clients(ws.aws_env, "cloudformation", "dynamodb", "sagemaker", "logs")
    (stack,) = cfn.describe_stacks(StackName="Trainstack-platform-demo-tiny-Data")["Stacks"]
    table = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}["RunTableName"]
    # the demo's newest run: `demo`, or `demo-<time>` on an emulator that already had one (this one)
    runs = [r for r in scan_runs(dynamodb, table) if r.run.startswith("ts-platform-demo-tiny--demo")]
    run = max(runs, key=lambda r: r.created, default=None)
    problems = []
    if run is None or run.state != "completed" or len(run.jobs) < 2:
        problems.append(f"the run did not complete in 2+ jobs: {run and (run.state, run.why, run.jobs)}")
    else:
        first, second = (sagemaker.describe_training_job(TrainingJobName=j.name) for j in run.jobs[:2])
        if first["SecondaryStatus"] != "MaxRuntimeExceeded":
            problems.append(f"job 1 ended {first['SecondaryStatus']}, not at its max runtime")
        streams = logs.describe_log_streams(
            logGroupName="/aws/sagemaker/TrainingJobs", logStreamNamePrefix=f"{second['TrainingJobName']}/"
        )["logStreams"]
        text = "\n".join(
            e["message"]
            for s in streams
            for e in logs.get_log_events(
                logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=s["logStreamName"]
            )["events"]
        )
        if not re.search(r"resum\w* .*step [1-9]", text):
            problems.append(f"job 2's log does not say it resumed from a checkpoint:\n{text[-1500:]}")
        exports = [sagemaker.describe_training_job(TrainingJobName=e["job"]) for e in run.exports]
        if not exports or exports[0]["TrainingJobStatus"] != "Completed":
            problems.append(f"no completed export job: {[e['TrainingJobStatus'] for e in exports]}")
        url = (read_state(ws.repo / ".emulator" / "endpoint.json") or {}).get("mlflow")
        if url:
            client = tracking.client(url)
            experiment = client.get_experiment_by_name("platform/demo-tiny")
            found = client.search_runs([experiment.experiment_id], filter_string=run_filter(run.run))
            steps = sorted(m.step for m in client.get_metric_history(found[0].info.run_id, "loss"))
            if len(found) != 1 or steps[-1] != run.steps:
                problems.append(f"MLflow: {len(found)} runs, loss steps {steps}")
    ws.failures += [f"make demo: {p}" for p in problems]


def _demo_next_steps(ws: Workspace) -> None:
    """What `make demo` prints under "Try next" works as printed (its `emulator stop` runs at the end)."""
    lines = ws.demo_output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.endswith("Try next:")), None)
    if start is None:
        ws.failures.append(
            "make demo printed no 'Try next:' list" + (ws.demo_output[-2000:] or " (it did not run)")
        )
        return
    suggested = []
    for line in lines[start + 1 :]:
        match = TRY_NEXT.match(line)
        if match is None:
            break
        suggested.append(match.group("command"))
    if not suggested or suggested[-1] != ".venv/bin/trainstack emulator stop":
        ws.failures.append(f"make demo's 'Try next' does not end with how to stop the emulator: {suggested}")
    _run_block(ws, [Command("make demo: Try next", n, t) for n, t in enumerate(suggested[:-1], start=1)])


def changed_commands(ws: Workspace) -> list[str]:
    """Each documented command whose text bash was given differs from the doc's (none, when the docs run
    as written)."""
    return [
        f"{command.where}: documented `{command.text}`, ran `{ws.executed[index]}`"
        for command, index in ws.ran
        if ws.executed[index] != command.text
    ]


def _words(text: str) -> tuple[str, ...]:
    try:
        return tuple(sorted(shlex.split(text, comments=True)))
    except ValueError:  # unbalanced quotes: compare as written
        return (text,)


GROUPS = grouped()


def test_every_skip_marker_gives_a_reason():
    for doc, line, only, reason in all_markers():
        assert len(reason.strip()) >= 10, f"{doc}:{line}: a docs-test skip marker must say why ({only!r})"


def test_the_docs_show_commands():
    assert len(GROUPS) >= 10 and any("make demo" in c.text for _, cmds in GROUPS for c in cmds)


def test_every_documented_command_runs(tmp_path: Path) -> None:
    """One test, so the blocks run in document order against one emulator whatever the scheduler does;
    every failing block is reported, not only the first."""
    with workspace(tmp_path) as ws:
        for _, commands in GROUPS:
            _run_block(ws, commands)
        _demo_next_steps(ws)
    print("slowest documented commands (-s shows this):")  # the test is most of the suite's time
    for seconds, text in sorted(ws.timings, reverse=True)[:30]:
        print(f"  {seconds:7.1f} s  {text}")
    ran = len(ws.done)
    assert not changed_commands(ws), changed_commands(ws)
    assert not ws.failures, f"{len(ws.failures)} documented command(s) failed ({ran} ran):\n\n" + "\n\n".join(
        ws.failures
    )
