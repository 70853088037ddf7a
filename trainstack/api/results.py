"""What every API call returns: a frozen result whose `to_json()` is exactly what the matching command's
`--json` prints (tests/api/test_json_equality.py holds each command to it), and the progress callback
that long operations report through."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

# A long operation (a tuning run, a Processing job, a wait for a run) reports each step as one line of
# text, the line the command prints; None: report nothing.
OnProgress = Callable[[str], None] | None


def report(on_progress: OnProgress, line: str) -> None:
    """Hand one progress line to the caller's callback, if there is one."""
    if on_progress is not None:
        on_progress(line)


@dataclass(frozen=True)
class Result:
    """A typed, frozen result. Subclasses keep their fields and say in `to_document()` which JSON value
    the command's `--json` prints; `to_json()` renders it as the command does (indent 2 unless the
    command printed one line, JSON_INDENT None)."""

    JSON_INDENT: ClassVar[int | None] = 2

    def to_document(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no JSON form")

    def to_json(self) -> str:
        """The text `--json` prints (without its final newline)."""
        return json.dumps(self.to_document(), indent=self.JSON_INDENT)


@dataclass(frozen=True)
class DocumentResult(Result):
    """A result whose JSON form is a document the layer below already builds (a plan's `to_dict()`, a
    CreateTrainingJob request). `document` is never handed out itself: `to_document()` returns a copy,
    so a caller editing what it got cannot change the frozen result."""

    document: Any

    def to_document(self) -> Any:
        return copy.deepcopy(self.document)
