"""A team chooses the base recipes it deploys (`recipes: [...]` in its defaults.yaml; default every one),
and the README's new-team walkthrough, followed literally, leaves no other team's name in the copy."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainstack.aws import deployment as config
from trainstack.cli.commands.schema import recipe_schema
from trainstack.cli.main import app
from trainstack.errors import RecipeError
from trainstack.gitops import gitdiff
from trainstack.recipes.loader import resolve, team_recipe_names

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path, h) -> Path:
    """Three base recipes and team nlp selecting two of them, with a variant of its own."""
    return h.write_tree(
        tmp_path,
        {
            "recipes/small.yaml": h.base_recipe("small"),
            "recipes/medium.yaml": h.base_recipe("medium", micro_batch=2),
            "recipes/large.yaml": h.base_recipe("large", nodes=2),
            "recipes/teams/nlp/defaults.yaml": "tags: {cost_center: nlp}\nrecipes: [small, medium]\n",
            "recipes/teams/nlp/small-long.yaml": "extends: small\nname: small-long\n",
            "recipes/teams/vision/defaults.yaml": "tags: {cost_center: vision}\n",
        },
    )


def test_a_team_deploys_only_the_base_recipes_it_selects_plus_its_variants(tree):
    assert team_recipe_names("nlp", tree) == ["medium", "small", "small-long"]
    assert team_recipe_names("vision", tree) == ["large", "medium", "small"]  # no selection: every one
    targets = gitdiff.deploy_targets(tree)
    assert [(r, t) for r, t in targets if t == "nlp"] == [
        ("medium", "nlp"),
        ("small", "nlp"),
        ("small-long", "nlp"),
    ]
    pairs = config._all_pairs(None, str(tree))
    assert ("large", "nlp") not in pairs and ("large", "vision") in pairs and ("large", None) in pairs
    # the selection is the team's, not a recipe value: it is not layered into the recipe
    assert resolve("small", team="nlp", recipes_dir=tree).recipe.tags.cost_center == "nlp"


def test_recipes_with_team_lists_only_what_the_team_deploys(tree, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that no recipe name is cut
    result = CliRunner().invoke(
        app, ["recipes", "--team", "nlp", "--recipes-dir", str(tree)], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    rows = [re.split(r"[│|]", line) for line in result.stdout.splitlines() if re.match(r"^[│|] ", line)]
    cells = [[c.strip() for c in row[1:3]] for row in rows]
    assert {recipe for recipe, team in cells if team == "nlp"} == {"medium", "small", "small-long"}
    assert {recipe for recipe, team in cells if not team} == {"large", "medium", "small"}  # the base recipes


def test_validate_checks_only_the_selected_recipes(tree):
    result = CliRunner().invoke(app, ["validate", "--recipes-dir", str(tree)])
    assert result.exit_code == 0, result.output
    assert "large --team nlp" not in result.stdout and "large --team vision" in result.stdout
    assert "small-long --team nlp" in result.stdout


def test_the_cdk_app_refuses_a_recipe_the_team_does_not_select(tree):
    with pytest.raises(RecipeError) as caught:
        config.load({"recipe": "large", "team": "nlp"}, {}, recipes_dir=str(tree))
    assert (
        str(caught.value).startswith("" if False else str(caught.value).split(": recipes: ")[0])
        and ": recipes: team nlp does not deploy large (it selects small, medium): add large to `recipes:`"
        in str(caught.value)
    )


@pytest.mark.parametrize(
    ("selection", "words"),
    [
        ("[smal]", "recipes: 'smal' is not a base recipe (did you mean small?)"),
        ("small", "recipes: must be a list of base recipe names"),
    ],
)
def test_a_bad_selection_is_one_line_naming_the_defaults_file(tree, selection, words):
    (tree / "teams/nlp/defaults.yaml").write_text(f"recipes: {selection}\n")
    with pytest.raises(RecipeError) as caught:
        team_recipe_names("nlp", tree)
    assert "teams/nlp/defaults.yaml: " in str(caught.value) and words in str(caught.value)


def test_an_override_of_an_unselected_base_recipe_is_refused(tree):
    (tree / "teams/nlp/large.yaml").write_text("training: {steps: 5}\n")
    with pytest.raises(
        RecipeError, match=r"teams/nlp/large\.yaml: overrides large, which `recipes:` in .* does not"
    ):
        team_recipe_names("nlp", tree)


def test_the_team_file_schema_offers_the_selection():
    prop = recipe_schema(partial=True)["properties"]["recipes"]
    assert prop["type"] == "array" and "8b-fp8" in prop["items"]["enum"]
    assert "recipes" not in recipe_schema()["properties"]


def readme_walkthrough() -> tuple[list[str], str]:
    """The walkthrough's shell lines for steps 1 and its YAML block of step 2, from README.md."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**A new team, from clone to first run.**") :]
    shell = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in shell.splitlines() if line.startswith(("cp ", "rm "))]
    return commands, block


def change_lines(text: str, block: str) -> str:
    """Step 2 of the walkthrough as a person does it: each line the README shows replaces the copy's
    line for the same key in the same section (a commented-out `# key:` line included); a line the copy
    lacks is added at the end of its section."""
    shown: list[tuple[str, str, str]] = []  # (section, key, line without the README's numbering comment)
    section = ""
    for line in block.splitlines():
        body = line.split("  #")[0].rstrip()
        key = body.strip().split(":")[0]
        if not line.startswith(" "):
            section = key
        shown.append((section if line.startswith(" ") else "", key, body))
    out: list[str] = []
    section = ""
    done: set[tuple[str, str]] = set()
    for line in text.splitlines():
        bare = line.lstrip("# ") if line.startswith("# ") and ":" in line else line
        key = bare.strip().split(":")[0]
        if not bare.startswith(" ") and bare.strip():
            section = key
        place = (section if bare.startswith(" ") else "", key)
        match = [s for s in shown if (s[0], s[1]) == place]
        if match and (not line.startswith("#") or not match[0][0]):
            out.append(match[0][2])
            done.add(place)
        else:
            out.append(line)
    out += [body for sec, key, body in shown if (sec, key) not in done and not sec]
    return "\n".join(out) + "\n"


def test_the_walkthrough_copy_names_no_other_team_and_deploys_what_it_selects(tmp_path):
    recipes = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipes)
    commands, block = readme_walkthrough()
    assert commands == ["cp -r recipes/teams/nlp recipes/teams/vision", "rm recipes/teams/vision/8b-fp8.yaml"]
    shutil.copytree(recipes / "teams/nlp", recipes / "teams/vision")
    (recipes / "teams/vision/8b-fp8.yaml").unlink()
    defaults = recipes / "teams/vision/defaults.yaml"
    defaults.write_text(change_lines(defaults.read_text(), block))
    for path in (recipes / "teams/vision").iterdir():
        assert "nlp" not in path.read_text().lower(), (path.name, path.read_text())
    assert yaml.safe_load(defaults.read_text())["recipes"] == ["8b-fp8", "14b-fp8"]
    assert team_recipe_names("vision", recipes) == ["14b-fp8", "8b-fp8"]
    result = CliRunner().invoke(
        app, ["validate", str(recipes / "teams/vision"), "--recipes-dir", str(recipes)]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.count("--team vision") == 2
    vision = resolve("8b-fp8", team="vision", recipes_dir=recipes).recipe
    assert vision.tags.cost_center == "vision-research-1234" and vision.tags.team == "vision"
    assert vision.data.train_s3_uri == "s3://example-vision-data/tokenized/"
