"""The recipe: one YAML file per model size and precision, validated by pydantic.

A recipe is everything a training run needs to be planned, deployed and trained. Every section is a
frozen model that rejects unknown keys, so a typo is an error and not a silently ignored setting.
Loading and layering (base, `extends`, team files, `--set`) lives in `trainstack.recipes.loader`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from trainstack.recipes.hardware import INSTANCES, Instance, get_instance, volume_size_problem

PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
Percent = Annotated[float, Field(gt=0, le=100)]
S3Uri = Annotated[str, Field(pattern=r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$")]

# Team and recipe names are joined by hyphens into stack and job names (`Trainstack-<team>-<recipe>`,
# `ts-<team>-<recipe>--<hash>-<suffix>`, see trainstack.recipes.naming). A team name has no hyphen, so
# the first hyphen after the project marks where the recipe begins; a recipe name never has two hyphens
# in a row nor one at its end, so the `--` after it marks where it ends. The lengths keep job names within
# SageMaker's 63 characters.
TEAM_NAME_MAX = 16
TEAM_NAME = rf"^[a-z][a-z0-9]{{0,{TEAM_NAME_MAX - 1}}}$"
TEAM_NAME_RULE = f"1-{TEAM_NAME_MAX} lowercase letters and digits, starting with a letter, no hyphens"
RECIPE_NAME_MAX = 22
RECIPE_NAME = rf"^(?=.{{1,{RECIPE_NAME_MAX}}}$)[a-z0-9]+(-[a-z0-9]+)*$"
RECIPE_NAME_RULE = (
    f"at most {RECIPE_NAME_MAX} characters: words of lowercase letters and digits joined by single hyphens "
    "(no leading, trailing or double hyphen)"
)


def team_name_problem(name: str) -> str | None:
    """Why `name` cannot be a team name (one line, stating the rule), or None if it can."""
    if re.fullmatch(TEAM_NAME, name):
        return None
    return f"invalid team name {name!r}: a team name is {TEAM_NAME_RULE}"


def recipe_name_problem(name: str) -> str | None:
    """Why `name` cannot be a recipe name (one line, stating the rule), or None if it can."""
    if re.fullmatch(RECIPE_NAME, name):
        return None
    return f"invalid recipe name {name!r}: a recipe name is {RECIPE_NAME_RULE}"


def _checked(problem):  # a pydantic validator whose error states the rule, not the raw regex
    def check(value: str) -> str:
        if (message := problem(value)) is not None:
            raise ValueError(message)
        return value

    return AfterValidator(check)


# The pattern stays in the JSON Schema (editors check names as people type); the validator gives the error.
TeamName = Annotated[str, _checked(team_name_problem), Field(json_schema_extra={"pattern": TEAM_NAME})]
RecipeName = Annotated[str, _checked(recipe_name_problem), Field(json_schema_extra={"pattern": RECIPE_NAME})]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelShape(Section):
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

    layers: PosInt
    hidden: PosInt
    heads: PosInt
    kv_heads: PosInt
    ffn: PosInt
    vocab: PosInt
    tied_embeddings: bool = False
    rope_theta: PosFloat = 500000.0

    @model_validator(mode="after")
    def _divisible(self) -> ModelShape:
        # Messages start with the field they blame (relative to this section); the loader adds the section.
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads: heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        kv_dim = self.kv_heads * self.head_dim
        attention = self.hidden * (self.hidden + 2 * kv_dim) + self.hidden * self.hidden
        mlp = 3 * self.hidden * self.ffn
        norms = 2 * self.hidden
        return attention + mlp + norms

    @property
    def embedding_params(self) -> int:
        """Token embedding plus output head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params + self.hidden

    @property
    def non_embedding_params(self) -> int:
        return self.layers * self.params_per_layer + self.hidden


