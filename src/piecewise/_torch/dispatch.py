"""Dispatcher state piecewise reads (``torch._C``'s mode, autocast and storage queries, the
profiler flag, ``torch.utils._python_dispatch``, ``torch._dispatch.python``).

Verified on torch 2.13.0 (CPU); every name here is imported by ``import torch`` since torch 2.1.
"""

from __future__ import annotations

import torch
import torch.autograd.profiler
from torch._C import _has_storage, _is_any_autocast_enabled
from torch._dispatch.python import enable_python_dispatcher
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["dispatch_is_plain", "is_any_autocast_enabled", "has_storage", "disable_current_modes",
           "enable_python_dispatcher", "TorchDispatchMode"]

#: ``torch._C._is_any_autocast_enabled()``: whether autocast is on for any device. One C call:
#: a compiled model checks it on every call (autocast is state Dynamo guards and guard-free
#: dispatch does not).
is_any_autocast_enabled = _is_any_autocast_enabled

#: ``torch._C._has_storage(t)``: whether tensor `t` has a storage (fakes and some subclasses have
#: none); the no-op pass compares storages.
has_storage = _has_storage

#: ``torch.utils._python_dispatch._disable_current_modes()``: a context that leaves every dispatch
#: mode the caller runs under, so a piece's fakes run on fake tensors only (``piece``).
disable_current_modes = _disable_current_modes

#: ``torch._dispatch.python.enable_python_dispatcher()``: a context that routes ops through their
#: Python kernels (the decompositions a fake run of a graph needs, ``backend``).
enable_python_dispatcher = enable_python_dispatcher

#: ``torch.utils._python_dispatch.TorchDispatchMode``: the base class of a dispatch mode (the fake
#: graph platform of ``piecewise.testing`` watches what a capture runs with one); torch has no
#: public spelling of it.
TorchDispatchMode = TorchDispatchMode


def dispatch_is_plain() -> bool:
    """No torch-function mode, no dispatch mode, no profiler and no autocast is on: a splitting op
    may be called as its Python function (``ops.DirectCall``) with nothing skipped. Reads
    ``torch._C._is_torch_function_mode_enabled``, ``torch._C._len_torch_dispatch_stack``,
    ``torch.autograd.profiler._is_profiler_enabled`` and ``torch._C._is_any_autocast_enabled``."""
    return not (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
                or torch.autograd.profiler._is_profiler_enabled or torch._C._is_any_autocast_enabled())


