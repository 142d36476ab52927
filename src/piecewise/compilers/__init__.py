"""Compiler adaptors: what turns one piece into a callable (docs/design.md §4.5).

An adaptor is registered by name (`register_adaptor`) and looked up from
`CompilationConfig.backend`. Built-ins: ``"inductor"`` and ``"eager"``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError
from .base import CompiledPiece, CompilerAdaptor, CompileTarget

__all__ = ["CompilerAdaptor", "CompiledPiece", "CompileTarget", "register_adaptor", "get_adaptor", "adaptor_names"]

_adaptors: dict[str, Callable[..., CompilerAdaptor]] = {}


def register_adaptor(name: str, factory: Callable[..., CompilerAdaptor]) -> None:
    """Make `factory(config)` available as ``CompilationConfig(backend=name)``."""
    _adaptors[name] = factory


def adaptor_names() -> tuple[str, ...]:
    return tuple(sorted(_adaptors))


def get_adaptor(name: str, config) -> CompilerAdaptor:
    """Instantiate the adaptor registered as `name`.

    Raises:
        ConfigError: no adaptor has that name.
    """
    try:
        factory = _adaptors[name]
    except KeyError:
        raise ConfigError(
            f"backend={name!r} is not a registered compiler adaptor; known: {list(adaptor_names())}; "
            "register one with piecewise.compilers.register_adaptor"
        ) from None
    return factory(config)


def _register_builtins() -> None:
    from .eager import EagerAdaptor
    from .inductor import InductorAdaptor

    register_adaptor("eager", EagerAdaptor)
    register_adaptor("inductor", InductorAdaptor)


_register_builtins()
