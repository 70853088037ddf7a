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

# Every number in a recipe is finite, a number (not text, not a boolean) and within what AWS, the
# hardware or a sane factor on published runs allows (trainstack.recipes.numbers; each bound says why).
# Sections import these types from here; a new field names its own bound with Max.
from trainstack.recipes.numbers import (  # noqa: F401 (re-exported for every section)
    FLOAT_CEILING,
    INT_CEILING,
    Fraction,
    Max,
    Min,
    NonNegFloat,
    NonNegInt,
    Percent,
    PosFloat,
    PosInt,
)

# Published runs the bounds are a factor on (the bound's own text gives the factor):
LLAMA3_405B = "Llama 3.1 405B (arXiv:2407.21783, table 3)"
# SageMaker's StoppingCondition.MaxRuntimeInSeconds ceiling (28 days), and PutMetricAlarm's longest
# evaluation range for periods under an hour ("Period multiplied by EvaluationPeriods" at most 86,400 s).
MAX_RUNTIME_HOURS = 28 * 24
ALARM_MINUTES = Max(24 * 60, "PutMetricAlarm evaluates periods under an hour over at most one day")
MAX_NODES = 256  # 2,048 GPUs: 32x this project's largest recipe (64b-fp8, 8 nodes)
NODES = Max(MAX_NODES, "2,048 GPUs, 32x the largest recipe's 8 nodes (CreateTrainingJob sets no maximum)")
STEPS = Max(10_000_000, f"10x the ~1M optimizer steps of {LLAMA3_405B}")
# The token budget of one run: about 3x the 36T tokens of Qwen3's pretraining (arXiv:2505.09388).
MAX_RUN_TOKENS = 100e12
GLOBAL_BATCH = Max(65_536, "4x DeepSeek-V3's 15,360 sequences per step (arXiv:2412.19437)")
RUN_USD = Max(1e9, "5x the costliest published training run (Gemini Ultra, about 191M USD, AI Index 2024)")
ShardsGB = Annotated[PosFloat, Max(10_000_000, "10 PB of token shards: 2,500T tokens at 4 bytes each")]
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