class Training(Section):
    seq_len: PosInt
    micro_batch: PosInt  # sequences per GPU per forward/backward
    global_batch: PosInt  # sequences per optimizer step, across all data-parallel ranks
    steps: PosInt
    lr: PosFloat = 3.0e-4
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    warmup_steps: NonNegInt = 2000
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    grad_clip: PosFloat = 1.0
    seed: NonNegInt = 1234
    # Cross-entropy over chunks of this many tokens, so full FP32 logits never exist at once. At a 128K
    # vocabulary one chunk peaks at 12 bytes x tokens x vocab: 2.9 GiB here, 11.7 GiB at 8192, and the
    # matmul per chunk (2048 x hidden x vocab) is still large enough to run at full speed.
    loss_chunk_tokens: PosInt = 2048
    log_every: PosInt = 10
    # torch.compile each block; None: on where the trainer runs on CUDA, off on CPU.
    compile: bool | None = None


class Precision(Section):
    dtype: Literal["bf16", "fp8"]
    # Transformer Engine scaling recipe; only meaningful with dtype fp8.
    fp8_recipe: Literal["mxfp8", "current", "delayed", "block"] | None = None

    @model_validator(mode="after")
    def _recipe_matches_dtype(self) -> Precision:
        if self.dtype == "fp8" and self.fp8_recipe is None:
            raise ValueError("fp8_recipe: required when dtype is fp8 (mxfp8 | current | delayed | block)")
        if self.dtype == "bf16" and self.fp8_recipe is not None:
            raise ValueError("fp8_recipe: must be unset when dtype is bf16")
        return self


class ActivationCheckpointing(Section):
    mode: Literal["none", "selective", "full"]
    every: PosInt = 2  # selective, policy block: checkpoint one block in every `every`
    # selective only: `block` recomputes whole blocks (one in `every`); `op` is torchtitan's op-level
    # selective checkpointing in every block (matmul outputs saved, cheap ops recomputed).
    policy: Literal["block", "op"] = "block"

    @model_validator(mode="after")
    def _policy_needs_selective(self) -> ActivationCheckpointing:
        if self.policy == "op" and self.mode != "selective":
            raise ValueError(f"policy: op applies to mode selective only (mode is {self.mode})")
        return self

    def checkpointed_fraction(self) -> float:
        """Fraction of blocks whose activations are recomputed whole in backward (op policy: none)."""
        if self.mode == "selective" and self.policy == "op":
            return 0.0
        return {"none": 0.0, "full": 1.0}.get(self.mode, 1.0 / self.every)


class Parallelism(Section):
    shard_group: PosInt  # FSDP shard group in GPUs; replicated across groups (HSDP) if smaller than world
    # Tensor and context parallelism: in the schema so a recipe can say 1 explicitly, refused above 1
    # because the trainer does not implement them (a job would fail at start, after nodes are paid for).
    tp: PosInt = 1
    cp: PosInt = 1

    @model_validator(mode="after")
    def _implemented(self) -> Parallelism:
        for field, what in (("tp", "tensor"), ("cp", "context")):
            if getattr(self, field) > 1:
                raise ValueError(
                    f"{field}: {getattr(self, field)}: the trainer does not implement {what} parallelism "
                    "yet; use 1 (shard over more GPUs with shard_group, or checkpoint more activations)"
                )
        return self


class Compute(Section):
    instance_type: str
    instance_count: PosInt = 1
    volume_size_gb: Annotated[int, Field(ge=1, le=16384)] = 500
    # One job's limit (SageMaker's MaxRuntimeInSeconds, at most 28 days). None: the planned run time plus
    # a margin, capped at 28 days (trainstack.planner.run_plan). A run longer than this takes several jobs.
    max_runtime_hours: Annotated[float, Field(gt=0, le=28 * 24)] | None = None
    # How many jobs one run may take (max-runtime stops, spot interruptions, capacity and
    # infrastructure failures each end a job; the run's next job resumes from its checkpoint).
    max_jobs: Annotated[int, Field(ge=1, le=99)] = 20
    # Price per instance-hour when the catalogue's on-demand estimate is not what the team pays (a
    # negotiated rate or a training plan); None: trainstack.recipes.hardware's figure.
    usd_per_instance_hour: PosFloat | None = None
    spot: bool = False
    max_wait_hours: Annotated[float, Field(gt=0, le=28 * 24)] | None = None  # spot only
    training_plan_arn: str | None = None
    keep_alive_seconds: Annotated[int, Field(ge=0, le=3600)] = 0  # warm pool between short tuning runs
    max_retry_attempts: Annotated[int, Field(ge=1, le=30)] = 3
    # How long a run may wait for instances in all, over every capacity failure since it was launched or
    # resumed (the supervisor retries with a back-off, docs/runs.md); then it fails for a person.
    capacity_wait_hours: Annotated[float, Field(gt=0, le=28 * 24)] = 72.0

    @model_validator(mode="after")
    def _known_instance(self) -> Compute:
        if self.instance_type not in INSTANCES:
            raise ValueError(
                f"instance_type: {self.instance_type!r} is not offered; "
                f"supported: {', '.join(sorted(INSTANCES))}"
            )
        if self.max_wait_hours is not None and not self.spot:
            raise ValueError("max_wait_hours: only applies with spot: true")
        if (
            self.spot
            and self.max_wait_hours is not None
            and self.max_runtime_hours is not None
            and self.max_wait_hours < self.max_runtime_hours
        ):
            raise ValueError("max_wait_hours: must be >= max_runtime_hours (SageMaker requires it for spot)")
        problem = volume_size_problem(get_instance(self.instance_type), self.volume_size_gb)
        if problem is not None:
            raise ValueError(f"volume_size_gb: {problem}")
        return self


