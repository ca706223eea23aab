"""Any torch optimizer's state as plain tensors + JSON, and back: the pickle-free checkpoint of a learner.

Contract: `export_state(opt, names)` gives ({"<key>/<param>": fp32 CPU tensor}, meta) for every tensor of
every parameter's state (format 2), with 0-d tensors and numbers in meta (their dtype kept, so a resumed
optimizer continues bit for bit); `import_state` restores it into an optimizer built the same way (the
parameter groups' hyperparameters come from that build) and raises ValueError — changing nothing — when it
does not fit. Format 1 (AdamW's exp_avg / exp_avg_sq and per-parameter step counts) is still read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

STATE_FORMAT = 2
LEGACY_FORMAT = 1  # AdamW only: "exp_avg/<p>", "exp_avg_sq/<p>" tensors, meta["param_steps"]
LEGACY_KEYS = ("exp_avg", "exp_avg_sq")


def param_names(opt: torch.optim.Optimizer, named: dict[str, nn.Parameter]) -> dict[int, str]:
    """The name of every parameter the optimizer holds (its state is keyed by the parameter object)."""
    by_id = {id(p): n for n, p in named.items()}
    names = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError("the optimizer holds a parameter the model does not name")
            names[id(p)] = by_id[id(p)]
    return names


def export_state(opt: torch.optim.Optimizer, named: dict[str, nn.Parameter], step: int) -> tuple[dict, dict]:
    """(tensors, json-able meta) of the optimizer's state and the trainer's step (fp32 CPU copies)."""
    tensors = {key: value.detach().to("cpu", torch.float32).clone()
               for key, value in state_tensors(opt, named)}
    return tensors, state_meta(opt, named, step)


def state_tensors(opt: torch.optim.Optimizer,
                  named: dict[str, nn.Parameter]) -> Iterator[tuple[str, torch.Tensor]]:
    """("<key>/<param>", the live tensor) of every tensor of the optimizer's state, one at a time, copying
    nothing: what a checkpoint streams from (the caller must not step the optimizer meanwhile)."""
    names = param_names(opt, named)
    for p, state in opt.state.items():
        name = names[id(p)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if not value.is_floating_point():
                    raise ValueError(f"optimizer state {key}/{name} is {value.dtype}: only float tensors are "
                                     "saved")
                yield f"{key}/{name}", value.detach()


def state_meta(opt: torch.optim.Optimizer, named: dict[str, nn.Parameter], step: int) -> dict:
    """The json-able part of export_state: format, the trainer's step, every scalar of the state."""
    names = param_names(opt, named)
    scalars: dict[str, dict[str, Any]] = {}
    for p, state in opt.state.items():
        name = names[id(p)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                continue
            if isinstance(value, torch.Tensor):
                scalars.setdefault(name, {})[key] = {"value": value.item(), "dtype": str(value.dtype)}
            elif isinstance(value, bool | int | float):
                scalars.setdefault(name, {})[key] = value
            else:
                raise ValueError(f"optimizer state {key}/{name} is a {type(value).__name__}: not saved "
                                 "pickle-free")
    meta = {"format": STATE_FORMAT, "step": step, "scalars": scalars}
    steps = {n: s["step"] for n, s in scalars.items() if isinstance(s.get("step"), dict)}
    if steps:
        meta["param_steps"] = {n: int(s["value"]) for n, s in steps.items()}
    return meta


def _scalar(value: Any) -> Any:
    if isinstance(value, dict):
        return torch.tensor(value["value"], dtype=getattr(torch, value["dtype"].removeprefix("torch.")))
    return value


def _legacy_state(tensors: Mapping, meta: dict, named: dict[str, nn.Parameter]) -> dict[str, dict[str, Any]]:
    state = {}
    for name, count in (meta.get("param_steps") or {}).items():
        if name not in named:
            raise ValueError(f"optimizer state names unknown parameter {name!r}")
        entry: dict[str, Any] = {"step": torch.tensor(float(count), dtype=torch.get_default_dtype())}
        for key in LEGACY_KEYS:
            entry[key] = tensors.get(f"{key}/{name}")
        state[name] = entry
    return state


def _state(tensors: Mapping, meta: dict, named: dict[str, nn.Parameter]) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = {}
    for name, values in (meta.get("scalars") or {}).items():
        state.setdefault(name, {}).update({k: _scalar(v) for k, v in values.items()})
    for key, value in tensors.items():
        kind, _, name = key.partition("/")
        state.setdefault(name, {})[kind] = value
    unknown = sorted(set(state) - set(named))
    if unknown:
        raise ValueError(f"optimizer state names unknown parameter {unknown[0]!r}")
    return state


def import_state(opt: torch.optim.Optimizer, named: dict[str, nn.Parameter], tensors: Mapping, meta: dict,
                 copy: bool = True) -> int:
    """Restore what export_state gave (or format 1; `tensors` may read each tensor on access); returns the
    trainer's step. ValueError, nothing changed, on an unknown format, name or shape. `copy=False`: the
    tensors are fresh and the caller's own (read from a file): taken as they are when already on the
    parameter's device and dtype, not cloned."""
    fmt, step = meta.get("format"), meta.get("step")
    if fmt not in (STATE_FORMAT, LEGACY_FORMAT):
        raise ValueError(f"optimizer state format {fmt!r}, expected {STATE_FORMAT} (or {LEGACY_FORMAT})")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"optimizer state meta: step must be an int >= 0, got {step!r}")
    by_name = (_legacy_state if fmt == LEGACY_FORMAT else _state)(tensors, meta, named)
    new_state = {}
    for name, entry in by_name.items():
        p = named[name]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {key}/{name}: shape {tuple(value.shape)} differs from "
                                 f"{tuple(p.shape)}")
            if value is None:
                raise ValueError(f"optimizer state {key}/{name}: missing")
        new_state[p] = {k: (_placed(v, p, copy) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                        for k, v in entry.items()}
    opt.state.clear()
    opt.state.update(new_state)
    return step


def _placed(value: torch.Tensor, p: torch.Tensor, copy: bool) -> torch.Tensor:
    out = value.detach().to(p.device, p.dtype)
    return out.clone() if copy else out
