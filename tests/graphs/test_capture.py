"""CPU tier of graph capture, with a fake graph platform injected by the tests."""

import pytest
import torch

import piecewise as pw
from piecewise.testing.graph_platform import fake_cpu_platform
from piecewise import CompilationConfig, counters
from piecewise.graphs import Phase, batch_hint
from piecewise.testing.toy import ToyTransformer, TwoSplitModel


@pytest.fixture(params=["fx", "inductor_partition"])
def strategy(request):
    """Both split strategies: the FX split (eager adaptor, no codegen) and Inductor's partitions
    (one whole-graph Inductor compile, each partition wrapped for capture)."""
    return request.param


def _compile(model, strategy="fx", **kw):
    if strategy == "inductor_partition":
        kw.update(backend="inductor", split_strategy=strategy)
    kw.setdefault("backend", "eager")
    kw.setdefault("max_num_tokens", 32)
    kw.setdefault("cudagraph_capture_sizes", [4, 8, 16])
    return pw.compile(model, CompilationConfig(**kw), dynamic_arg_dims={"x": 0})


def test_warmup_capture_replay_counts_and_equality_every_size(strategy):
    model = ToyTransformer(num_layers=3, dim=16)
    with fake_cpu_platform() as plat:
        cm = _compile(model, strategy=strategy)
        gen = torch.Generator().manual_seed(0)
        with counters.expect(graphs_captured=3 * 4, capturable_pieces=4, recompiles=0):
            x = torch.randn(3, 16, generator=gen)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert plat.captured_sizes[:4] == [16] * 4, "largest size captured first"
        assert sorted(set(plat.captured_sizes)) == [4, 8, 16]
        # the default mode, "auto", is piecewise for a model compiled directly (its ops may be the user's)
        assert CompilationConfig().cudagraph_mode == "auto" and cm.backend.result.graphs.dispatcher.mode == "piecewise"
        wrappers = [cm.backend.stitched_wrappers[i] for i in range(4)]
        for w in wrappers:
            assert {s: e.phase for s, e in w.entries.items()} == {4: Phase.CAPTURED, 8: Phase.CAPTURED, 16: Phase.CAPTURED}
            assert all(e.warmups_done == 1 for e in w.entries.values())
        # sizes 1..16 replay all 4 pieces (counted once per forward, exactly); 17..32 run without graphs
        with counters.expect(graphs_captured=0, recompiles=0, graph_replays=16 * 4):
            for n in range(1, 33):
                x = torch.randn(n, 16, generator=gen)
                torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert counters.by_tag[cm.tag].eager_above_capture == 16  # sizes 17..32
        assert counters.by_tag[cm.tag].graph_replays == counters.graph_replays


def test_pad_rows_zero_and_forward_context_has_real_and_padded_counts(strategy):
    seen = []

    @pw.splitting_op("pw_test_graphs::peek", mutates_args=())
    def peek(x: torch.Tensor) -> torch.Tensor:
        ctx = pw.forward_context()
        seen.append((ctx.num_tokens, ctx.padded_num_tokens, ctx.runtime_mode, x.shape[0], x[ctx.num_tokens:].abs().sum().item()))
        return x * 3

    @peek.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.pw_test_graphs.peek(x + 0) * 2

    with fake_cpu_platform():
        cm = _compile(M(), strategy=strategy)
        x = torch.randn(5, 2) + 10
        cm(x)  # the first padded call checks that padding leaves real rows alone (unpadded result)
        out = cm(x)
        torch.testing.assert_close(out, x * 6)
        assert out.shape == (5, 2)
        n, padded, mode, rows, pad_sum = seen[-1]
        assert (n, padded, mode, rows) == (5, 8, "piecewise", 8) and pad_sum == 0.0


@pw.splitting_op("pw_test_graphs::two_outputs", mutates_args=())
def _two_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@_two_outputs.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


class _TwoOutputs(torch.nn.Module):
    def forward(self, x):
        a, b = torch.ops.pw_test_graphs.two_outputs(x.sin())
        return a.cos() + b


def test_a_splitting_op_with_several_outputs_replays_fresh_values(strategy):
    """Inductor hands such an op's whole result tuple to the next partition; its tensors must be
    refreshed on every replay like any other input, not bound once at capture."""
    model = _TwoOutputs()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy, cudagraph_capture_sizes=[4, 8])
        gen = torch.Generator().manual_seed(3)
        with counters.expect(recompiles=0):
            for n in (4, 3, 8, 4, 5, 8, 2):
                x = torch.randn(n, 8, generator=gen)
                torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert counters.by_tag[cm.tag].graph_replays > 0


def test_failed_capture_falls_back_to_next_size(strategy):
    model = TwoSplitModel()
    with fake_cpu_platform(fail_sizes={8}):
        cm = _compile(model, strategy=strategy)
        with pytest.warns(RuntimeWarning, match="size 8"):
            cm(torch.randn(2, 8))
        dispatcher = cm.backend.compiled.graphs
        assert dispatcher.sizes == [4, 16]
        x = torch.randn(6, 8)
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert pw.forward_context() is None


