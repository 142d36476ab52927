"""What one compile is for: a compile range of token counts, one static size, or the general
(symbolic) shape (docs/design.md §4.6). The config names ranges; adaptors, passes and the entry
table compile for targets; both live here so neither imports the other."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["CompileRange", "CompileTarget"]


@dataclasses.dataclass(frozen=True, order=True)
class CompileRange:
    """An inclusive range of runtime token counts `[start, end]` compiled as one artifact.

    `CompilationConfig.ranges()` derives them from ``compile_ranges``; adaptors and passes see the
    one being compiled as ``PassContext.compile_range``.

    Examples:
        >>> from piecewise import CompileRange
        >>> r = CompileRange(17, 256)
        >>> 17 in r, 300 in r, str(r)
        (True, False, '[17, 256]')
    """

    start: int
    end: int

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and self.start <= n <= self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """What one compile is for: the general shape, one range, or one static size.

    Exactly one of `compile_range` / `size` is set for a range or size compile; neither for the
    general compile."""

    compile_range: CompileRange | None = None
    size: int | None = None
    #: the sympy symbol of the dispatch dim (the token count) in the piece's example inputs
    symbol: Any = dataclasses.field(default=None, compare=False, hash=False)

    @property
    def label(self) -> str:
        if self.size is not None:
            return f"size {self.size}"
        if self.compile_range is not None:
            return f"range {self.compile_range}"
        return "general"

    @property
    def key(self) -> str:
        """A file-name-safe token naming this target (cache artifact names)."""
        if self.size is not None:
            return f"size_{self.size}"
        if self.compile_range is not None:
            return f"range_{self.compile_range.start}_{self.compile_range.end}"
        return "general"
