"""The pipeline end to end with the eager adaptor: piece counts, dispatch, no recompiles, errors."""

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.testing.toy import ToyTransformer, TwoSplitModel


def _cfg(**kw):
    kw.setdefault("backend", "eager")
    kw.setdefault("max_num_tokens", 64)
    return CompilationConfig(**kw)


def test_two_splitting_ops_give_five_pieces_three_compiled():
    model = TwoSplitModel()
    cm = pw.compile(model, _cfg(), dynamic_arg_dims={"x": 0})
    with counters.expect(pieces_seen=5, pieces_compiled=3, splitting_pieces=2, graphs_seen=1, recompiles=0):
        x = torch.randn(6, 8)
        torch.testing.assert_close(cm(x), model(x))


@pytest.mark.parametrize("layers", [1, 3, 5])
def test_toy_transformer_piece_counts_and_dedupe(layers):
    model = ToyTransformer(num_layers=layers)
    cm = pw.compile(model, _cfg(), dynamic_arg_dims={"x": 0})
    distinct = 2 if layers == 1 else 3
    with counters.expect(pieces_seen=2 * layers + 1, pieces_compiled=layers + 1, compiler_invocations=distinct):
        cm(torch.randn(5, model.dim))
    assert len({r.fingerprint for r in cm.backend.runners}) == distinct


def test_every_size_equals_eager_without_recompiles_first_call_size_one():
    model = ToyTransformer(num_layers=3)
    cm = pw.compile(model, _cfg(compile_sizes=[4, 8], compile_ranges=[16]), dynamic_arg_dims={"x": 0})
    gen = torch.Generator().manual_seed(1)
    dynamo_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with counters.expect(recompiles=0, dynamo_traces=1, graphs_seen=1):
        for n in [1, *range(2, 65)]:
            x = torch.randn(n, model.dim, generator=gen)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - dynamo_graphs == 1


def test_exact_size_preferred_over_range():
    from piecewise.piece import EntryKind, EntryTable

    table = EntryTable(_cfg(compile_sizes=[4, 20], compile_ranges=[16]), dynamic=True)
    kinds = [e.kind for e in table.entries]
    assert kinds == [EntryKind.RANGE, EntryKind.RANGE, EntryKind.SIZE, EntryKind.SIZE]
    assert table.entries[table.index_for(4)].target.size == 4
    assert table.entries[table.index_for(20)].target.size == 20
    assert table.entries[table.index_for(5)].target.compile_range.end == 16
    assert table.entries[table.index_for(17)].target.compile_range.start == 17
    assert EntryTable(_cfg(compile_sizes=[4]), dynamic=True).entries[0].kind is EntryKind.GENERAL


def test_two_tagged_regions_do_not_interfere():
    a, b = ToyTransformer(num_layers=2, seed=1), TwoSplitModel()
    ca = pw.compile(a, _cfg(tag="backbone"), dynamic_arg_dims={"x": 0})
    cb = pw.compile(b, _cfg(), dynamic_arg_dims={"x": 0})
    cb2 = pw.compile(TwoSplitModel(), _cfg(), dynamic_arg_dims={"x": 0})
    assert len({ca.tag, cb.tag, cb2.tag}) == 3
    for n in (3, 9, 3):
        x = torch.randn(n, 32)
        torch.testing.assert_close(ca(x), a(x))
        torch.testing.assert_close(cb(x), b(x))
    assert counters.by_tag[ca.tag].pieces_seen == 5
    assert counters.by_tag[cb.tag].pieces_seen == 5
    assert counters.by_tag[ca.tag].recompiles == counters.by_tag[cb.tag].recompiles == 0


