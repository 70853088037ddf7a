"""The run registry's items as runs, and what `trainstack runs` computes from them (pure, no AWS)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from trainstack.aws.registry import run_from_item, view
from trainstack.aws.runs import Job

pytestmark = pytest.mark.fast

RUN = "ts-platform-30b-fp8--main"
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def item(**changes) -> dict:
    base = {
        "run": {"S": RUN},
        "run_id": {"S": "main"},
        "recipe": {"S": "30b-fp8"},
        "team": {"S": "platform"},
        "run_state": {"S": "running"},
        "current_job": {"S": f"{RUN}-2"},
        "job_index": {"N": "2"},
        "counted": {"N": "2"},
        "jobs": {"L": [{"S": f"{RUN}-1"}, {"S": f"{RUN}-2"}]},
        "ended": {
            "M": {
                f"{RUN}-1": {
                    "M": {
                        "job_status": {"S": "Stopped"},
                        "secondary_status": {"S": "MaxRuntimeExceeded"},
                        "rule": {"S": "MaxRuntime"},
                    }
                }
            }
        },
        "checkpoint_uri": {"S": "s3://b/checkpoints/platform/30b-fp8/main/"},
        "steps": {"N": "20000"},
        "tokens_per_step": {"N": "8388608"},
        "usd_per_hour": {"N": "456.0000"},
        "overrides": {"S": '{"training.steps": "20000"}'},
        "keep_alive": {"N": "0"},
        "stop_requested": {"BOOL": False},
        "why": {"S": "it reached its max runtime"},
        "next_step": {"S": f"job {RUN}-2 starts"},
        "recipe_hash": {"S": "546079e0"},
        "max_jobs": {"N": "20"},
        "creator": {"S": "arn:aws:states:us-east-1:123456789012:execution:x:y"},
        "request": {"S": '{"HyperParameters": {"training.lr": "0.0003"}}'},
        "history": {
            "S": '[{"at": "2026-11-01T00:00:00Z", "who": "arn:aws:iam::1:user/a", "what": "launch"}]'
        },
        "created": {"S": T0.isoformat()},
        "updated": {"S": T0.isoformat()},
    }
    return {**base, **changes}


def job(name: str, status: str, hours: float | None) -> Job:
    ended = T0 + timedelta(hours=hours) if hours is not None and status != "InProgress" else None
    return Job(name=name, status=status, secondary_status="", created=T0, started=T0, ended=ended)


def test_an_item_becomes_a_run_with_its_jobs_in_order_and_their_recorded_ends() -> None:
    run = run_from_item(item())
    assert [(j.index, j.status, j.secondary_status) for j in run.jobs] == [
        (1, "Stopped", "MaxRuntimeExceeded"),
        (2, "InProgress", ""),
    ]
    assert run.overrides == {"training.steps": "20000"} and run.usd_per_hour == 456.0
    assert run.name.run_id == "main" and run.name.stack_prefix == "Trainstack-platform-30b-fp8"


def test_progress_and_cost_come_from_every_job_at_the_planned_price() -> None:
    run = run_from_item(item())
    now = T0 + timedelta(hours=30)
    described = {
        f"{RUN}-1": job(f"{RUN}-1", "Stopped", 24.0),
        f"{RUN}-2": job(f"{RUN}-2", "InProgress", None),
    }
    v = view(run, described, 1234, now)
    assert v.cost_usd == (24.0 + 30.0) * 456.0
    assert v.tokens == 1234 * 8388608 and not v.unsupervised
    d = v.as_dict()
    assert {"run", "recipe", "team", "state", "jobs", "checkpoint_uri"} <= set(d)
    assert d["jobs"][0] == {
        "name": f"{RUN}-1",
        "index": 1,
        "status": "Stopped",
        "secondary_status": "",
        "rule": "MaxRuntime",  # the supervisor's decision, as recorded in the item
    }


def test_a_pending_decision_or_a_capacity_wait_is_never_advised_to_be_stopped_and_resumed() -> None:
    """`stop` then `resume` of a run whose end is not decided yet would overwrite how its job ended (a
    completed run made resumable, a NaN's reason lost); of a capacity wait, it would waste the wait.
    Neither note advises an action: the supervisor (or the reconciler) decides, the wait ends itself."""
    run = run_from_item(item())
    described = {f"{RUN}-2": job(f"{RUN}-2", "Failed", 2.0)}
    pending = view(run, described, None, T0 + timedelta(hours=5))
    waiting = view(run, {f"{RUN}-1": job(f"{RUN}-1", "Failed", 1.0)}, None, T0 + timedelta(hours=5))
    assert pending.unsupervised and "reconciler" in pending.notes[0]
    assert waiting.waiting and not waiting.unsupervised and "not created yet" in waiting.notes[0]
    for v in (pending, waiting):
        assert not any("resume" in note for note in v.notes), v.notes
    assert not view(run_from_item(item(run_state={"S": "failed"})), described, None, T0).unsupervised


def test_a_run_whose_deployment_changed_is_reported_with_its_history() -> None:
    run = run_from_item(item())
    same = view(run, {}, None, T0, deployed_hash="546079e0")
    changed = view(run, {}, None, T0, deployed_hash="0badf00d")
    assert not same.deployment_changed and changed.deployment_changed
    assert any("keeps training its recorded recipe" in n for n in changed.notes)
    d = changed.as_dict()
    assert d["deployment_changed"] and d["deployed_recipe_hash"] == "0badf00d"
    assert d["history"] == [{"at": "2026-11-01T00:00:00Z", "who": "arn:aws:iam::1:user/a", "what": "launch"}]
    assert run.request["HyperParameters"]["training.lr"] == "0.0003"


class _Stacks:
    """CloudFormation with three trainstack deployments (one without a registry) and another stack."""

    class exceptions:  # noqa: N801 (boto3's spelling)
        ClientError = Exception

    stacks = [
        {
            "StackName": "Trainstack-nlp-8b-fp8-Data",
            "Outputs": [{"OutputKey": "RunTableName", "OutputValue": "t1"}],
        },
        {"StackName": "Trainstack-nlp-8b-fp8-Launcher", "Outputs": []},
        {
            "StackName": "Trainstack-platform-1b-bf16-Data",
            "Outputs": [{"OutputKey": "RunTableName", "OutputValue": "t2"}],
        },
        {
            "StackName": "Trainstack-old-7b-bf16-Data",
            "Outputs": [{"OutputKey": "BucketName", "OutputValue": "b"}],
        },
        {"StackName": "CDKToolkit", "Outputs": []},
    ]

    def get_paginator(self, operation: str):
        assert operation == "describe_stacks"
        return self

    def paginate(self):
        yield {"Stacks": self.stacks[:2]}
        yield {"Stacks": self.stacks[2:]}

    def describe_stacks(self, StackName: str):  # noqa: N803
        found = [s for s in self.stacks if s["StackName"] == StackName]
        if not found:
            raise Exception(f"Stack with id {StackName} does not exist")
        return {"Stacks": found}


def test_registries_are_every_data_stack_with_a_run_table_or_the_one_asked_for() -> None:
    from trainstack.aws.registry import Registry, registries

    assert registries(_Stacks()) == [
        Registry("Trainstack-nlp-8b-fp8-Data", "t1"),
        Registry("Trainstack-platform-1b-bf16-Data", "t2"),
    ]
    assert registries(_Stacks(), "Trainstack-platform-1b-bf16") == [
        Registry("Trainstack-platform-1b-bf16-Data", "t2")
    ]
    assert registries(_Stacks(), "Trainstack-platform-64b-fp8") == []


def test_a_resume_keeps_the_launch_and_the_newest_changes_of_a_bounded_history() -> None:
    from trainstack.aws.registry import HISTORY_MAX, WHAT_MAX, history_with

    run = run_from_item(item())
    for n in range(HISTORY_MAX + 5):
        entries = history_with(run, f"t{n}", "who", f"change {n} " + "x" * WHAT_MAX)
        run = run_from_item(item(history={"S": json.dumps(entries)}))
    assert len(run.history) == HISTORY_MAX and run.history[0].what == "launch"
    assert run.history[-1].at == f"t{HISTORY_MAX + 4}" and len(run.history[-1].what) == WHAT_MAX