class RopeScaling(Section):
    """Llama 3.1's RoPE frequency scaling (`rope_scaling: {rope_type: llama3, ...}` in a Hugging Face
    config.json): wavelengths below original_max_position_embeddings / high_freq_factor keep their
    frequency, those above original_max_position_embeddings / low_freq_factor are divided by `factor`,
    and the band between is interpolated smoothly. The one scaling the trainer implements; others
    (linear, dynamic, yarn, longrope) are refused in one line."""

    rope_type: str
    # Llama 3.1: factor 8, low 1, high 4, original 8,192; the bounds are generous factors on those.
    factor: Annotated[PosFloat, Max(1024, "128x Llama 3.1's 8")]
    low_freq_factor: Annotated[PosFloat, Max(1024, "1,024x Llama 3.1's 1")]
    high_freq_factor: Annotated[PosFloat, Max(1024, "256x Llama 3.1's 4")]
    original_max_position_embeddings: Annotated[PosInt, Max(1 << 24, "16M tokens, 2,048x Llama 3.1's 8,192")]

    @model_validator(mode="after")
    def _implemented(self) -> RopeScaling:
        if self.rope_type != "llama3":
            raise ValueError(
                f"rope_type: {self.rope_type!r} is not implemented by the trainer (supported: llama3); "
                "a base model with another RoPE scaling cannot be trained here"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor: {self.high_freq_factor} must be above low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self


# Where a Hugging Face base model folder lives: an S3 prefix or a local directory (local runs; a path
# without spaces or colons).
InitFrom = Annotated[
    str, Field(min_length=1, pattern=r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|[^:\s]+)$")
]


class ModelShape(Section):
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; optionally Q/K/V biases
    (Qwen2), a head width other than hidden / heads, and Llama 3.1's RoPE scaling."""

    layers: Annotated[PosInt, Max(256, f"2x the 126 layers of {LLAMA3_405B}")]
    hidden: Annotated[PosInt, Max(32_768, f"2x the 16,384 of {LLAMA3_405B}")]
    heads: Annotated[PosInt, Max(256, f"2x the 128 of {LLAMA3_405B}")]
    kv_heads: Annotated[PosInt, Max(256, "as many as heads may be")]
    ffn: Annotated[PosInt, Max(131_072, f"about 2.5x the 53,248 of {LLAMA3_405B}")]
    vocab: Annotated[PosInt, Max(1_048_576, "4x Gemma 3's 262,144 entries, the largest published vocabulary")]
    tied_embeddings: bool = False
    # Llama 3 500,000, Qwen2.5 1,000,000; at or below 1 the RoPE wavelengths stop growing with dimension.
    rope_theta: Annotated[
        PosFloat, Min(1.0, "RoPE needs a base above 1", exclusive=True), Max(1e9, "1,000x Qwen2.5's")
    ] = 500000.0
    # Per-head width; default hidden / heads (filled in when not given, so it is always a number).
    head_dim: Annotated[PosInt, Max(1024, "4x the widest published head (256: Gemma)")] = Field(  # type: ignore[assignment]
        default=None, validate_default=False
    )
    # RMSNorm epsilon (Llama 3: 1e-5; Llama 2 and many others: 1e-6)
    norm_eps: Annotated[PosFloat, Max(0.01, "1,000x Llama 3's 1e-5: past it the norm stops normalising")] = (
        1e-5
    )
    attention_bias: bool = False  # Q/K/V projections with a bias (Qwen2/2.5); the output projection has none
    rope_scaling: RopeScaling | None = None
    # A Hugging Face folder (config.json + safetensors) the run starts from instead of random weights:
    # checked against this shape, loaded sharded at step 0 (docs/models.md). Ignored once the run has
    # its own checkpoint.
    init_from: InitFrom | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        # Messages start with the field they blame (relative to this section); the loader adds the section.
        if not isinstance(data, dict) or data.get("head_dim") is not None:
            return data
        hidden, heads = data.get("hidden"), data.get("heads")
        if isinstance(hidden, int) and isinstance(heads, int) and 0 < heads <= hidden and not hidden % heads:
            return {**data, "head_dim": hidden // heads}
        return data  # left unset: the fields' own checks speak first, then `_divisible`

    @model_validator(mode="after")
    def _divisible(self) -> ModelShape:
        if self.head_dim is None:
            raise ValueError(
                f"hidden: {self.hidden} must be divisible by heads ({self.heads}), or set head_dim explicitly"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"kv_heads: heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: {self.head_dim} must be even (RoPE rotates pairs)")
        return self

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (and the attention output): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_bias_params(self) -> int:
        return self.q_dim + 2 * self.kv_dim if self.attention_bias else 0

    @property
    def params_per_layer(self) -> int:
        attention = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        mlp = 3 * self.hidden * self.ffn
        norms = 2 * self.hidden
        return attention + self.qkv_bias_params + mlp + norms

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
    # pretrain: every token of the data's windows is a target (docs/trainer.md). sft: supervised
    # fine-tuning on a chat dataset (`trainstack data prepare --format chat`): packed conversations that
    # never see each other, the loss the mean over the global batch's target (assistant) tokens
    # (docs/sft.md); needs model.init_from and data.train_s3_uri, cp 1 (Recipe._objective).
    objective: Literal["pretrain", "sft"] = "pretrain"
    seq_len: Annotated[PosInt, Max(1_048_576, "8x this project's 128K recipe")]
    # sequences per optimizer step, across all data-parallel ranks
    global_batch: Annotated[PosInt, GLOBAL_BATCH]
    # sequences per GPU per forward/backward: never more than global_batch (the layout check); the
    # planner's search tries every divisor of the per-rank batch, so the bound is global_batch's
    micro_batch: Annotated[PosInt, GLOBAL_BATCH]
    # The run's length in optimizer steps, for sft too: the schedule, checkpoints, the supervisor and the
    # registry count steps, and a recipe is validated and planned without reading its data. Under sft a
    # step takes global_batch packed rows and the rows repeat in a new order each epoch, so E epochs of
    # a set packed into S rows is ceil(E x S / global_batch) steps (S: the trainer logs it at start;
    # `data prepare --format chat` reports it at the prepared seq_len; docs/sft.md).
    steps: Annotated[PosInt, STEPS]
    # AdamW moves each weight by about lr per step; published LLM peaks are 1e-4 to 1e-2.
    lr: Annotated[PosFloat, Max(1.0, "100x the highest published LLM peak (1e-2)")] = 3.0e-4
    min_lr_ratio: Annotated[NonNegFloat, Max(1.0, "a fraction of lr")] = 0.1
    warmup_steps: Annotated[NonNegInt, STEPS] = 2000
    # AdamW multiplies every weight by 1 - lr x weight_decay per step: above 1 (with lr up to 1) it would
    # flip their signs. Published runs use 0 to 0.1.
    weight_decay: Annotated[NonNegFloat, Max(1.0, "10x the published 0.1; lr x it stays below 1")] = 0.1
    grad_clip: Annotated[PosFloat, Max(100.0, "100x the published 1.0")] = 1.0
    seed: Annotated[NonNegInt, Max(2**32 - 1, "a 32-bit seed, what every RNG the trainer seeds takes")] = 1234
    # Cross-entropy over chunks of this many tokens, so full FP32 logits never exist at once. At a 128K
    # vocabulary one chunk peaks at 12 bytes x tokens x vocab: 2.9 GiB here, 11.7 GiB at 8192, and the
    # matmul per chunk (2048 x hidden x vocab) is still large enough to run at full speed.
    loss_chunk_tokens: Annotated[PosInt, Max(1_048_576, "the longest seq_len")] = 2048
    log_every: Annotated[PosInt, Max(100_000, "a metric line at least every 100,000 steps")] = 10
    # torch.compile each block; None: on where the trainer runs on CUDA, off on CPU.
    compile: bool | None = None

    @model_validator(mode="after")
    def _token_budget(self) -> Training:
        tokens = self.steps * self.global_batch * self.seq_len
        if tokens > MAX_RUN_TOKENS:
            raise ValueError(
                f"steps: steps x global_batch x seq_len = {tokens:.3g} tokens is above {MAX_RUN_TOKENS:.0e}, "
                "the most one run may train on (about 3x the 36T tokens of Qwen3's pretraining, "
                "arXiv:2505.09388)"
            )
        return self


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
    # selective, policy block: checkpoint one block in every `every`
    every: Annotated[PosInt, Max(256, "the most layers a model may have")] = 2
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
    # FSDP shard group in GPUs of data parallelism; replicated across groups (HSDP) if smaller than
    # world / cp. Under context parallelism FSDP shards over shard_group x cp ranks (the CP ranks of a
    # sequence hold the same weights; training_image/trainer/distributed/context_parallel.py).
    shard_group: Annotated[PosInt, Max(8 * MAX_NODES, "every GPU of the largest run")]
    # Tensor parallelism: in the schema so a recipe can say 1 explicitly, refused above 1 because the
    # trainer does not implement it (a job would fail at start, after nodes are paid for).
    tp: Annotated[PosInt, Max(8, "a node's 8 GPUs")] = 1
    # Context parallelism: each sequence split over cp GPUs in 2 x cp load-balanced chunks.
    cp: Annotated[PosInt, Max(8 * MAX_NODES, "every GPU of the largest run")] = 1

    @model_validator(mode="after")
    def _implemented(self) -> Parallelism:
        if self.tp > 1:
            raise ValueError(
                f"tp: {self.tp}: the trainer does not implement tensor parallelism yet; use 1 (shard "
                "over more GPUs with shard_group, split long sequences with cp, or checkpoint more "
                "activations)"
            )
        return self


class Compute(Section):
    instance_type: str
    instance_count: Annotated[PosInt, NODES] = 1
    volume_size_gb: Annotated[PosInt, Max(16_384, "EBS's largest volume, 16 TiB")] = 500
    # One job's limit (SageMaker's MaxRuntimeInSeconds, at most 28 days). None: the planned run time plus
    # a margin, capped at 28 days (trainstack.planner.run_plan). A run longer than this takes several jobs.
    # At least an hour: a job spends about 0.25 h starting (planner.run_plan.JOB_STARTUP_HOURS).
    max_runtime_hours: (
        Annotated[
            PosFloat,
            Min(1.0, "a job spends about a quarter of an hour starting"),
            Max(MAX_RUNTIME_HOURS, "SageMaker's MaxRuntimeInSeconds ceiling, 28 days"),
        ]
        | None
    ) = None
    # How many jobs one run may take (max-runtime stops, spot interruptions, capacity and
    # infrastructure failures each end a job; the run's next job resumes from its checkpoint).
    max_jobs: Annotated[PosInt, Max(99, "99 counted jobs: a run restarting that often is not training")] = 20
    # Price per instance-hour when the catalogue's on-demand estimate is not what the team pays (a
    # negotiated rate or a training plan); None: trainstack.recipes.hardware's figure.
    usd_per_instance_hour: (
        Annotated[
            PosFloat,
            Min(1.0, "below any rate for an 8-GPU instance (the catalogue's cheapest: 55 USD/h)"),
            Max(1000.0, "about 9x the catalogue's highest (114 USD/h)"),
        ]
        | None
    ) = None
    spot: bool = False
    max_wait_hours: (
        Annotated[
            PosFloat,
            Min(1.0, "at least max_runtime_hours, itself at least an hour"),
            Max(MAX_RUNTIME_HOURS, "SageMaker's MaxWaitTimeInSeconds ceiling, 28 days"),
        ]
        | None
    ) = None  # spot only
    training_plan_arn: str | None = None
    # warm pool between short tuning runs
    keep_alive_seconds: Annotated[NonNegInt, Max(3600, "SageMaker's KeepAlivePeriodInSeconds ceiling")] = 0
    max_retry_attempts: Annotated[PosInt, Max(30, "SageMaker's RetryStrategy ceiling")] = 3
    # How long a run may wait for instances in all, over every capacity failure since it was launched or
    # resumed (the supervisor retries with a back-off, docs/runs.md); then it fails for a person.
    capacity_wait_hours: Annotated[PosFloat, Max(MAX_RUNTIME_HOURS, "28 days, one job's longest runtime")] = (
        72.0
    )

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


# A tokenizer's identity as `trainstack data prepare` prints it and the dataset's manifest records it:
# sha256 of the tokenizer.json bytes, or the built-in byte-level tokenizer (docs/data.md).
TokenizerIdentity = Annotated[str, Field(pattern=r"^(bytes|sha256:[0-9a-f]{64})$")]


# --- Data: one prepared dataset, or a blend of several (training_image/trainer/data/blend.py) ----------
# Each source of a blend reaches the job as an input channel of its own, and adds one metric definition
# (its val_loss_<name>). CreateTrainingJob takes at most 20 channels and 40 metric definitions
# (botocore's SageMaker model: InputDataConfig max 20, MetricDefinitions max 40); the metric line has 16
# of its own and the saved step one more (trainstack.protocol.metrics): 16 sources make 33 of the 40.
MAX_SOURCES = 16
SOURCE_NAME_MAX = 16
SOURCE_NAME = rf"^[a-z][a-z0-9_]{{0,{SOURCE_NAME_MAX - 1}}}$"
TRAIN_CHANNEL = "train"  # data.train_s3_uri's channel: /opt/ml/input/data/train in the job
SOURCE_CHANNEL_PREFIX = "train_"  # a blend source's channel: train_<name>
VALIDATION_DIR = "validation"  # a prepared dataset's validation split: <dataset>/validation/, same format


def source_name_from_uri(uri: str) -> str:
    """A source's default name: the last path segment of its URI, as lowercase letters, digits and `_`
    (s3://corpus/tokenized/web-2024/ -> web_2024), starting with a letter, at most 16 characters."""
    last = uri.removeprefix("s3://").rstrip("/").rsplit("/", 1)[-1]
    name = re.sub(r"[^a-z0-9]+", "_", last.lower()).strip("_")
    if not name or not name[0].isalpha():
        name = f"s_{name}"
    return name[:SOURCE_NAME_MAX].rstrip("_")


class DataSource(Section):
    """One prepared dataset of a blend: its token shards under `uri`, its validation split under
    `uri`/validation/, and its share of the training samples."""

    uri: S3Uri
    # relative to the other sources' weights (they need not sum to 1)
    weight: Annotated[PosFloat, Max(1e6, "a million to one: a share below any sample a run draws")]
    # Names the source's metric (val_loss_<name>) and input channel (train_<name>); default: from the uri.
    name: Annotated[str, Field(pattern=SOURCE_NAME)] | None = None
    # Size of the shards under uri in GB (the dataset's manifest says), for the launcher's input mode.
    size_gb: (
        Annotated[PosFloat, Max(10_000_000, "10 PB of token shards: 2,500T tokens at 4 bytes each")] | None
    ) = None

    @property
    def resolved_name(self) -> str:
        return self.name or source_name_from_uri(self.uri)

    @property
    def channel(self) -> str:
        return SOURCE_CHANNEL_PREFIX + self.resolved_name


class Data(Section):
    train_s3_uri: S3Uri | None = None  # prefix holding token shards (see docs/data.md); None = synthetic
    # size of the shards under train_s3_uri in GB, for the input mode
    size_gb: (
        Annotated[PosFloat, Max(10_000_000, "10 PB of token shards: 2,500T tokens at 4 bytes each")] | None
    ) = None
    # A blend of prepared datasets, mixed by weight (instead of train_s3_uri; see docs/data.md).
    sources: tuple[DataSource, ...] = ()
    # How shards reach the nodes: auto chooses from their size (trainstack.planner.input_mode).
    input_mode: Literal["auto", "File", "FastFile"] = "auto"
    # The tokenizer the model is trained for: the trainer refuses shards whose manifest names another.
    tokenizer: TokenizerIdentity | None = None
    # Raw corpus prefixes `trainstack data prepare` may read on AWS (the data stack's processing role gets
    # read access to exactly these, and write access to train_s3_uri).
    corpus_s3_uris: tuple[S3Uri, ...] = ()

    @model_validator(mode="after")
    def _one_kind(self) -> Data:
        if self.sources and self.train_s3_uri:
            raise ValueError("sources: set train_s3_uri (one dataset) or sources (a blend), not both")
        if self.size_gb is not None and not self.train_s3_uri:
            raise ValueError("size_gb: applies to train_s3_uri only (a blend gives each source its own)")
        if len(self.sources) > MAX_SOURCES:
            raise ValueError(
                f"sources: {len(self.sources)} sources, at most {MAX_SOURCES} (one input channel and one "
                "metric definition each; CreateTrainingJob takes 20 channels and 40 metric definitions)"
            )
        seen: dict[str, int] = {}
        for index, source in enumerate(self.sources):
            name = source.resolved_name
            if name in seen:
                raise ValueError(
                    f"sources: source {index} is named {name!r} like source {seen[name]} (a name comes from "
                    "the uri when not set); give each source a name of its own"
                )
            seen[name] = index
        return self

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.resolved_name for s in self.sources)

    @property
    def uris(self) -> tuple[str, ...]:
        """Every S3 prefix the job reads data from."""
        return tuple(s.uri for s in self.sources) or ((self.train_s3_uri,) if self.train_s3_uri else ())


class Validation(Section):
    """Evaluate the model every `every_steps` steps on the same `batches` global batches of each
    dataset's validation split (training_image/trainer/validation.py)."""

    every_steps: Annotated[PosInt, STEPS]
    # global batches (training.global_batch sequences each) per validation split
    batches: Annotated[PosInt, Max(1_000, "1,000 global batches: a held-out set of 1B+ tokens at 8K")]
    # Alarm when the validation loss rose this many evaluations in a row (docs/monitoring.md); one
    # evaluation is one alarm period of at least a minute, and PutMetricAlarm looks back at most a day.
    alarm_rises: Annotated[PosInt, ALARM_MINUTES] = 3
    # Evaluate once more before the first step, so the first point of val_loss is the starting model's
    # (step 0): what continued pretraining from a base model is measured against. None: on with
    # `model.init_from` (a base model's loss is worth knowing), off otherwise (a random model's is not,
    # and it costs one evaluation). Only a run's first job starts at step 0; a resume never re-evaluates.
    at_start: bool | None = None


class Checkpointing(Section):
    # How often to save: every `interval_minutes` of training, or every `interval_steps` steps (one of
    # the two). Neither: the Young/Daly optimum for the run's save time and node count (planner.run_plan).
    # Its least is the plan's: one save must fit in it (planner.run_plan.IntervalError says by how much).
    interval_minutes: (
        Annotated[PosFloat, Max(MAX_RUNTIME_HOURS * 60.0, "one job's longest run, 28 days")] | None
    ) = None
    interval_steps: Annotated[PosInt, STEPS] | None = None
    keep: Annotated[PosInt, Max(1000, "6x the 154 checkpoints Pythia kept per model (arXiv:2304.01373)")] = 3
    # Mean time between failures of one node, hours, for the default interval (docs/planner.md);
    # None: the planner's published figure (6,335 h, Llama 3).
    node_mtbf_hours: (
        Annotated[
            PosFloat,
            Min(24.0, "a node failing daily; a multi-node run would restart more than it trains"),
            Max(1e6, "160x the Llama 3 figure (6,335 h)"),
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _one_interval(self) -> Checkpointing:
        if self.interval_minutes is not None and self.interval_steps is not None:
            raise ValueError("interval_steps: set interval_minutes or interval_steps, not both")
        return self


class Monitoring(Section):
    notification_email: Annotated[str, Field(pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$")] | None = None
    gpu_idle_util_pct: Percent = 30.0
    gpu_idle_minutes: Annotated[PosInt, ALARM_MINUTES] = 15
    gpu_mem_high_pct: Percent = 97.0
    slow_fraction: Fraction = 0.7  # alarm when tokens/s falls below this fraction of the plan
    slow_minutes: Annotated[PosInt, ALARM_MINUTES] = 20
    stall_minutes: Annotated[PosInt, ALARM_MINUTES] = 20
    # A job with no step for stall_minutes is stopped by the supervisor (the trainer saves) and the run
    # continues with its next job on fresh instances; false: only the Stalled alarm tells a person.
    stop_stalled: bool = True
    disk_high_pct: Percent = 85.0
    # One rank's step compute time this fraction above the median for straggler_minutes: a bad GPU or link.
    straggler_skew: Annotated[PosFloat, Max(10.0, "one rank 11x slower than the median")] = 0.25
    straggler_minutes: Annotated[PosInt, ALARM_MINUTES] = 10


class Export(Section):
    """Turning the run's checkpoint into a Hugging Face folder (docs/models.md)."""

    # Export the final checkpoint when the run completes (the launcher's export state machine), to
    # s3://<bucket>/exports/<team>/<recipe>/<run>/step-N/.
    on_complete: bool = False
    # Tokenizer files to ship with the model: an S3 prefix or a local directory. None: the base
    # model's (model.init_from), when it has them.
    tokenizer: InitFrom | None = None
    dtype: Literal["bf16", "fp32"] = "bf16"  # the exported weights' dtype


# Where runs are tracked (docs/tracking.md). An MLflow resource ARN as CreateTrainingJob's MlflowConfig
# takes it (SageMaker API reference, MlflowConfig.MlflowResourceArn: `arn:aws[a-z\-]*:sagemaker:...:
# mlflow-[a-zA-Z-]*/.*`), narrowed to the two kinds that exist, an MLflow App or a tracking server.
MLFLOW_ARN = (
    r"^arn:aws[a-z\-]*:sagemaker:[a-z0-9\-]+:[0-9]{12}:mlflow-(app|tracking-server)/[A-Za-z0-9\-_.]+$"
)
MLFLOW_CHOICES = "off, managed (the team's SageMaker MLflow App), or an MLflow App / tracking server ARN"
# MLflow experiment names as SageMaker's MLflow configurations accept them (API reference, AIMlflowConfig).
MLFLOW_EXPERIMENT = r"^[a-zA-Z0-9\-_./]{1,256}$"


class Tracking(Section):
    """Experiment tracking: MLflow (one MLflow run per trainstack run) and TensorBoard event files."""

    # off | managed | arn:aws:sagemaker:<region>:<account>:mlflow-app/<id> (or mlflow-tracking-server/<name>)
    mlflow: Annotated[str, Field(json_schema_extra={"pattern": f"^(off|managed)$|{MLFLOW_ARN}"})] = "off"
    # Write TensorBoard event files to /opt/ml/output/tensorboard (synced to S3 by TensorBoardOutputConfig).
    tensorboard: bool = False
    # The MLflow experiment runs are grouped in; None: `<team>/<recipe>`.
    experiment: Annotated[str, Field(pattern=MLFLOW_EXPERIMENT)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _yaml_off(cls, data: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: `tracking: {mlflow: off}` means "off", not a type error.
        if isinstance(data, dict) and data.get("mlflow") is False:
            return {**data, "mlflow": "off"}
        return data

    @model_validator(mode="after")
    def _known_mlflow(self) -> Tracking:
        if self.mlflow not in ("off", "managed") and not re.fullmatch(MLFLOW_ARN, self.mlflow):
            raise ValueError(f"mlflow: {self.mlflow!r} is not {MLFLOW_CHOICES}")
        return self

    @property
    def managed(self) -> bool:
        return self.mlflow == "managed"

    @property
    def mlflow_arn(self) -> str | None:
        """The ARN the recipe names (None for off and for managed, whose ARN the team's stack knows)."""
        return None if self.mlflow in ("off", "managed") else self.mlflow


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

    max_instance_count: Annotated[PosInt, NODES] | None = None  # refuse recipes asking for more nodes
    # refuse recipes whose planned run costs more than this
    max_run_usd: Annotated[PosFloat, RUN_USD] | None = None
    approval_usd: Annotated[NonNegFloat, RUN_USD] = 5000.0  # planned runs above this need a human approval


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
    validation: Validation | None = None
    checkpointing: Checkpointing = Checkpointing()
    monitoring: Monitoring = Monitoring()
    export: Export = Export()
    tracking: Tracking = Tracking()
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
        if tr.seq_len % (2 * par.cp):
            raise ValueError(
                f"parallelism.cp: training.seq_len {tr.seq_len} is not divisible by 2 x cp = {2 * par.cp} "
                "(context parallelism splits each sequence into 2 x cp equal chunks)"
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
        self._objective()
        if self.activation_checkpointing.policy == "op" and self.precision.dtype == "fp8":
            # Refused here, not at job start: the trainer runs FP8 only in Transformer Engine's fused
            # modules, and the op policy needs every op visible to PyTorch's dispatcher
            # (training_image/trainer/models/activation_checkpointing.py).
            raise ValueError(
                "activation_checkpointing.policy: op cannot run with precision.dtype fp8 (a per-op policy "
                "cannot see inside Transformer Engine's fused FP8 modules); use mode full, or mode "
                "selective with policy block, or precision.dtype bf16"
            )
        return self

    def _objective(self) -> None:
        """What training.objective sft needs of the other sections (one line naming the field)."""
        if self.training.objective != "sft":
            return
        if self.model.init_from is None:
            raise ValueError(
                "model.init_from: required with training.objective sft (fine-tuning starts from a base "
                "model's weights: a Hugging Face folder, an S3 prefix or a local directory)"
            )
        if self.parallelism.cp > 1:
            # The CP split cuts each row into 2 x cp chunks regardless of where its examples end, and the
            # CP attention has no block-diagonal mask: examples would see each other.
            raise ValueError(
                f"parallelism.cp: {self.parallelism.cp}: context parallelism is not supported with "
                "training.objective sft yet (its split does not respect example boundaries); use cp 1"
            )
        if self.data.sources:
            raise ValueError(
                "data.sources: a blend is not supported with training.objective sft; prepare the "
                "conversations as one chat dataset and set data.train_s3_uri"
            )
        if self.data.train_s3_uri is None:
            raise ValueError(
                "data.train_s3_uri: required with training.objective sft (a chat dataset from "
                "`trainstack data prepare --format chat`; there is no synthetic chat data)"
            )

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

    @property
    def validates_at_start(self) -> bool:
        """Whether the first job evaluates before step 1 (validation.at_start; None: with init_from)."""
        if self.validation is None:
            return False
        at_start = self.validation.at_start
        return self.model.init_from is not None if at_start is None else at_start


# --- Hyperparameters: the one encoding between the launcher and the trainer ---------------------
# SageMaker hyperparameters are a flat string->string map (values up to 2500 characters). The resolved
# recipe travels as dotted keys with JSON values, so the console shows each knob on its own line and
# the trainer rebuilds exactly the recipe that was planned.

HYPERPARAMETER_KEY = re.compile(r"[a-z_]+(\.[a-z0-9_]+)*\Z")  # fullmatch: no trailing newline


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
        if key.startswith("sagemaker_") or not HYPERPARAMETER_KEY.fullmatch(key):
            continue
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            if not isinstance(node.get(part), dict):  # a section unset at launch ("null"), set by an override
                node[part] = {}
            node = node[part]
        value = json.loads(raw)
        if value is None and isinstance(node.get(leaf), dict):
            continue  # the section's own keys outrank the null it was encoded as before an override set them
        node[leaf] = value
    return Recipe.model_validate(tree)
