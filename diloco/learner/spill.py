"""Tensors a learner keeps on its own disk instead of in memory: the installed global G of each lane (and, on
a CPU learner, its reference r), the prefetcher's G, and the parts of its local state; each read back one
tensor at a time.

Contract: a spill file is written once, in one pass over its tensors (a temporary name, then a rename), and
never changes; `Spilled` is a read-only mapping over it (name -> a fresh fp32 CPU tensor on every read),
holding the file open, so a file unlinked while it is read still reads. Nothing here is trusted beyond its own
checks (sizes, a magic and a footer): a spill file is this host's own cache, never bucket input. A `SpillDir`
with `persist` off unlinks each file as soon as it is open (nothing is left on disk); with it on (local
state), it keeps a file by name while its Spilled is alive or a state on disk names it, and `collect` unlinks
the rest.

Format: the tensors' raw fp32 bytes one after another, then a JSON footer ({"entries": [[name, shape,
offset]], "meta": ...}), its length (u64) and the magic.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import struct
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from diloco.run.lease import pid_alive

MAGIC = b"DLSPILL1"
TAIL = struct.Struct("<Q8s")  # footer length, magic
SPILL_RE = re.compile(r"^[a-z]+-\d+-\d+-\d+\.f32$")  # <tag>-<pid>-<dir>-<n>.f32: a SpillDir's own files
MAX_READ = 1 << 30  # bytes per read call (Linux reads at most ~2 GiB at once)


class SpillError(ValueError):
    """A spill file is missing, truncated or not one: its state is not used."""


class Spilled(Mapping[str, torch.Tensor]):
    """A read-only name -> tensor mapping over one spill file (fp32 CPU tensors, read on every access)."""

    def __init__(self, path: Path, entries: dict[str, tuple[tuple[int, ...], int]], meta: dict,
                 fd: int) -> None:
        self.path, self.entries, self.meta = path, entries, meta
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path) -> Spilled:
        """The spill file at `path`: SpillError when it is missing, truncated or not a spill file."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise SpillError(f"spill file {path}: {err}") from None
        try:
            entries, meta = _footer(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, entries, meta, fd)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, offset = self.entries[name]
        out = torch.empty(shape, dtype=torch.float32)
        _read_into(self._fd, out, offset, self.path)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"Spilled({self.path.name}, {len(self.entries)} tensors)"