def test_out_of_memory_skips_the_remaining_sizes(strategy):
    model = TwoSplitModel()
    with fake_cpu_platform(oom_sizes={8}) as plat:
        cm = _compile(model, strategy=strategy)
        with pytest.warns(RuntimeWarning, match="out of memory"):
            cm(torch.randn(2, 8))
        assert set(plat.captured_sizes) == {16}
        for n in (3, 7, 12):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)


class _WithBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.ones(8))
        self.register_buffer("cache", torch.zeros(8))

    def forward(self, x):
        return torch.ops.piecewise_models.toy_attention(x + self.bias + self.cache, x, x) * 2


@pytest.mark.parametrize("reassign", ["parameter", "buffer", "load_state_dict_assign"])
def test_weight_or_buffer_reassigned_after_every_size_replayed_is_followed_by_recapture(reassign, strategy):
    with fake_cpu_platform():
        model = _WithBias()
        cm = _compile(model, strategy=strategy)
        gen = torch.Generator().manual_seed(1)
        for n in (3, 7, 12, 3, 7, 12):  # every capture size replayed, addresses checked once each
            cm(torch.randn(n, 8, generator=gen))
        captured = counters.graphs_captured
        if reassign == "parameter":
            model.bias = torch.nn.Parameter(torch.full((8,), 5.0))
        elif reassign == "buffer":
            model.cache = torch.full((8,), 10.0)  # a KV cache allocated again: new address
        else:
            model.load_state_dict({"bias": torch.full((8,), -2.0)}, strict=False, assign=True)
        with counters.expect(recaptures=1, recompiles=0):
            for n in (3, 7, 12, 5):
                x = torch.randn(n, 8, generator=gen)
                torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert counters.graphs_captured == 2 * captured, "every size captured again, once"


def test_moved_address_not_announced_is_caught_at_replay(strategy):
    """``p.data = t`` moves memory behind nn.Module's back (no epoch change): the replay-time address
    check still refuses it on a size's first replay, and on every replay with debug=True."""
    with fake_cpu_platform():
        model = _WithBias()
        cm = _compile(model, strategy=strategy)
        cm(torch.randn(3, 8))  # replays size 4 once: checked
        model.bias.data = torch.zeros(8)
        with pytest.raises(pw.CaptureError, match="moved since capture"):
            cm(torch.randn(7, 8))  # the first replay of size 8 checks addresses
        torch._dynamo.reset()
        model = _WithBias()
        cm = _compile(model, debug=True, strategy=strategy)
        cm(torch.randn(3, 8))
        cm(torch.randn(3, 8))
        model.bias.data = torch.zeros(8)
        with pytest.raises(pw.CaptureError, match="moved since capture"):
            cm(torch.randn(3, 8))


class _Pooled(torch.nn.Module):
    """Attention, then a step that combines tokens (set by `how`)."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        h = torch.ops.piecewise_models.toy_attention(self.a(x), x, x)
        if self.how == "mean":
            return h.mean(dim=0)
        if self.how == "sum_keepdim":
            return h.sum(0, keepdim=True) + 1
        if self.how == "centre":  # every row depends on every row, shape unchanged
            return h - h.mean(0)
        if self.how == "softmax_tokens":
            return h.softmax(dim=0)
        if self.how == "cumsum_tokens":
            return h.cumsum(0)
        if self.how == "gram":
            return h.t() @ h
        if self.how == "softmax_features":  # row-local: graphs stay on
            return h.softmax(dim=-1)
        if self.how == "sort_default":  # sorts each row (dim=-1): row-local
            return h.sort().values
        if self.how == "topk_3d":  # topk over the last dim; k=3 must not be read as a dim
            return h.view(-1, 2, 4).topk(3).values
        raise AssertionError(self.how)


@pytest.mark.parametrize("how", ["mean", "sum_keepdim", "centre", "softmax_tokens", "cumsum_tokens", "gram"])
def test_token_mixing_outside_splitting_ops_turns_graphs_off_and_stays_exact(how, caplog):
    """Padding a call to a capture size must never let pad rows into real results: a model that
    reduces or mixes along the token dim outside splitting ops gets no graphs (logged)."""
    model = _Pooled(how).eval()
    with fake_cpu_platform() as plat:
        cm = _compile(model)
        gen = torch.Generator().manual_seed(2)
        with caplog.at_level("WARNING", logger="piecewise"):
            for n in (13, 3, 5, 9):
                x = torch.randn(n, 8, generator=gen)
                with torch.no_grad():
                    torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert plat.captured_sizes == [] and counters.graphs_captured == 0
        assert "combines values across tokens" in caplog.text and "cudagraph_mode='none'" in caplog.text


class _Leaky(torch.nn.Module):
    """Steps that mix tokens in ways a static look at the graph does not see (set by `how`)."""

    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)
        self.how = how

    def forward(self, x):
        h = torch.ops.piecewise_models.toy_attention(self.a(x), x, x)
        if self.how == "sdpa":  # attention over tokens outside a splitting op
            q = h[None, None]
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)[0, 0]
        if self.how == "gram_sum":
            return (h @ h.t() + 1).sum(1, keepdim=True) * h
        if self.how == "count":  # the token count used as a value
            return h * h.shape[0]
        if self.how == "conv":  # over the projected input, whose pad rows are not zero
            return self.conv(self.a(x).t()[None])[0].t() + h
        if self.how == "instance_norm":
            return torch.nn.functional.instance_norm(h.t()[None])[0].t()
        raise AssertionError(self.how)


@pytest.mark.parametrize("how", ["sdpa", "gram_sum", "count", "conv", "instance_norm"])
def test_padding_that_changes_real_rows_is_found_on_the_first_padded_call(how, caplog, strategy):
    model = _Leaky(how).eval()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        gen = torch.Generator().manual_seed(4)
        with caplog.at_level("WARNING", logger="piecewise"):
            for n in (13, 3, 5, 9, 16):
                x = torch.randn(n, 8, generator=gen)
                with torch.no_grad():
                    torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
        assert counters.padding_refusals == 1 and counters.graph_replays == 0
        assert "when the call was padded from 13 to 16 tokens" in caplog.text


@pytest.mark.parametrize("how", ["flatten", "shortened"])
def test_an_output_whose_token_dim_is_derived_gets_no_graphs(how, strategy):
    class Derived(torch.nn.Module):
        def forward(self, x):
            h = torch.ops.piecewise_models.toy_attention(x + 1, x, x)
            return h.reshape(-1) if how == "flatten" else h[1:] - h[:-1]

    model = Derived()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        for n in (13, 3, 6):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert counters.graphs_captured == 0


@pytest.mark.parametrize("how", ["softmax_features", "sort_default", "topk_3d"])
def test_row_local_model_keeps_graphs(how, strategy):
    model = _Pooled(how).eval()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        for n in (13, 5):
            x = torch.randn(n, 8)
            with torch.no_grad():
                torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert counters.graphs_captured > 0 and counters.padding_refusals == 0 and counters.graph_replays > 0


@pw.splitting_op("pw_test_graphs::gate", mutates_args=("out",))
def _gate(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q * k.sigmoid())  # row-local, any rank; writes into an output argument


@_gate.register_fake
def _(q, k, out):
    return None


class _TokenDim(torch.nn.Module):
    """Token dim at `dim`: input [2, tokens, 8] (dim 1) or [2, 3, tokens, 8] (dim 2)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qk = torch.nn.Linear(8, 16)
        self.o = torch.nn.Linear(8, 8)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        out = torch.empty_like(q)
        torch.ops.pw_test_graphs.gate(q, k, out)
        return self.o(out) + x


