"""Region tags: the name a compiled region's cache entries, counters and logs go under.

A tag is the config's ``tag`` (or the model's class name) made unique among the live compiled
regions of this process by a ``_<k>`` suffix. The suffix follows compile order, on purpose: a program
that compiles its models in the same order gets the same tags, hence the same cache entries, every
run. `scoped_tags` gives a block (a test) a registry of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["unique_tag", "release_tag", "current_registry", "scoped_tags"]

_tags_lock = threading.Lock()
_tags_used: set[str] = set()


def unique_tag(base: str) -> str:
    """`base`, or `base_<k>` with the smallest k making it unique among the live compiled regions
    of this process (a tag is released when its model is garbage collected), so a program that
    compiles its models in the same order gets the same tags - and cache entries - every run."""
    with _tags_lock:
        tag, k = base, 1
        while tag in _tags_used:
            tag = f"{base}_{k}"
            k += 1
        _tags_used.add(tag)
        return tag


def release_tag(tag: str, registry: set[str] | None = None) -> None:
    """Free `tag` in `registry` (the one it was taken from, `current_registry()` at the time;
    default: the current one)."""
    with _tags_lock:
        (_tags_used if registry is None else registry).discard(tag)


def current_registry() -> set[str]:
    """The registry `unique_tag` takes tags from now (pass it to `release_tag`)."""
    return _tags_used


@contextlib.contextmanager
def scoped_tags() -> Iterator[None]:
    """Within the block, tags are handed out from an empty registry (``base`` first again); the
    process's registry is restored after it. Tags taken inside are released on exit."""
    global _tags_used
    with _tags_lock:
        saved, _tags_used = _tags_used, set()
    try:
        yield
    finally:
        with _tags_lock:
            _tags_used = saved
