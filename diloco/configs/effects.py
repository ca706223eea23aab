"""Knobs that do nothing on the path a run takes: which ones, and why — said once, when the run starts.

Contract: `ignored_knobs(cfg, explicit, path)` names every key the user set (in the recipe or as an override)
whose value has no effect on `path` ("fork", "exec", "prefect": local processes; "deployments": Prefect
deployments), one line each, with the reason; keys left at their recipe defaults are never named.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from diloco.configs.schema import RECIPE_DIR, Config, recipe_names

PATHS = ("fork", "exec", "prefect", "deployments")

# key -> (does it matter on this path for this config?, why not)
_RULES: dict[str, tuple[Callable[[Config, str], bool], str]] = {
    "run.warm_standby": (lambda cfg, path: path == "exec"
                         or (path == "prefect" and cfg.run.start_method == "exec"),
                         "warm spares exist only for exec'd local processes (a forked role is warm already; "
                         "deployment workers start their own flow runs)"),
    "run.start_method": (lambda cfg, path: path in ("fork", "exec", "prefect"),
                         "deployment workers start their own flow runs"),
    "learner.probe_every_steps": (lambda cfg, path: cfg.learner.mode != "sync",
                                  "a sync learner waits for the version that decides its delta instead of "
                                  "probing"),
    "learner.prefetch": (lambda cfg, path: cfg.learner.mode != "sync",
                         "a sync learner installs the version that decides its delta itself, it never "
                         "prefetches"),
    "learner.encode_in_background": (lambda cfg, path: cfg.fragments.count > 1,
                                     "a whole-model learner (fragments.count 1) encodes its delta between "
                                     "phases"),
    "fragments.cohorts": (lambda cfg, path: cfg.fragments.count > 1,
                          "cohorts offset the fragments' schedules: with fragments.count 1 there is one "
                          "delta a phase"),
}


def _dotted(data: Any, prefix: str = "") -> set[str]:
    if not isinstance(data, dict):
        return {prefix.rstrip(".")} if prefix else set()
    out: set[str] = set()
    for key, value in data.items():
        out |= _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return out


def recipe_keys(name_or_path: str | Path) -> set[str]:
    """The dotted keys a recipe (name or YAML path) sets; an unreadable file sets none (load_config says
    why)."""
    path = RECIPE_DIR / f"{name_or_path}.yaml" if str(name_or_path) in recipe_names() else Path(name_or_path)
    try:
        return _dotted(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError):
        return set()


def ignored_knobs(cfg: Config, explicit: set[str], path: str) -> list[str]:
    """One line per explicitly set key that does nothing on `path`."""
    if path not in PATHS:
        raise ValueError(f"path {path!r} must be one of {PATHS}")
    return [f"{key} has no effect here: {why}" for key, (matters, why) in _RULES.items()
            if key in explicit and not matters(cfg, path)]


def knob_warnings(config: str | Path | Config, overrides: dict[str, Any] | None, cfg: Config,
                  path: str) -> list[str]:
    """What the user set (the recipe's keys and the overrides) that has no effect on `path`."""
    explicit = recipe_keys(config) if isinstance(config, str | Path) else set()
    explicit |= {k for k, v in (overrides or {}).items() if v is not None}
    return ignored_knobs(cfg, explicit, path)
