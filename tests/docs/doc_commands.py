"""Extract every command README.md and docs/*.md show, so tests/docs/test_doc_commands.py can run them.

What counts as a command:
- every line of a fenced block labelled bash, sh, shell or console (a leading `$ ` is dropped, a line
  ending in `\\` continues on the next, comment-only lines are skipped);
- in a fenced block of any other label or none: the lines that start with `$ ` (the lines after them
  are the output shown, not checked); and, in a block without a label, every line when each of them
  starts with a program the project ships or uses (trainstack, .venv/bin/..., npx, make, python, ...),
  since such a block is a list of commands whatever its label says.

Optional parts written `[--flag value]` are dropped (the command runs in its shortest form).

A doc marks a command that cannot run here with an HTML comment just before its block, saying why:
    <!-- docs-test: skip: needs a Docker engine -->            every command of the next block
    <!-- docs-test: skip "git push": pushes to your remote --> the next block's commands containing it
A marker without a reason is an error (test_every_skip_marker_gives_a_reason).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LABELS = {"bash", "sh", "shell", "console"}
PROGRAMS = (
    "trainstack ",
    ".venv/bin/",
    "npx ",
    "make ",
    "python ",
    "python3 ",
    "torchrun ",
    "node ",
    "git ",
    "docker ",
    "cp ",
    "rm ",
)
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<label>[\w+-]*)\s*$")
MARKER = re.compile(r"<!--\s*docs-test:\s*skip(?:\s+\"(?P<only>[^\"]+)\")?\s*:?\s*(?P<reason>.*?)\s*-->")
OPTIONAL = re.compile(r"\s\[-[^\[\]]*\]")


@dataclass(frozen=True)
class Command:
    doc: str  # README.md, docs/cdk.md
    line: int  # where the command starts (1-based)
    text: str  # as it will run: continuation joined, optional parts dropped
    skip: str | None = None  # the reason a marker gives, when the command cannot run here

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence
    label: str
    lines: list[tuple[int, str]] = field(default_factory=list)
    markers: list[tuple[str | None, str]] = field(default_factory=list)  # (substring or None, reason)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    doc = str(path.relative_to(root))
    found: list[Block] = []
    pending: list[tuple[str | None, str]] = []
    current: Block | None = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(raw)
        if current is not None:
            if fence and not fence.group("label"):
                found.append(current)
                current = None
            else:
                current.lines.append((number, raw))
            continue
        if fence:
            current = Block(doc, number, fence.group("label").lower(), markers=pending)
            pending = []
        elif (marker := MARKER.search(raw)) is not None:
            pending.append((marker.group("only"), marker.group("reason")))
        elif raw.strip():
            pending = []  # a marker applies to the block right after it (blank lines aside)
    return found


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    start, parts = 0, []
    for number, raw in lines:
        text = raw.strip()
        if not parts:
            start = number
        if text.endswith("\\"):
            parts.append(text[:-1].rstrip())
            continue
        parts.append(text)
        out.append((start, " ".join(p for p in parts if p)))
        parts = []
    if parts:
        out.append((start, " ".join(parts)))
    return out


def commands_of(block: Block) -> list[Command]:
    if block.label in SHELL_LABELS:
        candidates = [(n, t.removeprefix("$ ")) for n, t in _joined(block.lines)]
    else:
        dollar = [(n, t[2:]) for n, t in _joined(block.lines) if t.startswith("$ ")]
        bare = [(n, t) for n, t in _joined(block.lines) if t]
        listing = not block.label and bare and all(t.startswith(PROGRAMS) for _, t in bare)
        candidates = dollar or (bare if listing else [])
    out = []
    for number, text in candidates:
        if not text or text.startswith("#"):
            continue
        text = OPTIONAL.sub("", text).strip()
        reason = next((why for only, why in block.markers if only is None or only in text), None)
        out.append(Command(block.doc, number, text, reason))
    return out


def all_commands(root: Path = ROOT) -> list[Command]:
    return [c for path in documents(root) for b in blocks(path, root) for c in commands_of(b)]


def all_markers(root: Path = ROOT) -> list[tuple[str, int, str | None, str]]:
    return [
        (b.doc, b.line, only, why)
        for p in documents(root)
        for b in blocks(p, root)
        for only, why in b.markers
    ]
