"""A run in the bucket, as every process of it sees it: run.json's config, fingerprint, learners, model
layout.

Contract: every process of a run reads its config from run.json (open_run), so they cannot disagree;
creating a run (diloco.run.create) writes run.json once. The layout (parameter names, shapes, dtypes, and
which are averaged directly) is what the merger and audit work from, without the user's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.configs import Config, config_from_record
from diloco.run.controls import run_overrides
from diloco.run.pin import pin_state
from diloco.storage import NotFound, RunKeys, open_store
from diloco.storage.records import CHUNKED_NORMS_FROM_RULES, RecordError, RunRecord
from diloco.storage.store import Store
from diloco.storage.window import KEPT_FROM_RULES


class RunError(ValueError):
    """The run does not exist, or exists with another configuration."""


@dataclass
class RunContext:
    store: Store
    keys: RunKeys
    cfg: Config
    fingerprint: str
    learners: list[str]
    created_at: float = 0.0  # run.json's: tells a new run from an old one of the same id
    # run.json's model layout ([] for runs made before layouts)
    layout: list[dict] = field(default_factory=list)
    # run.json's fragment layout ([]: one fragment, the root chain)
    fragments: list[dict] = field(default_factory=list)
    # run.json's buffers the run merges ([]: none; per chain: see fragments)
    buffers: list[dict] = field(default_factory=list)
    # what the spec read (TrainSpec.data_source), where create_run built it; "" from run.json
    data_source: str = ""
    pin: str = ""  # run.json against version 0's pin (diloco.run.pin): "pinned by version 0", or why not
    # run.json's: the tokens of one of the spec's batches (None: an older run)
    tokens_per_step: int | None = None
    trust_rules: int = 1  # run.json's: the rules its merges judge by (trust/guard.py TRUST_RULES)

    @property
    def run_id(self) -> str:
        return self.keys.run_id

    @property
    def window_apart(self) -> bool:
        """The run's merges keep the outlier window and each decision's figures in the merger's guard/ object,
        not in the manifests learners read (trust rules 3: storage/window.py)."""
        return self.trust_rules >= KEPT_FROM_RULES

    @property
    def chunked_norms(self) -> bool:
        """The run's merges sum each tensor's squares a chunk at a time for a delta's norm (trust rules 4:
        training/fp64.sum_squares_chunked), not the whole tensor's at once: audit replays a run by its own."""
        return self.trust_rules >= CHUNKED_NORMS_FROM_RULES


def open_run(store: Store | str, run_id: str, *, check_pin: bool = True) -> RunContext:
    """The context of an existing run, its config read from run.json — RunError when run.json changed since
    creation (its checksum in version 0: diloco.run.pin), unless `check_pin` is False (audit, which reports
    it)."""
    if isinstance(store, str):
        store = open_store(store)
    keys = RunKeys(run_id)
    try:
        data = store.get(keys.run_json())
    except NotFound:
        raise RunError(f"no run {run_id!r} in {store.url} (missing {keys.run_json()})") from None
    ok, pin = pin_state(store, keys, data)
    if not ok and check_pin:
        raise RunError(f"run {run_id!r}: {pin}; no role runs on it (restore the original bytes; "
                       "`diloco audit` names the change)")
    try:
        record = RunRecord.from_bytes(data, key=keys.run_json())
    except RecordError as err:
        raise RunError(f"run {run_id!r}: {err}") from None
    cfg = config_from_record(record.config)
    overrides = run_overrides(store, keys)  # `diloco resume` raised the target / set a new time limit
    if overrides:
        cfg = cfg.with_overrides(overrides)
    return RunContext(store, keys, cfg, record.fingerprint, list(record.learners), record.created_at,
                      list(record.layout), list(record.fragments), list(record.buffers or []), pin=pin,
                      tokens_per_step=record.tokens_per_step, trust_rules=record.trust_rules or 1)


LEGACY_DIRECT = ("wte.weight", "wpe.weight")  # the built-in GPT's embeddings, for runs made before layouts


def direct_names(ctx: RunContext, params: dict) -> tuple[str, ...]:
    """The tensors the merge averages directly (embeddings; the paper's rule), from the run's layout."""
    if ctx.layout:
        return tuple(p["name"] for p in ctx.layout if p.get("direct"))
    return tuple(k for k in params if k in LEGACY_DIRECT)
