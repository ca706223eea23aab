"""The errors a user can cause (a bad config, name, run, corpus, or storage that refuses), in one tuple.

Contract: every entry point (the CLI, the launch entry, the Python API) turns exactly these into one clear
line (exit code 2 on a command line) and lets everything else — a bug — surface with its traceback; a learner
that fails on one at its start is not restarted (diloco.launch.record_learner_failure: `fatal`).
"""

from __future__ import annotations

from diloco.configs import ConfigError
from diloco.run.context import RunError
from diloco.storage import StorageError
from diloco.storage.keys import InvalidName
from diloco.training.data import DataError
from diloco.training.spec import SpecError
from diloco.trust.signing import SigningError

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, RunError, InvalidName, DataError, SpecError,
                                            StorageError, SigningError)


def describe(err: BaseException) -> str:
    """The one line a user sees: the message, with the kind of storage failure in front."""
    if isinstance(err, StorageError):
        return f"storage: {type(err).__name__}: {err}"
    return str(err)
