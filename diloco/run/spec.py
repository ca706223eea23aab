"""A run's TrainSpec: loaded from run.json's reference, its model built and checked against the run's layout.

Contract: `load_run_spec(ctx)` builds the spec named by `spec`/`spec_args` in the run's config (the factory
gets the run's Config and the run's spec files when it asks); `build_model(spec, seed)` builds the model
under the run's seed and checks it is a module with floating-point parameters; `check_layout` refuses a model
whose layout differs from the run's, naming the first difference. `probe(spec, model)` runs the spec's
functions once (a batch, its loss, the held-out batches) so a bad spec fails before a run is created.
Spec files (a trained tokenizer, ...) live under <run>/spec/: the first writer of a name wins, and everyone
reads what was stored, so every process of the run uses the same bytes.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from diloco.configs import Config
from diloco.run.context import RunContext, RunError
from diloco.specs.loader import build_spec
from diloco.storage import Conflict, NotFound, RunKeys
from diloco.storage.store import Store
from diloco.training.buffers import buffer_difference, buffer_layout
from diloco.training.spec import (
    SpecError,
    TrainSpec,
    check_loss,
    check_model,
    first_difference,
    model_layout,
    slice_batch,
)


class SpecFiles:
    """The run's spec files in the bucket (<run>/spec/<name>): get, and put-if-absent returning what is
    stored."""

    def __init__(self, store: Store, keys: RunKeys) -> None:
        self.store, self.keys = store, keys

    def get(self, name: str) -> bytes | None:
        try:
            return self.store.get(self.keys.spec_file(name))
        except NotFound:
            return None

    def put(self, name: str, data: bytes) -> bytes:
        """Store `data` under `name` unless another process stored it first; the stored bytes either way
        (read first: a learner, which may not write <run>/spec/ under its bucket policy, only reads)."""
        stored = SpecFiles.get(self, name)  # the bucket's copy (a StagedFiles flushing must not see its own)
        if stored is not None:
            return stored
        try:
            self.store.put_if_absent(self.keys.spec_file(name), data)
        except Conflict:
            return self.store.get(self.keys.spec_file(name))
        return data


class StagedFiles(SpecFiles):
    """Spec files of a run being created: kept in memory until the run's inputs are all checked, then flushed,
    so a bad input leaves nothing behind."""

    def __init__(self, store: Store, keys: RunKeys) -> None:
        super().__init__(store, keys)
        self.staged: dict[str, bytes] = {}

    def get(self, name: str) -> bytes | None:
        return self.staged.get(name) if name in self.staged else super().get(name)

    def put(self, name: str, data: bytes) -> bytes:
        stored = super().get(name)
        if stored is not None:
            return stored
        return self.staged.setdefault(name, data)

    def flush(self) -> None:
        for name, data in self.staged.items():
            SpecFiles.put(self, name, data)


def spec_of(cfg: Config, files: SpecFiles | None) -> TrainSpec:
    """The spec a config names, with the config (and the run's spec files) passed when the factory asks."""
    return build_spec(cfg.spec, cfg.spec_args, run_config=cfg, files=files)


def load_run_spec(ctx: RunContext) -> TrainSpec:
    """The spec of an existing run (user code is imported here: learners and the evaluator only)."""
    return spec_of(ctx.cfg, SpecFiles(ctx.store, ctx.keys))


def build_model(spec: TrainSpec, seed: int) -> nn.Module:
    """spec.build_model() under the run's seed (the same init in every process), checked."""
    torch.manual_seed(seed)
    try:
        model = spec.build_model()
    except SpecError:
        raise
    except Exception as err:  # noqa: BLE001 - user code: its failure is reported in one line
        raise SpecError(f"build_model failed: {type(err).__name__}: {err}") from err
    return check_model(model)


def check_layout(ctx: RunContext, model: nn.Module, who: str) -> None:
    """RunError unless the model's layout is the run's (names, shapes, dtypes, in order), and so are the
    buffers the run merges."""
    if not ctx.layout:
        return  # a run created before layouts were recorded: its fingerprint still guards every object
    diff = first_difference(ctx.layout, model_layout(model))
    if diff is None and ctx.buffers:
        diff = buffer_difference(ctx.buffers, buffer_layout(model)[0])
    if diff is not None:
        raise RunError(f"{who}: the spec builds another model than run {ctx.run_id!r}: {diff}")


def probe(spec: TrainSpec, model: nn.Module, ranks: set[int] = frozenset({1})) -> int:
    """Run the spec's functions once on CPU (a batch and its loss, the held-out batches; the batch split in
    equal slices for every rank count of the run's learners): SpecError early. Returns the batch's tokens
    (what the run records as its tokens per step: the merge bounds a delta's counters with it)."""
    try:
        batch = next(iter(itertools.islice(spec.batches(0, 1, 0), 1)), None)
    except Exception as err:  # noqa: BLE001 - user code
        raise SpecError(f"batches(0, 1, 0) failed: {type(err).__name__}: {err}") from err
    if batch is None:
        raise SpecError("batches(0, 1, 0) yielded no batch")
    for n in sorted(ranks - {1}):
        try:
            slice_batch(batch, 0, n)
        except ValueError as err:
            raise SpecError(str(err)) from None
    with torch.no_grad():
        _, tokens = check_loss(_call(spec.loss, model, batch, what="loss"))
    if spec.eval_batches is not None:
        held = _call(spec.eval_batches, what="eval_batches")
        if not held:
            raise SpecError("eval_batches() returned no batches")
    return tokens


def _call(fn, *args, what: str):
    try:
        return fn(*args)
    except SpecError:
        raise
    except Exception as err:  # noqa: BLE001 - user code
        raise SpecError(f"{what} failed: {type(err).__name__}: {err}") from err
