"""The comms gate's verdict on recorded NCCL_DEBUG=INFO output (tests/trainer/fixtures/nccl/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer.distributed.comms import (
    NCCL_DEBUG_FILE,
    CommsGateError,
    check_efa,
    decide,
    efa_problem,
    local_problem,
    multi_node,
    parse_nccl_debug,
)

from trainstack.protocol import exit_codes

pytestmark = pytest.mark.fast

NCCL_LOGS = Path(__file__).resolve().parent / "fixtures" / "nccl"


def log(name: str) -> str:
    return (NCCL_LOGS / name).read_text()


def test_a_healthy_efa_run_passes():
    found = parse_nccl_debug(log("efa_libfabric.log"))
    assert found.networks == ["Libfabric", "Libfabric"]  # the first communicator and its split
    assert found.providers == ["efa"]
    assert efa_problem(found) is None


def test_the_older_aws_libfabric_plugin_name_passes_too():
    assert efa_problem(parse_nccl_debug(log("aws_libfabric_2021.log"))) is None


def test_the_plugin_name_mismatch_fallback_to_sockets_is_caught_and_explained():
    problem = efa_problem(parse_nccl_debug(log("plugin_name_mismatch.log")))
    assert problem is not None
    assert "NCCL uses network Socket" in problem
    assert "libnccl-net-aws-ofi.so: cannot open shared object file" in problem


def test_one_communicator_on_sockets_is_enough_to_fail():
    healthy = log("efa_libfabric.log")
    split_on_sockets = healthy + "host:1:2 [0] NCCL INFO Using network Socket\n"
    assert "network Socket" in efa_problem(parse_nccl_debug(split_on_sockets))


def test_the_plugin_without_the_efa_provider_fails():
    text = log("efa_libfabric.log").replace("Selected provider is efa,", "Selected provider is tcp,")
    assert efa_problem(parse_nccl_debug(text)) == (
        "the aws-ofi-nccl plugin loaded but its libfabric provider is not efa (tcp)"
    )


def test_a_log_without_a_network_line_fails_rather_than_passes():
    assert "no 'Using network' line" in efa_problem(parse_nccl_debug("NCCL version 2.27.3+cuda12.9\n"))


def test_each_process_reads_its_own_nccl_debug_file(tmp_path):
    pattern = str(tmp_path / "nccl.%h.%p.log")
    (tmp_path / "nccl.algo-1.111.log").write_text(log("efa_libfabric.log"))
    (tmp_path / "nccl.algo-1.222.log").write_text(log("plugin_name_mismatch.log"))
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": pattern}
    assert local_problem(env, 111) is None
    assert "network Socket" in local_problem(env, 222)
    assert "no NCCL log" in local_problem(env, 333)
    assert "cannot check" in local_problem({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_FILE": pattern}, 111)
    assert NCCL_DEBUG_FILE.endswith("nccl.%h.%p.log")  # what the entrypoint sets


def test_any_failing_rank_stops_the_job_with_one_fatal_line_and_exit_4():
    assert decide([("algo-1", 0, None), ("algo-2", 8, None)]) == "passed: 2 ranks use aws-ofi-nccl over EFA"
    with pytest.raises(CommsGateError) as stopped:
        decide([("algo-1", 0, None), ("algo-2", 8, "NCCL uses network Socket (...)")])
    message = str(stopped.value)
    assert message.startswith("comms gate: NCCL is not running over EFA on 1 of 2 ranks")
    assert "(first: rank 8 on algo-2): NCCL uses network Socket" in message
    assert "TRAINSTACK_EFA_GATE=off" in message and "\n" not in message
    assert stopped.value.exit_code == exit_codes.NETWORK == 4
    assert exit_codes.failure_line(stopped.value.exit_code, message).startswith("trainstack-fatal exit=4: ")


def test_the_gate_runs_only_for_multi_node_gpu_jobs(monkeypatch):
    import torch

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert multi_node()
    assert check_efa(torch.device("cpu"), 0, 16) == "not needed (CPU)"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert not multi_node()
    assert check_efa(torch.device("cuda"), 0, 16) == "not needed (one node)"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("TRAINSTACK_EFA_GATE", "off")
    assert check_efa(torch.device("cuda"), 0, 16) == "skipped (TRAINSTACK_EFA_GATE=off)"
