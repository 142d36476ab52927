"""Deciding whether and how a compiled model captures graphs, and installing the wrappers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..counters import counters
from .dispatch import GraphDispatcher, StaticInput
from .platform import resolve_platform
from .wrapper import GraphRunner, PieceGraphWrapper

__all__ = ["graph_plan", "install_graphs"]

log = logging.getLogger("piecewise")
_logged_no_platform: set[str] = set()


def _token_dim(x: Any, symbol: Any) -> int | None | bool:
    """The dim of `x` equal to the token symbol; None without one; False when the symbol appears
    in a dim in another form (2*s, s+1): such an input cannot be padded row by row."""
    if not isinstance(x, torch.Tensor):
        return None
    found = None
    for d, s in enumerate(x.shape):
        if isinstance(s, torch.SymInt) and symbol in s.node.expr.free_symbols:
            if s.node.expr != symbol or found is not None:
                return False
            found = d
    return found


def graph_plan(fake_inputs: Sequence[Any], fake_outputs: Any, symbol: Any, tag: str) -> dict[str, Any]:
    """What graph capture needs to know about a graph, as plain data (saved in warm-start bundles).

    Returns ``{"device": str, "static_inputs": [[input index, token dim], ...], "output_dims":
    [token dim or None per output]}``, or with ``"refused": reason`` when inputs cannot be padded."""
    device = next((x.device.type for x in fake_inputs if isinstance(x, torch.Tensor)), "cpu")
    statics: list[list[int]] = []
    for i, x in enumerate(fake_inputs):
        d = _token_dim(x, symbol)
        if d is False:
            return {"device": device, "refused": f"graph input {i} has the token count inside a dim expression"}
        if d is not None:
            statics.append([i, d])
    outs = fake_outputs if isinstance(fake_outputs, (tuple, list)) else (fake_outputs,)
    output_dims = []
    for o in outs:
        d = _token_dim(o, symbol)
        output_dims.append(None if d is None or d is False else d)
    return {"device": device, "static_inputs": statics, "output_dims": output_dims}


def install_graphs(backend, stitched, plan: dict[str, Any]) -> GraphDispatcher | None:
    """A `GraphDispatcher` for `stitched`, with piece wrappers installed in its split module, or None
    when graphs do not apply (mode ``none``, no graph platform for the device, inputs that cannot be
    padded). `plan` comes from `graph_plan`."""
    config, tag = backend.config, backend.tag
    mode = config.cudagraph_mode
    if mode == "none":
        return None
    device = plan["device"]
    platform = resolve_platform(device)
    if platform is None:
        if device not in _logged_no_platform:
            _logged_no_platform.add(device)
            log.info("no graph platform for device %r: cudagraph_mode=%r resolves to 'none'", device, mode)
        return None
    if "refused" in plan:
        log.warning("[%s] %s; capturing no graphs", tag, plan["refused"])
        return None
    statics = [StaticInput(i, d) for i, d in plan["static_inputs"]]
    from .capture_sizes import default_capture_sizes, validate_capture_sizes

    sizes = config.cudagraph_capture_sizes or default_capture_sizes(config.max_num_tokens)
    sizes, _dropped = validate_capture_sizes(sizes, config.max_num_tokens)
    runner = GraphRunner(platform, debug=config.debug, tag=tag)
    split_gm = stitched.split_gm
    if mode in ("piecewise", "full_and_piecewise"):
        for i, r in enumerate(backend.runners):
            w = PieceGraphWrapper(r, runner, mode="piecewise", first=(i == 0), name=r.name)
            split_gm.__dict__[r.name] = w
            backend.stitched_wrappers.append(w)
        counters.bump("capturable_pieces", len(backend.runners), tag=tag)
    backend.graph_runner = runner
    return GraphDispatcher(stitched.forward, runner, sizes, sym_index=stitched.sym_index, static_inputs=statics,
                           output_dims=list(plan["output_dims"]), cudagraph_mode=mode, max_num_tokens=config.max_num_tokens,
                           select_entry=stitched.select_entry, plain=stitched.run_plain, tag=tag)
