"""Compiler adaptors: what turns one piece into a callable (docs/design.md §4.5).

An adaptor is registered by name (`register_adaptor`) and looked up from
`CompilationConfig.backend`. Built-ins: ``"inductor"`` and ``"eager"``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError
from ..registry import Registration, Registry
from .base import CompiledPiece, CompilerAdaptor, CompileTarget

__all__ = ["CompilerAdaptor", "CompiledPiece", "CompileTarget", "register_adaptor", "get_adaptor", "adaptor_names"]

_adaptors: Registry[Callable[..., CompilerAdaptor]] = Registry("compiler adaptor")


def register_adaptor(name: str, factory: Callable[..., CompilerAdaptor]) -> Registration:
    """Make `factory(config)` available as ``CompilationConfig(backend=name)``.

    Returns a `Registration`: ``with register_adaptor(...): ...`` (or ``.remove()``) puts back
    what the name meant before.

    Examples:
        >>> from piecewise.compilers import adaptor_names, register_adaptor
        >>> from piecewise.compilers.eager import EagerAdaptor
        >>> with register_adaptor("my_eager", EagerAdaptor):   # CompilationConfig(backend="my_eager")
        ...     "my_eager" in adaptor_names()
        True
        >>> "my_eager" in adaptor_names()
        False
    """
    return _adaptors.register(name, factory)


def adaptor_names() -> tuple[str, ...]:
    return _adaptors.names()


def get_adaptor(name: str, config) -> CompilerAdaptor:
    """Instantiate the adaptor registered as `name`.

    Raises:
        ConfigError: no adaptor has that name.
    """
    factory = _adaptors.get(name)
    if factory is None:
        raise ConfigError(
            f"backend={name!r} is not a registered compiler adaptor; known: {list(adaptor_names())}; "
            "register one with piecewise.compilers.register_adaptor"
        )
    return factory(config)


def _register_builtins() -> None:
    from .eager import EagerAdaptor
    from .inductor import InductorAdaptor

    register_adaptor("eager", EagerAdaptor)
    register_adaptor("inductor", InductorAdaptor)


_register_builtins()
