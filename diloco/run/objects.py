"""Tensor objects in the bucket: encode/write and read/decode tensor dicts through the codec, with checks.

Contract: every tensor object is written by the pickle-free codec and read back with size, checksum and
fingerprint checks; callers get fp32 CPU torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from diloco.run.context import RunError
from diloco.run.heap import release_freed_memory
from diloco.storage import codec
from diloco.storage.codec.lazy import LazyObject
from diloco.storage.store import Store
from diloco.training.tensors import Tensors, to_numpy, to_torch

T = TypeVar("T")
Item = TypeVar("Item")

TRIM_EVERY_BYTES = 64 << 20  # a consuming encode returns freed memory this often
# reads of a committed object before it is declared corrupt: committed objects are written once and never
# change, so a check that fails on three fresh GETs is the object's own fault (a torn or damaged transfer
# fails once)
COMMITTED_READS = 3


class CorruptObject(RunError):
    """An object a manifest commits fails its checks on every read: no retry or restart can fix it."""


def encode_tensors(
    tensors: Tensors, *, codec_name: str, kind: str, fingerprint: str,
    meta: dict[str, Any] | None = None, shuffle: bool = True, consume: bool = False, compress: bool = True,
) -> bytes | bytearray:
    """The codec's bytes of `tensors`; `consume`: pop each tensor from the dict once encoded and build the
    object in a bytearray (the same bytes; the tensors, the frames and the object are never all held whole
    when the dict holds the last reference to its tensors). `compress=False`: no lz4 (codec.Encoder)."""
    if not consume:
        return codec.encode(
            to_numpy(tensors), codec=codec_name, kind=kind, fingerprint=fingerprint, meta=meta or {},
            shuffle=shuffle, compress=compress,
        )
    encoder = codec.Encoder(codec=codec_name, kind=kind, fingerprint=fingerprint, meta=meta or {},
                            shuffle=shuffle, into_bytearray=True, compress=compress)
    freed = 0
    for name in list(tensors):
        tensor = tensors.pop(name)
        freed += tensor.numel() * 4
        encoder.add(name, to_numpy({name: tensor})[name])
        del tensor
        # the freed tensors' pages to the OS, not kept beside the growing object
        if freed >= TRIM_EVERY_BYTES:
            release_freed_memory()
            freed = 0
    release_freed_memory()
    return encoder.finish()


def encode_shipped(
    tensors: Tensors, *, codec_name: str, kind: str, fingerprint: str, meta: dict[str, Any] | None = None,
    shuffle: bool = True, buffers: Tensors | None = None,
) -> tuple[bytes, Tensors]:
    """encode_tensors' bytes and what decode_tensors gives back from them, bit for bit (the codec's decode of
    each stream just made, without the lz4/zstd round trip): a learner's delta and the values it ships, which
    its error feedback keeps. `tensors` must not change until this returns. `buffers`: the model's buffers,
    stored after the tensors, exactly (each its own fp32 codec, whatever `codec_name`), their count in the
    meta (`buffers`); not among the shipped values."""
    meta = {**(meta or {}), **({"buffers": len(buffers)} if buffers else {})}
    encoder = codec.Encoder(codec=codec_name, kind=kind, fingerprint=fingerprint, meta=meta, shuffle=shuffle)
    shipped: Tensors = {}
    for name, array in to_numpy(tensors).items():
        stream = encoder.add(name, array)
        shipped[name] = torch.from_numpy(encoder.shipped(name, array.shape, stream))
        del stream
    for name, array in to_numpy(buffers or {}).items():
        encoder.add(name, array, codec="fp32")
    return encoder.finish(), shipped


def decode_tensors(
    data: bytes, *, fingerprint: str | None = None, max_bytes: int | None = None, verified: bool = False
) -> tuple[codec.Header, Tensors]:
    """`verified`: `data` matched the checksum a manifest recorded for it (read_checked): the codec's own
    payload crc32 is skipped (a second pass over the bytes that can only agree)."""
    header, arrays = codec.decode(data, max_bytes=max_bytes, expected_fingerprint=fingerprint,
                                  verified=verified)
    return header, to_torch(arrays)


def write_state(
    store: Store, key: str, tensors: Tensors, *, kind: str, fingerprint: str,
    meta: dict[str, Any] | None = None, consume: bool = False,
) -> tuple[int, str]:
    """A version's fp32 state (params, outer state), encoded and put; returns (size in bytes, object
    checksum). Stored raw, neither shuffled nor lz4-framed: lz4 shrinks fp32 weights by only about a tenth,
    and on a 124M-parameter model it cost the merger more time than anything else in writing a version
    (docs/bench/scale.md). `consume`: see encode_tensors."""
    data = encode_tensors(tensors, codec_name="fp32", kind=kind, fingerprint=fingerprint, meta=meta,
                          consume=consume, shuffle=False, compress=False)
    return len(data), put_checksummed(store, key, data)


def put_checksummed(store: Store, key: str, data: bytes | bytearray) -> str:
    """Put `data` and return its object checksum, the hash computed on a second thread while the put writes
    (both release the GIL: a 500 MB object's BLAKE2b no longer waits for its write). `data` must not
    change."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum") as pool:
        checksum = pool.submit(codec.object_checksum, data)
        store.put(key, data)
        return checksum.result()


