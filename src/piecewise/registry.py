"""Named registries (compiler adaptors, graph platforms, call routes) that can be undone.

``register(name, value)`` returns a `Registration`: call ``.remove()``, or use it as a context
manager, to put back what the name held before (or nothing). Tests and plug-ins scope their
registrations this way instead of editing a module's dict.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "Registration"]

V = TypeVar("V")
_MISSING: Any = object()


class Registration:
    """One `Registry.register` call; undo it with `remove` or by leaving a ``with`` block."""

    def __init__(self, registry: Registry[Any], name: str, value: Any, previous: Any) -> None:
        self._registry, self.name, self.value, self._previous = registry, name, value, previous
        self._removed = False

    def remove(self) -> None:
        """Restore what the name held before this registration (idempotent). A later registration
        of the same name that is still in place is left alone."""
        if not self._removed:
            self._removed = True
            self._registry._restore(self.name, self.value, self._previous)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Registry(Generic[V]):
    """An ordered ``name -> value`` map with undoable registrations (thread-safe)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, V] = {}
        self._lock = threading.Lock()

    def register(self, name: str, value: V) -> Registration:
        with self._lock:
            previous = self._items.get(name, _MISSING)
            self._items[name] = value
        return Registration(self, name, value, previous)

    def _restore(self, name: str, value: V, previous: Any) -> None:
        with self._lock:
            if self._items.get(name, _MISSING) is not value:
                return
            if previous is _MISSING:
                del self._items[name]
            else:
                self._items[name] = previous

    def get(self, name: str, default: Any = None) -> V | Any:
        return self._items.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._items))

    def values(self) -> Iterator[V]:
        return iter(list(self._items.values()))
