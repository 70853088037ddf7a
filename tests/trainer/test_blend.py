"""The blend's schedule (trainer.data.blend): a pure function of the data position, low-discrepancy, exact
across weight changes; and a blend over real token shards read through trainer.data.loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
from blend_helpers import write_dataset
from trainer.data.blend import Blend, Schedule, Segment, counts, open_blend, pick, split_ratios
from trainer.data.loader import open_source
from trainer_helpers import TINY

from trainstack.errors import TrainstackError
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

WEIGHTS = [(0.7, 0.3), (1.0, 1.0), (0.5, 0.3, 0.2), (3.0, 1.0, 1.0, 0.25), (0.1, 0.2, 0.7)]


def naive_schedule(weights, n):
    """An independent reference: smooth weighted round robin with exact fractions (each step, credit
    every source its share and pick the one furthest behind; ties to the lowest index). Any correct
    low-discrepancy blend keeps each source within a couple of samples of its share, as this one does."""
    from fractions import Fraction

    shares = [Fraction(w) / sum(Fraction(x) for x in weights) for w in weights]
    taken = [0] * len(weights)
    out = []
    for i in range(n):
        behind = [(i + 1) * s - t for s, t in zip(shares, taken, strict=True)]
        j = max(range(len(weights)), key=lambda k: (behind[k], -k))
        taken[j] += 1
        out.append(j)
    return out


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_every_source_is_read_in_order_and_counts_agree_with_picks(weights):
    ratios = split_ratios(weights)
    seen = [0] * len(weights)
    for q in range(3000):
        source, index = pick(q, ratios)
        assert index == seen[source], (q, source)  # each source's samples in order, none skipped or repeated
        seen[source] += 1
        assert counts(q + 1, ratios) == tuple(seen)


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_each_source_stays_within_its_index_plus_one_of_its_share_at_every_length(weights):
    ratios = split_ratios(weights)
    total = sum(weights)
    reference = naive_schedule(weights, 2000)
    for n in range(1, 2001):
        drawn = counts(n, ratios)
        for j, w in enumerate(weights):
            assert abs(drawn[j] - n * w / total) <= j + 1, (n, j, drawn)
            # an independent low-discrepancy schedule agrees to within the same bound
            assert abs(drawn[j] - reference[:n].count(j)) <= j + 2, (n, j)


def test_exact_fractions_hold_at_a_trillion_samples():
    ratios = split_ratios((0.1, 0.2, 0.7))
    n = 10**12
    drawn = counts(n, ratios)
    assert sum(drawn) == n
    # 0.1 and 0.2 as the recipe's floats (binary fractions), exactly: no float rounding at this scale
    from fractions import Fraction

    exact = Fraction(0.1) / (Fraction(0.1) + Fraction(0.2) + Fraction(0.7))
    assert drawn[0] == -((-n * exact.numerator) // exact.denominator)


def test_a_weight_change_keeps_the_past_and_continues_every_source_where_it_was():
    before = Schedule([Segment(0, (0.7, 0.3))])
    changed = before.resumed(1000, (0.2, 0.8))
    assert [changed.locate(p) for p in range(1000)] == [before.locate(p) for p in range(1000)]
    assert changed.drawn(1000) == before.drawn(1000) == (700, 300)
    seen = list(changed.drawn(1000))
    for p in range(1000, 3000):
        source, index = changed.locate(p)
        assert index == seen[source]  # no sample of either source skipped or read twice
        seen[source] += 1
    assert seen == [700 + 400, 300 + 1600]  # the new 20/80 mix from position 1000 on
    # Unchanged weights on resume: the same schedule; and the schedule survives the checkpoint as JSON.
    assert changed.resumed(2000, (0.2, 0.8)).segments == changed.segments
    again = Schedule.from_json(changed.to_json())
    assert again.segments == changed.segments
    assert json.loads(changed.to_json()) == [[0, [0.7, 0.3]], [1000, [0.2, 0.8]]]
    # Resuming from an older checkpoint (position 500) with the new weights: the change moves there.
    older = changed.resumed(500, (0.2, 0.8))
    assert [s.start for s in older.segments] == [0, 500]
    assert [older.locate(p) for p in range(500)] == [before.locate(p) for p in range(500)]


def test_a_blend_reads_each_source_by_the_schedule_and_names_them_without_weights(tmp_path):
    seq = 32
    web = open_source(write_dataset(tmp_path / "web", 0), seq, 256, 0)
    code = open_source(write_dataset(tmp_path / "code", 100), seq, 256, 0)
    mix = Blend([("web", web), ("code", code)], Schedule([Segment(0, (0.75, 0.25))]))
    taken = {0: 0, 1: 0}
    for p in range(40):
        window = mix.sample(p)
        source = 1 if window[0] >= 100 else 0
        assert source == mix.schedule.locate(p)[0]
        expected = (web, code)[source].sample(taken[source])
        assert np.array_equal(window, expected)
        taken[source] += 1
    assert taken == {0: 30, 1: 10}
    assert mix.name == f"blend(web={web.name}, code={code.name})"
    resumed = mix.resumed(mix.schedule.to_json(), 40, (0.5, 0.5))
    assert resumed.name == mix.name  # a weight change keeps the data identity the checkpoint compares
    with pytest.raises(TrainstackError, match="mixes 3 sources"):
        mix.resumed(Schedule([Segment(0, (1.0, 1.0, 1.0))]).to_json(), 40, (0.5, 0.5))


def test_open_blend_finds_each_source_in_its_channel_folder_or_names_the_missing_one(tmp_path):
    recipe = resolve(
        str(TINY),
        overrides=[
            'data.sources=[{"uri": "s3://corpus/web/", "weight": 3}, '
            '{"uri": "s3://corpus/code/", "weight": 1}]'
        ],
    ).recipe
    assert recipe.data.source_names == ("web", "code")
    write_dataset(tmp_path / "train_web", 0)

    def opener(d, uri=None):
        return open_source(d, 32, 256, 0)

    with pytest.raises(TrainstackError, match=r"data\.sources\.1\.uri: s3://corpus/code/ is not mounted"):
        open_blend(recipe, tmp_path, opener)
    write_dataset(tmp_path / "train_code", 100)
    mix = open_blend(recipe, tmp_path, opener)
    assert mix.labels == ("web", "code") and mix.schedule.segments == (Segment(0, (3.0, 1.0)),)
