"""The tuning run's core: candidates, what a job measured, the choice, the store and the refit.

The logs under data/ are real trainer output recorded on this project's shared 2-core machine by
tests/tuning/record_logs.py (data/README.md): the tiny recipe's three candidates as `tune --local`
picks them, the same run at ten times the learning rate (a candidate that is not the same run), and a
job whose forward raised torch.OutOfMemoryError (fault injection). They carry the machine's real noise.
Where a test needs figures no recording has (a clear winner), it builds a Measurement and says so.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from trainstack.errors import TrainstackError
from trainstack.protocol import exit_codes
from trainstack.protocol.metrics import parse_line
from trainstack.recipes.loader import resolve
from trainstack.tuning.candidates import apply, candidates
from trainstack.tuning.choose import LOSS_TOLERANCE, choose
from trainstack.tuning.engine import JobResult, job_recipe, tune, tuning_cost_usd
from trainstack.tuning.measure import Measurement, measure, spread, steps_for
from trainstack.tuning.store import Hardware, Store, layout_key, recipe_hardware, refit

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "trainer" / "fixtures" / "tiny.yaml"
FINAL_STEP = 15  # record_logs.py: 2 warm-up + 12 window + the final step


def log(name: str) -> list[str]:
    return (DATA / f"{name}.log").read_text().splitlines()


def failure(name: str) -> str:
    path = DATA / f"{name}.failure"
    return path.read_text().strip() if path.exists() else ""


@pytest.fixture(scope="module")
def tiny():
    return resolve(str(TINY)).recipe


@pytest.fixture(scope="module")
def tiny_candidates(tiny):
    return candidates(tiny, 3, world=1, compile_choices=False)


@pytest.fixture(scope="module")
def recorded():
    return {name: measure(log(name), warmup=2, final_step=FINAL_STEP) for name in ("c0", "c1", "c2", "lr10x")}


# --- candidates -----------------------------------------------------------------------------------------


def test_candidates_are_the_recipe_first_then_fitting_layouts_of_the_same_run():
    recipe = resolve("30b-fp8").recipe
    found = candidates(recipe, 4)
    assert found[0].name == "c0" and found[0].overrides == () and found[0].is_recipe
    assert len(found) == 4 and len({c.overrides for c in found}) == 4
    for c in found[1:]:
        assert c.fits, c
        variant = apply(recipe, c.overrides)
        # The same run: model, global batch, sequence length, data, seed, steps and nodes untouched.
        for section in ("model", "data"):
            assert getattr(variant, section) == getattr(recipe, section)
        for knob in ("global_batch", "seq_len", "seed", "steps"):
            assert getattr(variant.training, knob) == getattr(recipe.training, knob)
        assert variant.compute == recipe.compute
        assert all(o.split("=")[0] in SEARCHED for o in c.overrides), c.overrides


SEARCHED = {
    "training.micro_batch",
    "activation_checkpointing.mode",
    "activation_checkpointing.every",
    "activation_checkpointing.policy",
    "parallelism.shard_group",
    "training.compile",
    "precision.fp8_recipe",
}


def test_the_cheapest_predicted_layout_is_the_first_after_the_recipes():
    found = candidates(resolve("8b-fp8").recipe, 6)
    assert found[1].planned.usd == min(c.planned.usd for c in found[1:])
    assert len({c.knobs for c in found}) == len(found)  # no layout twice


def test_hopper_candidates_never_try_mxfp8():
    recipe = resolve(
        "8b-fp8", overrides=["compute.instance_type=ml.p5.48xlarge", "precision.fp8_recipe=current"]
    ).recipe
    for c in candidates(recipe, 6):
        assert (
            "precision.fp8_recipe=mxfp8" not in c.overrides
            and "precision.fp8_recipe=block" not in c.overrides
        )


def test_a_global_batch_the_tuning_ranks_cannot_share_is_one_clear_error(tiny):
    with pytest.raises(TrainstackError, match="training.global_batch: 16 is not divisible by the 3 ranks"):
        candidates(tiny, 3, world=3)


# --- what a job measured ----------------------------------------------------------------------------------


def test_recorded_job_is_measured_over_its_steady_window(recorded):
    m = recorded["c0"]
    assert m.status == "ok"
    lines = [line for line in log("c0") if line.startswith("step=")]
    steps = [int(line.split()[0].split("=")[1]) for line in lines]
    assert steps == list(range(1, FINAL_STEP + 1))
    window = [s for s, _ in m.losses]
    assert window[0] >= 3 and window[-1] == FINAL_STEP - 1  # warm-up and the final step left out
    times = sorted(
        float(line.split("step_time_s=")[1].split()[0])
        for line in lines
        if int(line[5:].split()[0]) in window
    )
    assert min(times) <= m.step_time_s <= max(times)
    assert m.step_time_spread == pytest.approx(spread(times))
    assert m.tokens_per_s_spread > 0  # a shared machine: never noiseless
    assert m.checkpoint_save_s == pytest.approx(
        float(next(line for line in log("c0") if "checkpoint complete" in line).split("(")[-1].split()[0])
    )
    assert m.peak_reserved_gib is not None and m.peak_reserved_gib >= m.peak_mem_gib > 0
    assert m.data_wait_s is not None and m.data_wait_s >= 0
    assert m.straggler is not None and m.straggler.rank == 0


def test_cpu_hardware_measures_the_step_in_the_ranks_cpu_time():
    lines = log("c0")
    m = measure(lines, warmup=2, final_step=FINAL_STEP, clock="cpu")
    assert m.clock == "cpu"
    window = {s for s, _ in m.losses}
    values = [parse_line(line) for line in lines if line.startswith("step=")]
    cpu = [v["cpu_time_s"] for v in values if v["step"] in window]
    assert m.step_time_s == pytest.approx(statistics.median(cpu))
    assert m.step_time_spread == pytest.approx(spread(cpu))
    # Lines of an image that does not print cpu_time_s: wall time, and the measurement says so.
    older = [line.split(" cpu_time_s=")[0] if line.startswith("step=") else line for line in lines]
    assert measure(older, warmup=2, final_step=FINAL_STEP, clock="cpu").clock == "wall"


def test_a_leading_step_still_slow_after_the_fixed_warm_up_is_left_out():
    lines = log("c0")
    slow = [
        line.replace("step_time_s=", "step_time_s=9") if line.startswith("step=3 ") else line
        for line in lines
    ]
    m = measure(slow, warmup=2, final_step=FINAL_STEP)
    assert [s for s, _ in m.losses][0] == 4 and m.warmup == 3


def test_out_of_memory_is_recorded_as_oom_from_the_trainers_failure_line():
    reason = failure("oom")
    assert reason.startswith(
        f"{exit_codes.FATAL_MARKER} exit={exit_codes.OUT_OF_MEMORY}: {exit_codes.OOM_MESSAGE}"
    )
    m = measure(log("oom"), job_failed=True, failure_reason=reason)
    assert m.status == "oom" and exit_codes.OOM_MESSAGE in m.reason
    # Without the failure file (a runtime that lost it) the log's error line says the same.
    assert measure(log("oom"), job_failed=True, failure_reason="").status == "oom"
    # Another failure is a failure, not an OOM.
    assert (
        measure(
            ["error: data.train_s3_uri ..."], job_failed=True, failure_reason="trainstack-fatal exit=2: x"
        ).status
        == "failed"
    )


def test_step_count_covers_warm_up_and_a_window_sized_in_time():
    eager, compiled = steps_for(0.5, compiled=False), steps_for(0.5, compiled=True)
    assert compiled.warmup > eager.warmup
    assert eager.window == 40  # 60 s at 0.5 s would be 120 steps: capped
    assert steps_for(30.0, compiled=True).window == 8  # a 30 B step: the minimum for a spread
    assert steps_for(5.0, compiled=True).window == 12


# --- the choice ---------------------------------------------------------------------------------------


def test_recorded_candidates_within_each_others_noise_choose_the_simplest(tiny, tiny_candidates, recorded):
    measured = {c.name: recorded[c.name] for c in tiny_candidates}
    choice = choose(tiny, tiny_candidates, measured)
    assert all(o.status == "ok" for o in choice.outcomes)
    fastest = min(choice.outcomes, key=lambda o: o.measurement.step_time_s)
    chosen = choice.chosen
    # The chosen one is the fastest measured, or within its spread.
    assert (
        chosen is fastest
        or chosen.measurement.step_time_s - chosen.measurement.step_time_spread
        <= fastest.measurement.step_time_s + fastest.measurement.step_time_spread
    )
    if not choice.beyond_noise:
        assert chosen.candidate.changes == min(
            o.candidate.changes
            for o in choice.outcomes
            if o.usd_range[0] <= min(x.usd_range[1] for x in choice.outcomes)
        )
        assert "within the measured spread" in choice.why


def fake(m: Measurement, factor: float) -> Measurement:
    """A measurement `factor` times faster than `m` with the same spread (constructed, not recorded)."""
    return Measurement(
        "ok",
        steps=m.steps,
        tokens_per_s=m.tokens_per_s * factor,
        tokens_per_s_spread=m.tokens_per_s_spread,
        step_time_s=m.step_time_s / factor,
        step_time_spread=m.step_time_spread / factor,
        peak_mem_gib=m.peak_mem_gib,
        checkpoint_save_s=m.checkpoint_save_s,
        losses=m.losses,
    )


def test_a_winner_beyond_the_noise_is_chosen_and_its_gain_stated(tiny, tiny_candidates, recorded):
    base = recorded["c0"]
    measured = {"c0": base, "c1": fake(base, 3.0), "c2": fake(base, 1.05)}
    choice = choose(tiny, tiny_candidates, measured)
    assert choice.chosen.candidate.name == "c1" and choice.beyond_noise
    assert choice.gain == pytest.approx(choice.outcomes[0].usd / choice.chosen.usd)
    # > 1 but well under 3x: this 60-step run's start-ups and saves do not speed up with the layout
    assert 1 < choice.gain < 3 and "tokens per dollar over the recipe's layout" in choice.why


def test_a_disagreeing_loss_is_flagged_and_never_chosen(tiny, tiny_candidates, recorded):
    lr = recorded["lr10x"]
    assert lr.status == "ok"
    # Make the disagreeing candidate the fastest by far: it must still not be chosen.
    measured = {"c0": recorded["c0"], "c1": recorded["c1"], "c2": fake(lr, 10.0)}
    choice = choose(tiny, tiny_candidates, measured)
    status = {o.candidate.name: o.status for o in choice.outcomes}
    assert status == {"c0": "ok", "c1": "ok", "c2": "flagged"}
    assert f"tolerance {LOSS_TOLERANCE:.0%}" in choice.outcomes[2].why
    assert choice.chosen.candidate.name in ("c0", "c1")


def test_the_recorded_candidates_agree_on_the_loss(recorded):
    means = [recorded[n].mean_loss for n in ("c0", "c1", "c2")]
    assert max(means) / min(means) - 1 <= LOSS_TOLERANCE


def test_an_oom_candidate_is_recorded_and_the_rest_still_chosen_from(tiny, tiny_candidates, recorded):
    oom = measure(log("oom"), job_failed=True, failure_reason=failure("oom"))
    choice = choose(tiny, tiny_candidates, {"c0": oom, "c1": recorded["c1"], "c2": recorded["c2"]})
    assert [o.status for o in choice.outcomes] == ["oom", "ok", "ok"]
    assert choice.chosen is not None and choice.gain is None
    assert "the recipe's own layout is oom" in choice.why
    assert choice.to_dict()["candidates"][0] == {
        "name": "c0",
        "overrides": [],
        "layout": tiny_candidates[0].describe,
        "status": "oom",
        "planned": tiny_candidates[0].planned.to_dict(),
        "measured": {},
        "why": oom.reason,
    }


# --- the engine, the budget and the JSON --------------------------------------------------------------


def replay(names: dict[str, str]):
    """A job runner that answers each candidate with a recorded log (by candidate name)."""
    ran = []

    def run_job(candidate, recipe, steps):
        ran.append((candidate.name, recipe, steps))
        name = names[candidate.name]
        return JobResult(tuple(log(name)), bool(failure(name)), failure(name), 60.0)

    return run_job, ran


def test_tuning_run_trains_every_candidate_with_the_measurement_settings(tiny, tiny_candidates):
    run_job, ran = replay({"c0": "c0", "c1": "c1", "c2": "oom"})
    result = tune(tiny, tiny_candidates, run_job, run="tune-x", compiled=False, window=12)
    assert [r[0] for r in ran] == ["c0", "c1", "c2"]
    for name, recipe, steps in ran:
        assert steps.max_steps == FINAL_STEP
        assert recipe.training.log_every == 1 and recipe.checkpointing.interval_steps == FINAL_STEP
        assert recipe.validation is None and recipe.tracking.mlflow == "off"
        assert recipe == job_recipe(tiny, next(c for c in tiny_candidates if c.name == name), steps)
    out = result.choice.to_dict()
    assert set(out) == {"candidates", "chosen"}
    assert set(out["chosen"]) >= {"overrides", "why"}
    for c in out["candidates"]:
        assert set(c) >= {"overrides", "status", "planned", "measured"}
        assert c["status"] in ("ok", "oom", "failed", "flagged")
        if c["status"] == "ok":
            assert set(c["measured"]) >= {
                "tokens_per_s",
                "tokens_per_s_spread",
                "peak_mem_gib",
                "step_time_s",
            }
    assert out["candidates"][2]["status"] == "oom"


def test_the_budget_bounds_the_jobs_started(tiny, tiny_candidates):
    run_job, ran = replay({"c0": "c0", "c1": "c1", "c2": "c2"})
    total = tuning_cost_usd(tiny, tiny_candidates)
    one = total / len(tiny_candidates)
    result = tune(
        tiny, tiny_candidates, run_job, run="tune-x", compiled=False, window=12, budget_usd=one * 1.2
    )
    assert [r[0] for r in ran] == ["c0"] and result.skipped == ("c1", "c2")
    with pytest.raises(TrainstackError, match="--budget-usd: .* does not cover even the recipe's own layout"):
        tune(tiny, tiny_candidates, run_job, run="tune-y", budget_usd=one / 10)


def test_parallel_jobs_all_start_within_the_budget_and_are_measured_alike(tiny, tiny_candidates):
    run_job, ran = replay({"c0": "c0", "c1": "c1", "c2": "c2"})
    sequential = tune(tiny, tiny_candidates, run_job, run="tune-s", compiled=False, window=12)
    run_job, ran = replay({"c0": "c0", "c1": "c1", "c2": "c2"})
    parallel = tune(tiny, tiny_candidates, run_job, run="tune-p", compiled=False, window=12, parallel=True)
    assert sorted(r[0] for r in ran) == ["c0", "c1", "c2"]
    assert parallel.measurements == sequential.measurements
    assert parallel.choice.to_dict() == sequential.choice.to_dict()
    one = tuning_cost_usd(tiny, tiny_candidates) / 3
    run_job, ran = replay({"c0": "c0", "c1": "c1", "c2": "c2"})
    bounded = tune(
        tiny,
        tiny_candidates,
        run_job,
        run="t",
        compiled=False,
        window=12,
        parallel=True,
        budget_usd=one * 2.1,
    )
    assert sorted(r[0] for r in ran) == ["c0", "c1"] and bounded.skipped == ("c2",)


# --- the store and the refit --------------------------------------------------------------------------


def stored(tmp_path: Path, tiny, tiny_candidates, recorded, hardware: Hardware) -> Store:
    store = Store(tmp_path / "tuning.json")
    choice = choose(tiny, tiny_candidates, {c.name: recorded[c.name] for c in tiny_candidates})
    records = [
        {
            "name": o.candidate.name,
            "overrides": list(o.candidate.overrides),
            "layout": layout_key(apply(tiny, o.candidate.overrides)),
            "status": o.status,
            "planned": o.candidate.planned.to_dict(),
            "measured": o.measurement.to_dict(),
        }
        for o in choice.outcomes
    ]
    result = {
        "choice": choice.to_dict(),
        "overrides": list(choice.chosen.candidate.overrides),
        "gain": choice.gain,
    }
    store.record("tune-a", "2026-12-02 19:50 UTC", tiny, None, hardware, records, result)
    store.save()
    return Store(tmp_path / "tuning.json")  # read back from the file


CPU = Hardware("local", "cpu", "local:sha256:abc", 1)


def test_a_measured_layout_is_planned_at_its_measured_step_time(tmp_path, tiny, tiny_candidates, recorded):
    store = stored(tmp_path, tiny, tiny_candidates, recorded, CPU)
    chosen = apply(tiny, tiny_candidates[1].overrides)
    found = refit(chosen, CPU, store)
    assert found.exact and found.step_time_s == pytest.approx(recorded["c1"].step_time_s, rel=1e-5)
    assert found.source == "measured by tuning run tune-a on 2026-12-02 19:50 UTC"


def test_an_unmeasured_layout_is_refit_by_the_measured_over_planned_ratio(
    tmp_path, tiny, tiny_candidates, recorded
):
    store = stored(tmp_path, tiny, tiny_candidates, recorded, CPU)
    other = apply(tiny, ["activation_checkpointing.mode=full"])
    found = refit(other, CPU, store)
    ratios = sorted(recorded[c.name].step_time_s / c.planned.step_time_s for c in tiny_candidates)
    assert not found.exact and found.step_time_s == pytest.approx(
        found.planned_step_time_s * ratios[1], rel=1e-3
    )
    assert found.source.startswith("refit from 3 measurements of tuning run tune-a")


def test_a_cpu_measurement_never_changes_a_gpu_plan(tmp_path, tiny, tiny_candidates, recorded):
    store = stored(tmp_path, tiny, tiny_candidates, recorded, CPU)
    assert refit(tiny, recipe_hardware(tiny), store) is None
    assert refit(tiny, Hardware("local", "cpu", "local:sha256:abc", 2), store) is None  # other ranks
    assert refit(tiny, CPU, store, exclude_run="tune-a") is None


def test_a_second_tune_finds_the_result_of_its_recipe_team_and_image_only(
    tmp_path, tiny, tiny_candidates, recorded
):
    store = stored(tmp_path, tiny, tiny_candidates, recorded, CPU)
    assert store.result("tiny-cpu", None, CPU.image)["run"] == "tune-a"
    assert store.result("tiny-cpu", None, "local:sha256:other") is None
    assert store.result("tiny-cpu", "nlp", CPU.image) is None
    assert (
        store.latest_result("tiny-cpu", None)["overrides"]
        == store.result("tiny-cpu", None, CPU.image)["overrides"]
    )


def test_a_damaged_store_is_one_clear_error(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    with pytest.raises(TrainstackError, match="not a tuning store"):
        Store(path)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(TrainstackError, match="not a version 1 tuning store"):
        Store(path)
