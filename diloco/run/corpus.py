"""The corpus a run trains on, with URL support wired in from storage/.

Contract: the same config yields the same bytes in every process of a run.
"""

from __future__ import annotations

from diloco.configs import DataConfig
from diloco.storage import corpus_io
from diloco.training.data import Corpus, load_corpus


def load_run_corpus(cfg: DataConfig) -> Corpus:
    if corpus_io.is_remote(cfg.corpus):
        return load_corpus(cfg, read_bytes=corpus_io.read_bytes, list_files=corpus_io.list_files)
    return load_corpus(cfg)
