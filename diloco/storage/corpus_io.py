"""Reading a training corpus from any fsspec URL: the hooks training/data.py asks for.

Contract: read_bytes(url) returns one object's bytes; list_files(url) lists the files under a
folder URL ([] for a single file). Errors surface as OSError for data.py to name.
"""

from __future__ import annotations

import fsspec


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def list_files(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.isdir(path):
        return []
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return sorted(f"{protocol}://{p}" for p in fs.find(path))


def is_remote(corpus: str | None) -> bool:
    return bool(corpus) and "://" in corpus and not corpus.startswith("file://")
