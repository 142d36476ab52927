"""Inductor internals piecewise depends on.

Verified on torch 2.13.0 (CPU) and written against the 2.11 source (the GPU machine's build).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["size_oblivious_view_strides"]

log = logging.getLogger("piecewise")


@contextlib.contextmanager
def size_oblivious_view_strides() -> Iterator[None]:
    """While a piece compiles, let Inductor's ``view`` lowering decide a view's strides
    size-obliviously when the trace itself was size-oblivious (``backed_size_oblivious``).

    Why: ``torch._inductor.ir.View.create`` computes the strides of a view of a non-contiguous
    buffer with ``torch._subclasses.fake_impls._compute_stride(..., size_oblivious=<unbacked sizes
    only>)``. For backed dynamic sizes it then branches on ``size != 1`` for every dim, adding a
    guard ``Ne(s, 1)`` to the trace's shape environment: a nanoGPT-style
    ``y.transpose(1, 2).reshape(B, T, D)`` after attention made a trace at ``T = 16`` hold for
    ``T >= 2`` only, although the trace itself (and the eager adaptor) serves ``T = 1``. Decided
    size-obliviously, a dim of unknown size is taken to be other than 1: the strides found are
    valid for size 1 too (a size-1 dim's stride is never multiplied by a non-zero index), and
    where no view is found the lowering copies instead, which is right for every size. Dynamo's
    own fake kernels already decide views this way under ``backed_size_oblivious``.

    A no-op when the trace was not size-oblivious, or where this torch has no ``_compute_stride``
    (another torch: the guards then refuse or trace the sizes as before).

    Patched: ``torch._subclasses.fake_impls._compute_stride`` (looked up by name by
    ``View.create`` at each call in torch 2.11-2.13), restored on exit. Callers hold torch's
    compile lock, so no other thread compiles meanwhile.
    """
    import torch.fx.experimental._config as fx_config

    try:
        import torch._subclasses.fake_impls as fake_impls
    except ImportError:  # pragma: no cover - another torch
        yield
        return
    original = getattr(fake_impls, "_compute_stride", None)
    if original is None or not fx_config.backed_size_oblivious:
        yield
        return

    @functools.wraps(original)
    def compute_stride(old_shape: Any, old_stride: Any, new_shape: Any, size_oblivious: bool = False) -> Any:
        return original(old_shape, old_stride, new_shape, size_oblivious=True)

    fake_impls._compute_stride = compute_stride
    try:
        yield
    finally:
        fake_impls._compute_stride = original
