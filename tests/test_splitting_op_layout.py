"""A splitting op whose fake (``register_fake``) promises other strides than the op returns: the
compiled piece after it was built for the fake's layout, so its outputs are copied into that layout
(warned once, counted in ``layout_mismatches``); a fake of other sizes or dtype is a typed error
naming the op. An op that returns its fake's layout runs without any check after its first call."""

import gc
import logging

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.piece import LAYOUT_CALLS_CHECKED, LayoutBook, LayoutPhase, SplittingRunner


@pw.splitting_op("pw_test_layout::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # a kernel that wants contiguous inputs: its result is contiguous whatever q's layout is
    return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True)


@_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)  # keeps the strides of a transposed q: not what the op returns


@pw.splitting_op("pw_test_layout::attention_fixed", mutates_args=())
def _attention_fixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True)


@_attention_fixed.register_fake
def _(q, k, v):
    return q.new_empty(q.shape)  # contiguous, as the op returns


@pw.splitting_op("pw_test_layout::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).contiguous()


@_double.register_fake
def _(x):
    return torch.empty_like(x)


@pw.splitting_op("pw_test_layout::pair", mutates_args=())
def _pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x * 2).contiguous(), x * 3  # the second keeps x's layout (elementwise ops do)


@_pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


@pw.splitting_op("pw_test_layout::row_scale", mutates_args=())
def _row_scale(h: torch.Tensor) -> torch.Tensor:
    return h.sum(-1, keepdim=True)  # [n, 1]


@_row_scale.register_fake
def _(h):
    return torch.empty_like(h)  # [n, d]: other sizes than the op returns


@pw.splitting_op("pw_test_layout::as_double", mutates_args=())
def _as_double(x: torch.Tensor) -> torch.Tensor:
    return x.double()


@_as_double.register_fake
def _(x):
    return torch.empty_like(x)  # float32 where the op returns float64


class Block(nn.Module):
    """nanoGPT's layout: fused qkv, ``view(B, T, h, d).transpose(1, 2)``, attention as a splitting op."""

    def __init__(self, d, h, fixed):
        super().__init__()
        self.h, self.fixed = h, fixed
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        attention = torch.ops.pw_test_layout.attention_fixed if self.fixed else torch.ops.pw_test_layout.attention
        y = attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, fixed, vocab=128, d=48, h=3, n_layer=2, max_len=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, h, fixed) for _ in range(n_layer))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(T, device=input_ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def _gpt(backend, fixed=False, **kw):
    """The model with the op whose fake has the wrong strides, or (`fixed`) the one whose fake is right."""
    torch.manual_seed(0)
    model = TinyGPT(fixed).eval()
    cfg = CompilationConfig(backend=backend, max_num_tokens=64, **kw)
    return model, pw.compile(model, cfg, dynamic_arg_dims={"input_ids": 1})


def _runners(cm):
    split = cm.backend.result.split
    return [split.split_module.__dict__[it.name] for it in split.items if it.is_splitting]


def _layout_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "register_fake" in r.getMessage()]


def test_fake_with_other_strides_is_copied_into_its_layout_and_matches_eager_with_inductor(caplog):
    model, cm = _gpt("inductor")
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="piecewise"), torch.no_grad():
        for t in (12, 5, 33, 2, 64, 12):  # fresh data every call
            ids = torch.randint(0, 128, (2, t), generator=gen)
            torch.testing.assert_close(cm(ids), model(ids), rtol=1e-4, atol=1e-4)
    assert counters.layout_mismatches == 1 and counters.by_tag[cm.tag].layout_mismatches == 1
    assert counters.recompiles == 0
    (message,) = _layout_warnings(caplog)  # once, though both layers' pieces copy
    # batch 2, 3 heads, 12 tokens, head dim 16: the op's contiguous result, the fake's transposed q
    assert "pw_test_layout::attention" in message and "new_empty" in message
    assert "size (2, 3, 12, 16) stride (576, 192, 16, 1)" in message and "stride (576, 16, 48, 1)" in message
    runners = _runners(cm)
    assert [r.phase for r in runners] == [LayoutPhase.COPYING] * 2
    # the two layers' pieces share their fakes' answers: one fake run per distinct length, not two
    assert runners[0].book is runners[1].book and len(runners[0].book.expected) == 5


def test_fake_with_the_ops_layout_leaves_the_bare_piece_after_the_first_call():
    model, cm = _gpt("eager", fixed=True)
    with torch.no_grad():
        ids = torch.randint(0, 128, (2, 12))
        torch.testing.assert_close(cm(ids), model(ids))
        runners = _runners(cm)
        assert runners and not any(isinstance(r, SplittingRunner) for r in runners)
        for t in (5, 40):
            ids = torch.randint(0, 128, (2, t))
            torch.testing.assert_close(cm(ids), model(ids))
    assert counters.layout_mismatches == 0


