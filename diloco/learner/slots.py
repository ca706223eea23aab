"""Who holds a delta's slot (`deltas/<learner>/<seq>.delta`) when the learner's exclusive create of it
conflicts, and the same delta moved to another seq.

Contract: `Slots.holder` reads the object at the slot, bounded (its size first: an object over
MAX_HOLDER_FACTOR x the delta's size is not read), and names it: `ours` (these very bytes: an earlier try
landed), `mine` (a delta of the process that made these bytes, moved there earlier), `twin` (a well-formed
delta of this learner at this seq from another process, with signing on validly signed: another process
publishes under this name, so the learner stops), `planted` (anything else: junk, another learner's or another
seq's delta, a bad or missing signature: the delta ships at the next free seq), or `free` (nothing there now).
Storage trouble is raised (StorageError) for the caller's retry. `moved` is the delta for another seq: its
header's seq rewritten (codec.rehead: the payload untouched) and its signature made again.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from diloco.storage import NotFound, RunKeys, Store
from diloco.storage.codec import CodecError, read_header, rehead
from diloco.trust.signing import MAX_SIG_BYTES, sign, verify

# slots a delta tries past its own before the learner stops: the merger ignores a key further past its cursor
# than learner.max_unmerged + 16 (diloco.merger.waiting.plausible_ahead): a delta never goes where it is
# not read
MAX_MOVES = 8
# the largest holder read, as a multiple of the delta's own size: a twin's delta (the same model and codec) is
# about as large; anything larger is not one and is not downloaded
MAX_HOLDER_FACTOR = 2
HOLDER_SLACK_BYTES = 1 << 20  # plus this much, for a tiny model whose deltas compress unevenly


@dataclass(frozen=True)
class Holder:
    kind: str  # ours | mine | twin | planted | free
    reason: str = ""


class Slots:
    """The slots of learner `name`'s deltas on every chain of run `run_id`; `process`: this process's id,
    which every delta it makes carries in its header (meta `process`)."""

    def __init__(self, store: Store, run_id: str, keys: RunKeys, name: str,
                 signing_key: bytes | None) -> None:
        self.store, self.run_id, self.keys, self.name = store, run_id, keys, name
        self.signing_key = signing_key
        self.process = secrets.token_hex(8)

    def key(self, fragment: int | None, seq: int) -> str:
        return self.keys.for_fragment(fragment).delta(self.name, seq)

    def moved(self, data: bytes, fragment: int | None,
              seq: int) -> tuple[str, bytes, tuple[str, bytes] | None]:
        """(key, bytes, signature sidecar) of delta `data` shipped as `seq` instead."""
        moved = bytes(rehead(data, seq=seq))
        return self.key(fragment, seq), moved, self.sidecar(fragment, seq, moved)

    def sidecar(self, fragment: int | None, seq: int, data: bytes) -> tuple[str, bytes] | None:
        if self.signing_key is None:
            return None
        return (self.keys.for_fragment(fragment).signature(self.name, seq),
                sign(self.signing_key, self.run_id, self.name, seq, data))

    def holder(self, fragment: int | None, seq: int, data: bytes,
               sidecar: tuple[str, bytes] | None) -> Holder:
        """What holds slot `seq` of the chain, which delta `data` (signed by `sidecar`) could not take."""
        keys = self.keys.for_fragment(fragment)
        key = keys.delta(self.name, seq)
        try:
            size = self.store.get_size(key)
            if size > MAX_HOLDER_FACTOR * len(data) + HOLDER_SLACK_BYTES:
                return Holder("planted", f"an object of {size} bytes, not read (this delta is {len(data)})")
            held = self.store.get(key)
        except NotFound:
            return Holder("free")
        if held == data:
            return Holder("ours")
        try:
            header = read_header(held)
        except CodecError as err:
            return Holder("planted", f"not a delta: {err}"[:200])
        meta = header.meta
        if header.kind != "delta" or meta.get("learner") != self.name:
            return Holder("planted", f"a {header.kind} of learner {meta.get('learner')!r:.40}")
        if meta.get("seq") != seq:
            return Holder("planted", f"a delta of seq {meta.get('seq')!r:.24} (replayed)")
        if self.signing_key is not None:
            signature = self._signature(keys.signature(self.name, seq))
            if sidecar is not None and signature == sidecar[1]:  # ours overwrote its own: nothing to tell by
                return Holder("twin", "a delta of another process (its signature overwritten by this one's)")
            why = verify([self.signing_key], self.run_id, self.name, seq, held, signature)
            if why:
                return Holder("planted", why[:200])
        process = meta.get("process")
        if process is not None and process == read_header(data).meta.get("process"):
            return Holder("mine", "a delta of the same process, moved there")
        return Holder("twin", f"a delta of process {process!r:.40}")

    def _signature(self, key: str) -> bytes | None:
        try:
            if self.store.get_size(key) > MAX_SIG_BYTES:
                return b""
            return self.store.get(key)
        except NotFound:
            return None
