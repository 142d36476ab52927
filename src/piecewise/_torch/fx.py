"""FX and tracing-context internals piecewise depends on: lazy graph modules, qualified names,
FX's graph pickler, the symbolic-shapes config (``torch.fx.experimental._config``) and torch's
tracing and compile contexts (``torch._guards``).

Verified on torch 2.13.0 (CPU). ``torch.fx._graph_pickler`` is imported on first use (``import
torch`` does not import it; it exists since torch 2.6); a name this torch lacks raises ImportError
where it is imported, as a direct import did.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.fx.experimental._config as _fx_config
from torch._guards import CompileContext, TracingContext, detect_fake_mode, tracing
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import _get_qualified_name

from ._lazy import lazy_names

__all__ = ["torch_check", "force_recompile", "qualified_name", "backed_size_oblivious", "size_oblivious_patch", "detect_fake_mode",
           "CompileContext", "TracingContext", "tracing", "GraphPickler", "GraphPicklerOptions"]

#: ``torch._guards.detect_fake_mode(inputs)``: the fake mode Dynamo's example inputs were made
#: in (the backend makes fakes in it); ``TracingContext`` / ``CompileContext`` / ``tracing``: the
#: context of the compile in progress (the traced code objects, Dynamo's compile id; ``trace``
#: runs the backend inside a tracing context of its own, as Dynamo does).

#: ``torch._check(cond)``: a size fact for the trace's shape environment (a fake kernel tells the
#: trace that two sizes are equal, so it keeps one dynamic dim, ``serving.llama``).
torch_check = torch._check


def force_recompile(gm: torch.fx.GraphModule) -> None:
    """``torch.fx._lazy_graph_module._LazyGraphModule.force_recompile(gm)``: generate `gm`'s code
    now. Why: lazy graph modules generate it on the first call through ``Module.__call__``, and
    piecewise calls the generated ``forward`` directly (``split.fx_forward``)."""
    _LazyGraphModule.force_recompile(gm)


def qualified_name(target: Any) -> str:
    """``torch.fx.node._get_qualified_name(target)``: the dotted name FX's generated code looks a
    function up by (``torch.nn.functional.silu``); ``split.shadowed_torch_functions`` resolves it
    to find torch functions a user replaced. Raises what FX raises for an unnamed target."""
    return _get_qualified_name(target)


def backed_size_oblivious() -> bool:
    """``torch.fx.experimental._config.backed_size_oblivious``: whether the trace in progress
    decides backed sizes size-obliviously (``dynamic_shapes='backed_size_oblivious'``)."""
    return bool(_fx_config.backed_size_oblivious)


def size_oblivious_patch(oblivious: bool) -> Any:
    """``torch.fx.experimental._config.patch(backed_size_oblivious=oblivious)``: a context in which
    a trace decides backed sizes size-obliviously (piecewise's default ``dynamic_shapes``); torch's
    only switch for it."""
    return _fx_config.patch(backed_size_oblivious=oblivious)


#: ``GraphPickler`` (``torch.fx._graph_pickler``): pickles an FX graph module without its
#: metadata, what a warm start saves and loads a split graph with; ``GraphPicklerOptions`` is its
#: ``Options``. Imported on first use.
__getattr__ = lazy_names({
    "GraphPickler": "torch.fx._graph_pickler:GraphPickler",
    "GraphPicklerOptions": "torch.fx._graph_pickler:Options",
}, globals())
