"""Names derived from a team and a recipe never overlap: one recipe's job-name prefix is not a prefix of
another recipe's or team's job names, stack names are distinct, the longest names (the longest team,
recipe and run id, job 99) fit SageMaker's 63 characters, run names parse back into their parts, and
names that would break this are refused with one line that states the rule."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from trainstack.api.runs_api import _suffix
from trainstack.aws.request import job_name
from trainstack.aws.runs import is_recipe_job
from trainstack.cli.main import app
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import RECIPE_NAME_MAX, TEAM_NAME_MAX, Recipe, Tags

pytestmark = pytest.mark.fast

# (team, recipe): the same team with a recipe extending another's name (8b-fp8, 8b-fp8-128k, 8b), teams
# whose names run into the recipe (`nlp8b` + `fp8`, `nlp8` + `b-fp8`, `nl` + `p-8b-fp8`: with hyphens
# allowed in team names, `nlp-8b` + `fp8` was the same name as `nlp` + `8b-fp8`), and the longest names.
LONGEST_TEAM, LONGEST_RECIPE = "t" * TEAM_NAME_MAX, "-".join(["r" * 10, "s" * 11])
PAIRS = [
    ("nlp", "8b-fp8"),
    ("nlp", "8b-fp8-128k"),
    ("nlp", "8b"),
    ("nlp", "8b-fp8-128k-v2"),
    ("nlp8b", "fp8"),
    ("nlp8", "b-fp8"),
    ("nl", "p-8b-fp8"),
    ("platform", "8b-fp8"),
    ("platform", "nlp-8b-fp8"),
    (LONGEST_TEAM, LONGEST_RECIPE),
    (LONGEST_TEAM, LONGEST_RECIPE[:-1]),
]
SUFFIXES = ("deploy", "r1a2b3c", "t9", "x" * naming.RUN_SUFFIX_MAX)


def job_names(recipe: Recipe, team: str) -> list[str]:
    """Names of its runs (one per kind of default suffix, and a --name) and of their first and last jobs."""
    runs = [job_name(recipe, team, suffix) for suffix in SUFFIXES]
    runs.append(naming.run_name(recipe, team, "x" * naming.RUN_ID_MAX))
    return runs + [naming.job_of_run(r, i) for r in runs for i in (1, naming.JOB_INDEX_MAX)]


@pytest.fixture(scope="module")
def base() -> Recipe:
    return resolve("8b-fp8").recipe


def named(base: Recipe, name: str) -> Recipe:
    """`base` renamed, validated again (model_copy would skip the name rule)."""
    return Recipe.model_validate({**base.model_dump(), "name": name})


@pytest.fixture(scope="module")
def recipes(base) -> dict[tuple[str, str], Recipe]:
    return {(team, name): named(base, name) for team, name in PAIRS}


def test_the_longest_names_are_valid_and_as_long_as_allowed():
    assert len(LONGEST_RECIPE) == RECIPE_NAME_MAX and len(LONGEST_TEAM) == TEAM_NAME_MAX


def test_no_job_of_one_team_and_recipe_starts_with_anothers_prefix(recipes):
    for (mine, me), (theirs, them) in itertools.permutations(recipes.items(), 2):
        prefix = naming.job_name_prefix(me, mine[0])
        for other in job_names(them, theirs[0]):
            assert not other.startswith(prefix), (mine, theirs, prefix, other)
            assert not is_recipe_job(other, prefix)


def test_every_job_of_a_team_and_recipe_starts_with_its_prefix(recipes):
    for (team, _), recipe in recipes.items():
        prefix = naming.job_name_prefix(recipe, team)
        assert prefix == f"ts-{team}-{recipe.name}--"
        for name in job_names(recipe, team):
            assert is_recipe_job(name, prefix)
            assert len(name) <= naming.JOB_NAME_MAX
        assert job_name(recipe, team, "deploy") == f"{prefix}{naming.recipe_hash(recipe)}-deploy"


def test_a_recipe_extending_anothers_name_overlaps_as_text_but_not_by_prefix(recipes):
    shorter, longer = recipes[("nlp", "8b-fp8")], recipes[("nlp", "8b-fp8-128k")]
    theirs = job_name(longer, "nlp", "deploy")
    assert theirs.startswith("ts-nlp-8b-fp8-")  # what `<prefix>-*` used to let 8b-fp8's launcher touch
    assert not theirs.startswith(naming.job_name_prefix(shorter, "nlp"))


def test_stack_and_checkpoint_names_are_distinct_for_every_team_and_recipe(recipes):
    stacks = {naming.stack_prefix(recipe, team) for (team, _), recipe in recipes.items()}
    checkpoints = {naming.checkpoint_prefix(recipe, team) for (team, _), recipe in recipes.items()}
    assert len(stacks) == len(checkpoints) == len(PAIRS)
    # The team is what comes before the first hyphen after the project name.
    for (team, name), recipe in recipes.items():
        assert naming.stack_prefix(recipe, team).split("-", 2)[1:] == [team, name]


def test_the_longest_team_recipe_and_run_id_give_a_job_name_of_at_most_63_characters(recipes):
    recipe = recipes[(LONGEST_TEAM, LONGEST_RECIPE)]
    prefix = naming.job_name_prefix(recipe, LONGEST_TEAM)
    assert len(prefix) == naming.JOB_PREFIX_MAX == 44
    longest_run = naming.run_name(recipe, LONGEST_TEAM, "x" * naming.RUN_ID_MAX)
    assert len(naming.job_of_run(longest_run, naming.JOB_INDEX_MAX)) == naming.JOB_NAME_MAX == 63
    default = job_name(recipe, LONGEST_TEAM, "x" * naming.RUN_SUFFIX_MAX)  # hash + suffix: the longest id
    assert len(default) == len(longest_run)
    with pytest.raises(ValueError, match="suffix"):
        job_name(recipe, LONGEST_TEAM, "x" * (naming.RUN_SUFFIX_MAX + 1))
    with pytest.raises(ValueError, match="job index"):
        naming.job_of_run(longest_run, naming.JOB_INDEX_MAX + 1)


@pytest.mark.parametrize("max_steps", [None, 50])
def test_the_suffixes_launch_gives_today_fit(recipes, max_steps):
    run = job_name(recipes[(LONGEST_TEAM, LONGEST_RECIPE)], LONGEST_TEAM, _suffix(max_steps))
    assert len(naming.job_of_run(run, naming.JOB_INDEX_MAX)) <= 63


def test_run_names_parse_back_into_team_recipe_and_id(recipes):
    for (team, _), recipe in recipes.items():
        for run_id in ("a", "lr-sweep-1", naming.default_run_id(recipe, "r1a2b3c"), "x" * naming.RUN_ID_MAX):
            run = naming.run_name(recipe, team, run_id)
            parsed = naming.parse_run_name(run)
            assert (parsed.team, parsed.recipe, parsed.run_id) == (team, recipe.name, run_id)
            assert str(parsed) == run and parsed.stack_prefix == naming.stack_prefix(recipe, team)
    for not_a_run in (
        "ts-nlp-8b-fp8",
        "nlp-8b-fp8--x",
        "ts-nlp-8b-fp8--",
        "ts-NLP-8b--x",
        "ts-nlp-8b--Bad_id",
    ):
        assert naming.parse_run_name(not_a_run) is None, not_a_run


@pytest.mark.parametrize("run_id", ["", "Lr", "a--b", "-a", "a-", "a_b", "x" * (naming.RUN_ID_MAX + 1)])
def test_invalid_run_names_are_refused_stating_the_rule(base, run_id):
    assert "a run name is 1-16 characters" in naming.run_id_problem(run_id)
    with pytest.raises(ValueError, match="invalid run name"):
        naming.run_name(base, "nlp", run_id)


def test_every_job_of_a_run_shares_the_run_checkpoint_prefix(base):
    run_id = naming.default_run_id(base, "r1")
    assert naming.run_checkpoint_prefix(base, "nlp", run_id) == f"checkpoints/nlp/8b-fp8/{run_id}/"


@pytest.mark.parametrize("team", ["nlp-8b", "NLP", "8b", "n_lp", "", "t" * (TEAM_NAME_MAX + 1), "nlp-"])
def test_invalid_team_names_are_refused_stating_the_rule(base, team):
    with pytest.raises(ValidationError, match="invalid team name .*no hyphens"):
        Tags(team=team)
    if team:  # an empty team means the recipe's own (tags.team), as everywhere
        with pytest.raises(ValueError, match="invalid team name"):
            naming.job_name_prefix(base, team)  # a name can never be made from one


@pytest.mark.parametrize(
    "name", ["8b--fp8", "8b-fp8-", "-8b-fp8", "8B-fp8", "8b_fp8", "", "r" * (RECIPE_NAME_MAX + 1)]
)
def test_invalid_recipe_names_are_refused_stating_the_rule(base, name):
    with pytest.raises(ValidationError, match="invalid recipe name .*single hyphens"):
        named(base, name)


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_plan_refuses_a_team_name_with_a_hyphen_before_looking_it_up(recipes_dir):
    (recipes_dir / "teams" / "nlp-8b").mkdir()  # even where the directory exists
    result = CliRunner().invoke(app, ["plan", "small", "--team", "nlp-8b", "--recipes-dir", str(recipes_dir)])
    line = one_line_error(result)
    assert line == (
        "error: --team: invalid team name 'nlp-8b': a team name is 1-16 lowercase letters and digits, "
        "starting with a letter, no hyphens"
    )


def test_plan_refuses_an_invalid_recipe_name_stating_the_rule(recipes_dir, small_text):
    (recipes_dir / "8b--fp8.yaml").write_text("name: 8b--fp8\n" + small_text)
    result = CliRunner().invoke(app, ["plan", "8b--fp8", "--recipes-dir", str(recipes_dir)])
    line = one_line_error(result)
    assert "8b--fp8.yaml: name: invalid recipe name '8b--fp8': a recipe name is at most 22 " in line
    assert "(no leading, trailing or double hyphen)" in line


def test_plan_refuses_a_recipe_naming_an_invalid_team_in_its_tags(recipes_dir, small_text):
    (recipes_dir / "tagged.yaml").write_text("name: tagged\ntags: {team: nlp-8b}\n" + small_text)
    result = CliRunner().invoke(app, ["plan", "tagged", "--recipes-dir", str(recipes_dir)])
    assert "tagged.yaml: tags.team: invalid team name 'nlp-8b': " in one_line_error(result)


def test_validate_refuses_a_team_directory_with_an_invalid_name(recipes_dir):
    (recipes_dir / "teams" / "nlp-8b").mkdir()
    result = CliRunner().invoke(app, ["validate", "--recipes-dir", str(recipes_dir)])
    line = one_line_error(result)
    assert "teams/nlp-8b: invalid team name 'nlp-8b': a team name is" in line
    assert line.endswith("(rename the directory)")


def test_the_installed_cli_exits_2_with_one_line_for_an_invalid_team(recipes_dir):
    cli = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "trainstack"
    done = subprocess.run(
        [str(cli), "plan", "small", "--team", "nlp-8b", "--recipes-dir", str(recipes_dir)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --team: invalid team name 'nlp-8b': a team name is 1-16 lowercase letters and digits, "
        "starting with a letter, no hyphens"
    ]


def test_job_suffixes_number_1035_jobs_uniquely_within_three_characters() -> None:
    """Past job 99 the suffix is a letter and a base-36 digit: no suffix of one scheme is one of the
    other, the index reads back, and the supervisor's lookup table lists them in order."""
    suffixes = [naming.job_suffix(i) for i in range(1, naming.JOB_INDEX_MAX + 1)]
    assert suffixes[:2] == ["1", "2"] and suffixes[98:101] == ["99", "a0", "a1"] and suffixes[-1] == "zz"
    assert len(set(suffixes)) == naming.JOB_INDEX_MAX and max(map(len, suffixes)) == 2
    assert [naming.job_index(s) for s in suffixes] == list(range(1, naming.JOB_INDEX_MAX + 1))
    assert naming.JOB_SUFFIXES.split(",") == suffixes
    assert naming.job_index("0") is None and naming.job_index("100") is None and naming.job_index("a") is None


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\n\n"])
def test_every_name_rule_is_matched_to_the_end_of_the_text_so_a_trailing_newline_fails(base, newline) -> None:
    """A Python `$` also matches before a trailing newline: `odd\\n` passed the run-id rule and reached
    SageMaker (moto created `...odd\\n-1`). Every place that validates a name refuses it."""
    from stacks.pipeline import BRANCH, REPOSITORY
    from trainstack.aws.export_job import EXPORT_JOB
    from trainstack.recipes.schema import HYPERPARAMETER_KEY, recipe_name_problem, team_name_problem

    assert naming.run_id_problem("odd") is None
    assert naming.run_id_problem("odd" + newline) is not None
    assert naming.parse_run_name("ts-nlp-8b-fp8--odd" + newline) is None
    with pytest.raises(ValueError, match="invalid run name"):
        naming.run_name(base, None, "odd" + newline)
    assert team_name_problem("nlp" + newline) and recipe_name_problem("8b-fp8" + newline)
    assert REPOSITORY.fullmatch("org/repo") and not REPOSITORY.match("org/repo" + newline)
    assert BRANCH.match("main") and not BRANCH.match("main" + newline)
    assert HYPERPARAMETER_KEY.fullmatch("training.lr") and not HYPERPARAMETER_KEY.fullmatch("training.lr\n")
    assert EXPORT_JOB.search("ts-a-b--c-X1") and not EXPORT_JOB.search("ts-a-b--c-X1\n")
    result = CliRunner().invoke(app, ["launch", "1b-bf16", "--name", "odd" + newline])
    assert result.exit_code == 2 and "invalid run name" in result.output
