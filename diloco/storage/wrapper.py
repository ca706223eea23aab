"""WrapperStore: the one base for a Store that wraps another (fault injection, traffic counting).

Contract: every Store operation is forwarded explicitly to `inner`; `with_retries(n)` is a wrapper of
the same kind over `inner.with_retries(n)` that shares this wrapper's state (see `_over`).
"""

from __future__ import annotations

from typing import Self

from diloco.storage.store import Store


class WrapperStore:
    """Forwards every operation to `inner`; a subclass overrides the operations it changes, and `_over`
    when it has constructor arguments or state."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def _over(self, inner: Store) -> Self:
        """A wrapper of this kind over `inner` that shares this one's state (counters, windows, locks):
        what with_retries returns. Override it in a subclass with state or constructor arguments."""
        return type(self)(inner)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def max_retries(self) -> int:
        return self.inner.max_retries

    def with_retries(self, max_retries: int) -> Self:
        """This wrapper, over the inner store with another retry budget (ValueError if negative)."""
        return self._over(self.inner.with_retries(max_retries))

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_size(self, key: str) -> int:
        return self.inner.get_size(key)

    def modified(self, key: str) -> float:
        return self.inner.modified(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.inner.put_if_absent(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str, after: str = "") -> list[str]:
        return self.inner.list(prefix, after)

    def folders(self, prefix: str) -> list[str]:
        return self.inner.folders(prefix)

    def sizes(self, prefix: str) -> dict[str, int]:
        return self.inner.sizes(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
