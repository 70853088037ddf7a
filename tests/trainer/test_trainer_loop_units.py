"""Pure pieces of the step loop: the SIGTERM plan, the prefetching loader, stragglers, hosts."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from trainer.data.loader import Prefetcher, SyntheticTokens, load_batch, micro_batch_plan
from trainer.metrics.throughput import BlockComputeTimer, current_host, host_number, slowest_rank
from trainer.runtime.stopping import EXIT_MARGIN_S, plan_stop

pytestmark = pytest.mark.fast

GRACE = 120.0


def test_sigterm_saves_the_current_step_when_the_save_fits():
    choice = plan_stop(GRACE, step=14, newest_complete=10, in_flight=None, save_s=30.0)
    assert choice.final_save and not choice.finish_in_flight and choice.resume_step == 14


def test_sigterm_without_time_for_a_save_names_the_checkpoint_the_next_job_resumes_from():
    # 64b-fp8 class: ~90 GiB per node at the plan's 5 GB/s is ~19 s, but a slower measured save (150 s)
    # cannot fit: exit 0 without saving, resuming from step 10.
    choice = plan_stop(GRACE, step=14, newest_complete=10, in_flight=None, save_s=150.0)
    assert not choice.final_save and choice.resume_step == 10
    assert "no time to save step 14" in choice.reason


def test_sigterm_finishes_an_in_flight_save_that_fits_then_needs_no_final_save_when_it_is_current():
    # The save of step 14 started 20 s ago and takes ~40 s: 20 s left fits; it holds the current state.
    choice = plan_stop(GRACE, step=14, newest_complete=10, in_flight=(14, 20.0), save_s=40.0)
    assert choice.finish_in_flight and not choice.final_save and choice.resume_step == 14


def test_sigterm_finishes_the_in_flight_save_and_saves_again_only_if_both_fit():
    both = plan_stop(GRACE, step=16, newest_complete=10, in_flight=(14, 10.0), save_s=40.0)
    assert both.finish_in_flight and both.final_save and both.resume_step == 16
    # 30 s left of the in-flight save + 40 s for another exceeds 120 - 15 - 60 (already gone)
    late = plan_stop(GRACE - 60, step=16, newest_complete=10, in_flight=(14, 10.0), save_s=40.0)
    assert late.finish_in_flight and not late.final_save and late.resume_step == 14


def test_sigterm_abandons_an_in_flight_save_that_cannot_finish():
    choice = plan_stop(GRACE, step=16, newest_complete=10, in_flight=(14, 5.0), save_s=200.0)
    assert not choice.finish_in_flight and not choice.final_save and choice.resume_step == 10
    assert "abandoning the save of step 14" in choice.reason


def test_sigterm_budget_keeps_the_exit_margin():
    just = plan_stop(GRACE, step=3, newest_complete=None, in_flight=None, save_s=GRACE - EXIT_MARGIN_S)
    over = plan_stop(GRACE, step=3, newest_complete=None, in_flight=None, save_s=GRACE - EXIT_MARGIN_S + 1)
    assert just.final_save and not over.final_save and over.resume_step is None


def test_sigterm_before_the_first_step_saves_nothing():
    """A step-0 checkpoint holds nothing the recipe's seed does not, and DCP's get_state_dict would give
    the fresh optimizer a step of its own (state `step` 1): its resume drifted by 0.017 to 0.067."""
    choice = plan_stop(GRACE, step=0, newest_complete=None, in_flight=None, save_s=1.0)
    assert not choice.final_save and choice.resume_step is None
    assert "nothing to save before the first step" in choice.reason


def test_the_planner_tells_the_user_with_the_margin_the_trainer_keeps():
    # run.checkpoint.sigterm_fits and plan_stop spend the same window: one constant, in trainstack.
    from trainstack.planner import run_plan

    assert EXIT_MARGIN_S is run_plan.EXIT_MARGIN_S
    assert GRACE == run_plan.SIGTERM_GRACE_S


def test_prefetcher_yields_the_plans_micro_batches_in_order_and_equal_to_direct_reads():
    source = SyntheticTokens(vocab=64, seq_len=8, seed=3)
    plan = micro_batch_plan(position=32, grad_accum=2, global_batch=16, rank=1, world=2, micro_batch=4)
    expected = [range(36, 40), range(44, 48), range(52, 56), range(60, 64)]
    prefetcher = Prefetcher(source, plan, torch.device("cpu"), depth=2)
    try:
        for indices in expected:
            batch = prefetcher.next(indices)
            direct = load_batch(source, indices, torch.device("cpu"))
            assert batch.sample_indices == tuple(indices)
            assert torch.equal(batch.inputs, direct.inputs) and torch.equal(batch.targets, direct.targets)
        with pytest.raises(RuntimeError, match="prefetched samples"):
            prefetcher.next(range(0, 4))  # the loop asking for something else is a bug, not data
    finally:
        prefetcher.close()


def test_prefetcher_raises_a_read_error_in_the_training_thread():
    class Broken:
        name = "broken"

        def sample(self, index: int) -> np.ndarray:
            raise OSError(f"shard read failed at {index}")

    prefetcher = Prefetcher(Broken(), micro_batch_plan(0, 1, 2, 0, 1, 2), torch.device("cpu"))
    with pytest.raises(OSError, match="shard read failed at 0"):
        prefetcher.next(range(0, 2))
    prefetcher.close()


def test_prefetcher_reads_ahead_while_the_step_computes():
    class Slow:
        name = "slow"

        def sample(self, index: int) -> np.ndarray:
            time.sleep(0.02)
            return np.zeros(9, dtype=np.int64)

    prefetcher = Prefetcher(Slow(), micro_batch_plan(0, 1, 2, 0, 1, 2), torch.device("cpu"), depth=3)
    time.sleep(0.3)  # "a step": the thread fills the queue meanwhile
    started = time.perf_counter()
    for first in (0, 2, 4):
        prefetcher.next(range(first, first + 2))
    waited = time.perf_counter() - started
    prefetcher.close()
    assert waited < 0.04, waited  # read directly, 3 batches x 2 samples x 20 ms = 120 ms


def test_slowest_rank_and_its_skew_against_the_median():
    straggler = slowest_rank([1.0, 1.1, 1.5, 0.9, 1.0], hosts=[1, 1, 2, 2, 3])
    assert (straggler.rank, straggler.host, straggler.compute_s) == (2, 2, 1.5)
    assert straggler.median_s == 1.0 and straggler.skew == pytest.approx(0.5)
    assert slowest_rank([0.0, 0.0], [1, 1]).skew == 0.0  # nothing measured: no skew


def test_current_host_from_sagemaker_env_then_resourceconfig(tmp_path):
    config = tmp_path / "resourceconfig.json"
    config.write_text(json.dumps({"current_host": "algo-3", "hosts": ["algo-1", "algo-2", "algo-3"]}))
    assert current_host({"SM_CURRENT_HOST": "algo-7"}, config) == "algo-7"
    assert current_host({}, config) == "algo-3"
    assert host_number("algo-12") == 12 and host_number("ip-10-0-0-1") == 0


def test_block_timer_counts_only_armed_steps_and_each_forward_once():
    blocks = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    timer = BlockComputeTimer(blocks, torch.device("cpu"))
    x = torch.ones(4, 8)
    for block in blocks:
        block(x)
    assert timer.collect() == 0.0  # not armed
    timer.arm()
    for block in blocks:
        block(x)
    measured = timer.collect()
    assert 0.0 < measured < 1.0
    for block in blocks:
        block(x)
    assert timer.collect() == 0.0  # disarmed by collect
