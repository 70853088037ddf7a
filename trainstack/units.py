"""How sizes are written for a reader, the same in every layer: the planner's plans, `trainstack data
prepare`'s plan and the preparation job's own progress lines (which the training image prints).
Standard library only, open to every layer like `errors`: the image's data-preparation workers import
it, and importing the planner for it cost each of them 0.2-0.3 CPU-s (the recipe schema, pydantic)."""

from __future__ import annotations


def data_size(count: float) -> str:
    """Bytes in decimal units, as S3 and the plans count them, in the largest unit that is at least 1
    ("4.12 GB", "3.70 MB", "812 B"), so a small corpus never reads as 0.00 GB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:,.2f} {unit}"
    return f"{count:,.0f} B"
