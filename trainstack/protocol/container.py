"""Where SageMaker's container contract puts things (/opt/ml), and the one variable that moves it.

On SageMaker every path of the contract is under /opt/ml (../shared/README.md section 15): the config
files in /opt/ml/input/config/, channels in /opt/ml/input/data/<channel>/, the failure file
/opt/ml/output/failure, checkpoints in /opt/ml/checkpoints, processing inputs under /opt/ml/processing/.
The local emulator (trainstack.emulator.jobs) runs jobs as plain processes, each node in its own
directory standing in for /opt/ml, and says which through TRAINSTACK_OPT_ML; nothing sets it on
SageMaker, so there the paths are SageMaker's own. The trainer reads every such path through `opt_ml`.

Read when called (not at import), so a process can set it before it first looks. No third-party imports:
the training image imports this module.
"""

from __future__ import annotations

import os
from pathlib import Path

OPT_ML = "/opt/ml"
OPT_ML_ENV = "TRAINSTACK_OPT_ML"  # the directory standing in for /opt/ml (the local emulator's jobs)


def opt_ml_root(environ: dict[str, str] | None = None) -> Path:
    """/opt/ml, or the directory TRAINSTACK_OPT_ML names."""
    env = os.environ if environ is None else environ
    return Path(env.get(OPT_ML_ENV) or OPT_ML)


def opt_ml(relative: str, environ: dict[str, str] | None = None) -> Path:
    """The contract's path `relative` to /opt/ml (e.g. "input/config/hyperparameters.json")."""
    return opt_ml_root(environ) / relative


def map_opt_ml(value: str, root: Path | str) -> str:
    """A path written against /opt/ml (a container argument, a LocalPath) moved under `root`; any other
    value unchanged."""
    if value == OPT_ML or value.startswith(OPT_ML + "/"):
        return str(Path(root)) + value[len(OPT_ML) :]
    return value
