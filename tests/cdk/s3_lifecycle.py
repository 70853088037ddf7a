"""A small evaluator of S3 lifecycle rules on a versioned bucket, as AWS documents them, to test what a
synthesized `LifecycleConfiguration` does to objects over time (the emulator applies no lifecycle).

Semantics, each from the Amazon S3 user guide and API reference:
- A rule applies to the keys under its `Prefix` (or `Filter.Prefix`) when `Status` is Enabled; other
  filters (tags, sizes) are refused here rather than guessed.
- Deleting an object in a versioned bucket adds a delete marker; the version it hid becomes noncurrent
  at that moment ("Using versioning in S3 buckets").
- `NoncurrentVersionExpiration`: "Specifies the number of days an object is noncurrent before Amazon S3
  can perform the associated action", counted from when it became noncurrent and "rounding the resulting
  time to the next day midnight UTC" (lifecycle configuration elements). With `NewerNoncurrentVersions`
  N: "If there are this many more recent noncurrent versions, Amazon S3 will take the associated action"
  (AWS::S3::Bucket NoncurrentVersionExpiration) - both conditions must hold.
- `ExpiredObjectDeleteMarker`: "remove a delete marker with no noncurrent versions" (PutBucketLifecycle-
  Configuration); S3 evaluates rules once a day, so it goes at the first evaluation after it is alone.
- `ExpirationInDays` (current versions): expires a current version that many days after creation,
  rounded to the next midnight UTC; in a versioned bucket that adds a delete marker (expiring objects).
- `AbortIncompleteMultipartUpload.DaysAfterInitiation`: an upload not completed that many days after it
  was initiated is aborted and its parts deleted; the same midnight rounding is assumed.
- Where several rules apply, "the shorter expiration policy is honored" (lifecycle conflicts): an
  object goes at the first time any applicable rule makes it eligible.

Time is in days from day 0, 00:00 UTC; rules are evaluated at every midnight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED = {
    "Id",
    "Status",
    "Prefix",
    "NoncurrentVersionExpiration",
    "ExpiredObjectDeleteMarker",
    "ExpirationInDays",
    "AbortIncompleteMultipartUpload",
}


def next_midnight(t: float) -> float:
    return float(math.floor(t) + 1) if t != math.floor(t) else float(t)


@dataclass
class Version:
    created: float
    delete_marker: bool = False
    noncurrent_since: float | None = None  # when a newer version (or a delete marker) replaced it


@dataclass
class Key:
    versions: list[Version] = field(default_factory=list)  # oldest first; the last one is current

    @property
    def current(self) -> Version | None:
        return self.versions[-1] if self.versions else None


@dataclass
class Bucket:
    """A versioned bucket under `rules` (a template's LifecycleConfiguration.Rules)."""

    rules: list[dict[str, Any]]
    keys: dict[str, Key] = field(default_factory=dict)
    uploads: dict[str, float] = field(default_factory=dict)  # incomplete multipart uploads: key -> initiated
    now: float = 0.0

    def __post_init__(self) -> None:
        for rule in self.rules:
            if unknown := set(rule) - SUPPORTED - ({"Filter"} if _filter_prefix(rule) is not None else set()):
                raise ValueError(f"rule {rule.get('Id')}: the evaluator does not model {sorted(unknown)}")

    # --- what clients do ---------------------------------------------------------------------------
    def put(self, key: str, at: float) -> None:
        self.advance(at)
        entry = self.keys.setdefault(key, Key())
        if entry.current is not None:
            entry.current.noncurrent_since = at
        entry.versions.append(Version(created=at))

    def delete(self, key: str, at: float) -> None:
        """DeleteObject without a version id: a delete marker becomes the current version."""
        self.advance(at)
        entry = self.keys.setdefault(key, Key())
        if entry.current is not None:
            entry.current.noncurrent_since = at
        entry.versions.append(Version(created=at, delete_marker=True))

    def start_upload(self, key: str, at: float) -> None:
        """CreateMultipartUpload never completed (a save killed mid-upload)."""
        self.advance(at)
        self.uploads[key] = at

    # --- what S3 shows ---------------------------------------------------------------------------
    def stored_versions(self, key: str, at: float) -> list[Version]:
        """Every version of `key` still stored (and billed) at `at`, delete markers included."""
        self.advance(at)
        return list(self.keys.get(key, Key()).versions)

    def data_versions(self, key: str, at: float) -> list[Version]:
        return [v for v in self.stored_versions(key, at) if not v.delete_marker]

    def upload_open(self, key: str, at: float) -> bool:
        self.advance(at)
        return key in self.uploads

    # --- the daily lifecycle run -------------------------------------------------------------------
    def advance(self, to: float) -> None:
        if to < self.now:
            raise ValueError("time runs forward")
        midnight = math.floor(self.now) + 1.0
        while midnight <= to:
            self._evaluate(midnight)
            midnight += 1.0
        self.now = to

    def _applicable(self, key: str) -> list[dict[str, Any]]:
        return [r for r in self.rules if r.get("Status") == "Enabled" and key.startswith(_rule_prefix(r))]

    def _evaluate(self, midnight: float) -> None:
        for key, entry in self.keys.items():
            rules = self._applicable(key)
            current = entry.current
            # delete markers that were alone before this run (S3 evaluates once a day)
            if (
                current is not None
                and current.delete_marker
                and len(entry.versions) == 1
                and any(r.get("ExpiredObjectDeleteMarker") for r in rules)
            ):
                entry.versions = []
                continue
            survivors: list[Version] = []
            noncurrent = [v for v in entry.versions if v.noncurrent_since is not None]
            for version in entry.versions:
                if version.noncurrent_since is not None and any(
                    _noncurrent_expires(version, noncurrent, rule, midnight) for rule in rules
                ):
                    continue
                survivors.append(version)
            entry.versions = survivors
            current = entry.current
            if current is not None and not current.delete_marker:
                days = [r["ExpirationInDays"] for r in rules if "ExpirationInDays" in r]
                if days and midnight >= next_midnight(current.created + min(days)):
                    current.noncurrent_since = midnight
                    entry.versions.append(Version(created=midnight, delete_marker=True))
        for key, initiated in list(self.uploads.items()):
            days = [
                r["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"]
                for r in self._applicable(key)
                if "AbortIncompleteMultipartUpload" in r
            ]
            if days and midnight >= next_midnight(initiated + min(days)):
                del self.uploads[key]


def _noncurrent_expires(version: Version, noncurrent: list[Version], rule: dict[str, Any], at: float) -> bool:
    action = rule.get("NoncurrentVersionExpiration")
    if action is None or version.noncurrent_since is None:
        return False
    if at < next_midnight(version.noncurrent_since + action["NoncurrentDays"]):
        return False
    newer = sum(1 for v in noncurrent if v.noncurrent_since is not None and v.created > version.created)
    return newer >= action.get("NewerNoncurrentVersions", 0)


def _filter_prefix(rule: dict[str, Any]) -> str | None:
    filt = rule.get("Filter")
    if filt is None:
        return None
    if set(filt) - {"Prefix"}:
        raise ValueError(f"rule {rule.get('Id')}: the evaluator models prefix filters only, not {filt}")
    return filt.get("Prefix", "")


def _rule_prefix(rule: dict[str, Any]) -> str:
    prefix = _filter_prefix(rule)
    return prefix if prefix is not None else rule.get("Prefix", "")
