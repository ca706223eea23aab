"""How the command line reports what a user got wrong: one line naming the problem, exit code 2.

Contract: only the errors a user can cause (diloco.supervise.user_errors.USER_ERRORS) are turned into that
line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer


def fail(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(2)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can cause into one clear line and exit code 2."""
    from diloco.supervise.user_errors import USER_ERRORS, describe

    try:
        yield
    except USER_ERRORS as err:
        fail(describe(err))
