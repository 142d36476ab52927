"""What following module attribute changes costs: per-call dispatch, an assignment, a look.

    .venv/bin/python benchmarks/module_attributes.py                  # SmolLM2-shaped, random weights
    .venv/bin/python benchmarks/module_attributes.py --guard-manager  # also time the rejected design

A compiled model follows a plain attribute assigned after its first call (``norm.eps = 10.0``)
through the state epoch (`piecewise.state`): ``Module.__setattr__`` moves the epoch for a watched
module, and each call compares one integer. This script prints, on a transformers
``LlamaForCausalLM`` shaped as SmolLM2-135M (397 modules, random weights, fp32, CPU, eager adaptor):

* ``dispatch``: one call of the compiled model with its compiled forward replaced by a stub that
  returns at once, so what is timed is piecewise's per-call work only (argument checks, the epoch,
  the per-call code guard); run it on a checkout before the change (``PYTHONPATH=<old>/src``) for
  the "before" figure; and the same calls in rounds alternating between the watch on and undone
  (torch's ``Module.__setattr__`` put back, nothing watched), each round the best of 3, which
  compares the two in one process;
* ``setattr``: ``module.attr = value`` on a module no compiled model holds, on one it holds (that
  moves the epoch), and torch's own ``Module.__setattr__`` unwrapped;
* ``look after an assignment``: the first call after an assignment that changes nothing the trace
  read (the module described again and compared, no new trace);
* with ``--guard-manager``: Dynamo's C++ guard manager holding only the trace's guards on module
  attribute values (``CONSTANT_MATCH``, ``EQUALS_MATCH``, ``ID_MATCH`` outside parameter slots),
  the design that checks them on every call instead, for comparison.

Each figure is the median over `--repeats` rounds of `--number` calls, with the rounds' min and max.
Not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import timeit


def _rounds(fn, number: int, repeats: int) -> dict[str, float]:
    per = [t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeats)]
    return {"median_us": statistics.median(per), "min_us": min(per), "max_us": max(per)}


def _show(name: str, r: dict[str, float]) -> None:
    print(f"| {name} | {r['median_us']:.3f} | {r['min_us']:.3f} | {r['max_us']:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=2000, help="calls a round")
    p.add_argument("--repeats", type=int, default=15, help="rounds")
    p.add_argument("--guard-manager", action="store_true", help="also time the trace's attribute guards per check")
    a = p.parse_args(argv)
    os.environ.setdefault("PIECEWISE_CACHE_DIR", tempfile.mkdtemp(prefix="pw-attr-bench-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="pw-attr-bench-inductor-"))
    import warnings

    import torch

    import piecewise as pw
    from piecewise import state
    from piecewise import trace as trace_mod
    from piecewise.bench.generation import smollm2_shaped

    captured: dict[str, object] = {}
    if a.guard_manager:  # keep the capture to build a guard manager of our own from it
        build = trace_mod._build_guards

        def spy(gco, code, **kw):
            captured.setdefault("gco", gco)
            captured.setdefault("code", code)
            return build(gco, code, **kw)

        trace_mod._build_guards = spy

    model = smollm2_shaped("cpu", torch.float32)
    modules = len(list(model.modules()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=64), dynamic_arg_dims={"input_ids": 1})
        ids = torch.randint(0, 1000, (1, 8))
        cm(ids)
    reads = getattr(state, "read_attributes", None)  # a checkout before the change has none
    read = reads(model) if reads is not None else None
    print(f"piecewise from {os.path.dirname(pw.__file__)}, torch {torch.__version__}, {modules} modules, "
          f"{len(read) if read is not None else 'n/a'} plain attributes read by the trace, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}")
    print(f"median of {a.repeats} rounds of {a.number} calls, us a call\n")
    print("| what | median | min | max |\n|---|---|---|---|")

    traced = cm._fast
    cm._fast = lambda module, *args, **kwargs: None  # dispatch only: the forward is a stub
    _show("dispatch (compiled forward stubbed)", _rounds(lambda: cm(ids), a.number, a.repeats))
    wrapped = torch.nn.Module.__setattr__
    if hasattr(wrapped, "__wrapped__") and hasattr(state, "_WATCHED"):
        # the same calls with the watch undone (torch's __setattr__ back, nothing watched), rounds
        # alternating in this process: what following attributes adds to a call, free of the
        # differences between processes
        held = dict(state._WATCHED)
        on: list[float] = []
        off: list[float] = []
        for _ in range(a.repeats):
            for undone, out in ((False, on), (True, off)):
                torch.nn.Module.__setattr__ = wrapped.__wrapped__ if undone else wrapped
                state._WATCHED.clear() if undone else state._WATCHED.update(held)
                out.append(min(timeit.repeat(lambda: cm(ids), number=a.number, repeat=3)) / a.number * 1e6)
        torch.nn.Module.__setattr__ = wrapped
        state._WATCHED.update(held)
        for name, xs in (("dispatch, alternating: watching on", on), ("dispatch, alternating: watching undone", off)):
            _show(name, {"median_us": statistics.median(xs), "min_us": min(xs), "max_us": max(xs)})

    free = torch.nn.LayerNorm(8)  # a module no compiled model holds
    norm = model.model.layers[0].input_layernorm
    eps = norm.variance_epsilon
    original = getattr(torch.nn.Module.__setattr__, "__wrapped__", torch.nn.Module.__setattr__)
    _show("torch's Module.__setattr__ (unwrapped)", _rounds(lambda: original(free, "eps", 1e-5), a.number, a.repeats))
    _show("setattr on a module no compiled model holds", _rounds(lambda: setattr(free, "eps", 1e-5), a.number, a.repeats))
    _show("setattr on a compiled model's module", _rounds(lambda: setattr(norm, "variance_epsilon", eps), a.number,
                                                              a.repeats))

    def look() -> None:
        norm.variance_epsilon = eps  # same value: the next call describes and compares, no trace
        cm(ids)

    before = pw.counters.snapshot()
    _show("look after an assignment (setattr + describe + compare)", _rounds(look, 20, 5))
    assert not pw.counters.delta_since(before).get("dynamo_traces"), "an assignment of the same value traced again"
    cm._fast = traced

    if a.guard_manager:
        from torch._dynamo.hooks import Hooks
        from torch._dynamo.utils import dynamo_timed, get_metrics_context

        roots = ("args[0]", "L['args'][0]", "self", "L['self']")

        def keep(g) -> bool:
            return (g.name.startswith(roots) and g.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH", "ID_MATCH")
                    and "._parameters[" not in g.name)

        with torch.no_grad(), get_metrics_context(), dynamo_timed("module_attribute_guards"):
            gm = captured["gco"].build_guards(captured["code"], hooks=Hooks(
                guard_filter_fn=lambda entries: [keep(g) for g in entries])).guard_manager
        f_locals = cm.frame_locals((ids,), {})
        f_locals.setdefault("args", (model, ids))
        if not gm.check(f_locals):
            print("(the guard manager fails on the traced call; figure not meaningful)")
        _show("rejected: guard manager of attribute value guards, one check", _rounds(lambda: gm.check(f_locals), a.number,
                                                                                       a.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
