"""The pass manager inside real Inductor compiles (kept few and tiny): every range and size reaches
the passes with its own target, passes may decline targets, timing and rewrite counts are logged,
a lambda pass works with the compile cache, and a failing pass names itself."""

import gc
import logging

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise._torch.onednn import packable_dtypes
from piecewise.config import CompileRange
from piecewise.passes import PiecewisePass


class Tiny(torch.nn.Module):
    """``forward(x [n, 8])``: elementwise code around a reshape chain (no splitting op),
    one Inductor leaves for our no-op elimination to collapse."""

    def forward(self, x):
        return (x.sin().reshape(-1, 2, 4).reshape(-1, 4, 2) * 2).cos()


class TargetRecorder(PiecewisePass):
    """Records what each run was compiled for and whether its graph is symbolic."""

    def __init__(self):
        self._seen = []

    def __call__(self, graph, context):
        val = next(n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)).meta["val"]
        symbolic = any(isinstance(s, torch.SymInt) for s in val.shape)
        self._seen.append((context.label, context.compile_range, context.size, symbolic))
        return 0


class StaticSizesOnly(PiecewisePass):
    def __init__(self):
        self._sizes = []

    def applies_to(self, context):
        return context.is_static

    def __call__(self, graph, context):
        self._sizes.append(context.size)
        return 0


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def pass_log():
    logger = logging.getLogger("piecewise.passes")
    handler, level = _Capture(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_user_pass_sees_the_compile_target_of_every_range_and_size(pass_log):
    rec, static = TargetRecorder(), StaticSizesOnly()
    cfg = CompilationConfig(mode="full", backend="inductor", max_num_tokens=16, compile_ranges=[8], compile_sizes=[4],
                            passes=[rec, static])
    model = Tiny()
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(compiler_invocations=3, recompiles=0):
        x = torch.randn(5, 8)
        torch.testing.assert_close(cm(x), model(x))
    assert sorted(rec._seen, key=str) == sorted(
        [
            ("range [1, 8]", CompileRange(1, 8), None, True),
            ("range [9, 16]", CompileRange(9, 16), None, True),
            ("size 4", None, 4, False),
        ],
        key=str,
    )
    assert static._sizes == [4]
    gen = torch.Generator().manual_seed(1)
    with counters.expect(compiler_invocations=0, recompiles=0):
        for n in range(1, 17):
            x = torch.randn(n, 8, generator=gen)
            torch.testing.assert_close(cm(x), model(x))

    # timing and rewrite counts: one record per pass and target, logged too
    records = cm.backend.adaptor.passes.records
    assert [r.name for r in records if r.target == "size 4"] == [
        "noop_elimination", "TargetRecorder", "StaticSizesOnly", *(["packed_linear"] if packable_dtypes() else []),
        "reinplace_custom_ops",
    ]
    skipped = [(r.name, r.target) for r in records if not r.ran]
    assert sorted(skipped) == [("StaticSizesOnly", "range [1, 8]"), ("StaticSizesOnly", "range [9, 16]")]
    noop = [r for r in records if r.name == "noop_elimination"]
    assert len(noop) == 3 and all(r.rewrites >= 1 and r.seconds > 0 for r in noop)  # the reshape chain
    assert any(line.startswith("pass noop_elimination for range [1, 8]: ") and "rewrites in" in line for line in pass_log)
    assert any("StaticSizesOnly skipped for range [9, 16]" in line for line in pass_log)


class Unpicklable(PiecewisePass):
    """Holds a lock: a pass is never pickled, so the artifact still saves and loads."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()

    def __call__(self, graph, context):
        with self._lock:
            return 0


def test_a_lambda_pass_works_with_the_cache():
    calls = []
    cfg = CompilationConfig(mode="full", backend="inductor", max_num_tokens=8, tag="passes_lambda",
                            passes=[lambda graph: calls.append(len(graph.nodes)), Unpicklable()])
    x = torch.randn(3, 8)
    cm = pw.compile(Tiny(), cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(cache_misses=1, compiler_invocations=1, artifacts_saved=1):
        torch.testing.assert_close(cm(x), Tiny()(x))
    assert len(calls) == 1

    del cm
    gc.collect()  # releases the tag
    torch._dynamo.reset()
    cm = pw.compile(Tiny(), cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(cache_hits=1, cache_loads=1, compiler_invocations=0):
        torch.testing.assert_close(cm(x), Tiny()(x))
    assert len(calls) == 1  # a hit runs no Inductor, so no pass


def test_a_failing_pass_names_itself_and_the_target():
    def boom(graph):
        raise RuntimeError("bad rewrite")

    cfg = CompilationConfig(mode="full", backend="inductor", max_num_tokens=8, passes=[boom])
    cm = pw.compile(Tiny(), cfg, dynamic_arg_dims={"x": 0})
    with pytest.raises(Exception, match=r"post-grad pass 'boom' failed for general: RuntimeError: bad rewrite"):
        cm(torch.randn(3, 8))
