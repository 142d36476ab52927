"""Graph capture: the platform interface, per-piece wrappers, padding and capture sizes (docs/design.md §6)."""

from .dispatch import GraphDispatcher, batch_hint
from .platform import CudaPlatform, GraphPlatform, register_platform, resolve_platform
from .subbatch import SubBatchReplay
from .wrapper import GraphEntry, GraphPool, Phase, PieceGraphWrapper

__all__ = [
    "CudaPlatform",
    "GraphDispatcher",
    "GraphEntry",
    "GraphPlatform",
    "GraphPool",
    "Phase",
    "PieceGraphWrapper",
    "SubBatchReplay",
    "batch_hint",
    "register_platform",
    "resolve_platform",
]
