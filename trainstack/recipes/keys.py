"""The recipe schema's dotted keys (`training.micro_batch`, ...), read from the pydantic models.

Used for "did you mean" on a misspelt key, for shell completion of `--set` keys, to keep `--set` values
of text fields as typed (`deploy.account=123456789012` stays text, not a YAML integer), and to say
pattern rules in words instead of printing the regular expression.
"""

from __future__ import annotations

import difflib
import types
import typing
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from trainstack.recipes.schema import Recipe

# Free-form maps: any key below them is a text value (`tags.extra.project=vision`).
FREE_FORM = frozenset({"tags.extra"})
# `--set` may not touch these: the name is the file's, `extends` is how files layer.
NOT_SETTABLE = frozenset({"name", "extends"})

# Every text field with a pattern, said in words (a test walks the schema and fails on one missing here).
# The team and recipe names have their own validators that state the rule (trainstack.recipes.schema).
PATTERN_WORDS = {
    "deploy.account": "an AWS account ID: 12 digits, e.g. 123456789012",
    "deploy.region": "an AWS region name, e.g. us-west-2 or eu-central-1",
    "data.train_s3_uri": (
        "an S3 URI: s3:// then a bucket name of 3-63 lowercase letters, digits, dots and hyphens "
        "(starting and ending with a letter or digit), then an optional /prefix, e.g. s3://my-bucket/tokens/"
    ),
    "monitoring.notification_email": "an e-mail address, e.g. ml-alerts@example.com",
    "model.init_from": (
        "a Hugging Face folder: an S3 URI (s3:// then a bucket name of 3-63 lowercase letters, digits, dots "
        "and hyphens, then an optional /prefix) or a local directory without spaces or colons, e.g. "
        "s3://my-models/Qwen2.5-32B/"
    ),
    "export.tokenizer": (
        "tokenizer files: an S3 URI (s3://bucket/prefix/) or a local directory without spaces or colons"
    ),
}


def alternatives(annotation: Any) -> list[Any]:
    """The alternatives of an annotation without None and Annotated wrappers."""
    if typing.get_origin(annotation) is typing.Annotated:
        return alternatives(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [
            alt for arg in typing.get_args(annotation) if arg is not type(None) for alt in alternatives(arg)
        ]
    return [annotation]


def _section(annotation: Any) -> type[BaseModel] | None:
    for alternative in alternatives(annotation):
        if isinstance(alternative, type) and issubclass(alternative, BaseModel):
            return alternative
    return None


@lru_cache(maxsize=1)
def leaf_fields() -> dict[str, Any]:
    """Dotted path -> annotation for every leaf field of a recipe, in schema order."""
    out: dict[str, Any] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            path = f"{prefix}{name}"
            section = _section(info.annotation)
            if section is not None:
                walk(section, f"{path}.")
            else:
                out[path] = info.annotation

    walk(Recipe, "")
    return out


def settable_keys() -> list[str]:
    """The keys `--set` accepts (free-form maps are shown with a trailing dot: `tags.extra.`)."""
    return [
        f"{key}." if key in FREE_FORM else key
        for key in leaf_fields()
        if key.split(".")[0] not in NOT_SETTABLE
    ]


def is_text(path: str) -> bool:
    """Whether the field at `path` holds text only (so a `--set` value is kept exactly as typed)."""
    if any(path.startswith(f"{free}.") for free in FREE_FORM):
        return True
    annotation = leaf_fields().get(path)
    return annotation is not None and alternatives(annotation) == [str]


def suggest(key: str) -> str | None:
    """The schema key a misspelt `key` most likely meant, or None."""
    keys = [k for k in leaf_fields() if k not in FREE_FORM]
    sections = sorted({k.split(".")[0] for k in keys})
    candidates = keys + [s for s in sections if s not in keys]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
    if close:
        return close[0]
    # A right leaf in the wrong (or no) section: `micro_batch` or `model.micro_batch`.
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if len(by_leaf) == 1:
        return by_leaf[0]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(key: str) -> str:
    """` (did you mean X?)`, or an empty string when nothing is close."""
    found = suggest(key)
    return f" (did you mean {found}?)" if found and found != key else ""
