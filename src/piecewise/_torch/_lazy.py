"""Lazy re-exports: a name of a torch module that ``import torch`` does not import (Dynamo's and
Inductor's submodules), imported on first use, so a ``from piecewise._torch.dynamo import X``
inside a function costs what ``from torch._dynamo.x import X`` cost there, no more and no sooner.
A name this torch lacks raises ImportError at that import, as the direct import did."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(table: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering each name of `table` (name -> ``"torch.module:attr"``,
    or ``"torch.module"`` for the module itself) by importing it then. Looked up at each use, never
    cached: a value torch rebinds (``torch._dynamo.utils.counters`` after a reset) stays torch's."""

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        module, _, attr = where.partition(":")
        value = importlib.import_module(module)
        if attr:
            try:
                value = getattr(value, attr)
            except AttributeError as e:
                raise ImportError(f"cannot import name {attr!r} from {module!r}") from e
        return value

    return __getattr__
