"""Dynamo internals piecewise depends on.

Verified on torch 2.13.0 (CPU). Dynamo's submodules are imported on first use of a name (``import
torch`` does not import ``torch._dynamo``), so a name used inside a function costs what the direct
import there cost; a name this torch lacks raises ImportError where it is imported, as the direct
import did (callers that degrade catch it as before).

``torch._dynamo.output_graph.OutputGraph.call_user_compiler``
re-raises a backend's `ShortenTraceback` as it is and wraps every other exception in
``BackendCompilerFailed``; ``eval_frame`` re-raises a `ShortenTraceback` after trimming Dynamo's
frames (none when ``first_useful_frame`` is None).
"""

from __future__ import annotations

from typing import Any

from ._lazy import lazy_names

__all__ = ["unwrapped_by_dynamo", "automatic_dynamic_shapes", "compiled_frames"]

#: name -> where in Dynamo it lives, each with why piecewise needs it.
_NAMES = {
    # entry points and marks: piecewise's trace is Dynamo's full-graph capture (``trace``), run
    # under Dynamo's compile lock (``api``), with the dims it marks dynamic or unbacked
    "convert_frame": "torch._dynamo.convert_frame",  # fullgraph_capture: the trace itself
    "compile_lock": "torch._dynamo.convert_frame:compile_lock",
    "mark_dynamic": "torch._dynamo:mark_dynamic",
    "mark_unbacked": "torch._dynamo.decorators:mark_unbacked",
    "reset": "torch._dynamo:reset",  # benchmarks start each measured compile from a cold Dynamo
    "config": "torch._dynamo.config",
    "eval_frame": "torch._dynamo.eval_frame",
    "OptimizedModule": "torch._dynamo.eval_frame:OptimizedModule",
    # errors a trace raises, which piecewise turns into its own typed errors (``api``)
    "Unsupported": "torch._dynamo.exc:Unsupported",
    "UserError": "torch._dynamo.exc:UserError",
    "TorchRuntimeError": "torch._dynamo.exc:TorchRuntimeError",
    # guards: built by the trace, saved and rebuilt by a warm start (``trace``)
    "CheckFunctionManager": "torch._dynamo.guards:CheckFunctionManager",
    "guard_closure_vars": "torch._dynamo.guards:_get_closure_vars",  # ``___odict_getitem`` and kin
    "Hooks": "torch._dynamo.hooks:Hooks",
    "torch_function_mode_stack_state_mgr": "torch._dynamo.variables.torch_function:torch_function_mode_stack_state_mgr",
    # saving the transformed code and its guards for a warm start (``trace``)
    "AOTCompilePickler": "torch._dynamo.aot_compile:AOTCompilePickler",
    "AOTCompileUnpickler": "torch._dynamo.aot_compile:AOTCompileUnpickler",
    "SerializedCode": "torch._dynamo.package:SerializedCode",
    "load_guard_manager": "torch._dynamo.package:load_guard_manager",
    "load_guards_state": "torch._dynamo.package:load_guards_state",
    # metrics and counters: the trace is timed as Dynamo times its compiles; the recompile reason;
    # benchmarks and the demo count Dynamo's graphs and read its compile times
    "dynamo_timed": "torch._dynamo.utils:dynamo_timed",
    "get_metrics_context": "torch._dynamo.utils:get_metrics_context",
    "counters": "torch._dynamo.utils:counters",
    "compilation_time_metrics": "torch._dynamo.utils:compilation_time_metrics",
    # which tensors share memory (the re-inplacing pass); Dynamo's guard helper in C
    "compute_overlapping_tensors": "torch._C._dynamo.guards:compute_overlapping_tensors",
}
__getattr__ = lazy_names(_NAMES, globals())


def automatic_dynamic_shapes(enabled: bool) -> Any:
    """``torch._dynamo.config.patch(automatic_dynamic_shapes=enabled)``. Why: a trace's dims are
    dynamic only where ``dynamic_arg_dims`` says so; Dynamo's automatic dynamic shapes would make a
    second trace of the same code dynamic in whatever differed from the first."""
    import torch._dynamo.config

    return torch._dynamo.config.patch(automatic_dynamic_shapes=enabled)


def compiled_frames() -> int:
    """``torch._dynamo.utils.counters["stats"]["unique_graphs"]``: how many graphs Dynamo has
    compiled in this process (the demo and benchmarks count recompiles by it)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]

_classes: dict[type, type] = {}


def unwrapped_by_dynamo(error: BaseException) -> BaseException:
    """`error` as an instance of a subclass of its own class and Dynamo's `ShortenTraceback`, so
    that raised from a backend it reaches the caller of ``torch.compile``'d code as itself (``except
    piecewise.ConfigError`` catches it) rather than wrapped in ``BackendCompilerFailed``. Same
    message, cause and attributes; `error` itself where this torch has no `ShortenTraceback` or the
    classes cannot be combined."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover - another torch
        return error
    cls = type(error)
    if isinstance(error, ShortenTraceback):
        return error
    combined = _classes.get(cls)
    if combined is None:
        try:
            combined = type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__,
                                                                    "__init__": _init})
        except TypeError:  # layouts that cannot be combined
            return error
        _classes[cls] = combined
    out = combined(*error.args)
    out.__dict__.update(error.__dict__)
    out.__cause__, out.__context__ = error.__cause__, error.__context__
    return out


def _init(self: Any, *args: Any) -> None:
    BaseException.__init__(self, *args)
    self.first_useful_frame = None