def test_warm_start_checks_the_layout_as_a_traced_model_does(tmp_path):
    cfg = dict(cache_dir=str(tmp_path / "c"))
    _, cold = _gpt("eager", **cfg)
    with torch.no_grad():
        cold(torch.randint(0, 128, (2, 7)))
    del cold
    gc.collect()  # frees the tag: the next model gets the same one, and the bundle
    counters.reset()
    model, cm = _gpt("eager", **cfg)
    with counters.expect(bundle_hits=1, dynamo_traces=0, layout_mismatches=1), torch.no_grad():
        for t in (9, 3, 20):
            ids = torch.randint(0, 128, (2, t))
            torch.testing.assert_close(cm(ids), model(ids))
    assert [r.phase for r in _runners(cm)] == [LayoutPhase.COPYING] * 2


class RowScale(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return h * torch.ops.pw_test_layout.row_scale(h)  # broadcasts: eager pieces would run on [n, 1]


def test_fake_with_other_sizes_is_a_compile_error_naming_the_op():
    model = RowScale()
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=32), dynamic_arg_dims={"x": 0})
    with pytest.raises(pw.CompileError, match="pw_test_layout::row_scale") as err, torch.no_grad():
        cm(torch.randn(5, 8))
    assert "size (5, 1)" in str(err.value) and "size (5, 8)" in str(err.value) and "fake" in str(err.value)


# -- the runner on a hand-built splitting piece (no trace, no compile)


def _piece(op, outputs=1):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    out = g.call_function(op, (x,))
    if outputs > 1:
        import operator

        out = tuple(g.call_function(operator.getitem, (out, i)) for i in range(outputs))
    g.output(out)
    return torch.fx.GraphModule(nn.Module(), g)


def _runner(op, outputs=1):
    gm = _piece(op, outputs)
    slots = {}
    runner = SplittingRunner("submod_1", gm, gm.forward, slots, "layout_test", LayoutBook())
    runner.install()
    return runner, slots


def _heads(n):
    """[2, n, 4], a transposed view (strides (4, 8, 1)): ``view(n, 2, 4).transpose(0, 1)``."""
    return torch.randn(n, 2, 4).transpose(0, 1)


def test_a_call_with_a_dim_of_size_one_decides_nothing(caplog):
    runner, slots = _runner(torch.ops.pw_test_layout.double.default)
    with caplog.at_level(logging.WARNING, logger="piecewise"):
        x = _heads(1)  # the op's contiguous (4, 4, 1) and the fake's (4, 8, 1) differ only at the size-1 dim
        torch.testing.assert_close(slots["submod_1"](x), x * 2)
        assert runner.phase is LayoutPhase.CHECKING and slots["submod_1"] is runner and not _layout_warnings(caplog)
        for n in (5, 3, 5):
            x = _heads(n)
            out = slots["submod_1"](x)
            assert out.stride() == (4, 8, 1), "the fake's layout"
            torch.testing.assert_close(out, x * 2)
    assert runner.phase is LayoutPhase.COPYING
    assert counters.layout_mismatches == 1 and len(_layout_warnings(caplog)) == 1


def test_outputs_that_always_have_a_dim_of_size_one_are_trusted_after_a_bounded_number_of_calls():
    runner, slots = _runner(torch.ops.pw_test_layout.double.default)
    for _ in range(LAYOUT_CALLS_CHECKED - 1):
        slots["submod_1"](_heads(1))
    assert runner.phase is LayoutPhase.CHECKING
    slots["submod_1"](_heads(1))
    assert runner.phase is LayoutPhase.TRUSTED and not isinstance(slots["submod_1"], SplittingRunner)


def test_only_the_output_in_another_layout_is_copied():
    runner, slots = _runner(torch.ops.pw_test_layout.pair.default, outputs=2)
    x = _heads(6)
    a, b = slots["submod_1"](x)
    assert a.stride() == b.stride() == x.stride() == (4, 8, 1)
    torch.testing.assert_close(a, x * 2)
    torch.testing.assert_close(b, x * 3)
    assert runner.phase is LayoutPhase.COPYING and counters.layout_mismatches == 1


def test_fake_of_another_dtype_is_a_compile_error_naming_the_op():
    runner, slots = _runner(torch.ops.pw_test_layout.as_double.default)
    with pytest.raises(pw.CompileError, match="pw_test_layout::as_double") as err:
        slots["submod_1"](torch.randn(3, 4))
    assert "torch.float64" in str(err.value) and "torch.float32" in str(err.value)


def test_an_inductor_stride_assertion_inside_one_compiled_piece_becomes_a_compile_error():
    """With mode='full' or split_strategy='inductor_partition' a splitting op runs inside Inductor's
    code, out of the splitting runners' reach: Inductor's own ``assert_size_stride`` failing there
    reaches the caller as a `CompileError` naming the likely cause and the fix; another
    AssertionError stays what it is."""
    from piecewise.compiled import _layout_assertion

    seen = _layout_assertion(AssertionError("expected size 3==3, stride 192==16 at dim=1"), "m")
    assert isinstance(seen, pw.CompileError)
    assert "register_fake" in str(seen) and "stride 192==16" in str(seen) and "q.new_empty(q.shape)" in str(seen)
    other = AssertionError("a model's own check")
    assert _layout_assertion(other, "m") is other
