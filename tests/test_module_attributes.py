"""A plain attribute of a module (not a parameter, buffer or submodule) assigned after the first
call, that the trace read, is followed: the next call traces again (logged naming the attribute,
counted as a recompile and a state change) and returns what eager returns with the new value.
An attribute no trace read moves nothing. See piecewise.state ("What moves the epoch")."""

import gc
import logging

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters, state


@pw.splitting_op("pw_test_attrs::attn", mutates_args=())
def attn(q: torch.Tensor) -> torch.Tensor:
    return q * 2


@attn.register_fake
def _(q):
    return torch.empty_like(q)


class Scaler:
    """A plain callable object (no module, no parameter) held as an attribute."""

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor


class Block(torch.nn.Module):
    """LayerNorm, a float scale, a bool flag picking a branch, an int head count used in a
    reshape, and a plain callable object; ``forward(x [tokens, 8]) -> [tokens, 8]``."""

    shift = 0.0  # a class attribute the trace reads

    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(8)
        self.lin = torch.nn.Linear(8, 8)
        self.scale = 2.0
        self.gated = True
        self.heads = 4
        self.post = Scaler(3.0)

    def forward(self, x):
        h = torch.ops.pw_test_attrs.attn(self.lin(self.ln1(x))) * self.scale + self.shift
        if self.gated:
            h = h * torch.sigmoid(h)
        n, d = h.shape
        h = h.reshape(n, self.heads, d // self.heads).softmax(-1).reshape(n, d)
        extra = getattr(self, "bias_scale", None)  # absent at the first call
        if extra is not None:
            h = h + extra
        return self.post(h)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _compiled(backend="eager", **kw):
    model = Model().eval()
    cm = pw.compile(model, CompilationConfig(backend=backend, max_num_tokens=32, **kw), dynamic_arg_dims={"x": 0})
    return model, cm


def _same_as_eager(cm, model, sizes=(5, 3, 9), seed=3, **tol):
    gen = torch.Generator().manual_seed(seed)
    for n in sizes:
        x = torch.randn(n, 8, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(cm(x), model(x), **tol)


def _set_post(b):
    b.post = Scaler(-0.5)


CHANGES = {
    "layernorm_eps": (lambda m: setattr(m.blocks[0].ln1, "eps", 10.0), "blocks.0.ln1.eps: 1e-05 -> 10.0"),
    "float_scale": (lambda m: setattr(m.blocks[1], "scale", 0.25), "blocks.1.scale: 2.0 -> 0.25"),
    "bool_branch": (lambda m: setattr(m.blocks[0], "gated", False), "blocks.0.gated: True -> False"),
    "int_heads": (lambda m: setattr(m.blocks[1], "heads", 2), "blocks.1.heads: 4 -> 2"),
    "object_replaced": (lambda m: _set_post(m.blocks[0]), "blocks.0.post: a Scaler object"),
    "absent_attribute_set": (lambda m: setattr(m.blocks[1], "bias_scale", 0.5), "blocks.1.bias_scale: absent -> 0.5"),
    "class_attribute_shadowed": (lambda m: setattr(m.blocks[0], "shift", 1.5), "blocks.0.shift: absent -> 1.5"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_attribute_the_trace_read_assigned_after_the_first_call_is_followed(change, caplog):
    model, cm = _compiled()
    _same_as_eager(cm, model, sizes=(5,))
    apply, logged = CHANGES[change]
    apply(model)
    with caplog.at_level(logging.INFO, logger="piecewise"), \
            counters.expect(recompiles=1, state_changes=1, dynamo_traces=1):
        _same_as_eager(cm, model)
    assert logged in caplog.text and "tracing again" in caplog.text
    with counters.expect(recompiles=0, state_changes=0, dynamo_traces=0):  # followed once, then steady
        _same_as_eager(cm, model, sizes=(7, 2), seed=4)


def test_the_eps_of_a_layernorm_changed_after_compile_is_followed_under_inductor():
    """The issue's case: ``model.blocks[0].ln1.eps = 10.0`` after the first call ran the old eps."""
    model, cm = _compiled("inductor")
    _same_as_eager(cm, model, sizes=(5,), rtol=1e-4, atol=1e-4)
    model.blocks[0].ln1.eps = 10.0
    with counters.expect(recompiles=1, state_changes=1):
        _same_as_eager(cm, model, rtol=1e-4, atol=1e-4)


def test_several_attributes_changed_together_trace_once():
    model, cm = _compiled()
    _same_as_eager(cm, model, sizes=(5,))
    for change in ("layernorm_eps", "float_scale", "int_heads"):
        CHANGES[change][0](model)
    with counters.expect(recompiles=1, dynamo_traces=1):
        _same_as_eager(cm, model)


def test_nothing_assigned_or_the_same_value_assigned_traces_nothing():
    model, cm = _compiled()
    _same_as_eager(cm, model, sizes=(5,))
    with counters.expect(recompiles=0, state_changes=0, dynamo_traces=0):
        _same_as_eager(cm, model)
        model.blocks[0].ln1.eps = 1e-5  # the traced value again: described and compared, no trace
        model.blocks[1].scale = 2.0
        model.blocks[0].post = model.blocks[0].post
        _same_as_eager(cm, model)


def test_an_attribute_no_trace_read_moves_no_epoch():
    model, cm = _compiled()
    _same_as_eager(cm, model, sizes=(5,))
    before = state.epoch()
    model.note = "served since Monday"  # forward never reads these
    model.blocks[0].ln1.comment = 1
    model.blocks[0].post.factor_note = 2
    assert state.epoch() == before
    with counters.expect(recompiles=0, dynamo_traces=0):
        _same_as_eager(cm, model)


def test_training_flag_assigned_directly_is_followed():
    """``m.training = True`` (not ``.train()``) changes what dropout does."""

    class WithDropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(torch.ops.pw_test_attrs.attn(x))

    model = WithDropout().eval()
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=32), dynamic_arg_dims={"x": 0})
    x = torch.ones(6, 64)
    torch.testing.assert_close(cm(x), x * 2)
    model.drop.training = True
    with counters.expect(recompiles=1, state_changes=1):
        out = cm(x)
    assert (out == 0).any() and ((out == 0) | (out == 4)).all()  # dropped, the rest scaled by 1 / (1 - p)


def test_a_forward_that_assigns_its_own_attribute_does_not_trace_again_on_every_call():
    """The compiled code replays ``self.calls = ...`` with ``object.__setattr__``: no epoch move."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.last_rows = 0

        def forward(self, x):
            self.last_rows = 7
            return torch.ops.pw_test_attrs.attn(x)

    model = Counting()
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=32), dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 2))
    before = state.epoch()
    with counters.expect(recompiles=0, dynamo_traces=0):
        for n in (3, 5, 2):
            torch.testing.assert_close(cm(x := torch.randn(n, 2)), x * 2)
    assert state.epoch() == before and model.last_rows == 7


def test_debug_mode_follows_the_change_instead_of_refusing_it():
    model, cm = _compiled(debug=True)
    _same_as_eager(cm, model, sizes=(5,))
    model.blocks[1].scale = -1.0
    with counters.expect(recompiles=1):
        _same_as_eager(cm, model)


def test_after_a_warm_start_an_attribute_change_is_followed(tmp_path):
    """A model started from a bundle has no trace in this process to tell which attributes were
    read: every plain attribute counts (an unread one traces again, needlessly but correctly)."""
    cfg = CompilationConfig(backend="eager", cache_dir=str(tmp_path / "c"), max_num_tokens=32)
    first = pw.compile(Model().eval(), cfg, dynamic_arg_dims={"x": 0})
    first(torch.randn(5, 8))
    del first
    gc.collect()  # frees the tag: the next model asks for the same one, as another process would
    model = Model().eval()
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(bundle_hits=1, dynamo_traces=0):
        _same_as_eager(cm, model, sizes=(5,))
    assert state.read_attributes(model) is None
    model.blocks[0].ln1.eps = 10.0
    with counters.expect(recompiles=1, dynamo_traces=1):
        _same_as_eager(cm, model)
    assert "blocks.0.ln1.eps" in state.read_attributes(model)  # the new trace recorded its reads


def test_the_trace_records_the_attributes_it_read():
    model, cm = _compiled()
    cm(torch.randn(5, 8))
    read = state.read_attributes(model)
    for i in (0, 1):
        assert {f"blocks.{i}.{a}" for a in ("scale", "gated", "heads", "post", "shift", "bias_scale", "ln1.eps")} <= read
    assert not any(p.endswith(("._parameters", "._modules", ".training", ".forward")) for p in read)
    assert state.watched(model.blocks[0].ln1, "eps") and state.watched(model.blocks[0], "training")
    assert not state.watched(model.blocks[0], "note") and not state.watched(torch.nn.LayerNorm(8), "eps")


def test_a_tensor_attribute_absent_at_the_first_call_and_set_later_is_followed():
    """``getattr(self, "gain", None)`` read nothing at the trace; a tensor set there later is read."""

    class Gained(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = torch.ops.pw_test_attrs.attn(self.lin(x))
            gain = getattr(self, "gain", None)
            return h * gain if gain is not None else h

    model = Gained()
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=32), dynamic_arg_dims={"x": 0})
    x = torch.randn(3, 4)
    cm(x)
    model.gain = torch.full((4,), 3.0)
    with counters.expect(recompiles=1, state_changes=1):
        with torch.no_grad():
            torch.testing.assert_close(cm(x), model(x))
