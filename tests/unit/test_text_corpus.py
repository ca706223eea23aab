"""The shipped text specs' corpora (diloco/specs/text.py): a folder of any text files, recursively (files
that are not UTF-8 text skipped and counted); a glob; .jsonl (and .gz) by a field; Parquet by a column, file
or folder; fsspec URLs; a binary or compressed file named alone refused with its reason; the held-out split.

Run: .venv/bin/pytest tests/unit/test_text_corpus.py
"""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diloco.specs.text import load_text, read_documents
from diloco.training.data import DataError


def words(n: int, seed: int = 0) -> str:
    return " ".join(f"w{(i * 7919 + seed) % 997}" for i in range(n))


def test_a_folder_of_any_text_files_is_read_recursively_skipping_what_is_not_text(tmp_path: Path) -> None:
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("def f():\n    return 1\n" * 100)
    (src / "lib.rs").write_text("fn main() {}\n" * 100)
    (src / "README").write_text(words(500))
    (src / "blob.bin").write_bytes(bytes(range(256)) * 40)  # NUL bytes: not text
    (src / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 200)  # not UTF-8
    docs, what = read_documents(str(src))
    assert len(docs) == 3 and "3 files (2 skipped: not text)" in what
    assert docs[1].startswith(b"fn main")  # sorted by path: README, lib.rs, pkg/mod.py
    corpus = load_text(str(src))
    assert b"def f()" in corpus.train.tobytes() + corpus.heldout.tobytes()


def test_a_glob_jsonl_and_gzip_jsonl_by_their_text_field(tmp_path: Path) -> None:
    rows = [{"text": words(60, i), "id": i} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:15]))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress("\n".join(json.dumps(r) for r in rows[15:]).encode()))
    docs, _ = read_documents(str(tmp_path / "*.jsonl*"))
    assert [d.decode() for d in docs] == [r["text"] for r in rows]
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": words(2000)}))
    assert load_text(str(tmp_path / "body.jsonl"), text_field="body").source.endswith("1 files")
    with pytest.raises(DataError, match="no string field 'text'"):
        read_documents(str(tmp_path / "body.jsonl"))


def test_parquet_by_its_text_column_file_or_folder(tmp_path: Path) -> None:
    folder = tmp_path / "pq"
    folder.mkdir()
    for part in range(2):
        table = pa.table({"text": [words(80, 10 * part + i) for i in range(10)], "n": list(range(10))})
        pq.write_table(table, folder / f"part-{part}.parquet")
    docs, what = read_documents(str(folder))
    assert len(docs) == 20 and docs[0].decode() == words(80, 0) and what.endswith("2 files")
    corpus = load_text(str(folder / "part-0.parquet"))
    text = corpus.train.tobytes() + corpus.heldout.tobytes()
    # read through the format, not bytes
    assert b"PAR1" not in text and text.startswith(words(80, 0).encode())
    with pytest.raises(DataError, match="no readable text column 'body'"):
        read_documents(str(folder), text_field="body")


def test_a_url_corpus_is_read_through_fsspec() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/corp/x/1.txt": words(300, 1).encode(),
             "/corp/y.jsonl": json.dumps({"text": words(300, 2)}).encode()})
    docs, _ = read_documents("memory://corp")
    assert [d.decode() for d in docs] == [words(300, 1), words(300, 2)]
    fs.rm("/corp", recursive=True)


def test_a_binary_or_compressed_file_named_alone_is_refused_with_its_reason(tmp_path: Path) -> None:
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("a.txt", words(500))
    with pytest.raises(DataError, match="data.zip: a zip archive"):
        load_text(str(archive))
    (tmp_path / "model.bin").write_bytes(b"\x00\x01\x02" * 1000)
    with pytest.raises(DataError, match="model.bin: binary"):
        load_text(str(tmp_path / "model.bin"))
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(words(2000).encode()))
    assert load_text(str(tmp_path / "notes.txt.gz")).train.tobytes().startswith(b"w0 ")  # gzip of text: read


def test_the_held_out_split_is_the_last_tenth_in_order(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a" * 4000)
    (tmp_path / "b.txt").write_text("b" * 6000)
    corpus = load_text(str(tmp_path))
    assert len(corpus.heldout) == 10_002 - int(10_002 * 0.9) and set(corpus.heldout.tobytes()) == {ord("b")}
    assert corpus.train.tobytes().startswith(b"a" * 4000 + b"\n\n")
    again = load_text(str(tmp_path))
    assert again.train.tobytes() == corpus.train.tobytes()  # deterministic
