"""Who may publish, and a merge a bad delta cannot wreck, on a tiny run driven in-process (real learners and
merger, file:// storage): a 1000x delta from a never-admitted name and an admitted learner's 1000x outlier
are rejected and the committed update stays in line; three in a row quarantine the learner until `readmit`;
a live switch to `clip` scales the next one to the bound; a removed learner's deltas are rejected; with
signing on, forged and unsigned deltas are rejected; audit replays every decision, statistic and bit.

Run: .venv/bin/pytest tests/integration/test_trust.py -q   (about 20 s)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from trust_helpers import decision, install_all, one_round, plant, publish_all, tiny_run

from diloco.api.operate import admit_learner, readmit, remove_learner, set_settings
from diloco.inspect.audit import audit_run
from diloco.merger.merger import Merger
from diloco.run.context import open_run
from diloco.run.objects import encode_tensors, read_tensors
from diloco.storage import list_versions, open_store, read_manifest
from diloco.storage.window import with_window
from diloco.trust.outliers import ratios, summarize
from diloco.trust.signing import new_key, sign


def test_rogue_and_outlier_deltas_never_wreck_the_merge(tmp_path: Path) -> None:
    ctx, learners, merger = tiny_run(tmp_path)
    for _ in range(5):  # 10 honest deltas merged: the window holds more than outlier_min_samples
        last = one_round(learners, merger)
    norms = [read_manifest(ctx.store, ctx.keys, v).stats["update_norm"] for v in range(1, last.version + 1)]
    like, base = ("local-0", learners[0].state.seq - 1), merger.version
    plant(ctx, "rogue-0", 0, like=like, scale=1000.0, base=base)  # never admitted
    admit_learner(ctx, None, "bad-0")
    plant(ctx, "bad-0", 0, like=like, scale=1000.0, base=base)  # admitted, 1000x
    m = one_round(learners, merger)
    rogue, bad = decision(m, "rogue-0", 0), decision(m, "bad-0", 0)
    assert (rogue.status, rogue.check) == ("rejected", "admission") and "not admitted" in rogue.reason
    assert ((bad.status, bad.check) == ("rejected", "outlier")  # the figures apart: `reason` tells no bound
            and bad.reason == "outlier: its norm per step is above the run's bound"
            and bad.detail.startswith("norm per step"))
    assert m.stats["update_norm"] < 3 * max(norms), (m.stats["update_norm"], norms)
    assert (m.stats["outlier_median"] > 0 and m.controls[0].kind == "admit"
            and m.controls[0].learner == "bad-0")
    assert "rogue-0" not in m.guard.members and "bad-0" in m.guard.members

    # two more in a row: quarantined; then even an honest-sized delta of it is rejected until readmit
    for seq in (1, 2):
        plant(ctx, "bad-0", seq, like=like, scale=1000.0, base=merger.version)
        m = one_round(learners, merger)
    assert ("bad-0" in m.guard.quarantined
            and "3 integrity rejections in a row" in m.guard.quarantined["bad-0"])
    plant(ctx, "bad-0", 3, like=like, scale=1.0, base=merger.version)
    m = one_round(learners, merger)
    assert (decision(m, "bad-0", 3).check == "quarantine"
            and "diloco readmit" in decision(m, "bad-0", 3).reason)
    readmit(ctx, None, "bad-0")
    plant(ctx, "bad-0", 4, like=(like[0], learners[0].state.seq - 1), scale=1.0, base=merger.version)
    m = one_round(learners, merger)
    assert decision(m, "bad-0", 4).status == "merged" and "bad-0" not in m.guard.quarantined

    # live: clip instead of reject, and a lower outer lr, from the next merge; audit replays with these values
    set_settings(ctx, None, ["merger.outlier_rule=clip", "outer.lr=0.5"])
    plant(ctx, "bad-0", 5, like=like, scale=1000.0, base=merger.version)
    m = one_round(learners, merger)
    clipped = decision(m, "bad-0", 5)
    assert (clipped.status == "merged" and clipped.clip_scale is not None
            and clipped.reason == "clipped to the run's bound" and "scaled by" in clipped.detail)
    assert m.guard.settings == {"merger.outlier_rule": "clip", "outer.lr": 0.5}
    assert m.stats["update_norm"] < 3 * max(norms)
    _a_restart_replays_the_clip_it_cannot_read(ctx, merger, m.version)

    remove_learner(ctx, None, "local-1")  # an in-process learner ignores its signal: the merger does not
    m = one_round(learners, merger)
    assert decision(m, "local-1", learners[1].state.seq - 1).check == "admission"
    assert "removed" in decision(m, "local-1", learners[1].state.seq - 1).reason
    for learner in learners:
        learner.close()

    report = audit_run(open_run(ctx.store, ctx.run_id))
    assert report.ok, report.problems
    assert (report.decisions_replayed >= 20 and report.controls_applied == 4
            and report.decisions_unreplayable == 0)
    stats = summarize(ratios(open_run(ctx.store, ctx.run_id)))
    assert stats["flagged_outlier"] == 4 and stats["would_reject"]["20x"] == 0  # honest ones, by the tool
    _nothing_a_learner_reads_tells_the_bound(ctx, m.version)
    _audit_sees_tampered_settings(tmp_path, ctx.run_id, m.version - 1)


def _nothing_a_learner_reads_tells_the_bound(ctx, newest: int) -> None:
    """Issue #44, invariant 6: the stored manifests (what learners read) hold no window, no median or bound,
    no decision's norm, clip scale or outlier figures (a quarantine's reason neither); the merger's window
    objects hold them, and a learner's bucket policy grants no read of them."""
    from diloco.trust.bucket_policy import allows, policy_for

    figures = 0
    for v in range(1, newest + 1):
        raw = ctx.store.get(ctx.keys.manifest(v)).decode()
        for word in ('"norms"', "norm_learners", "outlier_median", "outlier_bound", "median", '"norm"',
                     "clip_scale", '"detail"'):
            assert word not in raw, (v, word)
        full = with_window(ctx.store, ctx.keys, read_manifest(ctx.store, ctx.keys, v))
        figures += sum(1 for d in full.decisions if d.detail)
        assert all(d.norm is not None for d in full.merged())
    assert figures >= 4  # 3 rejected as outliers, 1 clipped: their figures kept apart
    policy = policy_for("s3://bucket/runs", ctx.run_id, learner="local-0")
    window = read_manifest(ctx.store, ctx.keys, newest).guard.window.key
    assert not allows(policy, "s3:GetObject", "bucket", f"runs/{window}")
    assert allows(policy, "s3:GetObject", "bucket", f"runs/{ctx.keys.manifest(newest)}")