def test_wrong_dtype_rank_and_oversize_raise_before_running():
    model = ToyTransformer(num_layers=1)
    cm = pw.compile(model, _cfg(max_num_tokens=16), dynamic_arg_dims={"x": 0})
    with pytest.raises(pw.InputError, match="max_num_tokens=16"):
        cm(torch.randn(17, 32))  # rejected before any compile
    assert cm.backend is None
    cm(torch.randn(4, 32))
    with counters.expect(recompiles=0, graphs_seen=0):
        with pytest.raises(pw.InputError, match="dtype"):
            cm(torch.randn(4, 32, dtype=torch.float64))
        with pytest.raises(pw.InputError, match="rank"):
            cm(torch.randn(4, 32, 1))
        with pytest.raises(pw.InputError, match="dim 1 is static"):
            cm(torch.randn(4, 16))
        with pytest.raises(pw.InputError, match="max_num_tokens"):
            cm(torch.randn(17, 32))


def test_dynamic_arg_dims_must_name_an_argument():
    with pytest.raises(pw.ConfigError, match="input_ids"):
        pw.compile(ToyTransformer(), _cfg(), dynamic_arg_dims={"input_ids": 0})


@pw.splitting_op("pw_test_compile::scatter_add_", mutates_args=("cache",))
def scatter_add_(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cache[: x.shape[0]] += x
    return x * 2


@scatter_add_.register_fake
def _(x, cache):
    return torch.empty_like(x)


@pw.splitting_op("pw_test_compile::split_two", mutates_args=())
def split_two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), x.cos()


@split_two.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


class MutatingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(64, 4))

    def forward(self, x):
        y = torch.ops.pw_test_compile.scatter_add_(x + 1, self.cache)
        a, b = torch.ops.pw_test_compile.split_two(y)
        return a * b + self.cache[: x.shape[0]]


def test_mutating_and_tuple_returning_splitting_ops():
    ref, model = MutatingModel(), MutatingModel()
    cm = pw.compile(model, _cfg(splitting_ops=["pw_test_compile::scatter_add_", "pw_test_compile.split_two"]),
                    dynamic_arg_dims={"x": 0})
    with counters.expect(pieces_seen=3, splitting_pieces=1, recompiles=0):
        for n in (3, 7, 1, 7):
            x = torch.randn(n, 4)
            torch.testing.assert_close(cm(x), ref(x))
            torch.testing.assert_close(model.cache, ref.cache)
    assert model.cache.abs().sum() > 0


