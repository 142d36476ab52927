"""The adaptor interface and the records it exchanges with the backend."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from ..targets import CompileTarget

__all__ = ["CompileTarget", "CompiledPiece", "CompilerAdaptor"]


@dataclasses.dataclass
class CompiledPiece:
    """A compiled callable plus, when the adaptor can save it, its serialised bytes.

    Attributes:
        fn: called as ``fn(*args)`` with the piece's runtime arguments; returns what the piece's
            graph returns.
        payload: bytes that `CompilerAdaptor.load` turns back into `fn` (None: not saveable).
    """

    fn: Callable[..., Any]
    payload: bytes | None = None


class CompilerAdaptor(abc.ABC):
    """Turns a piece graph into a callable; optionally saves and loads it.

    `compute_hash` must change whenever anything about the adaptor that changes its output
    changes (torch version, config patches, passes): it enters the cache key."""

    name: str = "?"

    def __init__(self, config) -> None:
        self.config = config

    @abc.abstractmethod
    def compute_hash(self) -> str: ...

    @abc.abstractmethod
    def compile(
        self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any], target: CompileTarget
    ) -> CompiledPiece: ...

    def prepare(self, device: str, root: str | None = None) -> None:
        """Called before this process compiles or loads pieces for `device` (before the Dynamo
        trace of a cold start, before the artifact loads of a warm start; more than once is fine):
        a chance to start per-process setup in the background, or to reuse what an earlier process
        recorded under the cache `root` (None: no cache). Default: nothing."""

    def machine_factors(self) -> dict[str, Any]:
        """What about this machine the adaptor's artifacts depend on (instruction sets, GPU
        architecture), as JSON data for the cache key: an artifact built for another machine must
        miss, not load. Default: nothing (the artifact is machine-independent)."""
        return {}

    def load(self, payload: bytes, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        """Rebuild a callable from `CompiledPiece.payload`. Adaptors that save nothing never
        receive this call."""
        raise NotImplementedError(f"adaptor {self.name!r} does not load artifacts")

    def unpack(self, payload: bytes, graph: torch.fx.GraphModule) -> dict[str, bytes]:
        """The readable form of a saved artifact, for ``artifact_format="unpacked"``: relative
        file name -> bytes (names of letters, digits, ``_.-`` and ``/``). Debugging only: the
        payload is what loads. Default: the piece's FX code as ``piece.py``."""
        return {"piece.py": graph.code.encode()}

    @property
    def saves_artifacts(self) -> bool:
        return False

    @property
    def rebuilds_from_graph(self) -> bool:
        """Whether `compile` needs nothing but the piece graph (no example inputs, no code
        generation), so a warm start may call it with empty inputs instead of loading an artifact."""
        return False

    @property
    def specializes_sizes(self) -> bool:
        """Whether a static-size compile produces different code than the general one."""
        return True