def _a_restart_replays_the_clip_it_cannot_read(ctx, merger: Merger, clipped_at: int) -> None:
    """A merger started cold rebuilds the state from the checkpoint and the merges after it: the clipped
    merge's scale comes from its window object (the stored manifest has none), and the state is the live
    merger's bit for bit."""
    restarted = Merger(ctx)
    restarted.load()
    state = restarted.state.held
    assert state.checkpoint.version < clipped_at and restarted.state.last_load.replayed >= 1
    for name, value in merger.state.held.params.items():
        assert torch.equal(state.params[name], value), name


def _audit_sees_tampered_settings(tmp_path: Path, run_id: str, version: int) -> None:
    """Copy the bucket, change the live settings a manifest recorded: audit says the replay differs."""
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "bucket", copy)
    store = open_store(f"file://{copy}")
    ctx = open_run(store, run_id)
    key = ctx.keys.manifest(version)
    obj = json.loads(store.get(key))
    obj["controls"] = []  # as if the `set` had never been recorded: the replay must notice
    (copy / key).write_text(json.dumps(obj))
    report = audit_run(ctx)
    assert not report.ok and any("differ" in p for p in report.problems), report.problems


def test_signing_rejects_forged_and_unsigned_deltas(tmp_path: Path) -> None:
    keys = {name: new_key().encode() for name in ("local-0", "local-1", "forger-0", "nosig-0")}
    ring = {name: [key] for name, key in keys.items()}
    ctx, learners, merger = tiny_run(tmp_path, keys=keys, keyring=ring, **{"learner.sign": True})
    one_round(learners, merger)
    assert ctx.store.exists(ctx.keys.signature("local-0", 0))
    like, base = ("local-0", 0), merger.version
    admit_learner(ctx, None, "forger-0")
    admit_learner(ctx, None, "nosig-0")
    data = plant(ctx, "forger-0", 0, like=like, scale=1.0, base=base)
    ctx.store.put(ctx.keys.signature("forger-0", 0),
                  sign(new_key().encode(), ctx.run_id, "forger-0", 0, data))
    plant(ctx, "nosig-0", 0, like=like, scale=1.0, base=base)
    m = one_round(learners, merger)
    assert (decision(m, "forger-0", 0).check == "signature"
            and "does not match" in decision(m, "forger-0", 0).reason)
    assert decision(m, "nosig-0", 0).reason.startswith("unsigned")
    assert all(d.status == "merged" for d in m.decisions if d.learner.startswith("local"))
    for learner in learners:
        learner.close()
    with_keys = audit_run(open_run(ctx.store, ctx.run_id), keyring=ring)
    assert (with_keys.ok and with_keys.signatures_verified
            and with_keys.decisions_unreplayable == 0), with_keys.problems
    without = audit_run(open_run(ctx.store, ctx.run_id))
    assert (without.ok and not without.signatures_verified
            and without.decisions_unreplayable == 2), without.problems
    assert len(list_versions(ctx.store, ctx.keys)) == 3


