"""bench/trainer_gpu.py runs its real code path on CPU in --smoke mode (the GPU run needs a GPU), and
it can run on the lent GPU machine as is: no module the machine lacks, pydantic from a wheelhouse."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
from trainer_helpers import REPO, trainer_env

sys.path.insert(0, str(REPO / "bench"))
import wheelhouse  # noqa: E402

pytestmark = pytest.mark.fast


@pytest.mark.slow
@pytest.mark.xdist_group("trainer")
def test_smoke_run_covers_every_section_through_the_trainers_modules(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "bench/trainer_gpu.py", "--smoke", "--json", str(out)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    assert {name for name, s in sections.items() if s["error"] is None} == {
        "layers",
        "checkpointing",
        "attention",
        "long_context",
        "fp8_gemm",
        "saved_tensors",
    }
    low, high = sections["layers"]["rows"]
    assert (low["layers"], high["layers"]) == (2, 3)
    for row in (low, high):
        assert row["tokens_per_sec_per_gpu"] > 0 and row["mfu"] > 0 and row["planned_allocator_peak_gib"] > 0
    assert sections["layers"]["slope"]["trainer_memory_saved_gib_per_block"] > 0
    assert [r["checkpointing"] for r in sections["checkpointing"]["rows"]] == ["none", "full", "op"]
    assert "error" in sections["attention"]["micro"]["cudnn"]  # no cuDNN on CPU, said so
    assert sections["attention"]["micro"]["flash"]["fwd_bwd_ms"] > 0
    assert sections["long_context"]["row"]["checkpointing"] == "full"
    assert "skipped" in sections["fp8_gemm"]
    for row in sections["saved_tensors"]["rows"]:  # on CPU the count is exact
        assert row["measured_bytes_per_token"] == row["trainer_memory_bytes_per_token"], row


def test_bench_imports_nothing_the_gpu_machine_lacks():
    """The lent H200 has torch, numpy and pyyaml, no Transformer Engine, no AWS libraries; the
    trainer's loop, data and checkpoint modules (which may import S3 clients) stay out."""
    probe = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"s3torchconnector", "boto3", "botocore", "transformer_engine", "typer",
                                  "aws_cdk", "sagemaker", "moto"}:
            raise ImportError("not on the GPU machine: " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, "bench")
import trainer_gpu
heavy = {"trainer.train", "trainer.data.loader", "trainer.checkpoint.manager"}
assert not heavy & set(sys.modules), sorted(sys.modules)
"""
    command = [sys.executable, "-c", probe]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "filename, fits",
    [
        ("pydantic-2.14.3-py3-none-any.whl", True),
        ("pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        ("pydantic_core-2.50.4-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", False),
        ("pydantic_core-2.50.4-cp312-cp312-macosx_11_0_arm64.whl", False),
        ("pydantic_core-2.50.4-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.whl", False),
    ],
)
def test_wheelhouse_picks_the_wheels_of_the_running_python(filename, fits):
    assert wheelhouse.wheel_fits(filename, (3, 12)) is fits


def test_wheelhouse_unpacks_a_missing_package_onto_the_path(tmp_path):
    with zipfile.ZipFile(tmp_path / "trainstack_probe_pkg-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("trainstack_probe_pkg/__init__.py", "ANSWER = 42\n")
    assert wheelhouse.make_importable("trainstack_probe_pkg", tmp_path).startswith("wheelhouse")
    import trainstack_probe_pkg

    assert trainstack_probe_pkg.ANSWER == 42
    assert wheelhouse.make_importable("json", tmp_path) == "installed"


def test_wheelhouse_pins_are_the_projects():
    pins = wheelhouse.pinned_versions()
    command = wheelhouse.download_command("3.12", tmp := REPO / "build" / "wheelhouse", pins)
    assert f"pydantic=={pins['pydantic']}" in command and f"pydantic_core=={pins['pydantic-core']}" in command
    assert command[command.index("--python-version") + 1] == "3.12" and str(tmp) in command


def test_a_failing_section_is_recorded_and_the_others_still_run(capsys):
    import torch
    import trainer_gpu

    bench = trainer_gpu.Bench(
        trainer_gpu.Settings(True, 1, 1), torch.device("cpu"), None, None, "ml.p5.48xlarge"
    )
    bench.run("broken", lambda: {"value": 1 / 0})
    bench.run("fine", lambda: {"value": 1})
    assert bench.sections["broken"]["error"].startswith("ZeroDivisionError")
    assert bench.sections["fine"] == {"value": 1, "error": None, "seconds": bench.sections["fine"]["seconds"]}
    assert "# broken failed: ZeroDivisionError" in capsys.readouterr().out
