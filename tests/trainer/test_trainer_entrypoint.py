"""The container entrypoint's torchrun command, from SageMaker resourceconfig.json fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer.entrypoint import (
    EntrypointError,
    build_command,
    build_environment,
    main,
    read_resource_config,
)

pytestmark = pytest.mark.fast

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_one_node_runs_standalone_with_8_processes():
    config = read_resource_config(FIXTURES / "one_node" / "resourceconfig.json")
    command = build_command(config, 8, [], python="python")
    assert command == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=8",
        "--standalone",
        "-m",
        "trainer",
    ]


def test_four_nodes_rendezvous_on_algo_1_with_this_hosts_rank():
    config = read_resource_config(FIXTURES / "four_nodes" / "resourceconfig.json")
    assert config.hosts == ("algo-1", "algo-2", "algo-3", "algo-4")  # file order is not trusted
    command = build_command(config, 8, ["--max-steps", "5"], python="python")
    assert command == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=8",
        "--nnodes=4",
        "--node-rank=2",
        "--master-addr=algo-1",
        "--master-port=29500",
        "-m",
        "trainer",
        "--max-steps",
        "5",
    ]


def test_environment_sets_efa_allocator_and_interfaces_without_overriding_the_job():
    config = read_resource_config(FIXTURES / "four_nodes" / "resourceconfig.json")
    env = build_environment(config, {"PATH": "/usr/bin", "PYTORCH_CUDA_ALLOC_CONF": "set-by-job"})
    assert env["FI_EFA_USE_HUGE_PAGE"] == "0"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "set-by-job"
    assert build_environment(config, {})["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    # torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT only from torch 2.11, newer than the base image's.
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env
    assert env["PATH"] == "/usr/bin"


def test_several_hosts_log_nccl_init_and_net_lines_for_the_comms_gate():
    four = read_resource_config(FIXTURES / "four_nodes" / "resourceconfig.json")
    env = build_environment(four, {})
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    assert "%h" in env["NCCL_DEBUG_FILE"] and "%p" in env["NCCL_DEBUG_FILE"]  # one file per process
    assert build_environment(four, {"NCCL_DEBUG": "WARN"})["NCCL_DEBUG"] == "WARN"  # the job's choice
    assert "NCCL_DEBUG_FILE" not in build_environment(four, {"NCCL_DEBUG": "WARN"})
    one = read_resource_config(FIXTURES / "one_node" / "resourceconfig.json")
    assert "NCCL_DEBUG" not in build_environment(one, {})  # no inter-node traffic, no gate


def test_dry_run_prints_the_command_sagemaker_style_invocation(capsys):
    code = main(
        [
            "train",
            "--resource-config",
            str(FIXTURES / "four_nodes" / "resourceconfig.json"),
            "--nproc-per-node",
            "8",
            "--dry-run",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert "--node-rank=2" in printed["command"] and printed["command"][-2:] == ["-m", "trainer"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"current_host": "algo-9", "hosts": ["algo-1"]}', "current_host"),
        ('{"current_host": "algo-1", "hosts": []}', "hosts"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_resource_config_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / "resourceconfig.json"
    path.write_text(content)
    with pytest.raises(EntrypointError, match=message):
        read_resource_config(path)
    result = subprocess.run(
        [sys.executable, "-m", "trainer.entrypoint", "train", "--resource-config", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and str(path) in result.stderr
