"""Host cost per piece of piecewise graphs, against its floor, on one device.

``python -m piecewise.bench.overhead`` (run by ``scripts/gpu_check.sh`` on a CUDA GPU) times one
forward of a model whose splitting op does almost nothing, so what piecewise graphs add over one
full graph is host work between the pieces:

* the model: `layers` x (``Linear(hidden, hidden)`` then the splitting op
  ``piecewise_bench::clone_split``, which copies its input into an output buffer the piece before
  allocated, as the attention ops do, so no piece copies an input before its replay), 16 layers of hidden 1024
  in bf16 by default, one call of `batch` tokens;
* systems: ``eager``, ``piecewise graphs`` (each piece replayed as a graph, the op eager in
  between) and ``piecewise full`` (the whole forward as one graph), each timed as the median of
  `rounds` medians of `steps` calls, the device synchronised after every call;
* per layer: ``(piecewise graphs - piecewise full) / layers``;
* the floor items, measured in the same process: the replay of a graph holding one kernel, one
  eager op (``x + 1``), an empty custom op through ``torch.ops`` and the splitting op itself
  (custom op and its copy); ``floor = replay + splitting op``, what one piece cannot avoid.
  ``ours = per layer - floor`` is what piecewise itself costs per piece (#15's target: <= 5 us on
  the H200, where the floor measured about 22 us a layer).

Graph capture needs the device's graph platform (`graphs.platform`); a device without one gets the
eager and floor rows and no graph rows. Prints a Markdown table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .._torch import dynamo
from ..ops import splitting_op

__all__ = ["CloneSplitModel", "measure", "main"]

CLONE_SPLIT_OP = "piecewise_bench::clone_split"


@splitting_op(CLONE_SPLIT_OP, mutates_args=("out",))
def clone_split(x: torch.Tensor, out: torch.Tensor) -> None:
    """The trivial splitting op: copies `x` (any shape and dtype) into `out` (same shape and
    dtype). The result goes into a buffer the caller allocated in the piece before, as with the
    attention ops: a fresh result would be copied into the next graph's input before every replay,
    a cost the attention ops do not pay."""
    out.copy_(x)


@clone_split.register_fake
def _(x, out):
    return None


@torch.library.custom_op("piecewise_bench::noop", mutates_args=())
def _noop(x: torch.Tensor) -> None:
    """An empty custom op: the dispatcher's cost of a ``torch.ops`` call and nothing else."""


