"""A learner's state on its own host: what a restarted learner process resumes from, bucket or not.

Contract: the learner writes its whole state here (atomically: a temporary file, then a rename) at every
publish and every `learner.local_state_every_steps` steps — theta, r, the installed global, the AdamW state,
the model's buffers the run merges, next seq, base version, data cursor, the steps and tokens not shipped yet
(per lane: the whole model's, or every fragment chain's) — and keeps each delta's bytes in a spool (per chain:
`delta-<seq>.bin` on the root chain, `delta-f<p>-<seq>.bin` on fragment p's) until its upload has landed. A
learner process restarted on the same host resumes from it: no download, no repeated phase, and no delta lost
to a crash while the bucket was unreachable. It is a cache: the bucket stays the truth (the learner checks it,
when it can, and drops a state the bucket has moved past), and it survives a process crash, not a lost host.

Writes run on a background thread, in order (a spool file is always written before the state that counts its
delta as shipped); the caller hands over tensors it will not change. A crash can lose the writes still queued:
the state on disk is then the one before, never a torn one. A state saved while an older one still waits in
the queue replaces it (at the end of the queue, after every spool write before it; a landed delta's spool file
goes only once a state on disk counts it as shipped), so at most two states are held, one being written and
one waiting, however slow the disk: at 124M parameters a state is ~2.5 GB, and a GPU learner's 10 steps take
about a second, far less than writing it. The learner also skips its periodic saves while one is still being
written (`writing()`).

Pickle-free: the same tensor codec (fp32) as the bucket's checkpoints; a state of another run (same run id,
new run), another model layout or an unreadable file is ignored, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco.learner.courier import Courier
from diloco.run.objects import decode_tensors, encode_tensors
from diloco.storage.codec import CodecError
from diloco.training.tensors import Tensors

log = logging.getLogger("diloco.local_state")
ENV_DIR = "DILOCO_LOCAL_DIR"  # where learners keep their local state; default .diloco/local under the cwd
DEFAULT_DIR = ".diloco/local"
STATE_FILE = "state.bin"
SPOOL_RE = re.compile(r"^delta-(?:f(\d{4})-)?(\d{12})\.bin$")  # the root chain's, or fragment <f>'s
PARTS = ("theta", "ref", "glob", "opt", "buffers")  # buffers: the model's own the run merges (may be none)


def spool_name(seq: int, fragment: int | None = None) -> str:
    """The spool file of delta `seq` of a chain (`fragment`: None for the root chain)."""
    return f"delta-{seq:012d}.bin" if fragment is None else f"delta-f{fragment:04d}-{seq:012d}.bin"


def next_seqs(meta: dict) -> dict[int | None, int]:
    """Per chain, the next seq a saved state's meta holds (seqs below it are shipped): the whole model's at
    the top level (chain None), a fragmented learner's in `lanes` (chain = fragment)."""
    lanes = meta.get("lanes")
    if isinstance(lanes, list):
        return {lane.get("fragment"): _int(lane.get("next_seq")) for lane in lanes if isinstance(lane, dict)}
    return {None: _int(meta.get("next_seq"))}


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass
class Saved:
    meta: dict
    parts: dict[str, Tensors]  # theta / ref / glob: the model's params; opt: the AdamW state tensors; buffers


def local_root() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