def test_audit_compares_an_update_packed_another_way_by_its_values(tmp_path: Path, monkeypatch) -> None:
    """A replay whose zstd packs the same update into other bytes (another zstd version; here, a writer
    without zstd: lz4 frames) passes on equal header and values; other values fail."""

    import diloco.storage.codec as codec
    from diloco.merger.replay import same_update
    from diloco.run.objects import encode_tensors, read_tensors

    ctx, learners, merger = tiny_run(tmp_path, **{"outer.update_codec": "int4"})
    for _ in range(2):
        m = one_round(learners, merger)
    for learner in learners:
        learner.close()
    stored = ctx.store.get(m.update_key)
    assert codec.read_header(stored).compression == "zstd"
    monkeypatch.setattr(codec, "zstd_available", lambda: False)  # the replay's encoder packs lz4 frames
    report = audit_run(open_run(ctx.store, ctx.run_id))
    assert report.ok and report.replay_ok, report.problems
    repacked = _repacked_lz4(stored)
    assert repacked != stored and codec.read_header(repacked).compression == "lz4"
    assert same_update(ctx, m, repacked)
    header, values = read_tensors(ctx.store, m.update_key)
    nudged = {k: v + 1e-3 if i == 0 else v for i, (k, v) in enumerate(values.items())}
    assert not same_update(ctx, m, encode_tensors(nudged, codec_name="int4", kind="update",
                                                  fingerprint=ctx.fingerprint, meta=header.meta))


def _repacked_lz4(data: bytes) -> bytes:
    """The same object with every zstd frame repacked as lz4 (no `compression` key): the same streams."""
    import zlib

    from diloco.storage.codec.header import elements_of, pack_header, read_layout, stream_bytes
    from diloco.storage.codec.payload import frame_stream, unframe_stream

    layout = read_layout(data, None, allow_partial=False)
    head, view, pos, parts, entries = layout.header, memoryview(data)[layout.payload_offset:], 0, [], []
    for spec, stored in zip(head.tensors, layout.frames, strict=True):
        raw = stream_bytes(head.codec, elements_of(spec.shape), head.block_size)
        stream = unframe_stream(view[pos:pos + sum(stored)], stored, raw, spec.name, "zstd")
        pos += sum(stored)
        frames, lengths = frame_stream(stream, "lz4")
        parts += [bytes(f) for f in frames]
        entries.append({"name": spec.name, "shape": list(spec.shape), "frames": lengths})
    payload = b"".join(parts)
    fields = {"format_version": head.format_version, "kind": head.kind, "codec": head.codec,
              "block_size": head.block_size, "shuffle": head.shuffle, "fingerprint": head.fingerprint,
              "meta": head.meta, "tensors": entries, "payload_bytes": len(payload),
              "payload_crc32": zlib.crc32(payload)}
    return pack_header(fields) + payload


def test_an_admitted_learner_cannot_buy_weight_with_its_counters(tmp_path: Path) -> None:
    """Issue #44, invariant 5, planted in a live run: an admitted learner whose deltas claim 1000x the steps
    and tokens of an honest phase got weight 0.9986 of every merge it joined. Now a learner's counters count
    up to merger.max_phases_per_merge phases and 1.25x the run's tokens per step: its share of a 3-learner
    merge is at most 3.125 / (3.125 + 2) (the honest two count one phase each), and audit replays it. Its
    tokens count as bounded in the run's tokens_total too: a liar's counters cannot end a token budget (nor
    move the learners' schedule clock)."""
    ctx, learners, merger = tiny_run(tmp_path, **{"merger.quorum": 3})
    assert ctx.tokens_per_step == ctx.cfg.data.batch_size * ctx.cfg.model.ctx_len  # recorded at creation
    admit_learner(ctx, None, "liar-0")
    one_round(learners, merger)
    for _ in range(3):
        publish_all(learners)
        like = ("local-0", learners[0].state.seq - 1)
        header, delta = read_tensors(ctx.store, ctx.keys.delta(*like))
        seq = max([d.last_seq for m in [merger.manifest] for d in m.decisions if d.learner == "liar-0"],
                  default=-1) + 1
        meta = {**header.meta, "learner": "liar-0", "seq": seq, "tokens": header.meta["tokens"] * 1000,
                "steps": header.meta["steps"] * 1000}
        ctx.store.put(ctx.keys.delta("liar-0", seq), encode_tensors(delta, codec_name="fp32", kind="delta",
                                                                    fingerprint=ctx.fingerprint, meta=meta))
        parent = merger.manifest
        m = merger.merge_once()
        install_all(learners, m.version)
        weights = {d.learner: d.weight for d in m.merged()}
        assert set(weights) == {"local-0", "local-1", "liar-0"}, m.decisions
        assert weights["liar-0"] <= 3.125 / 5.125 + 1e-9, weights  # was 0.9986
        claimed = {d.learner: d.tokens for d in m.merged()}
        liar_bound = ctx.cfg.merger.max_phases_per_merge * ctx.cfg.inner.steps_per_phase * 1.25 * \
            ctx.tokens_per_step
        assert claimed["liar-0"] > 100 * liar_bound  # its header's claim, recorded as claimed
        # the honest learners' tokens as claimed, the liar's within its bound (was its 1000x claim)
        assert m.tokens_total - parent.tokens_total == claimed["local-0"] + claimed["local-1"] + liar_bound
    for learner in learners:
        learner.close()
    report = audit_run(ctx)
    assert report.ok and report.replay_ok, report.problems