class _WritesInput(torch.nn.Module):
    """Writes its token input in place (not idempotent), then a row-local splitting op."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qk = torch.nn.Linear(8, 16)

    def forward(self, x):
        x.mul_(2)
        q, k = self.qk(x).chunk(2, dim=-1)
        out = torch.empty_like(q)
        torch.ops.pw_test_graphs.gate(q, k, out)
        return out + x


def test_an_input_forward_writes_in_place_gets_the_write_under_graphs(strategy):
    """Graphs run on padded copies of the token inputs: a replay wrote the copy and left the
    caller's tensor unwritten (silently), and the padding check ran its padded runs from the
    already written input, so it turned graphs off with a false report. Now the real rows are
    copied back after each call and the check starts from the input as passed."""
    model = _WritesInput().eval()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        for n in (3, 3, 5, 8, 3):
            x = torch.randn(n, 8)
            want_x = x.clone()
            with torch.no_grad():
                want = model(want_x)
                torch.testing.assert_close(cm(x), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x, want_x, rtol=0, atol=0)
        assert counters.padding_refusals == 0 and counters.graph_replays > 0 and counters.recompiles == 0


class _WritesStep(torch.nn.Module):
    """Writes an argument without a token dim in place outside splitting ops (a step counter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qk = torch.nn.Linear(8, 16)

    def forward(self, x, step):
        step.add_(1)
        q, k = self.qk(x).chunk(2, dim=-1)
        out = torch.empty_like(q)
        torch.ops.pw_test_graphs.gate(q, k, out)
        return out * step


def test_an_argument_without_token_dim_written_in_place_is_written_once_a_call_under_graphs(strategy):
    """Warm-ups, captures and the padding check run forward on it in place: the first call left
    the counter at 12 instead of 1 (every later output off by 8-17), and the check then turned
    graphs off with a false report. Now it is kept across those runs and put back."""
    model = _WritesStep().eval()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        step, want_step = torch.zeros(1), torch.zeros(1)
        for n in (3, 3, 5, 16, 4):
            x = torch.randn(n, 8)
            with torch.no_grad():
                want = model(x, want_step)
                torch.testing.assert_close(cm(x, step), want, rtol=1e-5, atol=1e-5)
            assert step.item() == want_step.item()
        assert counters.padding_refusals == 0 and counters.graph_replays > 0 and counters.recompiles == 0


class _BufferStep(torch.nn.Module):
    """Writes a module buffer in place outside splitting ops (a step counter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qk = torch.nn.Linear(8, 16)
        self.register_buffer("step", torch.zeros(1))

    def forward(self, x):
        self.step.add_(1)
        q, k = self.qk(x).chunk(2, dim=-1)
        out = torch.empty_like(q)
        torch.ops.pw_test_graphs.gate(q, k, out)
        return out * self.step


def test_a_module_buffer_written_in_place_is_written_once_a_call_under_graphs(strategy):
    """Only forward's arguments were kept across warm-up, capture and the padding check: a buffer
    counter stood at 12 after the first call where eager has 1, outputs were off by 4-12, and the
    check turned graphs off with a false report about token mixing."""
    model, ref = _BufferStep().eval(), _BufferStep().eval()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        for n in (3, 3, 5, 16, 4):
            x = torch.randn(n, 8)
            with torch.no_grad():
                torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-5)
            assert model.step.item() == ref.step.item()
        assert counters.padding_refusals == 0 and counters.graph_replays > 0 and counters.recompiles == 0


class _StateFromTokens(torch.nn.Module):
    """Writes a buffer from the token count outside splitting ops: the rows of this call read by
    the next (``last[:n] = out``; as a running max from -inf), the count itself (``seen += n``),
    or a scratch buffer every call fills before reading it (harmless under padding)."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.qk = torch.nn.Linear(8, 16)
        self.register_buffer("last", torch.full((32, 8), float("-inf") if kind == "running_max" else 0.0))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        n = x.shape[0]
        if self.kind == "scratch":
            self.last.narrow(0, 0, n).copy_(x * 2)
            x = self.last.narrow(0, 0, n) + 1
        elif self.kind == "running_max":
            x = x + self.last.amax(0).clamp(min=-5.0)
        else:
            x = x + self.last.sum(0) + self.seen
        q, k = self.qk(x).chunk(2, dim=-1)
        out = torch.empty_like(q)
        torch.ops.pw_test_graphs.gate(q, k, out)
        if self.kind in ("rows", "running_max"):
            self.last[:n] = out * 10
        elif self.kind == "count":
            self.seen.add_(n)
        return out


@pytest.mark.parametrize("kind", ["rows", "running_max", "count", "scratch"])
def test_state_written_from_the_token_count_turns_graphs_off_instead_of_taking_the_padded_count(kind, strategy, caplog):
    """A padded replay writes the pad rows (or the padded count) into a buffer the next call
    reads: outputs off with no error, as the padding check compared outputs only. It now also
    compares what forward writes outside splitting ops after its padded runs with the unpadded
    run's, tightly (a count off by 1 in 1024 counts) and through infinities (a buffer holding -inf
    gave a relative scale of inf), and turns graphs off (logged). A scratch buffer whose pad rows
    no call reads is refused too (correct outputs, no graphs): telling it apart would mean running
    the model from altered state, which also rewrote a KV cache kept by splitting ops."""
    model, ref = _StateFromTokens(kind).eval(), _StateFromTokens(kind).eval()
    with fake_cpu_platform():
        cm = _compile(model, strategy=strategy)
        for n in (3, 3, 2, 5, 4):
            x = torch.randn(n, 8)
            with torch.no_grad():
                torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.last, ref.last, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.seen, ref.seen, rtol=0, atol=0)
        assert counters.padding_refusals == 1 and counters.graph_replays == 0 and counters.recompiles == 0
    assert "what forward writes in place outside splitting ops" in caplog.text