class Image(Section):
    uri: str | None = None  # a prebuilt image; otherwise built from training_image/
    framework_version: str = "2.9"  # AWS Deep Learning Container PyTorch version for the base image


class Data(Section):
    train_s3_uri: S3Uri | None = None  # prefix holding token shards (see docs/data.md); None = synthetic


class Checkpointing(Section):
    # How often to save: every `interval_minutes` of training, or every `interval_steps` steps (one of
    # the two). Neither: the Young/Daly optimum for the run's save time and node count (planner.run_plan).
    interval_minutes: PosFloat | None = None
    interval_steps: PosInt | None = None
    keep: PosInt = 3
    # Mean time between failures of one node, hours, for the default interval (docs/planner.md);
    # None: the planner's published figure.
    node_mtbf_hours: PosFloat | None = None

    @model_validator(mode="after")
    def _one_interval(self) -> Checkpointing:
        if self.interval_minutes is not None and self.interval_steps is not None:
            raise ValueError("interval_steps: set interval_minutes or interval_steps, not both")
        return self


class Monitoring(Section):
    notification_email: Annotated[str, Field(pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$")] | None = None
    gpu_idle_util_pct: Percent = 30.0
    gpu_idle_minutes: PosInt = 15
    gpu_mem_high_pct: Percent = 97.0
    slow_fraction: Fraction = 0.7  # alarm when tokens/s falls below this fraction of the plan
    slow_minutes: PosInt = 20
    stall_minutes: PosInt = 20
    # A job with no step for stall_minutes is stopped by the supervisor (the trainer saves) and the run
    # continues with its next job on fresh instances; false: only the Stalled alarm tells a person.
    stop_stalled: bool = True
    disk_high_pct: Percent = 85.0
    # One rank's step compute time this fraction above the median for straggler_minutes: a bad GPU or link.
    straggler_skew: PosFloat = 0.25
    straggler_minutes: PosInt = 10


# The tags trainstack itself puts on every resource and training job (trainstack.aws.request.tags); cost
# reports and IAM conditions read them, so `extra` may add tags but never replace one of these.
RESERVED_TAG_KEYS = ("project", "team", "recipe", "cost-center")


class Tags(Section):
    team: TeamName = "platform"
    cost_center: str = "ml-training"
    extra: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _own_tags_kept(self) -> Tags:
        if reserved := [key for key in self.extra if key in RESERVED_TAG_KEYS]:
            raise ValueError(
                f"extra: {reserved[0]!r} is one of trainstack's own tags ({', '.join(RESERVED_TAG_KEYS)}), "
                "which extra tags cannot replace; use another key (team and cost-center come from "
                "tags.team and tags.cost_center)"
            )
        return self


class Budget(Section):
    """A team's guard rails, usually set in recipes/teams/<team>/defaults.yaml (see planner.budget)."""

    max_instance_count: PosInt | None = None  # refuse recipes asking for more nodes than this
    max_run_usd: PosFloat | None = None  # refuse recipes whose planned run costs more than this
    approval_usd: Annotated[float, Field(ge=0)] = 5000.0  # planned runs above this need a human approval


class Deploy(Section):
    """Where a team's stacks go; None means the CLI's / pipeline's own account and region."""

    account: Annotated[str, Field(pattern=r"^[0-9]{12}$")] | None = None
    region: Annotated[str, Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-[0-9]$")] | None = None


class Recipe(Section):
    name: RecipeName
    extends: str | None = None
    description: str = ""
    model: ModelShape
    training: Training
    precision: Precision
    activation_checkpointing: ActivationCheckpointing
    parallelism: Parallelism
    compute: Compute
    image: Image = Image()
    data: Data = Data()
    checkpointing: Checkpointing = Checkpointing()
    monitoring: Monitoring = Monitoring()
    tags: Tags = Tags()
    budget: Budget = Budget()
    deploy: Deploy = Deploy()
    launch_on_deploy: bool = False

    @model_validator(mode="after")
    def _layout(self) -> Recipe:
        # Cross-section checks; each message starts with the field path so errors can name it.
        par, tr = self.parallelism, self.training
        world = self.world_size
        model_parallel = par.shard_group * par.tp * par.cp
        if model_parallel > world:
            raise ValueError(
                f"parallelism.shard_group: shard_group x tp x cp = {model_parallel} exceeds the "
                f"{world} GPUs available"
            )
        if world % model_parallel:
            raise ValueError(
                f"parallelism.shard_group: {world} GPUs are not divisible by shard_group x tp x cp = "
                f"{model_parallel}"
            )
        per_step = tr.micro_batch * self.data_parallel
        if tr.global_batch % per_step:
            raise ValueError(
                f"training.global_batch: {tr.global_batch} is not a multiple of micro_batch x data-parallel "
                f"ranks = {tr.micro_batch} x {self.data_parallel} = {per_step}"
            )
        if self.precision.fp8_recipe == "mxfp8" and not self.instance.gpu.supports_mxfp8:
            raise ValueError(
                f"precision.fp8_recipe: mxfp8 needs Blackwell; {self.compute.instance_type} has "
                f"{self.instance.gpu.name} (use current or delayed)"
            )
        if self.activation_checkpointing.policy == "op" and self.precision.dtype == "fp8":
            # Refused here, not at job start: the trainer runs FP8 only in Transformer Engine's fused
            # modules, and the op policy needs every op visible to PyTorch's dispatcher
            # (training_image/trainer/activation_checkpointing.py).
            raise ValueError(
                "activation_checkpointing.policy: op cannot run with precision.dtype fp8 (a per-op policy "
                "cannot see inside Transformer Engine's fused FP8 modules); use mode full, or mode "
                "selective with policy block, or precision.dtype bf16"
            )
        return self

    @property
    def instance(self) -> Instance:
        return get_instance(self.compute.instance_type)

    @property
    def world_size(self) -> int:
        return self.instance.gpus * self.compute.instance_count

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: everything that is not tensor or context parallel."""
        return self.world_size // (self.parallelism.tp * self.parallelism.cp)

    @property
    def grad_accum_steps(self) -> int:
        return self.training.global_batch // (self.training.micro_batch * self.data_parallel)

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch * self.training.seq_len


# --- Hyperparameters: the one encoding between the launcher and the trainer ---------------------
# SageMaker hyperparameters are a flat string->string map (values up to 2500 characters). The resolved
# recipe travels as dotted keys with JSON values, so the console shows each knob on its own line and
# the trainer rebuilds exactly the recipe that was planned.

HYPERPARAMETER_KEY = re.compile(r"^[a-z_]+(\.[a-z0-9_]+)*$")


def to_hyperparameters(recipe: Recipe) -> dict[str, str]:
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value and prefix != "tags.extra":
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        else:
            flat[prefix] = json.dumps(value, separators=(",", ":"))

    walk("", recipe.model_dump(mode="json", exclude={"extends"}))
    return flat


def from_hyperparameters(hyperparameters: dict[str, str]) -> Recipe:
    """Inverse of `to_hyperparameters`; ignores keys SageMaker adds itself (sagemaker_*)."""
    tree: dict[str, Any] = {}
    for key, raw in hyperparameters.items():
        if key.startswith("sagemaker_") or not HYPERPARAMETER_KEY.match(key):
            continue
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = json.loads(raw)
    return Recipe.model_validate(tree)
