"""What infrastructure code changes deploy: synthesize the base commit and the working tree with the same
CDK CLI and compare their CloudFormation templates, stack by stack (used by `trainstack diff`).

Both sides are synthesized with `cdk synth -c recipe=all` by this checkout's CDK CLI and Python
environment; the base side is `git archive` of the base commit in a temporary directory (the same
files a `git worktree` would check out, without touching the repository's worktree list), with its
`recipes/` replaced by the working tree's. Holding the recipes equal means a template difference is
the code's doing; what recipe edits change is diffed per target by trainstack.gitops.gitdiff, as before.

Normalised before comparing (and why):
- resource `Metadata` keys `aws:cdk:path` (the construct path, CDK's bookkeeping: a refactor that
  moves a construct but keeps its logical ID changes nothing in AWS) and `aws:asset:*` (where an asset
  was staged: a directory in cdk.out, or the source directory when staging is off, so it differs with
  the checkout's location, not its content);
- the `CDKMetadata` resource and its `CDKMetadataAvailable` condition: CDK's version-reporting
  analytics (construct types and library versions), not an AWS resource of ours.
Asset hashes are compared as they are: CDK fingerprints an asset's files and their paths relative to
the asset's root, never absolute paths, so the same commit synthesized in two directories gives
byte-identical templates (tests/gitops/test_diff_templates.py checks it). A changed training image
hash is reported as the image, with the files of its build context that changed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainstack.errors import TrainstackError

SYNTH_TIMEOUT_S = 1800
DEFAULT_REGION = "us-west-2"  # synthesis picks the base image per region; both sides get the same one
METADATA_DROPPED = ("aws:cdk:path",)
METADATA_PREFIX_DROPPED = "aws:asset:"
CDK_METADATA = "CDKMetadata"
CDK_METADATA_CONDITION = "CDKMetadataAvailable"
SECTIONS = ("Parameters", "Conditions", "Rules", "Mappings", "Outputs")


class SynthError(TrainstackError):
    """A side could not be synthesized; the diff then falls back to redeploying every target."""


@dataclass(frozen=True)
class Assembly:
    templates: dict[str, dict]  # stack name -> normalised template
    images: dict[str, frozenset[str]] = field(default_factory=dict)  # stack -> docker image asset hashes


def normalise(template: dict[str, Any]) -> dict[str, Any]:
    """The template without what differs by checkout location or CDK bookkeeping (see module doc)."""
    out = json.loads(json.dumps(template))
    resources = out.get("Resources", {})
    resources.pop(CDK_METADATA, None)
    for resource in resources.values():
        metadata = resource.get("Metadata")
        if isinstance(metadata, dict):
            for key in list(metadata):
                if key in METADATA_DROPPED or key.startswith(METADATA_PREFIX_DROPPED):
                    del metadata[key]
            if not metadata:
                del resource["Metadata"]
    conditions = out.get("Conditions", {})
    conditions.pop(CDK_METADATA_CONDITION, None)
    if "Conditions" in out and not conditions:
        del out["Conditions"]
    return out


def read_assembly(outdir: Path) -> Assembly:
    templates, images = {}, {}
    for path in sorted(outdir.glob("*.template.json")):
        stack = path.name.removesuffix(".template.json")
        templates[stack] = normalise(json.loads(path.read_text()))
        assets = outdir / f"{stack}.assets.json"
        if assets.is_file():
            images[stack] = frozenset(json.loads(assets.read_text()).get("dockerImages", {}))
    return Assembly(templates, images)


def changes(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, ...]:
    """What differs between two normalised templates: `LogicalId (Type) added|removed|modified` per
    resource, then `Outputs.X modified` and the like for the other sections."""
    found: list[str] = []
    b_res, a_res = before.get("Resources", {}), after.get("Resources", {})
    for logical in sorted(set(b_res) | set(a_res)):
        old, new = b_res.get(logical), a_res.get(logical)
        kind = (new or old or {}).get("Type", "?")
        if old is None:
            found.append(f"{logical} ({kind}) added")
        elif new is None:
            found.append(f"{logical} ({kind}) removed")
        elif old != new:
            found.append(f"{logical} ({kind}) modified")
    for section in SECTIONS:
        b_sec, a_sec = before.get(section, {}), after.get(section, {})
        for key in sorted(set(b_sec) | set(a_sec)):
            if b_sec.get(key) != a_sec.get(key):
                how = "added" if key not in b_sec else "removed" if key not in a_sec else "modified"
                found.append(f"{section}.{key} {how}")
    return tuple(found)


def synthesize(tree: Path, outdir: Path, cdk: Path, env: dict[str, str]) -> Assembly:
    """`cdk synth -c recipe=all` of the app in `tree`, with this checkout's CDK CLI and Python."""
    command = [
        str(cdk),
        "synth",
        "--app",
        f"{sys.executable} app.py",
        "-c",
        "recipe=all",
        "-c",
        "quiet=true",
        "--quiet",
        "--output",
        str(outdir),
    ]
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env={**env, "PYTHONPATH": str(tree)},  # the tree's own trainstack/ and stacks/, not ours
            capture_output=True,
            text=True,
            timeout=SYNTH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise SynthError(f"cdk synth did not finish in {SYNTH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [x for x in (done.stderr + done.stdout).splitlines() if x.startswith("error") or "Error" in x]
        detail = (lines or (done.stderr.strip().splitlines() or ["no output"]))[-1]
        raise SynthError(f"cdk synth failed (exit {done.returncode}): {detail.strip()}")
    return read_assembly(outdir)


def synth_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """One environment for both sides: real-AWS synthesis (never the emulator), a fixed region when none
    is set, no instance-metadata lookups, no telemetry, no warnings."""
    env = {k: v for k, v in (environ or os.environ).items() if not k.startswith("AWS_ENDPOINT_URL")}
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
    return {
        **env,
        "AWS_REGION": region,
        "CDK_DEFAULT_REGION": env.get("CDK_DEFAULT_REGION") or region,
        "AWS_EC2_METADATA_DISABLED": "true",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
    }


def cdk_cli(root: Path) -> Path:
    cli = root / "node_modules" / ".bin" / "cdk"
    if not cli.exists():
        raise SynthError(f"the CDK CLI is not installed in {root} (run `make setup`)")
    return cli


def export_commit(root: Path, commit: str, dest: Path) -> None:
    """The files of `commit` under `dest` (git archive: what a worktree checks out, nothing else)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=root, capture_output=True, check=False
    )
    if archive.returncode != 0:
        detail = archive.stderr.decode(errors="replace").strip()
        raise SynthError(f"git archive {commit[:12]} failed: {detail}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


def compare(
    root: Path,
    commit: str,
    progress: Callable[[str], None] = lambda line: None,
    environ: dict[str, str] | None = None,
    keep: Path | None = None,
) -> tuple[dict[str, tuple[str, ...]], dict[str, bool]]:
    """Synthesize `commit` (with the working tree's recipes) and the working tree; per stack, the template
    changes, and whether its training image changed. Raises SynthError when a side cannot be synthesized.
    `keep`: a directory to leave both cloud assemblies in (base.out, head.out), for inspection."""
    cdk = cdk_cli(root)
    env = synth_env(environ)
    with tempfile.TemporaryDirectory(prefix="trainstack-diff-synth-") as scratch:
        tmp = str(keep) if keep is not None else scratch
        base = Path(tmp) / "base"
        base.mkdir()
        export_commit(root, commit, base)
        shutil.rmtree(base / "recipes", ignore_errors=True)
        shutil.copytree(root / "recipes", base / "recipes")  # recipes held equal: see module doc
        progress(f"synthesizing {commit[:12]} (cdk synth -c recipe=all) ...")
        before = synthesize(base, Path(tmp) / "base.out", cdk, env)
        progress("synthesizing the working tree (cdk synth -c recipe=all) ...")
        after = synthesize(root, Path(tmp) / "head.out", cdk, env)
    changed: dict[str, tuple[str, ...]] = {}
    images: dict[str, bool] = {}
    for stack in sorted(set(before.templates) | set(after.templates)):
        old, new = before.templates.get(stack, {}), after.templates.get(stack, {})
        changed[stack] = changes(old, new)
        images[stack] = before.images.get(stack, frozenset()) != after.images.get(stack, frozenset())
    return changed, images
