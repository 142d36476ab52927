"""The ``eager`` adaptor: the piece runs as traced, without code generation.

Splitting and (on accelerators) graph capture still apply, which is the compile-free path. Sizes and
ranges do not change the code, so every target shares the same callable.
"""

from __future__ import annotations

import hashlib

import torch

from .base import CompiledPiece, CompilerAdaptor

__all__ = ["EagerAdaptor"]


class EagerAdaptor(CompilerAdaptor):
    name = "eager"

    def compute_hash(self) -> str:
        return hashlib.sha256(f"eager:{torch.__version__}".encode()).hexdigest()[:16]

    def compile(self, graph, example_inputs, target) -> CompiledPiece:
        # The bound forward skips nn.Module.__call__ (hooks, ~µs per call) on the hot path.
        from ..split import fx_forward

        return CompiledPiece(fx_forward(graph))

    @property
    def rebuilds_from_graph(self) -> bool:
        return True

    @property
    def specializes_sizes(self) -> bool:
        return False
