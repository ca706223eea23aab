"""A learner's state on its own host: what a restarted learner process resumes from, bucket or not.

Contract: the learner writes its whole state here at every publish and every `learner.local_state_every_steps`
steps — theta, r, the installed global, the optimizer state, the model's buffers the run merges, next seq,
base version, data cursor, the steps and tokens not shipped yet (per lane: the whole model's, or every
fragment chain's) — and keeps each delta's bytes in a spool (per chain: `delta-<seq>.bin` on the root chain,
`delta-f<p>-<seq>.bin` on fragment p's) until its upload has landed. A learner process restarted on the same
host resumes from it: no download, no repeated phase, and no delta lost to a crash while the bucket was
unreachable. It is a cache: the bucket stays the truth (the learner checks it, when it can, and drops a state
the bucket has moved past), and it survives a process crash, not a lost host.

Written incrementally, in place of copies: r and G already live in spill files of this directory
(diloco.learner.spill: written when they change, at a ship or an install), and a state names them; theta, the
optimizer state and the buffers are streamed from the live tensors, one at a time, into `state.bin` (a spill
file whose footer holds the meta) on the calling thread, after the spool writes queued before it — so a state
is one consistent moment, and no copy of the model is held to write it. A temporary file, then a rename: a
crash leaves the state before, never a torn one. A periodic save that took over a second is not repeated
before 9x its time has passed (at most ~10% of the training thread: a 124M model's state is 1.5 GB). Spool
writes and their landings run on a background thread, in order; a landed delta's spool file goes once a state
on disk counts it as shipped.

Pickle-free; a state of another run (same run id, new run), another model layout or an unreadable file is
ignored, never trusted. A state written before spill files (one codec object) is still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.learner.courier import Courier
from diloco.learner.spill import SpillDir, Spilled, SpillError, write_spill
from diloco.run.objects import decode_tensors
from diloco.storage.codec import CodecError

log = logging.getLogger("diloco.local_state")
ENV_DIR = "DILOCO_LOCAL_DIR"  # where learners keep their local state; default .diloco/local under the cwd
DEFAULT_DIR = ".diloco/local"
STATE_FILE = "state.bin"
SPOOL_RE = re.compile(r"^delta-(?:f(\d{4})-)?(\d{12})\.bin$")  # the root chain's, or fragment <f>'s
PARTS = ("theta", "ref", "glob", "opt", "buffers")  # buffers: the model's own the run merges (may be none)
FILES = ("ref", "glob")  # the parts a state may name as spill files (per lane) instead of holding
STATE_FORMAT = 2  # a spill file naming r's and G's files; 1 (no "format"): one codec object of every part
SAVE_SHARE = 0.1  # periodic saves take at most this share of the training thread ...
SAVE_FREE_S = 1.0  # ... once a save takes longer than this (a small model's saves are never skipped)
Values = Mapping[str, torch.Tensor]


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
    # theta / ref / glob: the model's params; opt: the optimizer state tensors; buffers. Each read on access;
    # ref and glob of a whole-model state are its spill file itself when it names one
    parts: dict[str, Values]


class _Prefixed(Mapping[str, torch.Tensor]):
    """The tensors of one part of a state file ("<part>/<name>" entries), by name."""

    def __init__(self, spilled: Spilled, part: str) -> None:
        self.spilled, self.prefix = spilled, f"{part}/"
        self.names = [k[len(self.prefix):] for k in spilled if k.startswith(self.prefix)]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.spilled[self.prefix + name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _Joined(Mapping[str, torch.Tensor]):
    """Several lanes' spill files as one mapping (each name in one of them)."""

    def __init__(self, maps: list[Values]) -> None:
        self.maps = maps
        self.where = {k: m for m in maps for k in m}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


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
        self.spill = SpillDir(self.dir, persist=True)  # the learner's r and G files: a state names them
        self._writer = Courier(f"local-state-{name}")
        self._ops = 0  # each write its own courier key: run in order, none replaced by a later one
        self._lock = threading.RLock()  # guards the counters and sets (spool writes run on the writer thread)
        self._named: set[str] = set()  # the spill files the state on disk names
        self.last_save_s, self._last_end = 0.0, 0.0  # the time of the last save, and when it ended
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
        self.spill.close(named=self._named)  # what the state on disk names stays for the next process

    # ---- state ---------------------------------------------------------------------------
    def save(self, parts: dict[str, Values | list[Values]], meta: dict) -> None:
        """Write a state now, on this thread, after the spool writes queued before it. `parts`: name ->
        tensors (read one at a time while it writes: live ones must not change meanwhile); "ref" and "glob"
        may be a list (one per lane), and a spill file among them is named, not copied."""
        t0 = time.time()
        self.flush()
        files: dict[str, list[str]] = {}
        inline: dict[str, Values] = {}
        for part in PARTS:
            value = parts.get(part, {})
            maps = value if isinstance(value, list) else [value]
            if part in FILES and maps and all(isinstance(m, Spilled) for m in maps):
                files[part] = [self.spill.keep(m) for m in maps]
            else:
                inline[part] = maps[0] if len(maps) == 1 else _Joined(list(maps))
        items = ((f"{part}/{k}", v[k]) for part, v in inline.items() for k in v)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_spill(self.dir / STATE_FILE, items, {**meta, "identity": self.identity, "format": STATE_FORMAT,
                                                   "fingerprint": self.fingerprint, "files": files})
        named = {name for names in files.values() for name in names}
        with self._lock:
            self._named = named
        self.spill.collect(named)
        self._state_written(next_seqs(meta))
        self._last_end = time.time()
        self.last_save_s = self._last_end - t0

    def due(self) -> bool:
        """Whether a periodic save may run now: the last one took under SAVE_FREE_S, or at most SAVE_SHARE of
        the time since it began."""
        return self.last_save_s < SAVE_FREE_S or \
            time.time() - self._last_end >= self.last_save_s * (1 / SAVE_SHARE - 1)

    def writing(self) -> bool:
        """Whether a state save is still being written: never once save() returned (saves are synchronous)."""
        return False

    def load(self) -> Saved | None:
        """The saved state, or None (nothing saved, another run's, unreadable: each logged). Spill files of
        processes gone that the state does not name are removed."""
        path = self.dir / STATE_FILE
        saved = None
        if path.exists():
            try:
                saved = self._load_spilled(path)
            except SpillError:
                saved = self._load_legacy(path)
        if saved is not None and saved.meta.get("identity") != self.identity:
            log.info("local state %s belongs to another run; ignored", path)
            saved = None
        named = set()
        if saved is not None:
            named = {n for names in (saved.meta.get("files") or {}).values() for n in names}
            with self._lock:  # the state on disk counts the seqs below its next seq as shipped
                self._named = named
                for chain, next_seq in next_seqs(saved.meta).items():
                    self._on_disk_next_seq[chain] = max(self._on_disk_next_seq.get(chain, 0), next_seq)
        if self.dir.exists():
            self.spill.sweep(named)
        return saved

    def _load_spilled(self, path: Path) -> Saved | None:
        spilled = Spilled.open(path)
        meta = dict(spilled.meta)
        if meta.get("fingerprint") != self.fingerprint:
            log.warning("local state %s ignored: another model (fingerprint %s)", path,
                        meta.get("fingerprint"))
            return None
        parts: dict[str, Values] = {part: _Prefixed(spilled, part) for part in PARTS}
        try:
            for part, names in (meta.get("files") or {}).items():
                if part not in FILES or not isinstance(names, list) or not names:
                    raise SpillError(f"a state naming {part!r} files")
                maps = [self.spill.adopt(str(n)) for n in names]
                parts[part] = maps[0] if len(maps) == 1 else _Joined(maps)
        except SpillError as err:
            log.warning("local state %s ignored: %s", path, err)
            return None
        unknown = {k.partition("/")[0] for k in spilled} - set(PARTS)
        if unknown:
            log.warning("local state %s ignored: unknown part %r", path, sorted(unknown)[0])
            return None
        return Saved(meta, parts)

    def _load_legacy(self, path: Path) -> Saved | None:
        """A state of one codec object (before spill files)."""
        try:
            data = path.read_bytes()
            header, tensors = decode_tensors(data, fingerprint=self.fingerprint)
        except OSError as err:
            log.warning("local state %s unreadable: %s", path, err)
            return None
        except CodecError as err:
            log.warning("local state %s ignored: %s", path, err)
            return None
        parts: dict[str, dict] = {p: {} for p in PARTS}
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
            if path.name == STATE_FILE or SPOOL_RE.match(path.name):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        with self._lock:
            self._on_disk_next_seq, self._named = {}, set()
        self.spill.collect()

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

    # the writer thread's bookkeeping (_landed also emptied by a save; _on_disk_next_seq also set by a load)
    def _spool_now(self, seq: int, data: bytes, fragment: int | None) -> None:
        with self._lock:
            self._landed.discard((fragment, seq))  # a redone delta of a seq landed before a crash: a new one
        self._write(spool_name(seq, fragment), data)

    def _landed_now(self, seq: int, fragment: int | None) -> None:
        with self._lock:
            counted = seq < self._on_disk_next_seq.get(fragment, 0)
            if not counted:
                self._landed.add((fragment, seq))
        if counted:
            self._unlink(spool_name(seq, fragment))

    def _state_written(self, next_seq: dict[int | None, int]) -> None:
        with self._lock:
            self._on_disk_next_seq = dict(next_seq)
            counted = [(c, s) for c, s in self._landed if s < next_seq.get(c, 0)]
            for item in counted:
                self._landed.discard(item)
        for chain, seq in sorted(counted, key=lambda item: (-1 if item[0] is None else item[0], item[1])):
            self._unlink(spool_name(seq, chain))

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