def read_checked(store: Store, key: str, checksum: str | None = None) -> bytes:
    """Get an object's bytes and verify the checksum recorded for it (when given): CodecError naming the
    key."""
    data = store.get(key)
    if checksum and (got := codec.object_checksum(data)) != checksum:
        raise codec.CodecError(f"{key}: checksum {got} != recorded {checksum}")
    return data


def read_tensors(
    store: Store, key: str, *, fingerprint: str | None = None, checksum: str | None = None,
    max_bytes: int | None = None,
) -> tuple[codec.Header, Tensors]:
    """Get, verify the recorded checksum (when given), decode; a CodecError names the key."""
    data = read_checked(store, key, checksum)
    try:
        return decode_tensors(data, fingerprint=fingerprint, max_bytes=max_bytes, verified=bool(checksum))
    except codec.CodecError as err:
        raise codec.CodecError(f"{key}: {err}") from None


def read_committed(store: Store, key: str, *, checksum: str, fingerprint: str | None = None,
                   what: str = "") -> tuple[codec.Header, Tensors]:
    """read_tensors of an object a manifest commits (`what` says which, e.g. "version 7's update"): a failed
    check is read again, COMMITTED_READS reads in all, then CorruptObject naming the object — the caller stops
    instead of retrying forever. StorageError (the bucket, not the object) passes through for the caller to
    retry."""
    return _committed(lambda: read_tensors(store, key, fingerprint=fingerprint, checksum=checksum), key, what)


def read_committed_lazy(store: Store, key: str, *, checksum: str, fingerprint: str | None = None,
                        what: str = "") -> LazyObject:
    """read_committed's checks and retries, the object left to decode one tensor at a time."""
    return _committed(lambda: LazyObject(read_checked(store, key, checksum), fingerprint=fingerprint,
                                         verified=True), key,
                      what)


def _committed(read: Callable[[], T], key: str, what: str) -> T:
    for _ in range(COMMITTED_READS):
        try:
            return read()
        except codec.CodecError as err:
            failure = str(err).removeprefix(f"{key}: ")  # named once, below
    raise CorruptObject(corrupt_message(what or "the committed object", key, failure)) from None


def read_ahead(items: Sequence[Item], fetch: Callable[[Item], T], name: str) -> Iterator[tuple[Item, T]]:
    """(item, fetch(item)) in order, the next item fetched (read, checked, decoded) on a second thread while
    the caller works on this one; no thread for a single item. The caller's work keeps its order: the same
    bits as fetching one after the other."""
    if len(items) <= 1:
        for item in items:
            yield item, fetch(item)
        return
    with Prefetch(items, fetch, name, depth=1) as ahead:
        yield from ahead


class Prefetch:
    """fetch(item) of `items`, in order, on one thread, up to `depth` items ahead of the caller — started at
    once, so the caller can do other work (read a checkpoint) while the first ones arrive. Iterating gives
    (item, fetch(item)) in order (a fetch's exception is raised there, for its item); `skip_until(keep)` drops
    the items before the first that `keep` accepts, unconsumed (their failures unraised: a caller that starts
    further on never needed them). `close()` (the with-block's end) cancels what has not started and waits for
    the rest."""

    def __init__(self, items: Sequence[Item], fetch: Callable[[Item], T], name: str, depth: int) -> None:
        self._items, self._fetch, self._depth = list(items), fetch, max(1, depth)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: list[tuple[int, Any]] = []  # (position in items, future), in order
        self._next = 0
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._depth and self._next < len(self._items):
            self._pending.append((self._next, self._pool.submit(self._fetch, self._items[self._next])))
            self._next += 1

    def skip_until(self, keep: Callable[[Item], bool]) -> None:
        """Drop the items not yet taken before the first one `keep` accepts (every one when none does)."""
        start = self._pending[0][0] if self._pending else self._next
        first = next((i for i in range(start, len(self._items)) if keep(self._items[i])), len(self._items))
        while self._pending and self._pending[0][0] < first:
            self._pending.pop(0)[1].cancel()
        self._next = max(self._next, first)
        self._fill()

    def __iter__(self) -> Iterator[tuple[Item, T]]:
        while self._pending:
            position, future = self._pending.pop(0)
            item = self._items[position]
            got = future.result()
            self._fill()
            yield item, got
            del got  # the caller is done with it: not held while the next one is waited for

    def close(self) -> None:
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def corrupt_message(what: str, key: str, failure: str) -> str:
    """CorruptObject's words for a committed object that failed its checks COMMITTED_READS times."""
    return (f"{what} {key} is corrupt ({failure}; read {COMMITTED_READS} times). A committed object never "
            "changes, so no retry or restart can fix this: `diloco audit` names every corrupt object, and "
            "`diloco fork --at-version V` continues the run from the last good version")


def verify_written(store: Store, key: str, checksum: str, what: str) -> None:
    """Read back an object just put, before a manifest may name it: the same checksum, and the codec's own
    checks pass (header and payload crc). CorruptObject naming it otherwise: nothing that cannot be read is
    committed."""
    data = store.get(key)
    try:
        if codec.object_checksum(data) != checksum:
            raise codec.CodecError(f"read back with checksum {codec.object_checksum(data)}, written "
                                   f"{checksum}")
        codec.verify(data)
    except codec.CodecError as err:
        raise CorruptObject(f"the merger wrote {what} {key} and read it back corrupt ({err}); "
                            "it commits nothing it cannot read") from None