class InPlaceWriteModel(torch.nn.Module):
    """Writes a buffer in place with tensor methods whose results nothing reads (a user's own KV
    cache write, a step counter) in a graph that also takes a whole ``x.size()``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rows", torch.zeros(16, 4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, at):
        shape = x.size()
        self.rows.index_copy_(0, at, x * 2)
        self.calls.add_(1)
        y = torch.ops.piecewise_models.toy_attention(x, x, x)
        return y.reshape(shape[0] * shape[1]), y.new_ones(shape)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_an_in_place_write_whose_result_is_unused_is_kept(backend):
    """A whole ``x.size()`` is rewritten per dim before the split; the clean-up after it once ran
    FX's dead-code pass, which counts an unused in-place method call as dead and dropped the
    writes: the buffer stayed zero while the output looked right."""
    import piecewise.testing.toy  # noqa: F401  registers toy_attention

    ref, model = InPlaceWriteModel(), InPlaceWriteModel()
    cm = pw.compile(model, _cfg(backend=backend, splitting_ops=["piecewise_models::toy_attention"]),
                    dynamic_arg_dims={"x": 0, "at": 0})
    with counters.expect(recompiles=0):
        for n in (3, 5, 2):
            x, at = torch.randn(n, 4), torch.randperm(16)[:n]
            torch.testing.assert_close(cm(x, at), ref(x, at))
            torch.testing.assert_close(model.rows, ref.rows, rtol=0, atol=0)
    assert model.calls.item() == 3 and model.rows.abs().sum() > 0


class NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def test_piecewise_without_split_points_falls_back_loudly():
    cm = pw.compile(NoAttention(), _cfg(splitting_ops=["piecewise_models::toy_attention"]), dynamic_arg_dims={"x": 0})
    with pytest.warns(UserWarning, match="none of the splitting ops"):
        with counters.expect(fallbacks=1, pieces_seen=1, pieces_compiled=1):
            cm(torch.randn(3, 4))


def test_torch_builtin_module_compiles_directly():
    lin = torch.nn.Linear(4, 4)
    cm = pw.compile(lin, _cfg(), dynamic_arg_dims={"input": 0})
    with pytest.warns(UserWarning, match="none of the splitting ops"):
        cm(torch.randn(3, 4))
    with counters.expect(dynamo_traces=0, recompiles=0):
        for n in (1, 5, 9):
            x = torch.randn(n, 4)
            torch.testing.assert_close(cm(x), lin(x))


def test_graph_break_gives_a_clear_error():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            print("side effect")  # a graph break under full-graph capture
            return x * 2

    cm = pw.compile(Breaks(), _cfg(), dynamic_arg_dims={"x": 0})
    with pytest.raises(pw.CompileError, match="cannot be captured as one graph"):
        cm(torch.randn(3, 4))


def test_unknown_split_op_name_warns():
    cm = pw.compile(TwoSplitModel(), _cfg(splitting_ops=["piecewise_models::toy_attention", "nolib::nothing"]),
                    dynamic_arg_dims={"x": 0})
    with pytest.warns(UserWarning, match="nolib::nothing"):
        cm(torch.randn(3, 8))


def test_full_mode_is_one_piece():
    model = TwoSplitModel()
    cm = pw.compile(model, _cfg(mode="full"), dynamic_arg_dims={"x": 0})
    with counters.expect(pieces_seen=1, pieces_compiled=1, fallbacks=0):
        x = torch.randn(5, 8)
        torch.testing.assert_close(cm(x), model(x))


def test_mode_none_runs_eagerly():
    model = TwoSplitModel()
    cm = pw.compile(model, _cfg(mode="none"), dynamic_arg_dims={"x": 0})
    with counters.expect(graphs_seen=0, dynamo_traces=0):
        x = torch.randn(5, 8)
        torch.testing.assert_close(cm(x), model(x))


def test_forward_context_seen_by_splitting_op():
    seen = []

    @pw.splitting_op("pw_test_compile::peek", mutates_args=())
    def peek(x: torch.Tensor) -> torch.Tensor:
        ctx = pw.forward_context()
        seen.append((ctx.num_tokens, ctx.padded_num_tokens, ctx.tag))
        return x.clone()

    @peek.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.pw_test_compile.peek(x + 1) * 2

    cm = pw.compile(M(), _cfg(tag="peek"), dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 2))
    cm(torch.randn(5, 2))
    assert seen[-2:] == [(3, 3, cm.tag), (5, 5, cm.tag)]
    assert pw.forward_context() is None


def test_non_tensor_argument_change_is_rejected():
    class M(torch.nn.Module):
        def forward(self, x, scale: float = 1.0):
            return torch.ops.piecewise_models.toy_attention(x, x, x) * scale

    cm = pw.compile(M(), _cfg(), dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 4), 2.0)
    with pytest.raises(pw.InputError, match="scale"):
        cm(torch.randn(3, 4), 3.0)


def test_debug_mode_detects_guard_that_would_fail():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.shape[0] > 8:  # frozen to the first trace without debug
                return torch.ops.piecewise_models.toy_attention(x, x, x) + 1
            return torch.ops.piecewise_models.toy_attention(x, x, x) - 1

    cm = pw.compile(Branchy(), _cfg(debug=True), dynamic_arg_dims={"x": 0})
    cm(torch.randn(4, 2))
    cm(torch.randn(6, 2))
    with pytest.raises(pw.GuardFailureError):
        cm(torch.randn(12, 2))


def test_torch_compile_backend_name_resolves_to_piecewise():
    model = TwoSplitModel()
    fn = torch.compile(model, backend="piecewise")
    with counters.expect(graphs_seen=1, pieces_seen=5):
        x = torch.randn(4, 8)
        torch.testing.assert_close(fn(x), model(x))


def test_the_first_call_keeps_the_collector_off_old_objects_and_undoes_it():
    import gc

    from piecewise import backend as B

    seen = []
    orig = B.PiecewiseBackend.__call__

    def call(self, gm, example_inputs):
        seen.append(gc.get_freeze_count())
        return orig(self, gm, example_inputs)

    B.PiecewiseBackend.__call__ = call
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        cm = pw.compile(model, pw.CompilationConfig(backend="eager", cache_dir=None), dynamic_arg_dims={"input": 0})
        x = torch.randn(3, 4)
        torch.testing.assert_close(cm(x), model(x))
        assert seen and seen[0] > 0 and gc.get_freeze_count() == 0  # frozen while compiling, thawed after
        gc.freeze()  # a process that froze objects itself keeps them frozen
        cm2 = pw.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), pw.CompilationConfig(backend="eager", cache_dir=None),
                         dynamic_arg_dims={"input": 0})
        cm2(x)
        assert gc.get_freeze_count() > 0  # not thawed by the compile
    finally:
        gc.unfreeze()
        B.PiecewiseBackend.__call__ = orig


def test_the_build_id_follows_the_package_sources(tmp_path):
    """Cache and start keys hold the build id, so an artifact of other code of the same version
    number never loads: any change to a source file changes it."""
    import shutil
    from pathlib import Path

    import piecewise
    from piecewise._version import __version__, build_id, source_digest

    src = Path(piecewise.__file__).resolve().parent
    assert build_id() == f"{__version__}+{source_digest(src)}"
    copy = tmp_path / "pkg"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(src)
    (copy / "graphs" / "install.py").write_text((copy / "graphs" / "install.py").read_text() + "\n# changed\n")
    assert source_digest(copy) != source_digest(src)


class _RaisesOwnConfigError(torch.nn.Module):
    class ConfigError(Exception):  # the user's own class, named like piecewise's
        pass

    def forward(self, x):
        if x.shape[1] == 3:
            raise self.ConfigError("the user's refusal")
        return x + 1


def test_an_exception_raised_in_user_code_during_the_trace_is_not_taken_for_piecewise_own():
    """Piecewise rebuilds its own errors raised inside traced piecewise code (an attention function's
    refusal) from Dynamo's 'Observed exception'; a user's class of the same name raised in the
    user's forward stays a graph break (CompileError), never a piecewise ConfigError."""
    cm = pw.compile(_RaisesOwnConfigError(), pw.CompilationConfig(backend="eager"), dynamic_arg_dims={"x": 0})
    with pytest.raises(pw.CompileError, match="cannot be captured as one graph") as info:
        cm(torch.ones(2, 3))
    assert not isinstance(info.value, pw.ConfigError)


