"""torch's sympy size functions (``torch.utils._sympy.functions``): the names a size guard printed
by torch uses (``FloorDiv``, ``ModularIndexing``, ``PythonMod`` ...), for reading one back.

Verified on torch 2.13.0 (CPU); the module exists under this name since torch 2.1.
"""

from __future__ import annotations

from typing import Any

__all__ = ["size_functions"]


def size_functions() -> dict[str, Any]:
    """Name -> sympy function class of every public name in torch's sympy size functions
    ({} where this torch has none)."""
    try:
        import torch.utils._sympy.functions as fns
    except ImportError:  # pragma: no cover - another torch
        return {}
    return {n: getattr(fns, n) for n in dir(fns) if not n.startswith("_") and isinstance(getattr(fns, n), type)}