def write_spill(path: Path, items: Iterable[tuple[str, torch.Tensor]], meta: dict | None = None) -> None:
    """Write `items` (name, tensor: any device, any float dtype; stored fp32) to `path`, one tensor at a time:
    a temporary file beside it, then a rename (a crash leaves the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    entries, offset = [], 0
    try:
        with open(tmp, "wb") as f:
            for name, tensor in items:
                host = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
                if host.numel():
                    f.write(memoryview(host.numpy().reshape(-1)).cast("B"))
                entries.append([name, list(host.shape), offset])
                offset += 4 * host.numel()
                del host
            footer = json.dumps({"entries": entries, "meta": meta or {}}).encode()
            f.write(footer)
            f.write(TAIL.pack(len(footer), MAGIC))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def scratch_dir() -> Path:
    """Where a SpillDir without persistence writes (its files are unlinked once open): the system's temp
    dir."""
    return Path(tempfile.gettempdir()) / "diloco-spill"


class SpillDir:
    """Where one learner process spills: `dir`, its files named <tag>-<pid>-<instance>-<n>.f32. `persist`:
    keep files by name (a local state may name them) until `collect`; otherwise each is unlinked once open."""

    _instances = itertools.count()

    def __init__(self, path: Path, persist: bool) -> None:
        self.dir, self.persist = Path(path), persist
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prefix = f"{os.getpid()}-{next(self._instances)}"
        self._count = itertools.count()
        self._lock = threading.Lock()  # the prefetcher's thread writes while the training thread collects
        self._own: dict[str, weakref.ref] = {}  # file name -> its Spilled, for files this instance keeps
        self._copies: list[Spilled] = []

    def write(self, items: Iterable[tuple[str, torch.Tensor]], tag: str = "t",
              meta: dict | None = None) -> Spilled:
        """A new spill file of `items` (see write_spill), open."""
        with self._lock:
            name = f"{tag}-{self._prefix}-{next(self._count)}.f32"
        path = self.dir / name
        write_spill(path, items, meta)
        spilled = Spilled.open(path)
        if self.persist:
            with self._lock:
                self._own[name] = weakref.ref(spilled)
        else:
            path.unlink()  # the open file still reads: nothing is left behind, whatever happens
        return spilled

    def adopt(self, name: str) -> Spilled:
        """A file of this directory (a local state's, maybe of a process before this one), open and kept."""
        if "/" in name or not SPILL_RE.match(name):
            raise SpillError(f"spill file name {name!r} is not one")
        spilled = Spilled.open(self.dir / name)
        with self._lock:
            self._own[name] = weakref.ref(spilled)
        return spilled

    def keep(self, spilled: Spilled) -> str:
        """The file name of `spilled` for a state on disk to name: its own, or (unlinked meanwhile, or another
        directory's) a copy written here."""
        if spilled.path.parent == self.dir and spilled.path.exists():
            with self._lock:
                self._own.setdefault(spilled.path.name, weakref.ref(spilled))
            return spilled.path.name
        copy = self.write(((k, spilled[k]) for k in spilled), tag="copy")
        self._copies.append(copy)  # rare (a duplicate process swept the original): kept open until close
        return copy.path.name

    def collect(self, named: Iterable[str] = ()) -> None:
        """Unlink this instance's files whose Spilled is gone and that `named` (a state on disk) does not
        name."""
        named = set(named)
        with self._lock:
            dead = [n for n, ref in self._own.items() if ref() is None and n not in named]
            for name in dead:
                del self._own[name]
        for name in dead:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()

    def sweep(self, named: Iterable[str]) -> None:
        """At a start: unlink every spill file here that `named` (the state just loaded) does not name and no
        live process of this host made (a crashed process's leftovers)."""
        named = set(named)
        for path in self.dir.glob("*.f32"):
            pid = int(path.name.split("-")[1]) if SPILL_RE.match(path.name) else None
            if pid is not None and path.name not in named and not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def close(self, named: Iterable[str] = ()) -> None:
        """Unlink every file of this instance but those `named`."""
        named = set(named)
        with self._lock:
            names, self._own, self._copies = [n for n in self._own if n not in named], {}, []
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()


def _footer(fd: int, path: Path) -> tuple[dict[str, tuple[tuple[int, ...], int]], dict]:
    size = os.fstat(fd).st_size
    if size < TAIL.size:
        raise SpillError(f"spill file {path} is truncated ({size} bytes)")
    length, magic = TAIL.unpack(os.pread(fd, TAIL.size, size - TAIL.size))
    if magic != MAGIC or length > size - TAIL.size:
        raise SpillError(f"spill file {path} is not one (or is truncated)")
    try:
        footer = json.loads(os.pread(fd, length, size - TAIL.size - length))
        entries = {str(name): (tuple(int(d) for d in shape), int(offset))
                   for name, shape, offset in footer["entries"]}
        meta = footer.get("meta") or {}
    except (ValueError, KeyError, TypeError) as err:
        raise SpillError(f"spill file {path}: unreadable footer ({err})") from None
    data = size - TAIL.size - length
    for name, (shape, offset) in entries.items():
        if offset < 0 or offset + 4 * math.prod(shape) > data:
            raise SpillError(f"spill file {path}: tensor {name!r} lies outside its data")
    return entries, meta


def _read_into(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    if not out.numel():
        return
    view = memoryview(out.numpy().reshape(-1)).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + MAX_READ]], offset + done)
        if got <= 0:
            raise SpillError(f"spill file {path}: short read at byte {offset + done}")
        done += got