class LocalState:
    """<root>/<hash of storage url>/<run id>/<learner>/: state.bin and the spool files (spool_name). Spool
    calls name a chain by `fragment` (None: the root chain, the whole model's)."""

    def __init__(self, store_url: str, run_id: str, name: str, created_at: float, fingerprint: str,
                 root: Path | None = None) -> None:
        url_tag = hashlib.blake2b(store_url.encode(), digest_size=6).hexdigest()
        self.dir = (root or local_root()) / url_tag / run_id / name
        # which run a state belongs to: a new run with the same id and storage has another created_at
        self.identity = {"storage": store_url, "run_id": run_id, "created_at": created_at}
        self.fingerprint = fingerprint
        self._writer = Courier(f"local-state-{name}")
        self._ops = 0  # each write its own courier key: run in order, none replaced by a later one
        self._lock = threading.RLock()  # guards the counters and keys here (save() holds it around _submit)
        self._queued: str | None = None  # the key of a state save not started yet (a newer one replaces it)
        self._saving = 0  # state saves queued or being written
        # per chain, the next seq of the newest state on disk (read or written): seqs below are shipped
        self._on_disk_next_seq: dict[int | None, int] = {}
        # spooled deltas (chain, seq) that landed, their files kept until a state counts them
        self._landed: set[tuple[int | None, int]] = set()

    # ---- the writer thread -------------------------------------------------------------------
    def _submit(self, op: Callable[[str], None]) -> str:
        """Queue op(key) under a new key; returns the key."""
        with self._lock:  # the publisher's thread unspools while the training thread spools and saves
            self._ops += 1
            key = f"{self._ops:012d}"
            self._writer.post(key, lambda: op(key))
            return key

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._writer.drain(None)

    def close(self) -> None:
        self._writer.close(None)

    # ---- state ---------------------------------------------------------------------------
    def save(self, parts: dict[str, Tensors], meta: dict) -> None:
        """Queue a save of these tensors (the caller must not change them afterwards) and meta, replacing a
        save still waiting in the queue."""
        with self._lock:
            if self._queued is not None and self._writer.cancel(self._queued):
                self._saving -= 1
            self._saving += 1
            self._queued = self._submit(lambda key: self._save_job(key, parts, meta))

    def writing(self) -> bool:
        """Whether a state save is still queued or being written."""
        with self._lock:
            return self._saving > 0

    def _save_job(self, key: str, parts: dict[str, Tensors], meta: dict) -> None:
        with self._lock:
            if self._queued == key:
                self._queued = None
        try:
            self._save_now(parts, meta)
        finally:
            with self._lock:
                self._saving -= 1

    def _save_now(self, parts: dict[str, Tensors], meta: dict) -> None:
        tensors = {f"{part}/{k}": v for part in PARTS for k, v in parts.get(part, {}).items()}
        data = encode_tensors(tensors, codec_name="fp32", kind="state", fingerprint=self.fingerprint,
                                meta={**meta, "identity": self.identity}, shuffle=False)
        self._write(STATE_FILE, data)
        self._state_written(next_seqs(meta))

    def load(self) -> Saved | None:
        """The saved state, or None (nothing saved, another run's, unreadable: each logged)."""
        path = self.dir / STATE_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            log.warning("local state %s unreadable: %s", path, err)
            return None
        try:
            header, tensors = decode_tensors(data, fingerprint=self.fingerprint)
        except CodecError as err:
            log.warning("local state %s ignored: %s", path, err)
            return None
        if header.meta.get("identity") != self.identity:
            log.info("local state %s belongs to another run; ignored", path)
            return None
        with self._lock:  # the state on disk counts the seqs below its next seq as shipped
            for chain, next_seq in next_seqs(header.meta).items():
                self._on_disk_next_seq[chain] = max(self._on_disk_next_seq.get(chain, 0), next_seq)
        parts: dict[str, Tensors] = {p: {} for p in PARTS}
        for key, value in tensors.items():
            part, _, name = key.partition("/")
            if part not in parts:
                log.warning("local state %s ignored: unknown part %r", path, part)
                return None
            parts[part][name] = value
        return Saved(header.meta, parts)

    def clear(self) -> None:
        """Forget the state and the spool (the bucket showed them stale, or another process owns the name)."""
        self.flush()
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with self._lock:
            self._on_disk_next_seq = {}

    # ---- spool of deltas not landed yet --------------------------------------------------------
    def spool(self, seq: int, data: bytes, fragment: int | None = None) -> None:
        self._submit(lambda _: self._spool_now(seq, data, fragment))

    def unspool(self, seq: int, fragment: int | None = None) -> None:
        """Delta `seq` landed: its spool file goes once a state on disk counts it as shipped (a state saved
        before it may have been replaced by a newer one still to be written). Queued after the spool write of
        the same seq, whichever thread calls it."""
        self._submit(lambda _: self._landed_now(seq, fragment))

    def discard(self, seq: int, fragment: int | None = None) -> None:
        """Drop spool file `seq` now (in queue order): a resume found it redone or already in the bucket."""
        self._submit(lambda _: self._unlink(spool_name(seq, fragment)))

    # the writer thread's bookkeeping (_landed is its own; _on_disk_next_seq also set by a load)
    def _spool_now(self, seq: int, data: bytes, fragment: int | None) -> None:
        self._landed.discard((fragment, seq))  # a redone delta of a seq landed before a crash is a new one
        self._write(spool_name(seq, fragment), data)

    def _landed_now(self, seq: int, fragment: int | None) -> None:
        with self._lock:
            counted = seq < self._on_disk_next_seq.get(fragment, 0)
        if counted:
            self._unlink(spool_name(seq, fragment))
        else:
            self._landed.add((fragment, seq))

    def _state_written(self, next_seq: dict[int | None, int]) -> None:
        with self._lock:
            self._on_disk_next_seq = dict(next_seq)
        counted = [(c, s) for c, s in self._landed if s < next_seq.get(c, 0)]
        for chain, seq in sorted(counted, key=lambda item: (-1 if item[0] is None else item[0], item[1])):
            self._unlink(spool_name(seq, chain))
            self._landed.discard((chain, seq))

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / name).unlink()

    def spooled(self, fragment: int | None = None) -> list[tuple[int, bytes]]:
        """(seq, bytes) of every spooled delta of the chain, in seq order."""
        out = []
        for path in self._files():
            m = SPOOL_RE.match(path.name)
            if m and (None if m.group(1) is None else int(m.group(1))) == fragment:
                with contextlib.suppress(OSError):
                    out.append((int(m.group(2)), path.read_bytes()))
        return sorted(out, key=lambda item: item[0])

    def _files(self) -> list[Path]:
        try:
            return list(self.dir.iterdir())
        except FileNotFoundError:
            return []

    def _write(self, name: str, data: bytes) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / name)  # atomic: a crash leaves the old file or the new one
