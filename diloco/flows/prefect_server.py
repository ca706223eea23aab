"""`prefect server start`, with every SQLite write transaction begun IMMEDIATE: run as `python -m` in place of
the `prefect` script (flows/server.launch_server). Nothing else of Prefect's changes.

Why: Prefect's SQLite configuration begins a transaction DEFERRED unless its caller asks for a row lock, and
several writes read first inside theirs (creating a task run reads its flow run's labels, then inserts). In
WAL mode a deferred transaction that read and then writes while another writer holds the lock fails at once
with SQLITE_BUSY ("database is locked": the busy timeout does not wait for it, that would deadlock); the
server answers 503 and Prefect's client sleeps 2 s, then 4, 8... before it tries again. A role's start on the
busy local server stalled 2-7 s that way (docs/LIFECYCLE.md). Begun IMMEDIATE, a transaction takes the write
lock first and waits for it under the connection's busy timeout (Prefect sets 60 s), as SQLite advises for a
transaction that may write; readers outside a transaction (most of the API's) are not affected (WAL).
"""
from __future__ import annotations

import sys
from typing import Any


def immediate_transactions() -> None:
    """Make AioSqliteConfiguration.begin_transaction take Prefect's own IMMEDIATE path (with_for_update=True,
    what its row-locking writes ask for) whatever its caller asks. A Prefect without that hook (a later 3.x)
    runs as it is, with one line on stderr: its writes may then be answered 503 under load, as before, never
    fail."""
    try:
        from prefect.server.database.configurations import AioSqliteConfiguration

        begin = AioSqliteConfiguration.begin_transaction
    except (ImportError, AttributeError) as err:
        print(f"diloco: SQLite writes begun as Prefect begins them ({err})", file=sys.stderr)
        return

    def begin_immediate(self: Any, session: Any, with_for_update: bool = False) -> Any:
        return begin(self, session, with_for_update=True)

    AioSqliteConfiguration.begin_transaction = begin_immediate  # type: ignore[method-assign]


def main() -> int:
    immediate_transactions()
    from prefect.cli import app

    sys.argv[0] = "prefect"
    return app()


if __name__ == "__main__":
    sys.exit(main())