def test_the_judged_cannot_steer_the_outlier_window(tmp_path: Path) -> None:
    """Issue #44, invariant 6, planted in a live run: an admitted learner sent three deltas a merge just under
    the bound (0.9x, scaled up each time) and ratcheted the median 17x in 10 versions. Now the window takes
    one sample per learner per merge and its median is over learners: with two honest learners the median
    stays theirs, and no honest delta is rejected or clipped."""
    ctx, learners, merger = tiny_run(tmp_path, **{"merger.quorum": 3, "merger.outlier_min_samples": 4})
    assert ctx.trust_rules >= 3  # the window's rules (3), kept by every later rule set
    admit_learner(ctx, None, "steer-0")
    for _ in range(4):  # the window fills with the honest learners' samples
        one_round(learners, merger)
    honest = merger.manifest.stats["outlier_median"]
    seq = 0
    for _ in range(10):
        publish_all(learners)
        bound = ctx.cfg.merger.outlier_threshold * merger.manifest.stats["outlier_median"]
        like = ("local-0", learners[0].state.seq - 1)
        header, delta = read_tensors(ctx.store, ctx.keys.delta(*like))
        norm = float(sum((v.double() ** 2).sum() for v in delta.values()) ** 0.5) / header.meta["steps"]
        for _ in range(3):  # three a merge, each at 0.9x the bound the last manifest published
            meta = {**header.meta, "learner": "steer-0", "seq": seq}
            ctx.store.put(ctx.keys.delta("steer-0", seq), encode_tensors(
                {k: v * (0.9 * bound / norm) for k, v in delta.items()}, codec_name="fp32", kind="delta",
                fingerprint=ctx.fingerprint, meta=meta))
            seq += 1
        m = merger.merge_once()
        install_all(learners, m.version)
        assert all(d.status == "merged" and d.clip_scale is None
                   for d in m.decisions if d.learner != "steer-0")
    assert merger.manifest.stats["outlier_median"] < 3 * honest, (honest,
                                                                  merger.manifest.stats["outlier_median"])
    for learner in learners:
        learner.close()
    report = audit_run(ctx)
    assert report.ok and report.replay_ok, report.problems
    _the_window_is_kept_unpublished(ctx, merger)


def _the_window_is_kept_unpublished(ctx, merger: Merger) -> None:
    """Issue #44, invariant 6: no stored manifest (what learners read) holds the window or the bound; the
    merger's own object under guard/ does, a merger restarted from the bucket judges by the same window, and
    audit refuses a changed one."""
    for v in range(1, merger.version + 1):
        raw = ctx.store.get(ctx.keys.manifest(v)).decode()
        published = ('"norms"', "norm_learners", "outlier_median", "outlier_bound")
        assert not any(word in raw for word in published), (v, raw)
        assert read_manifest(ctx.store, ctx.keys, v).guard.window.key.startswith(ctx.keys.guard_prefix())
    restarted = Merger(ctx)
    restarted.load()
    state = restarted.policy.state
    assert state == merger.refresh_policy().state and len(state.norms) == len(state.norm_learners) > 0
    assert restarted.manifest.stats == merger.manifest.stats and "outlier_median" in restarted.manifest.stats
    key = merger.manifest.guard.window.key
    ctx.store.put(key, ctx.store.get(key).replace(b'"norms": [', b'"norms": [0.0, '))
    report = audit_run(ctx, do_replay=False)
    problems = report.problems
    assert any("outlier window is unreadable" in p and "checksum" in p for p in problems), problems