@pw.splitting_op("pw_test_graphs::cache_attn", mutates_args=("cache", "out"))
def _cache_attn(h: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> None:
    ctx = pw.forward_context()
    n = ctx.num_tokens if ctx is not None else h.shape[0]
    cache.narrow(0, 0, n).copy_(h[:n])  # real rows only, as a KV-cache write
    out.copy_(h + cache.sum(0) * 0.01)


@_cache_attn.register_fake
def _(h, cache, out):
    return None


class _CounterAndCache(torch.nn.Module):
    """A count written outside splitting ops (padding leaks into it) and a cache only a splitting
    op writes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(64, 8))

    def forward(self, x):
        h = self.lin(x) + self.seen * 0.01
        self.seen += x.shape[0]
        out = torch.empty_like(h)
        torch.ops.pw_test_graphs.cache_attn(h, self.cache, out)
        return out


def test_the_padding_check_leaves_state_splitting_ops_keep_as_eager_has_it():
    """A version of the state check re-ran the model from altered (NaN-tainted) state, and the
    splitting op wrote that into its cache: NaN in 40 cache elements and in every later output."""
    model, ref = _CounterAndCache().eval(), _CounterAndCache().eval()
    with fake_cpu_platform():
        cm = _compile(model)
        for n in (5, 3, 2, 6):
            x = torch.randn(n, 8)
            with torch.no_grad():
                torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.cache, ref.cache, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.seen, ref.seen, rtol=0, atol=0)
        assert counters.padding_refusals == 1 and counters.recompiles == 0


@pytest.mark.parametrize("dim,shape", [(1, (2, None, 8)), (2, (2, 3, None, 8)), (0, (None, 2, 8))])
@pytest.mark.parametrize("backend", ["eager", "inductor", "inductor_partition"])
def test_any_token_dim_pads_into_contiguous_static_buffers(dim, shape, backend):
    model = _TokenDim().eval()
    fields = dict(backend="inductor", split_strategy=backend) if backend == "inductor_partition" else dict(backend=backend)
    with fake_cpu_platform():
        cm = pw.compile(model, CompilationConfig(**fields, max_num_tokens=16, cudagraph_capture_sizes=[4, 8]),
                        dynamic_arg_dims={"x": dim})
        gen = torch.Generator().manual_seed(3)
        for n in (5, 1, 8, 3, 12, 5):
            x = torch.randn(*[n if s is None else s for s in shape], generator=gen)
            with torch.no_grad():
                torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
        assert counters.graphs_captured > 0 and counters.recompiles == 0


def test_warm_up_failure_is_a_capture_error_naming_piece_and_size():
    @pw.splitting_op("pw_test_graphs::fails_padded", mutates_args=())
    def fails_padded(x: torch.Tensor) -> torch.Tensor:
        ctx = pw.forward_context()
        if ctx is not None and ctx.padded_num_tokens == 16:
            raise RuntimeError("no kernel for 16 rows")
        return x * 2

    @fails_padded.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.pw_test_graphs.fails_padded(x + 1) - 1

    with fake_cpu_platform():
        cm = _compile(M())
        with pytest.raises(pw.CaptureError, match="size 16") as info:
            cm(torch.randn(3, 8))
        assert "no kernel for 16 rows" in str(info.value)


def test_full_and_full_and_piecewise_modes_nest(strategy):
    model = ToyTransformer(num_layers=2, dim=16)
    for mode in ("full", "full_and_piecewise"):
        with fake_cpu_platform() as plat:
            cm = _compile(model, cudagraph_mode=mode, strategy=strategy)
            for n in (3, 9, 16, 1):
                for uniform in (False, True):
                    with batch_hint(uniform_decode=uniform):
                        x = torch.randn(n, 16)
                        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
            full_graphs = len(cm.backend.compiled.graphs.full.entries)
            assert full_graphs == 3
            piece_graphs = sum(len(w.entries) for w in cm.backend.stitched_wrappers)
            assert piece_graphs == (0 if mode == "full" else 3 * 3)
        torch._dynamo.reset()


def test_cpu_without_platform_resolves_to_none(strategy):
    model = TwoSplitModel()
    cm = _compile(model, strategy=strategy)
    with counters.expect(graphs_captured=0, capturable_pieces=0):
        x = torch.randn(3, 8)
        torch.testing.assert_close(cm(x), model(x))
    assert cm.backend.compiled.graphs is None


def test_a_second_model_captures_cleanly_after_the_first_is_deleted(strategy):
    import gc

    with fake_cpu_platform():
        a = ToyTransformer(num_layers=2, dim=16, seed=1)
        ca = _compile(a, strategy=strategy)
        ca(torch.randn(3, 16))
        pool_a = ca.backend.graph_pool.pool
        del ca
        gc.collect()
        torch._dynamo.reset()
        b = ToyTransformer(num_layers=2, dim=16, seed=2)
        cb = _compile(b, strategy=strategy)
        x = torch.randn(5, 16)
        torch.testing.assert_close(cb(x), b(x), rtol=1e-5, atol=1e-5)
        assert cb.backend.graph_pool.pool is not pool_a


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise"])
def test_reference_decoder_decode_under_graphs_equals_eager(mode, strategy, monkeypatch):
    """The continuous-batching loop over the compiled reference decoder under each graph mode.
    Under ``full_and_piecewise`` the loop declares its decode-only steps (one token a request)
    uniform, so they replay full graphs and steps with a prefill in them replay pieces; before,
    it declared nothing and every step ran piecewise."""
    from piecewise.graphs import dispatch
    from piecewise.serving import LlamaConfig, LlamaForCausalLM, default_trace, greedy_decode

    seen = []  # (runtime mode, real tokens, uniform) of each real call the dispatcher ran
    enter = dispatch.enter_forward

    def spy(ctx):
        if ctx.num_tokens:
            seen.append((ctx.runtime_mode, ctx.num_tokens, ctx.batch_descriptor is not None and ctx.batch_descriptor.uniform_decode))
        return enter(ctx)

    monkeypatch.setattr(dispatch, "enter_forward", spy)

    cfg = LlamaConfig(num_layers=2)
    trace = default_trace(cfg.vocab_size)

    def decode(fn, model):
        return greedy_decode(fn, trace.prompts, trace.max_new_tokens, arrival_steps=trace.arrival_steps,
                             max_num_seqs=cfg.max_num_seqs, reset=model.reset_kv_cache)

    ref_model = LlamaForCausalLM(cfg, seed=5)
    ref = decode(ref_model, ref_model)
    with fake_cpu_platform():
        model = LlamaForCausalLM(cfg, seed=5)
        adaptor = dict(backend="inductor", split_strategy=strategy) if strategy != "fx" else dict(backend="eager")
        cm = pw.compile(model, CompilationConfig(**adaptor, max_num_tokens=64, cudagraph_mode=mode,
                                                 cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32]),
                        dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
        with counters.expect(recompiles=0):
            out = decode(cm, model)
        assert out.tokens == ref.tokens
        assert counters.by_tag[cm.tag].graph_replays > 0
        if mode == "piecewise":
            # The attention op writes into an output buffer the piece before it allocated, so every
            # piece's inputs are bound in place: nothing is copied into a graph before a replay.
            entries = [(w.name, e) for w in cm.backend.stitched_wrappers for e in w.entries.values()
                       if e.phase is Phase.CAPTURED]
            assert len(entries) >= 2 * cfg.num_layers
            assert [(name, e.size) for name, e in entries if e.copied] == []
        if mode == "full_and_piecewise":
            decode_steps = [n for m, n, uniform in seen if uniform]
            assert decode_steps and all(m == "full" for m, _, uniform in seen if uniform)
            assert any(m == "piecewise" and not uniform for m, _, uniform in seen)


def test_sub_batch_replay_gathers_rows_pads_and_slices():
    from piecewise.graphs.subbatch import SubBatchReplay

    lin = torch.nn.Linear(8, 8)

    def head(h, bias):
        return torch.tanh(lin(h) + bias), h.sum(-1)

    with torch.no_grad(), fake_cpu_platform() as plat:
        sub = SubBatchReplay(head, capture_sizes=[2, 4, 8], max_rows=8, tag="draft")
        gen = torch.Generator().manual_seed(0)
        for n in (3, 1, 4, 7, 3, 8):
            batch, bias = torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)
            index = torch.randperm(16, generator=gen)[:n]
            got = sub(index, batch, bias)
            want = head(batch[index], bias[index])
            assert got[0].shape == (n, 8) and got[1].shape == (n,)
            torch.testing.assert_close(got, want)
        # sizes seen twice were captured (one warm-up first); size 2 was seen once
        assert sorted(set(plat.captured_sizes)) == [4, 8]
        sub(torch.arange(3), batch, bias)
        assert sub.buffers[0][3:4].abs().sum() == 0  # the pad row of a 3-row call is zero
    assert sum(g.replays for g in plat.graphs) > 3
    # above the largest capture size: runs directly
    with torch.no_grad(), fake_cpu_platform():
        sub = SubBatchReplay(head, capture_sizes=[2], max_rows=8)
        batch, bias = torch.randn(16, 8), torch.randn(16, 8)
        index = torch.arange(5)
        torch.testing.assert_close(sub(index, batch, bias), head(batch[index], bias[index]))


def test_warm_start_from_a_bundle_captures_and_replays_like_a_traced_model(tmp_path, strategy):
    import gc

    cfg = dict(cache_dir=str(tmp_path / "c"), cudagraph_capture_sizes=[4, 8, 16])
    with fake_cpu_platform():
        cold = _compile(ToyTransformer(num_layers=3, dim=16), **cfg, strategy=strategy)
        cold(torch.randn(3, 16))
        del cold
        gc.collect()  # frees the tag: the next model gets the same one, and the bundle
        model = ToyTransformer(num_layers=3, dim=16)
        cm = _compile(model, **cfg, strategy=strategy)
        gen = torch.Generator().manual_seed(1)
        with counters.expect(bundle_hits=1, dynamo_traces=0, compiler_invocations=0, graphs_captured=3 * 4,
                             capturable_pieces=4, recompiles=0):
            for n in range(1, 33):
                x = torch.randn(n, 16, generator=gen)
                torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert counters.by_tag[cm.tag].eager_above_capture == 16


@pytest.mark.parametrize("warmups", [0, 1, 3])
def test_cudagraph_num_warmups_eager_runs_before_each_capture(warmups, strategy):
    """Every piece runs eagerly `cudagraph_num_warmups` times at each capture size, then captures;
    results equal eager whatever the count (0: capture on the first run)."""
    model = ToyTransformer(num_layers=2, dim=16)
    with fake_cpu_platform() as plat:
        cm = _compile(model, cudagraph_num_warmups=warmups, cudagraph_capture_sizes=[4, 8], strategy=strategy)
        gen = torch.Generator().manual_seed(1)
        with counters.expect(graphs_captured=3 * 2, recompiles=0):
            for n in (3, 8, 1, 5):
                x = torch.randn(n, 16, generator=gen)
                torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert sorted(set(plat.captured_sizes)) == [4, 8]
        for w in cm.backend.stitched_wrappers:
            assert {s: (e.phase, e.warmups_done) for s, e in w.entries.items()} == {
                4: (Phase.CAPTURED, warmups), 8: (Phase.CAPTURED, warmups)}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_cudagraph_num_warmups_is_validated(bad):
    with pytest.raises(pw.ConfigError, match="cudagraph_num_warmups"):
        CompilationConfig(cudagraph_num_warmups=bad)


def test_transformers_generate_replays_decode_graphs_and_equals_eager(tmp_path):
    """generate() where graphs apply: prefill runs the two-dynamic-dim step without graphs, decode
    steps a step whose batch is the token count, captured per size up to max_num_seqs. Before, the
    one step was padded along its batch to sizes above the cache's slots and failed at its first
    call. Tokens equal eager greedy for every batch (left padding included); one trace per phase;
    the attention op writes an output buffer, so no graph copies an input before a replay."""
    from piecewise.hf import attention as hf

    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    ref = hf.tiny_llama(num_layers=2, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(7)
    with fake_cpu_platform():
        cm = pw.compile(model, CompilationConfig(backend="eager", max_num_seqs=4, max_model_len=64, cudagraph_mode="piecewise",
                                                 cache_dir=str(tmp_path)))
        with counters.expect(recompiles=0):
            for batch, length, new in ((1, 5, 6), (3, 9, 4), (4, 2, 7), (2, 1, 5), (3, 6, 3)):
                ids = torch.randint(1, 256, (batch, length), generator=gen)
                mask = torch.ones(batch, length, dtype=torch.long)
                if batch > 1 and length > 2:
                    mask[0, :2] = 0  # a left-padded row
                kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
                assert torch.equal(cm.generate(ids, **kw), ref.generate(ids, **kw)), (batch, length, new)
        decode = counters.by_tag[f"{cm.tag}_generate_decode"]
        assert counters.by_tag[f"{cm.tag}_generate"].dynamo_traces == 1 and decode.dynamo_traces == 1
        assert counters.by_tag[f"{cm.tag}_generate"].graph_replays == 0
        assert decode.graph_replays > 0 and decode.graphs_captured > 0
        step = cm._route.compiled[(True, True)]  # (last position's logits, decode step with graphs)
        entries = [e for w in step.backend.stitched_wrappers for e in w.entries.values() if e.phase is Phase.CAPTURED]
        assert len(entries) >= 3 and [e.size for e in entries if e.copied] == []


def test_a_decode_step_with_graphs_that_took_the_batch_size_serves_other_batches_without_graphs(tmp_path):
    """GPT-2 under Inductor: the decode step with graphs traced at batch 2 holds for batches of 2
    and more only (the trace took ``Ne(batch, 1)`` in its strides), so a later batch-1 generate()
    was refused with SizeRefusedError, where the general step traces again. Now that call runs on
    the general step without graphs, with the eager tokens and no recompile."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from piecewise.hf import attention as hf

    hf.register_hf_attention()
    cfg = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=512, pad_token_id=0, bos_token_id=1,
               eos_token_id=None)

    def build(attn):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(GPT2Config(**cfg), attn_implementation=attn).eval()

    ref = build("sdpa")
    with fake_cpu_platform():
        cm = pw.compile(build("piecewise"), CompilationConfig(backend="inductor", max_num_seqs=4, max_model_len=64,
                                                               cache_dir=str(tmp_path)))
        with counters.expect(recompiles=0):
            for batch in (2, 1, 2):
                ids = torch.randint(3, 512, (batch, 6), generator=torch.Generator().manual_seed(batch))
                kw = dict(max_new_tokens=4, do_sample=False)
                with torch.no_grad():
                    want = ref.generate(ids, **kw)
                assert torch.equal(cm.generate(ids, **kw), want), batch
        assert counters.by_tag[f"{cm.tag}_generate_decode"].graph_replays > 0


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise", None])
def test_transformers_generate_replays_full_decode_graphs(mode, tmp_path, caplog):
    """With full graphs the decode step's attention op is captured inside the graph, where no
    device value may be read on the host (the strict platform refuses it, as CUDA does). Before,
    the op read the last write position per layer, every full capture failed, each size was
    dropped with a warning and decode ran without graphs. ``None``: the default mode ("auto"),
    under which the decode step is one full graph per size (before: pieces)."""
    from piecewise.hf import attention as hf

    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    ref = hf.tiny_llama(num_layers=2, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(11)
    with fake_cpu_platform(strict_capture=True), caplog.at_level("WARNING", logger="piecewise"):
        chosen = {} if mode is None else {"cudagraph_mode": mode}
        cm = pw.compile(model, CompilationConfig(backend="eager", max_num_seqs=4, max_model_len=64, cache_dir=str(tmp_path),
                                                 **chosen))
        with counters.expect(recompiles=0):
            for batch, length, new in ((2, 5, 6), (4, 3, 5), (1, 9, 4), (3, 6, 3)):
                ids = torch.randint(1, 256, (batch, length), generator=gen)
                mask = torch.ones(batch, length, dtype=torch.long)
                if batch > 1:
                    mask[-1, :2] = 0  # a left-padded row
                kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
                assert torch.equal(cm.generate(ids, **kw), ref.generate(ids, **kw)), (batch, length, new)
        decode = counters.by_tag[f"{cm.tag}_generate_decode"]
        assert decode.graphs_captured > 0 and decode.graph_replays > 0
        step = cm._route.compiled[(True, True)]
        dispatcher = step.backend.result.graphs.dispatcher
        assert dispatcher.mode == (mode or "full")
        assert sorted(e.size for e in dispatcher.full.entries.values() if e.phase is Phase.CAPTURED) == [1, 2, 4]
        assert "capture" not in caplog.text.lower(), caplog.text


def test_a_stale_non_finite_cache_value_past_the_prompt_does_not_reach_the_full_decode_graph(tmp_path):
    """Under the default mode the decode step is one full graph, whose attention reads every cache
    position and masks the ones past a row's length with -inf. An infinite key or value left there
    (what an earlier generation's overflow leaves) made the row NaN (0 * inf) until a generation
    starts clearing its rows past the prompt; pieces never read past the length."""
    from piecewise.hf import attention as hf

    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    ref = hf.tiny_llama(num_layers=2, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(5)
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    with fake_cpu_platform(strict_capture=True):
        cm = pw.compile(model, CompilationConfig(backend="eager", max_num_seqs=4, max_model_len=64, cache_dir=str(tmp_path)))
        ids = torch.randint(1, 256, (2, 5), generator=gen)
        assert torch.equal(cm.generate(ids, **kw), ref.generate(ids, **kw))
        assert cm._route.compiled[(True, True)].backend.result.graphs.dispatcher.mode == "full"
        for cache in (*cm._route.step.caches()[0], *cm._route.step.caches()[1]):
            cache[:, :, 20:] = float("inf")
        ids = torch.randint(1, 256, (2, 7), generator=gen)
        with counters.expect(recompiles=0):
            assert torch.equal(cm.generate(ids, **kw), ref.generate(ids, **kw))


@pw.splitting_op("pw_test_graphs::copy_rows", mutates_args=())
def _copy_rows(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_copy_rows.register_fake
def _(x):
    return torch.empty_like(x)


class _ActThroughOwnOp(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return torch.ops.pw_test_graphs.copy_rows(self.act(x))


def test_auto_captures_the_decode_step_piecewise_when_the_model_calls_a_splitting_op_of_its_own(tmp_path, caplog):
    """The default mode makes the decode step one full graph only when the generation attention op
    is the only splitting op in the model's graph: another one (here the user's, in every MLP) need
    not be safe inside a graph (one reading ``forward_context().num_tokens`` on the host would
    replay its capture's count), so the step is captured in pieces, logged."""
    from piecewise.hf import attention as hf

    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    ref = hf.tiny_llama(num_layers=2, attn_implementation="sdpa")
    for layer in model.model.layers:
        layer.mlp.act_fn = _ActThroughOwnOp(layer.mlp.act_fn)
    gen = torch.Generator().manual_seed(6)
    with fake_cpu_platform(), caplog.at_level("INFO", logger="piecewise"):
        cm = pw.compile(model, CompilationConfig(backend="eager", max_num_seqs=4, max_model_len=64, cache_dir=str(tmp_path)))
        with counters.expect(recompiles=0):
            for batch, length in ((2, 5), (3, 4)):
                ids = torch.randint(1, 256, (batch, length), generator=gen)
                kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
                assert torch.equal(cm.generate(ids, **kw), ref.generate(ids, **kw))
        assert cm._route.compiled[(True, True)].backend.result.graphs.dispatcher.mode == "piecewise"
        assert counters.by_tag[f"{cm.tag}_generate_decode"].graph_replays > 0
        assert "pw_test_graphs::copy_rows" in caplog.text


class _ArgumentRead(torch.nn.Module):
    def forward(self, x, scale):  # x: [tokens, 8]; scale: [8], read in place by the graphs
        return x.sin() * scale


class _SelfNamedArgument(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(8))
        self.shift = torch.randn(8)  # a plain tensor attribute: module state, not an argument

    def forward(self, x, self_scale):  # an argument whose name Dynamo turns into l_self_scale_
        return x.sin() * self_scale + self.bias + self.shift


@pytest.mark.parametrize("model_cls", [_ArgumentRead, _SelfNamedArgument])
def test_an_argument_without_a_token_dim_passed_anew_is_refused_not_read_stale(model_cls, tmp_path):
    """Graphs read such an argument at its capture address: a call with another tensor there
    raises CaptureError naming it (before, later calls could replay over stale memory); the same
    tensor filled in place is followed. Arguments are told from module state by Dynamo's source
    (``L['self_scale']`` against ``L['self']...``), not by the placeholder's name: an argument
    named ``self_scale`` was taken for state, went unchecked, and replayed the capture's values."""
    model = model_cls()
    with fake_cpu_platform():
        cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=16, cudagraph_capture_sizes=[4, 8],
                                                 cache_dir=str(tmp_path)), dynamic_arg_dims={"x": 0})
        scale = torch.randn(8)
        gen = torch.Generator().manual_seed(6)
        for n in (4, 3, 8, 5):
            scale.copy_(torch.randn(8, generator=gen))
            x = torch.randn(n, 8, generator=gen)
            torch.testing.assert_close(cm(x, scale), model(x, scale), rtol=1e-5, atol=1e-5)
        assert counters.by_tag[cm.tag].graph_replays > 0
        with pytest.raises(pw.CaptureError, match="graph input .* argument of the forward without a token dim"):
            cm(torch.randn(4, 8), torch.randn(8))


def _hf_out(o):
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


class _TwoDynamicDims(torch.nn.Module):
    def forward(self, x, y):  # x: [tokens, 8]; y: [other, 8], a second dynamic size
        return x.sin() * 2 + y.sum(0)


def test_a_second_dynamic_size_turns_graphs_off_and_stays_exact(caplog, tmp_path):
    """One graph per token count would replay the capture's shape of the other dynamic dim: the
    plan refuses graphs (logged, naming the input) and every call equals eager."""
    model = _TwoDynamicDims()
    with fake_cpu_platform():
        cfg = CompilationConfig(backend="eager", max_num_tokens=16, cudagraph_capture_sizes=[4, 8], cache_dir=str(tmp_path))
        cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0, "y": 0})
        gen = torch.Generator().manual_seed(5)
        with caplog.at_level("WARNING", logger="piecewise"), counters.expect(recompiles=0):
            for n, k in ((4, 3), (4, 5), (3, 7), (8, 2), (4, 9)):
                x, y = torch.randn(n, 8, generator=gen), torch.randn(k, 8, generator=gen)
                torch.testing.assert_close(cm(x, y), model(x, y), rtol=1e-5, atol=1e-5)
        assert "has a dynamic size other than the token count" in caplog.text
        assert counters.by_tag[cm.tag].graph_replays == 0