class CloneSplitModel(torch.nn.Module):
    """``layers`` x (Linear(hidden, hidden), `clone_split`); ``forward(x [tokens, hidden]) -> [tokens,
    hidden]``."""

    def __init__(self, layers: int, hidden: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        with torch.no_grad():
            for lin in self.linears:
                lin.weight.copy_(torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
        self.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.linears:
            h = lin(x)
            x = torch.empty_like(h)  # allocated in the piece: a fixed address in its graph
            clone_split(h, x)
        return x


def _median_us(fn: Callable[[], Any], sync: Callable[[], None], steps: int, rounds: int) -> tuple[float, float, float]:
    """(median, min, max) over `rounds` of the per-round median microseconds of one ``fn()``."""
    for _ in range(5):
        fn()
    sync()
    per_round = []
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e6)
        per_round.append(statistics.median(times))
    return statistics.median(per_round), min(per_round), max(per_round)


def measure(device: str = "cuda", *, layers: int = 16, hidden: int = 1024, batch: int = 8, dtype: torch.dtype = torch.bfloat16,
            steps: int = 200, rounds: int = 5, backend: str = "inductor") -> dict[str, Any]:
    """The overhead table's figures (see module doc), microseconds: ``systems`` (name -> (median,
    min, max) per forward), ``floor_items`` (name -> (median, min, max) per call), and the per-layer
    arithmetic (``per_layer_us``, ``floor_us``, ``ours_us``; None without graph rows)."""
    import piecewise as pw
    from ..graphs.platform import resolve_platform

    torch.set_grad_enabled(False)
    platform = resolve_platform(torch.device(device).type)
    sync = platform.synchronize if platform is not None else (lambda: None)
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    systems: dict[str, tuple[float, float, float]] = {}
    model = CloneSplitModel(layers, hidden, dtype, device).eval()
    systems["eager"] = _median_us(lambda: model(x), sync, steps, rounds)
    if platform is not None:
        for name, mode in (("piecewise graphs", "piecewise"), ("piecewise full", "full")):
            dynamo.reset()
            cm = pw.compile(model, pw.CompilationConfig(backend=backend, max_num_tokens=max(batch, 8), cudagraph_mode=mode,
                                                        cudagraph_capture_sizes=[batch], tag=f"bench_overhead_{mode}"),
                            dynamic_arg_dims={"x": 0})
            cm(x)
            systems[name] = _median_us(lambda: cm(x), sync, steps, rounds)
            del cm
    floor: dict[str, tuple[float, float, float]] = {}
    y = torch.zeros(batch, hidden, device=device, dtype=dtype)
    y_out = torch.empty_like(y)
    if platform is not None:
        from ..forward_context import BatchDescriptor, ForwardContext, RuntimeMode, set_forward_context

        graph = platform.new_graph()
        # captured as a piece is (a platform may read the batch descriptor of the capture)
        with set_forward_context(ForwardContext(batch, batch, RuntimeMode.PIECEWISE, BatchDescriptor(batch))):
            platform.capture(graph, platform.new_pool(), lambda t: t.add_(1), (y,), flush=True)
        floor["graph replay (1 kernel)"] = _median_us(graph.replay, sync, steps, rounds)
    floor["eager op (x + 1)"] = _median_us(lambda: y + 1, sync, steps, rounds)
    floor["empty custom op (torch.ops)"] = _median_us(lambda: torch.ops.piecewise_bench.noop(y), sync, steps, rounds)
    floor["splitting op (custom op + copy)"] = _median_us(lambda: torch.ops.piecewise_bench.clone_split(y, y_out), sync, steps,
                                                           rounds)
    out: dict[str, Any] = {"device": device, "layers": layers, "hidden": hidden, "batch": batch, "dtype": str(dtype),
                           "steps": steps, "rounds": rounds, "systems": systems, "floor_items": floor,
                           "per_layer_us": None, "floor_us": None, "ours_us": None}
    if "piecewise graphs" in systems:
        per_layer = (systems["piecewise graphs"][0] - systems["piecewise full"][0]) / layers
        floor_us = floor["graph replay (1 kernel)"][0] + floor["splitting op (custom op + copy)"][0]
        out.update(per_layer_us=per_layer, floor_us=floor_us, ours_us=per_layer - floor_us)
    return out


def render(r: dict[str, Any]) -> str:
    lines = [f"Host cost per piece, {r['device']}, {r['layers']} layers x (Linear {r['hidden']} + clone splitting op), "
             f"{r['dtype']}, {r['batch']} tokens; median of {r['rounds']} round medians of {r['steps']} calls (min-max "
             "of the round medians), us", "", "| system | us per forward |", "|---|---:|"]
    lines += [f"| {k} | {v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f}) |" for k, v in r["systems"].items()]
    lines += ["", "| floor item | us per call |", "|---|---:|"]
    lines += [f"| {k} | {v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f}) |" for k, v in r["floor_items"].items()]
    if r["per_layer_us"] is not None:
        lines += ["", f"(piecewise graphs - piecewise full) / layers = {r['per_layer_us']:.1f} us a layer; floor (replay + "
                  f"splitting op) = {r['floor_us']:.1f} us; ours = {r['ours_us']:.1f} us a piece"]
    else:
        lines += ["", "no graph platform for this device: no graph rows"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: pass --device cpu for the eager and floor rows only")
        return 1
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    r = measure(a.device, layers=a.layers, hidden=a.hidden, batch=a.batch, dtype=dtype, steps=a.steps, rounds=a.rounds)
    print(render(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
