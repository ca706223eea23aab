"""Live settings as an operator gives them (`diloco set`): each value read by its field's type, finite, within
what a live merger can act on, and checked against what the run sends now — a setting that would reject the
deltas the run's learners are sending is refused unless forced.

Contract: `check_live(ctx, policy, values, force=...)` returns the values to file (typed: what the op file
holds, the manifest records and audit replays, byte for byte) or raises ConfigError naming the field and why,
with nothing written; only keys of trust/guard.py LIVE_SETTINGS pass. Read-only: a few manifests and, before
the first merge, one listing per member.
"""

from __future__ import annotations

from typing import Any

from diloco.configs import Config, ConfigError, typed_value
from diloco.run.context import RunContext
from diloco.run.fragments import fragment_context, num_fragments
from diloco.storage import StorageError, list_versions, read_manifest
from diloco.storage.keys import parse_delta_key
from diloco.trust.guard import LIVE_SETTINGS, Policy, check_settings, window_median

# live bounds beyond the config models' own: the merger sleeps poll_interval_s between polls while it waits
# for a quorum, and would not see the next op (a pause, a better value) for that long
LIVE_MAX = {"merger.poll_interval_s": 60.0}
RECENT_VERSIONS = 8  # the deltas "the run sends now": those merged by the newest versions of each chain


def check_live(ctx: RunContext, policy: Policy, values: dict[str, Any], *,
               force: bool = False) -> dict[str, Any]:
    """The values, typed and checked against the run's live config (`policy.cfg`); ConfigError otherwise."""
    bad = sorted(k for k in values if k not in LIVE_SETTINGS)
    if bad:
        raise ConfigError(f"{', '.join(bad)} cannot change during a run; the live settings are: "
                          f"{', '.join(LIVE_SETTINGS)}")
    typed = {key: typed_value(key, value) for key, value in values.items()}
    for key, limit in LIVE_MAX.items():
        if key in typed and typed[key] > limit:
            raise ConfigError(f"{key}={typed[key]!r}: at most {limit:g} in a live run (the merger sleeps "
                              "that long between polls and would not see the next control op)")
    cfg = check_settings(ctx.cfg, {**policy.state.settings, **typed})
    if not force:
        harm = _rejects_what_is_sent(ctx, policy, cfg, typed)
        if harm:
            raise ConfigError(f"{harm}; give --force (force=True) to set it anyway")
    return typed


def _rejects_what_is_sent(ctx: RunContext, policy: Policy, cfg: Config, typed: dict[str, Any]) -> str:
    """Why the new settings would reject the honest deltas the run sends now ("" when they would not)."""
    if "merger.max_delta_bytes" in typed:
        limit = cfg.merger.max_delta_bytes  # None: the layout's own bound, which every real delta is under
        sizes = _recent_sizes(ctx) or _newest_sizes(ctx, policy.state.members)
        over = [s for s in sizes if limit is not None and s > limit]
        if over:
            return (f"merger.max_delta_bytes={limit}: {len(over)} of the {len(sizes)} deltas this run "
                    f"sent lately are larger (up to {max(sizes):,} bytes): they would be rejected as "
                    "oversized, and nothing their learners send would merge")
    if cfg.merger.outlier_rule != "off" and {"merger.outlier_threshold", "merger.outlier_rule"} & set(typed):
        median = window_median(policy.state, cfg)
        norms = policy.state.norms[-cfg.merger.outlier_window:]
        over = [n for n in norms if median and n > cfg.merger.outlier_threshold * median]
        if over:
            what = "clipped" if cfg.merger.outlier_rule == "clip" else "rejected"
            return (f"merger.outlier_threshold={cfg.merger.outlier_threshold:g}: {len(over)} of the "
                    f"{len(norms)} honest deltas in the window are above it (up to {max(over) / median:.3g}x "
                    f"the median): deltas like them would be {what}")
    return ""


def _chains(ctx: RunContext) -> list[RunContext]:
    return [fragment_context(ctx, p) for p in range(num_fragments(ctx))] if ctx.fragments else [ctx]


def _recent_sizes(ctx: RunContext) -> list[int]:
    """The bytes of the deltas merged by the newest RECENT_VERSIONS versions of every chain."""
    sizes: list[int] = []
    for chain in _chains(ctx):
        try:
            for version in list_versions(chain.store, chain.keys)[-RECENT_VERSIONS:]:
                merged = read_manifest(chain.store, chain.keys, version).merged()
                sizes += [d.bytes for d in merged if d.bytes]
        except (StorageError, ValueError):
            continue
    return sizes


def _newest_sizes(ctx: RunContext, members: list[str]) -> list[int]:
    """Before the first merge: the size of each member's newest delta in the bucket (one per chain)."""
    sizes: list[int] = []
    for chain in _chains(ctx):
        for learner in members:
            try:
                found = [k for k in chain.store.list(chain.keys.deltas_prefix(learner)) if parse_delta_key(k)]
                if found:
                    sizes.append(chain.store.get_size(found[-1]))
            except (StorageError, ValueError):
                continue
    return sizes
