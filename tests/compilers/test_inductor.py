"""The inductor adaptor: ranges, static sizes, dedupe, equality with eager (real Inductor compiles;
they share the session's TORCHINDUCTOR_CACHE_DIR)."""

import uuid

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.testing.toy import ToyTransformer, TwoSplitModel


class SymIntRecorder(CustomGraphPass):
    """Records, per compiled graph, whether any value in it is symbolic."""

    def __init__(self):
        self.graphs: list[bool] = []
        self._uuid = uuid.uuid4().hex  # a fresh uuid: Inductor's FX cache must not skip the pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        def symbolic(v):
            if isinstance(v, torch.Tensor):
                return any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))
            return isinstance(v, torch.SymInt)

        self.graphs.append(any(symbolic(n.meta.get("val")) for n in graph.nodes))

    def uuid(self):
        return self._uuid


def test_ranges_and_sizes_compile_once_each_and_sizes_are_static():
    rec = SymIntRecorder()
    model = ToyTransformer(num_layers=3, dim=16)
    cfg = CompilationConfig(backend="inductor", max_num_tokens=32, compile_ranges=[8], compile_sizes=[4],
                            inductor_options={"post_grad_custom_post_pass": rec})
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    # 3 distinct pieces x (2 ranges + 1 size)
    with counters.expect(compiler_invocations=9, pieces_compiled=4, recompiles=0):
        x = torch.randn(5, 16)
        torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    # Size compiles are static. The two range compiles of a piece lower to the same symbolic graph, so
    # Inductor's own cache may serve the second one without rerunning post-grad passes.
    assert rec.graphs.count(False) == 3
    assert 3 <= rec.graphs.count(True) <= 6
    table, state = cm.backend.table, cm.backend.runners[0].state
    gen = torch.Generator().manual_seed(0)
    with counters.expect(compiler_invocations=0, recompiles=0, graphs_seen=0):
        for n in (1, 4, 7, 8, 9, 31, 32):
            x = torch.randn(n, 16, generator=gen)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
            entry = table.entries[state.entry]
            if n == 4:
                assert entry.target.size == 4
            else:
                assert n in entry.target.compile_range


def test_two_split_model_inductor_equals_eager_every_size():
    model = TwoSplitModel()
    cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_tokens=24), dynamic_arg_dims={"x": 0})
    with counters.expect(pieces_seen=5, pieces_compiled=3, compiler_invocations=3, recompiles=0):
        for n in range(1, 25):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)


class CantSplit(Exception):
    """Named as Inductor's Triton tiling error (`torch._inductor.codegen.simd.CantSplit`)."""


class TilingFault(CustomGraphPass):
    """Raises ``CantSplit`` in every compile whose Inductor config has not the patches in `until`
    (always, with ``until=None``), as Triton's tiling did for a piece with two dynamic sizes on an
    H200 (torch 2.11); counts the compiles it saw."""

    def __init__(self, until: dict | None):
        self.until, self.calls = until, 0
        self._uuid = uuid.uuid4().hex

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor import config

        self.calls += 1
        if self.until is None or any(config.get_config_copy()[k] != v for k, v in self.until.items()):
            raise CantSplit("64*s70 not divisible by s44*s70")

    def uuid(self):
        return self._uuid


def test_a_piece_whose_kernel_cannot_be_tiled_compiles_again_untiled_and_equals_eager(caplog):
    """CantSplit from Inductor's tiling is a code-generation limit, not a fault of the graph: the
    piece compiles again with one-dimensional tiling (then also without loop reordering), logged,
    with eager's values. Any other error, or CantSplit on every rung, is a CompileError naming each
    attempt."""
    from piecewise.compilers.inductor import UNTILED_PATCHES

    model = TwoSplitModel()
    for until in UNTILED_PATCHES:
        fault = TilingFault(until)
        cfg = CompilationConfig(backend="inductor", max_num_tokens=24, inductor_options={"post_grad_custom_post_pass": fault})
        with caplog.at_level("WARNING", logger="piecewise"):
            cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
            for n in (1, 7, 24):
                x = torch.randn(n, 8)
                torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
        assert f"compiled it with {until}" in caplog.text
        assert fault.calls >= 2 * 3  # each distinct piece failed once, then compiled untiled
        caplog.clear()
        torch._dynamo.reset()

    fault = TilingFault(None)
    cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_tokens=24,
                                             inductor_options={"post_grad_custom_post_pass": fault}),
                    dynamic_arg_dims={"x": 0})
    try:
        cm(torch.randn(3, 8))
    except pw.CompileError as e:
        message = str(e)
    else:
        raise AssertionError("a piece no rung compiles must raise CompileError")
    assert message.count("CantSplit") == 1 + len(UNTILED_PATCHES) and "then with" in message
    assert fault.calls == 1 + len(UNTILED_PATCHES)


def test_a_size_symbol_an_earlier_compile_left_unbound_does_not_fail_the_next_piece(monkeypatch):
    """Pieces compile in the trace's one shape environment. A compile that leaves a fresh
    data-dependent size symbol unbound (torch 2.11 on CUDA did, in generate()'s decode step) made
    the next piece's compile fail with PendingUnbackedSymbolNotFound; a symbol none of the next
    piece's inputs holds is now dropped first, and the values equal eager's."""
    from piecewise.compilers.inductor import InductorAdaptor

    real = InductorAdaptor._standalone_compile_with
    leaked = []

    def leaky(self, standalone_compile, graph, example_inputs, target, options):
        art = real(self, standalone_compile, graph, example_inputs, target, options)
        mode = torch._guards.detect_fake_mode(list(example_inputs))
        leaked.append(mode.shape_env.create_unbacked_symint())  # made and never bound, as the leak was
        return art

    monkeypatch.setattr(InductorAdaptor, "_standalone_compile_with", leaky)
    model = TwoSplitModel()
    cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_tokens=24), dynamic_arg_dims={"x": 0})
    with counters.expect(recompiles=0):
        for n in (3, 1, 24):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(leaked) >= 3  # every distinct piece compiled after the first one's leak
