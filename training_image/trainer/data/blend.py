"""A blend: several prepared datasets mixed by weight, as one TokenSource (`data.sources` in the recipe).

Which source sample index p draws from, and which sample of that source, is a pure function of p and
the blend's schedule; nothing else is kept, so the data position (trainer.data.loader: samples consumed) stays
one integer, exact across restarts and world sizes, exactly as with one dataset.

The mix is a stride schedule, low-discrepancy by construction. Normalise the weights to shares w_j and
split the stream of sample indices source by source: source 0 takes ceil(n * r_0) of the first n
indices, r_0 = w_0 (index q is source 0's when ceil((q + 1) r_0) > ceil(q r_0), and is then that
source's sample ceil(q r_0)); the indices it leaves form the stream for source 1 with r_1 = w_1 / (w_1 +
... + w_k-1), and so on; the last source takes what is left. So after any n samples source j has drawn
n * w_j samples give or take j + 1 (tests/trainer/test_blend.py pins the bound): a 70/30 blend is
7 of every 10 consecutive samples, not 70% on average over an epoch. The arithmetic is on exact
fractions of the recipe's float weights, so every rank and every job computes the same schedule.

A source smaller than its share wraps, as one dataset does (trainer.data.loader: index mod windows, the next
epoch of that source); a larger one is never exhausted.

Changing the weights mid-run (`trainstack resume RUN --set data.sources.0.weight=...`, safe by
trainstack.recipes.changes) changes the schedule from the resumed position on: the schedule is a list
of segments (first position, weights), saved in every checkpoint's trainer state. Positions before a
segment keep the earlier weights, so a resume at an older checkpoint replays exactly what was trained,
and each source continues with its next unread sample (its count at the segment's start carries over).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from trainer.data.loader import TokenSource
from trainstack.errors import TrainstackError
from trainstack.protocol.container import opt_ml
from trainstack.recipes.schema import Recipe

log = logging.getLogger("trainer.blend")  # its log lines' name before the package move
SAGEMAKER_INPUT = opt_ml("input/data")  # one folder per input channel (SageMaker's container contract)

Ratio = tuple[int, int]  # an exact fraction: (numerator, denominator)


@dataclass(frozen=True)
class Segment:
    start: int  # the first data position (sample index) this mix applies to
    weights: tuple[float, ...]  # one per source, as the recipe gives them (not normalised)


def split_ratios(weights: Sequence[float]) -> tuple[Ratio, ...]:
    """Source j's share of the indices sources j, j+1, ... share: w_j / (w_j + ... + w_last), exact; one
    ratio per source but the last (which takes whatever is left)."""
    exact = [Fraction(w) for w in weights]
    remaining = sum(exact, Fraction(0))
    ratios = []
    for w in exact[:-1]:
        r = w / remaining
        ratios.append((r.numerator, r.denominator))
        remaining -= w
    return tuple(ratios)


def _ceil_times(n: int, ratio: Ratio) -> int:
    numerator, denominator = ratio
    return -((-n * numerator) // denominator)


def pick(q: int, ratios: Sequence[Ratio]) -> tuple[int, int]:
    """(source, sample of that source) of index q of a segment's stream."""
    for source, ratio in enumerate(ratios):
        before = _ceil_times(q, ratio)  # the indices below q this source took
        if _ceil_times(q + 1, ratio) > before:
            return source, before
        q -= before  # q's index among what this source leaves
    return len(ratios), q


def counts(n: int, ratios: Sequence[Ratio]) -> tuple[int, ...]:
    """How many of a segment's first n indices each source takes (consistent with `pick`)."""
    out = []
    for ratio in ratios:
        taken = _ceil_times(n, ratio)
        out.append(taken)
        n -= taken
    out.append(n)
    return tuple(out)