def test_first_calls_of_models_in_several_threads_take_turns_with_torch_compile():
    """Cold first calls of several models from several threads ran Dynamo's capture and Inductor's
    compiles at once: torch.fx's process-global patcher failed ("CURRENT_PATCHER is None"), 3 of
    4 threads every time, and took plain torch.compile calls in other threads down with them.
    Every output must equal eager, with no error in any thread."""
    import threading

    models = [ToyTransformer(num_layers=2, dim=40, seed=i).eval() for i in range(4)]
    runners = [pw.compile(m, _cfg(backend="inductor", max_num_tokens=32, tag=f"threads_{i}"), dynamic_arg_dims={"x": 0})
               if i % 2 == 0 else torch.compile(m, backend="inductor") for i, m in enumerate(models)]
    start = threading.Barrier(len(models))
    errors, mismatches = [], []

    def work(i):
        try:
            g = torch.Generator().manual_seed(i)
            start.wait()
            for n in (5, 9, 5):
                x = torch.randn(n, 40, generator=g)
                with torch.no_grad():
                    got, want = runners[i](x), models[i](x)
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    mismatches.append((i, n, (got - want).abs().max().item()))
        except BaseException as e:  # noqa: BLE001  reported below, with the thread
            errors.append((i, repr(e)[:300]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and mismatches == []
    for tag in ("threads_0", "threads_2"):
        tally = counters.by_tag[tag]
        assert (tally.dynamo_traces, tally.recompiles) == (1, 0), tag


def test_a_first_run_that_waits_on_a_thread_that_compiles_does_not_deadlock():
    """The first call held Dynamo's compile lock through its first run: a splitting op handing work
    to a worker thread whose own first call compiles (a pool, a rank's collective) waited on it
    for good (helper-26: TimeoutError after 30 s, 1.6 s before)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    doubled = torch.compile(lambda t: t * 2 + 1, backend="eager")  # its first call compiles, in the worker

    @pw.splitting_op("pw_test_compile::through_a_worker", mutates_args=())
    def through_a_worker(x: torch.Tensor) -> torch.Tensor:
        return pool.submit(doubled, x).result(timeout=120)

    @through_a_worker.register_fake
    def _(x):
        return torch.empty_like(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.b(torch.ops.pw_test_compile.through_a_worker(torch.relu(self.a(x))))

    torch.manual_seed(0)
    model = Model().eval()
    compiled = pw.compile(model, _cfg(max_num_tokens=32), dynamic_arg_dims={"x": 0})
    try:
        for n in (4, 7):
            x = torch.randn(n, 16)
            with torch.no_grad():
                assert torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    finally:
        pool.shutdown()


def test_a_first_call_whose_run_raises_does_not_keep_its_trace():
    """A float64 input to a float32 model traces, then fails in the run as eager does; the trace
    stayed, and every later float32 call was refused ("compiled for torch.float64")."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)).eval()
    compiled = pw.compile(model, _cfg(max_num_tokens=32), dynamic_arg_dims={"input": 0})
    x = torch.randn(8, 16)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="dtype"):
            model(x.double())
        with pytest.raises(RuntimeError, match="dtype"):
            compiled(x.double())
        assert torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        y = torch.randn(3, 16)
        assert torch.allclose(compiled(y), model(y), rtol=1e-5, atol=1e-5)


def test_a_call_during_another_threads_first_run_waits_for_it():
    """The compiled forward served other threads before its first run had succeeded: a float32 call
    made while a float64 first call was running (then raising, as eager does) was refused
    ("compiled for torch.float64"); it now waits and then makes its own first call."""
    import threading
    import time

    running = threading.Event()

    @pw.splitting_op("pw_test_compile::slow_copy", mutates_args=())
    def slow_copy(x: torch.Tensor) -> torch.Tensor:
        running.set()
        time.sleep(0.5)
        return x.clone()

    @slow_copy.register_fake
    def _(x):
        return torch.empty_like(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.a(torch.ops.pw_test_compile.slow_copy(x))

    torch.manual_seed(0)
    model = Model().eval()
    compiled = pw.compile(model, _cfg(max_num_tokens=32, tag="first_run_window"), dynamic_arg_dims={"x": 0})
    failed = []

    def bad_first_call():
        with torch.no_grad():
            try:
                compiled(torch.randn(4, 16).double())
            except RuntimeError as e:
                failed.append(str(e))

    other = threading.Thread(target=bad_first_call)
    other.start()
    assert running.wait(60)
    y = torch.randn(5, 16)
    with torch.no_grad():
        got = compiled(y)  # while the float64 first run is under way
        want = model(y)
    other.join()
    assert failed and "dtype" in failed[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert counters.by_tag["first_run_window"].recompiles == 0


class _FailsOnItsSizes(torch.nn.Module):
    def forward(self, x):
        h = torch.ops.piecewise_models.toy_attention(x, x, x)
        return h @ torch.ones(3, 2)  # x is [n, 4]: the product fails, on fake tensors too


def test_an_op_failing_during_the_trace_is_a_typed_compile_error():
    """An op that fails on the trace's fake tensors (a shape mismatch, or what only fails at the
    trace's symbolic sizes) raised Dynamo's TorchRuntimeError, not a piecewise error. It is a
    CompileError and, like eager's error, a RuntimeError."""
    import piecewise.testing.toy  # noqa: F401  registers toy_attention

    cm = pw.compile(_FailsOnItsSizes(), _cfg(), dynamic_arg_dims={"x": 0})
    with pytest.raises(pw.TraceError, match=r"tracing _FailsOnItsSizes.forward failed on its fake tensors .*matmul.*same reduction dim"):
        cm(torch.randn(5, 4))
    assert issubclass(pw.TraceError, (pw.CompileError)) and issubclass(pw.TraceError, RuntimeError)
