"""The docs test's extractor (tests/docs/doc_commands.py): which lines of a Markdown file are commands,
how continuations and optional parts are handled, and how skip markers apply. Fast, no commands run."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_commands import all_commands, blocks, commands_of

pytestmark = pytest.mark.fast

DOC = """\
# Title

```bash
# a comment line
make demo    # trailing comments stay (bash ignores them)
npx cdk deploy --all -c recipe=30b-fp8 [-c team=nlp] [--method direct] \\
    --require-approval=never
$ trainstack plan 8b-fp8
```

<!-- docs-test: skip: needs a Docker engine here -->

```sh
docker build .
```

<!-- docs-test: skip "git push": pushes to a remote -->
```bash
git add x
git commit -m x && git push
```

```
$ trainstack validate
ok      recipes/1b.yaml
```

```
trainstack plan 30b-fp8      # a bare listing of commands
.venv/bin/trainstack recipes
```

```
30b-fp8 (team platform) on the local emulator
state Completed
```

```yaml
tags: {team: x}
```

<!-- docs-test: skip: only for the next block -->
some text between
```bash
trainstack show 8b-fp8
```
"""


def test_commands_markers_and_optional_parts(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(DOC)
    found = [(c.line, c.text, c.skip) for c in all_commands(tmp_path)]
    assert found == [
        (5, "make demo    # trailing comments stay (bash ignores them)", None),
        (6, "npx cdk deploy --all -c recipe=30b-fp8 --require-approval=never", None),
        (8, "trainstack plan 8b-fp8", None),
        (14, "docker build .", "needs a Docker engine here"),
        (19, "git add x", None),
        (20, "git commit -m x && git push", "pushes to a remote"),
        (24, "trainstack validate", None),
        (29, "trainstack plan 30b-fp8      # a bare listing of commands", None),
        (30, ".venv/bin/trainstack recipes", None),
        (45, "trainstack show 8b-fp8", None),  # text between marker and block: the marker lapsed
    ]


def test_output_and_data_blocks_give_no_commands(tmp_path: Path):
    path = tmp_path / "x.md"
    path.write_text(DOC)
    output = [b for b in blocks(path, tmp_path) if b.lines and b.lines[0][1].startswith(("30b", "tags"))]
    assert len(output) == 2 and all(commands_of(b) == [] for b in output)
