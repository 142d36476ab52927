"""Patches of ``torch.nn.Module`` (and of torch's two global forward-hook registration functions
and of hook handles' ``remove``) that let piecewise notice a change of module state without a
check per call (``piecewise.state``: the state epoch).

What is patched, with wrappers ``piecewise.state`` builds (the logic stays there; this module only
puts them on torch and takes them off again):

- ``nn.Module._apply``, ``train``, ``register_forward_hook``, ``register_forward_pre_hook``,
  ``register_parameter``, ``__delattr__``: wrapped to move the epoch after they run;
- ``nn.Module.__setattr__``: wrapped to move the epoch for a watched module and name;
- ``torch.utils.hooks.RemovableHandle.remove``: wrapped to move the epoch when a module forward
  hook is removed;
- ``torch.nn.modules.module.register_module_forward_hook`` / ``..._pre_hook`` (and their
  re-exports in ``torch.nn.modules``): wrapped like the methods;
- torch's public global parameter, buffer and module registration hooks: registered.

Installed at the first ``piecewise.compile`` (never by ``import piecewise``), removed when the
last compiled model is freed. Cost while installed: about 0.2-0.4 us more per
``Module.__setattr__`` anywhere in the process; nothing per compiled call.

Verified on torch 2.13.0 (CPU): the names above are plain Python attributes of ``nn.Module`` and
of ``torch.nn.modules.module`` (Dynamo reads ``Module.__setattr__`` by identity when it traces, so
the installed wrapper is what it sees); the registration hooks return a ``RemovableHandle``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install_module_patches", "uninstall_module_patches", "module_patches_installed", "MODULE_METHODS",
           "GLOBAL_HOOK_FUNCTIONS", "global_forward_hooks"]

#: ``nn.Module`` methods wrapped to move the epoch after they run
MODULE_METHODS = ("_apply", "train", "register_forward_hook", "register_forward_pre_hook", "register_parameter",
                  "__delattr__")
#: functions of ``torch.nn.modules.module`` that register a hook for every module
GLOBAL_HOOK_FUNCTIONS = ("register_module_forward_hook", "register_module_forward_pre_hook")

_lock = threading.RLock()
#: (owner, name, original, wrapper) of every attribute patched, and the registration-hook handles
_patched: list[tuple[Any, str, Any, Any]] = []
_handles: list[Any] = []


def global_forward_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    """torch's forward hooks and pre-hooks registered for every module
    (``torch.nn.modules.module._global_forward_hooks`` / ``_global_forward_pre_hooks``: handle id ->
    hook, the live dicts). Why: a compiled model's state description holds them (the trace inlined
    them), and the reference decoder refuses a model that would run one it cannot."""
    from torch.nn.modules import module as nn_module

    return nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks


def _marked(fn: Any) -> bool:
    return bool(getattr(fn, "__piecewise_bumps__", False))


def _patch(owner: Any, name: str, wrapper: Any) -> None:
    original = getattr(owner, name)
    setattr(owner, name, wrapper)
    _patched.append((owner, name, original, wrapper))


def install_module_patches(registration_hook: Callable[..., None], bumping: Callable[[Any, bool], Any],
                           watching_setattr: Callable[[Any], Any], removing: Callable[[Any], Any]) -> None:
    """Put piecewise's wrappers on torch (see the module doc); a no-op where they are on already.

    `registration_hook` is registered as torch's global parameter, buffer and module registration
    hook; ``bumping(fn, mark_handle)`` wraps each of `MODULE_METHODS` and `GLOBAL_HOOK_FUNCTIONS`
    (``mark_handle`` for those that return a forward-hook handle); ``watching_setattr(fn)`` wraps
    ``Module.__setattr__`` and ``removing(fn)`` ``RemovableHandle.remove``. A wrapper is recognised
    by its ``__piecewise_bumps__`` attribute and never wrapped twice."""
    import torch.nn.modules as nn_modules
    from torch.nn.modules import module as nn_module
    from torch.utils.hooks import RemovableHandle

    with _lock:
        if _patched or _handles:
            return
        _handles.extend([nn_module.register_module_parameter_registration_hook(registration_hook),
                         nn_module.register_module_buffer_registration_hook(registration_hook),
                         nn_module.register_module_module_registration_hook(registration_hook)])
        for name in MODULE_METHODS:
            if not _marked(getattr(torch.nn.Module, name)):
                _patch(torch.nn.Module, name, bumping(getattr(torch.nn.Module, name), name.startswith("register_forward")))
        if not _marked(torch.nn.Module.__setattr__):
            _patch(torch.nn.Module, "__setattr__", watching_setattr(torch.nn.Module.__setattr__))
        if not _marked(RemovableHandle.remove):
            _patch(RemovableHandle, "remove", removing(RemovableHandle.remove))
        for name in GLOBAL_HOOK_FUNCTIONS:
            original = getattr(nn_module, name)
            if not _marked(original):
                wrapped = bumping(original, True)
                _patch(nn_module, name, wrapped)
                if getattr(nn_modules, name, None) is original:  # re-exported by torch.nn.modules
                    _patch(nn_modules, name, wrapped)


def uninstall_module_patches() -> None:
    """Take piecewise's wrappers off torch again and remove its registration hooks. An attribute
    something else replaced after us (a wrapper of our wrapper) is left as it is: taking ours out
    from under it is not possible, and it keeps working (the epoch just moves for nobody)."""
    with _lock:
        for owner, name, original, wrapper in reversed(_patched):
            if getattr(owner, name) is wrapper:
                setattr(owner, name, original)
        _patched.clear()
        for handle in _handles:
            handle.remove()
        _handles.clear()


def module_patches_installed() -> bool:
    """Whether `install_module_patches` put its wrappers on and they were not taken off since."""
    with _lock:
        return bool(_patched or _handles)
