"""trainstack: recipes, a planner and AWS CDK infrastructure for LLM training on SageMaker P6-B200.

Packages, by concern; each may import only the ones below it (tests/test_architecture.py enforces it):

    cli/        the `trainstack` command line, its completion and its commands: a shell over api/
    api/        the Python API: one function per thing a user does, each returning a frozen result
    aws/        recipe -> CreateTrainingJob request and its checks, boto3 access, the run registry,
                the runs view, the supervisor's decision, the CDK app's deployment configuration
    gitops/     what a merge deploys: the plan diff against a git ref, the template diff, their report
    emulator/   the local AWS endpoint (moto) and the events it does not send
    tuning/     the tuning run: candidates, what short jobs measured, the choice, the measured plan
    planner/    recipe -> plan: memory, throughput, cost, the run, budgets and sanity warnings
    recipes/    the recipe schema, its files and layering, overrides, names, the instance catalogue
    protocol/   what a training job and the control plane agree on: exit codes, the metric line
    errors.py   the one-line user errors every layer raises
    units.py    how sizes are written, the same in every layer

docs/architecture.md draws the data flow. `stacks/` (the CDK constructs) and `training_image/trainer`
sit outside this package and import from it, never the other way round.
"""


def _version() -> str:
    """The installed package's version (pyproject.toml, through its metadata): one source for
    `trainstack --version`, this attribute and CHANGELOG.md's newest section."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainstack")
    except PackageNotFoundError:  # a checkout run without `pip install -e .`
        return "0+unknown"


__version__ = _version()