class Schedule:
    """Segments of fixed weights: data position -> (source, sample index in that source)."""

    def __init__(self, segments: Sequence[Segment]):
        if not segments or segments[0].start != 0:
            raise ValueError("a blend schedule starts at data position 0")
        widths = {len(s.weights) for s in segments}
        if len(widths) != 1 or any(w <= 0 for s in segments for w in s.weights):
            raise ValueError(f"blend schedule segments need the same number of positive weights: {segments}")
        if any(b.start <= a.start for a, b in zip(segments, segments[1:], strict=False)):
            raise ValueError(f"blend schedule segments must start at increasing positions: {segments}")
        self.segments = tuple(segments)
        self.sources = widths.pop()
        self._starts = [s.start for s in self.segments]
        self._ratios = [split_ratios(s.weights) for s in self.segments]
        # Each source's samples drawn before each segment: where that source continues.
        self._bases: list[tuple[int, ...]] = [(0,) * self.sources]
        for i in range(1, len(self.segments)):
            taken = counts(self._starts[i] - self._starts[i - 1], self._ratios[i - 1])
            self._bases.append(tuple(b + t for b, t in zip(self._bases[-1], taken, strict=True)))

    def locate(self, position: int) -> tuple[int, int]:
        segment = bisect.bisect_right(self._starts, position) - 1
        source, index = pick(position - self._starts[segment], self._ratios[segment])
        return source, self._bases[segment][source] + index

    def drawn(self, position: int) -> tuple[int, ...]:
        """Samples each source has given to data positions below `position`."""
        segment = max(bisect.bisect_right(self._starts, position) - 1, 0)
        here = counts(position - self._starts[segment], self._ratios[segment])
        return tuple(b + c for b, c in zip(self._bases[segment], here, strict=True))

    def resumed(self, position: int, weights: Sequence[float]) -> Schedule:
        """This schedule up to `position`, then `weights` from there on (unchanged if they are the same)."""
        kept = [s for s in self.segments if s.start < position]
        weights = tuple(float(w) for w in weights)
        if not kept or kept[-1].weights != weights:
            kept.append(Segment(position, weights))
        return Schedule(kept)

    def to_json(self) -> str:
        return json.dumps([[s.start, list(s.weights)] for s in self.segments], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls(
            [Segment(int(start), tuple(float(w) for w in weights)) for start, weights in json.loads(text)]
        )


class Blend:
    """A TokenSource over named TokenSources: sample(p) is source j's sample i, (j, i) = schedule(p).

    `name` is the data identity the checkpoint keeps: the sources' own names in order, without the
    weights (those may change mid-run; the schedule in the checkpoint records how they did)."""

    def __init__(self, sources: Sequence[tuple[str, TokenSource]], schedule: Schedule):
        if schedule.sources != len(sources):
            raise ValueError(f"{len(sources)} sources but the schedule mixes {schedule.sources}")
        self.labels = tuple(label for label, _ in sources)
        self.sources = tuple(source for _, source in sources)
        self.schedule = schedule
        self.name = "blend(" + ", ".join(f"{label}={s.name}" for label, s in sources) + ")"

    def sample(self, index: int) -> np.ndarray:
        source, within = self.schedule.locate(index)
        return self.sources[source].sample(within)

    def resumed(self, saved_schedule: str, position: int, weights: Sequence[float]) -> Blend:
        """The blend a resumed job reads: the checkpoint's schedule, then `weights` from `position` on."""
        saved = (
            Schedule.from_json(saved_schedule) if saved_schedule else Schedule([Segment(0, tuple(weights))])
        )
        if saved.sources != len(self.sources):
            raise TrainstackError(
                f"data.sources: the checkpoint's blend mixes {saved.sources} sources, the recipe has "
                f"{len(self.sources)}; use a new checkpoint location for a new blend"
            )
        schedule = saved.resumed(position, weights)
        if schedule.segments[-1].weights != saved.segments[-1].weights:
            log.info(
                "data.sources weights %s -> %s from data position %d (samples drawn so far: %s)",
                list(saved.segments[-1].weights),
                list(weights),
                position,
                dict(zip(self.labels, schedule.drawn(position), strict=True)),
            )
        return Blend(list(zip(self.labels, self.sources, strict=True)), schedule)


def source_directory(channel: str, data_dir: Path | None) -> Path:
    """Where a source's channel is mounted: `data_dir`/<channel> when given (local runs: one folder per
    channel, as SageMaker lays them out), else $SM_CHANNEL_<CHANNEL>, else /opt/ml/input/data/<channel>."""
    if data_dir is not None:
        return Path(data_dir) / channel
    env = os.environ.get(f"SM_CHANNEL_{channel.upper()}")
    return Path(env) if env else SAGEMAKER_INPUT / channel


def source_directories(recipe: Recipe, data_dir: Path | None) -> list[tuple[str, Path]]:
    """(source name, mounted directory) for every source of the recipe's blend, each checked to exist."""
    found = []
    for index, source in enumerate(recipe.data.sources):
        directory = source_directory(source.channel, data_dir)
        if not directory.is_dir():
            raise TrainstackError(
                f"data.sources.{index}.uri: {source.uri} is not mounted at {directory} (the job's "
                f"{source.channel} channel; locally, --data-dir DIR with one folder per channel, or "
                "--synthetic)"
            )
        found.append((source.resolved_name, directory))
    return found


def open_blend(
    recipe: Recipe, data_dir: Path | None, open_source: Callable[[Path, str | None], TokenSource]
) -> Blend:
    """The recipe's blend from its mounted sources, with the recipe's weights from position 0 (a resumed
    job replaces the schedule with its checkpoint's: `Blend.resumed`). `open_source(directory, uri)`
    opens one source; its S3 URI goes into the source's data identity."""
    uris = {source.resolved_name: source.uri for source in recipe.data.sources}
    sources = [
        (name, open_source(directory, uris[name])) for name, directory in source_directories(recipe, data_dir)
    ]
    weights = tuple(s.weight for s in recipe.data.sources)
    return Blend(sources, Schedule([Segment(0, weights)]))


def schedule_of(source: TokenSource) -> str:
    """What the checkpoint keeps of a source beyond its name: a blend's schedule ("" for one dataset)."""
    return source.schedule.to_json() if isinstance(source, Blend) else ""


def resumed_source(source: TokenSource, recipe: Recipe, saved_schedule: str, position: int) -> TokenSource:
    """The source a resumed job reads from `position` on: a blend continues its checkpoint's schedule
    with the recipe's (possibly changed) weights; one dataset is unchanged."""
    if not isinstance(source, Blend):
        return source
    return source.resumed(saved_schedule, position, tuple(s.weight for s in recipe.data.sources))
