"""The training image's Dockerfile: hadolint-clean, pinned, and its build context complete."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from trainer.models import te_requirements

from trainstack.gitops.gitdiff import image_context

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "training_image" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"
TRAINER_TE_USERS = ("models/model.py", "models/precision.py", "models/activation_checkpointing.py")


def test_hadolint_reports_nothing():
    result = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_base_image_is_a_build_argument_and_transformer_engine_is_pinned():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG BASE_IMAGE$", text, re.M)  # no default: the stack resolves it per region
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG TRANSFORMER_ENGINE_VERSION=\d+\.\d+\.\d+$", text, re.M)
    assert 'ENTRYPOINT ["python", "-m", "trainer.entrypoint"]' in text


def test_transformer_engine_is_the_base_images_when_new_enough_else_built_for_the_target_gpus_only():
    text = DOCKERFILE.read_text()
    minimum = re.search(r"^ARG TRANSFORMER_ENGINE_MIN_VERSION=(\S+)$", text, re.M).group(1)
    assert minimum == te_requirements.MINIMUM  # one minimum, the one the check script documents
    assert "te_requirements.py --at-least" in text  # keep the base image's TE when it qualifies
    assert re.search(r'^ARG NVTE_CUDA_ARCHS="90;100"$', text, re.M)  # Hopper and Blackwell only
    assert re.search(r"^ARG MAX_JOBS=\d+$", text, re.M)
    assert 'NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}"' in text
    assert "--no-build-isolation" in text
    assert "--check-import" in text  # TE's import-time version consistency, plus the trainer's API


@pytest.mark.parametrize(
    "version, minimum, expected",
    [("2.8.0+4e2fa9c", "2.8", True), ("2.20.2", "2.8", True), ("2.7.1", "2.8", False), ("3.0", "2.8", True)],
)
def test_transformer_engine_version_comparison(version, minimum, expected):
    assert te_requirements.at_least(version, minimum) is expected


def test_the_required_api_is_what_the_trainer_calls():
    """Every TE name the trainer's code reaches for is in the build-time check (no GPU here to run it)."""
    sources = " ".join((REPO / "training_image" / "trainer" / f).read_text() for f in TRAINER_TE_USERS)
    for module, attribute in te_requirements.REQUIRED_API:
        assert attribute in sources, (module, attribute)


def test_the_build_checks_the_constructor_keywords_the_model_passes():
    """te_requirements checks every keyword trainer.models.model passes to a TE module (the fake TE's
    classes take exactly TE 2.8's keywords the trainer uses; a missing one is named)."""
    import types

    def module(keywords):
        exec_ns: dict = {}
        exec(f"def __init__(self, *args, {', '.join(k + '=None' for k in keywords)}): pass", exec_ns)
        return type("M", (), {"__init__": exec_ns["__init__"]})

    complete = types.SimpleNamespace(**{name: module(kw) for name, kw in te_requirements.REQUIRED_ARGUMENTS})
    assert te_requirements.missing_arguments(complete) == []
    without_bias = dict(te_requirements.REQUIRED_ARGUMENTS)
    without_bias["LayerNormLinear"] = tuple(k for k in without_bias["LayerNormLinear"] if k != "bias")
    fake = types.SimpleNamespace(**{name: module(kw) for name, kw in without_bias.items()})
    assert te_requirements.missing_arguments(fake) == ["LayerNormLinear(bias=)"]
    model_source = (REPO / "training_image" / "trainer" / "models" / "model.py").read_text()
    for name, keywords in te_requirements.REQUIRED_ARGUMENTS:
        for keyword in keywords:
            assert f"{keyword}=" in model_source, (name, keyword)


def test_core_and_checkpoint_dependencies_are_pinned_as_in_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["trainer"]
    pins = {re.split(r"[\[=]", d)[0]: d for d in declared}
    text = DOCKERFILE.read_text()
    for name in (
        "pydantic",
        "pyyaml",
        "s3torchconnector",
        "s3torchconnectorclient",
        "tenacity",
        "tokenizers",
        "pyarrow",
        "jinja2",
        "safetensors",
        "mlflow-skinny",
        "sagemaker-mlflow",
    ):
        assert f'"{pins[name]}"' in text, pins[name]
    lock = (REPO / "requirements.lock").read_text().splitlines()
    for name in (
        "s3torchconnector",
        "s3torchconnectorclient",
        "tenacity",
        "tokenizers",
        "pyarrow",
        "safetensors",
        "mlflow-skinny",
        "sagemaker-mlflow",
    ):
        assert pins[name].replace("[dcp]", "") in lock, pins[name]


def test_trainer_imports_only_what_the_image_installs():
    # The image has torch and numpy (base image), pydantic and pyyaml (pinned); no CDK, AWS SDK or CLI libs,
    # and of trainstack only the modules .dockerignore lets into the build context (as module paths).
    in_context = [
        entry.removesuffix(".py").removesuffix("/")
        for entry in image_context(REPO)
        if entry.startswith("trainstack/")
    ]
    probe = (
        f"IN_CONTEXT = {in_context!r}\n"
        + """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        # mlflow: the tracking client is imported only when tracking is on (trainer.metrics.tracking), never
        # by importing the trainer; tensorboard is not in the image at all (trainer.metrics.tensorboard).
        if name.split(".")[0] in {"typer", "rich", "boto3", "botocore", "aws_cdk", "constructs", "cdk_nag",
                                  "sagemaker", "matplotlib", "moto", "mlflow", "sagemaker_mlflow",
                                  "tensorboard"}:
            raise ImportError("not in the training image: " + name)
        module = name.replace(".", "/")
        if name.startswith("trainstack.") and not any(
            module == held or module.startswith(held + "/") for held in IN_CONTEXT
        ):
            raise ImportError("not in the image's build context (.dockerignore): " + name)
sys.meta_path.insert(0, Block())
import trainer.__main__, trainer.entrypoint, trainer.train
import trainer.prepare.__main__, trainer.prepare.make_shards, trainer.export.__main__
import trainer.metrics.tracking, trainer.metrics.tensorboard, trainer.metrics.delivery
import s3torchconnector.dcp  # the S3 checkpoint backend, imported only for s3:// locations
"""
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
