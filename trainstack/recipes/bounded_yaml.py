"""YAML for recipes and team files, read within bounds: size, nesting, alias expansion, one document.

A recipe is a few kilobytes of nested mappings (the largest in recipes/ is 2.2 KB, 3 levels deep, about
150 values). YAML itself is unbounded: an anchor may contain its own alias (a cycle that recursive code
walks until RecursionError), nine aliases of nine aliases expand to 9^n values from a few hundred bytes
(an "alias bomb": safe_load builds it as shared references in microseconds, and whatever walks it next,
the layering or pydantic, expands it into gigabytes), a 50 MB file takes minutes to parse, deep nesting
overflows the recursive composer. Every bound below is checked on the event stream before anything is
built, so each refusal is one line, well under a second, whatever the input.

Numbers follow YAML 1.2 as well as 1.1: `1e20` and `3e-4` are floats (YAML 1.1 needs a dot, `1.0e+20`,
and reads them as text), so an exponent written the usual way is the number it looks like, and a
number written as text (`"20000"`) can be refused as text by the schema.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from trainstack.errors import RecipeError

# 30x the largest recipe or team file in recipes/ (2.2 KB): room for long comments, never megabytes.
# libyaml parses this in milliseconds; the pure-Python parser (used where libyaml is missing) in about
# 0.3 s on the 2-core sandbox.
MAX_BYTES = 64 * 1024
# Recipes nest 3 levels (section, field, tags.extra's values); 16 leaves room for any section to come.
MAX_DEPTH = 16
# Values after alias expansion (mappings, sequences, scalars, keys included): 60x a whole recipe.
MAX_NODES = 10_000

# libyaml's parser where the wheel has it (the 2-core sandbox and the Deep Learning Containers do); the
# bounds hold with either: the event stream is walked and cut off at the first bound either way.
_BASE_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# YAML 1.2 floats without a dot (1e20, 3e-4, -2E+5); YAML 1.1's own float forms keep their resolver.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class RecipeYamlLoader(_BASE_LOADER):  # type: ignore[misc, valid-type]
    """safe_load (no arbitrary objects), but a key given twice in one mapping is an error: YAML would
    keep the last silently (a second `training:` block would drop the first one's values)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


RecipeYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


class OutOfBounds(Exception):
    """A bound broken, with where (the event's mark) and why."""

    def __init__(self, mark: Any, message: str):
        super().__init__(message)
        self.mark, self.message = mark, message


def _where(mark: Any) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def check_events(text: str, what: str = "a recipe file") -> None:
    """Walk the YAML event stream of `text` and raise OutOfBounds at the first bound it breaks: more than one
    document, nesting deeper than MAX_DEPTH, an alias inside its own anchor, more than MAX_NODES values
    once aliases are expanded. Stops at the first such event, so a hostile input costs only its prefix."""
    documents = 0
    open_collections: list[list[Any]] = []  # per open mapping/sequence: [anchor or None, expanded count]
    anchor_sizes: dict[str, int] = {}  # closed anchors: how many values their alias expands to
    open_anchors: set[str] = set()
    total = 0
    for event in yaml.parse(text, Loader=_BASE_LOADER):
        size = 0
        if isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise OutOfBounds(
                    event.start_mark, f"holds more than one YAML document (`---`); {what} is one mapping"
                )
        elif isinstance(event, yaml.CollectionStartEvent):
            if len(open_collections) >= MAX_DEPTH:
                raise OutOfBounds(
                    event.start_mark, f"nested deeper than {MAX_DEPTH} levels; {what} nests 3 or 4"
                )
            open_collections.append([event.anchor, 1])
            if event.anchor:
                open_anchors.add(event.anchor)
            continue
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_collections.pop()
            if anchor:
                anchor_sizes[anchor] = size
                open_anchors.discard(anchor)
        elif isinstance(event, yaml.ScalarEvent):
            size = 1
            if event.anchor:
                anchor_sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                raise OutOfBounds(
                    event.start_mark,
                    f"the alias *{event.anchor} is inside its own anchor &{event.anchor} (a value that "
                    "contains itself)",
                )
            size = anchor_sizes.get(event.anchor, 1)  # an undefined alias: the composer names it
        else:
            continue
        if open_collections:
            open_collections[-1][1] += size
            grown = open_collections[-1][1]
        else:
            total += size
            grown = total
        if grown > MAX_NODES:
            raise OutOfBounds(
                event.start_mark,
                f"expands to more than {MAX_NODES:,} values once its aliases are expanded (an alias bomb?); "
                f"{what} holds a few hundred",
            )


def _malformed(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"malformed YAML{_where(mark)}: {problem}"


def loads(text: str, source: str, what: str = "a recipe file") -> Any:
    """The YAML value of `text`, or a one-line RecipeError naming `source`, within every bound above."""
    if len(text) > MAX_BYTES:  # characters; read_file bounds the bytes before decoding
        raise RecipeError(source, None, f"is larger than {MAX_BYTES // 1024} KiB; {what} is a few KB")
    try:
        check_events(text, what)
        return yaml.load(text, Loader=RecipeYamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except OutOfBounds as refused:
        raise RecipeError(source, None, f"refused{_where(refused.mark)}: {refused.message}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(source, None, _malformed(exc)) from None
    except RecursionError:  # not reachable within MAX_DEPTH; kept so no input can print a traceback
        raise RecipeError(source, None, f"nested too deeply (more than {MAX_DEPTH} levels)") from None


def load_value(text: str, source: str, field: str) -> Any:
    """A `--set` value: YAML within the same bounds (one line naming the override and field when it breaks
    one), or the text as typed where it is not YAML at all (the schema then says what was expected)."""
    if len(text) > MAX_BYTES:
        raise RecipeError(source, field, f"a value larger than {MAX_BYTES // 1024} KiB")
    try:
        check_events(text, "a --set value")
        return yaml.load(text, Loader=RecipeYamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except OutOfBounds as refused:
        raise RecipeError(source, field, f"refused: {refused.message}") from None
    except yaml.YAMLError:
        return text


def read_text(path: Path, source: str, what: str = "a recipe file") -> str:
    """The text of the regular file at `path`, at most MAX_BYTES, or a one-line RecipeError.

    Only a regular file is opened: a FIFO would block the open, /dev/zero would never end; a symlink loop,
    a directory or a missing file is named as such."""
    try:
        info = os.stat(path)  # follows symlinks: what the path names in the end
    except FileNotFoundError:
        broken = os.path.islink(path)
        raise RecipeError(source, None, "a broken symlink" if broken else "file not found") from None
    except OSError as exc:  # ELOOP: a symlink to itself, or a cycle of them
        raise RecipeError(source, None, f"cannot read: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
        )
        raise RecipeError(source, None, f"{kind}; {what} is a YAML file")
    if info.st_size > MAX_BYTES:
        raise RecipeError(
            source, None, f"{info.st_size:,} bytes: larger than {MAX_BYTES // 1024} KiB; {what} is a few KB"
        )
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)  # the file may have grown since stat
    except OSError as exc:
        raise RecipeError(source, None, f"cannot read: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise RecipeError(source, None, f"larger than {MAX_BYTES // 1024} KiB; {what} is a few KB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(source, None, f"not UTF-8 text (byte {exc.start}): is this a YAML file?") from None


def load_file(path: Path, source: str, what: str = "a recipe file") -> Any:
    """read_text, then loads: the YAML value of a recipe or team file, within bounds."""
    return loads(read_text(path, source, what), source, what)
