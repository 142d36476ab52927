"""What guard-free dispatch must refuse or handle: every input change the first trace did not cover
either runs correctly or raises InputError before running (cases found by trying to break it)."""

import gc

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters

import piecewise.testing.toy  # noqa: F401  registers the op

ATTN = torch.ops.piecewise_models.toy_attention


def _cfg(**kw):
    kw.setdefault("backend", "eager")
    kw.setdefault("max_num_tokens", 64)
    return CompilationConfig(**kw)


class Cross(torch.nn.Module):
    def forward(self, x, ctx):
        return ATTN(x, ctx, ctx)


def test_tensors_aliased_in_the_trace_must_stay_aliased():
    m = Cross()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "ctx": 0})
    x = torch.randn(4, 8)
    torch.testing.assert_close(cm(x, x), m(x, x))
    with pytest.raises(pw.InputError, match="were one tensor"):
        cm(torch.randn(4, 8), torch.randn(4, 8))


class Scaled(torch.nn.Module):
    def forward(self, ids, k):
        return ATTN(ids.float(), ids.float(), ids.float()), ids * k


def test_non_tensor_argument_must_keep_its_type():
    cm = pw.compile(Scaled(), _cfg(), dynamic_arg_dims={"ids": 0})
    ids = torch.randint(0, 9, (3, 4))
    cm(ids, 1)
    for other in (1.0, True):
        with pytest.raises(pw.InputError, match="differs from the traced value"):
            cm(ids, other)


class ListArg(torch.nn.Module):
    def forward(self, x, w):
        return ATTN(x, x, x) * w[0]


def test_in_place_edit_of_a_list_argument_is_caught():
    cm = pw.compile(ListArg(), _cfg(), dynamic_arg_dims={"x": 0})
    w = [1.0]
    cm(torch.randn(3, 4), w)
    w[0] = 3.0
    with pytest.raises(pw.InputError, match="'w'"):
        cm(torch.randn(3, 4), w)


class Settings(torch.nn.Module):
    def forward(self, x, opts, d, s):
        return ATTN(x, x, x) * opts[0] * list(d.values())[0] / s


def test_a_non_tensor_argument_equal_by_value_but_not_as_traced_is_refused():
    """Each passed Python's == and ran the traced value: a leaf of another type ([2] for [2.0]),
    dict keys in another order (forward iterates them), -0.0 for 0.0 (x / s gave inf). A nan
    argument equals itself (it used to be refused as differing from the traced nan)."""
    cm = pw.compile(Settings(), _cfg(), dynamic_arg_dims={"x": 0})
    x = torch.randn(3, 4)
    cm(x, [2.0], {"a": 2.0, "b": 3.0}, 0.5)
    for name, call in (("opts", lambda: cm(x, [2], {"a": 2.0, "b": 3.0}, 0.5)),
                       ("d", lambda: cm(x, [2.0], {"b": 3.0, "a": 2.0}, 0.5))):
        with pytest.raises(pw.InputError, match=f"'{name}'"):
            call()
    zero = pw.compile(Settings(), _cfg(tag="zero"), dynamic_arg_dims={"x": 0})
    torch.testing.assert_close(zero(x, [1.0], {"a": 1.0}, 0.0), Settings()(x, [1.0], {"a": 1.0}, 0.0))
    with pytest.raises(pw.InputError, match="'s'=-0.0 differs"):
        zero(x, [1.0], {"a": 1.0}, -0.0)
    nan = pw.compile(Settings(), _cfg(tag="nan"), dynamic_arg_dims={"x": 0})
    nan(x, [1.0], {"a": 1.0}, float("nan"))
    assert torch.isnan(nan(x, [1.0], {"a": 1.0}, float("nan"))).all()


class Pair(torch.nn.Module):
    def forward(self, x, pair, **kw):
        out = ATTN(x, pair[0], pair[1])
        for v in kw.values():  # order-dependent
            out = out * 2 + v
        return out


def test_one_tensor_twice_in_a_container_or_kwargs_in_another_order_is_refused():
    """Both ran the traced call: a tuple holding one tensor twice is one trace input (distinct
    tensors later were read as the first, off by ~6), and **kwargs iterated in the traced order."""
    m = Pair()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0})
    x, t = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(cm(x, (t, t), a=1.0, b=2.0), m(x, (t, t), a=1.0, b=2.0))
    with pytest.raises(pw.InputError, match=r"\['pair\[0\]', 'pair\[1\]'\] were one tensor"):
        cm(x, (torch.randn(3, 4), torch.randn(3, 4)), a=1.0, b=2.0)
    with pytest.raises(pw.InputError, match=r"keyword arguments \['b', 'a'\] reach \*\*kwargs in another order"):
        cm(x, (t, t), b=2.0, a=1.0)
    torch.testing.assert_close(cm(x, (t, t), a=1.0, b=2.0), m(x, (t, t), a=1.0, b=2.0))


class TupleArg(torch.nn.Module):
    def forward(self, x, kv):
        return ATTN(x, kv[0], kv[1])


def test_tuple_of_tensors_argument_is_checked_leaf_by_leaf():
    m = TupleArg()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0})
    for _ in range(3):
        x, kv = torch.randn(3, 4), (torch.randn(3, 4), torch.randn(3, 4))
        torch.testing.assert_close(cm(x, kv), m(x, kv))
    with pytest.raises(pw.InputError, match="dtype"):
        cm(torch.randn(3, 4), (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)))
    with pytest.raises(pw.InputError, match="structure"):
        cm(torch.randn(3, 4), [torch.randn(3, 4)])


class WithDefault(torch.nn.Module):
    def forward(self, x, flag: bool = True):
        return ATTN(x, x, x) * (2 if flag else 3)


def test_default_argument_may_be_passed_explicitly_with_the_same_value():
    m = WithDefault()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0})
    x = torch.randn(3, 4)
    cm(x)
    torch.testing.assert_close(cm(x, flag=True), m(x, flag=True))
    with pytest.raises(pw.InputError, match="default"):
        cm(x, flag=False)


def test_top_level_forward_hooks_are_refused():
    m = Cross()
    m.register_forward_hook(lambda mod, inp, out: out * 10)
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "ctx": 0})
    with pytest.raises(pw.ConfigError, match="hooks"):
        cm(torch.randn(3, 4), torch.randn(3, 4))


def test_changed_module_attribute_is_followed_in_debug_mode_too():
    """Followed by a new trace (tests/test_module_attributes.py), before debug mode's guards run."""
    class Temp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = 1.0

        def forward(self, x):
            return ATTN(x, x, x) / self.temperature

    m = Temp()
    cm = pw.compile(m, _cfg(debug=True), dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 4))
    m.temperature = 2.0
    x = torch.randn(3, 4)
    with counters.expect(recompiles=1):
        torch.testing.assert_close(cm(x), m(x))


def test_same_class_compiled_many_times_in_one_process():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return ATTN(self.lin(x), x, x)

    for _ in range(12):  # above Dynamo's recompile limit of 8 per code object
        m = M()
        cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0})
        x = torch.randn(3, 4)
        torch.testing.assert_close(cm(x), m(x))
        del cm
        gc.collect()


def test_unmarked_tied_dim_gives_a_config_error_naming_the_remedy():
    class Tied(torch.nn.Module):
        def forward(self, x, pos):
            return ATTN(x + pos, x, x)

    cm = pw.compile(Tied(), _cfg(), dynamic_arg_dims={"x": 0})
    with pytest.raises(pw.ConfigError, match="dynamic_arg_dims"):
        cm(torch.randn(3, 4), torch.randn(3, 4))


def test_strided_input_runs_like_eager_with_inductor():
    class Res(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.lin(x) + x
            return ATTN(h, h, h)

    m = Res()
    cm = pw.compile(m, _cfg(backend="inductor"), dynamic_arg_dims={"x": 0})
    cm(torch.randn(5, 16))
    with counters.expect(recompiles=0, compiler_invocations=0):
        for x in (torch.randn(5, 32)[:, ::2], torch.randn(16, 7).t(), torch.randn(1, 16).expand(6, 16)):
            torch.testing.assert_close(cm(x), m(x), rtol=1e-4, atol=1e-4)


def test_unknown_backend_fails_at_compile_time():
    with pytest.raises(pw.ConfigError, match="nope"):
        pw.compile(Cross(), _cfg(backend="nope"), dynamic_arg_dims={"x": 0})


class WritesX(torch.nn.Module):
    """Writes its first argument in place, then reads both: eager semantics depend on whether the
    two share memory."""

    def forward(self, x, y):
        x.mul_(2)
        return ATTN(y + x, y, y)


def test_a_strided_argument_forward_writes_in_place_gets_the_write_like_eager():
    m = WritesX()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "y": 0})
    cm(torch.randn(3, 4), torch.randn(3, 4))
    assert cm._signature.mutated == ("x",)
    base = torch.randn(4, 5)
    want_base, y = base.clone(), torch.randn(5, 4)
    with counters.expect(recompiles=0):
        got = cm(base.t(), y)  # runs on a contiguous copy of the transposed view
    want = m(want_base.t(), y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(base, want_base)  # the caller's buffer got the write, as in eager


def test_a_strided_first_argument_with_a_dynamic_dim_serves_every_size():
    m = WritesX()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "y": 0})
    with counters.expect(recompiles=0):
        for n in (3, 5, 1, 8):  # strides (1, n) of a transposed view differ at every size
            base, y = torch.randn(4, n), torch.randn(n, 4)
            want_base = base.clone()
            torch.testing.assert_close(cm(base.t(), y), m(want_base.t(), y))
            torch.testing.assert_close(base, want_base)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_arguments_that_share_memory_unlike_the_trace_are_refused_when_forward_writes_one(backend):
    """Traced on distinct tensors, then called with y a view of x: Inductor's code read y before x's
    write and returned a wrong result (off by ~4.6, no recompile); now refused. Distinct tensors
    still run like eager."""
    m = WritesX()
    cm = pw.compile(m, _cfg(backend=backend), dynamic_arg_dims={"x": 0, "y": 0})
    cm(torch.randn(6, 4), torch.randn(6, 4))
    a = torch.randn(6, 4)
    with pytest.raises(pw.InputError, match=r"sharing memory.*now: x and y; traced: none"):
        cm(a, a.view(6, 4))
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    want_x = x.clone()
    torch.testing.assert_close(cm(x, y), m(want_x, y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x, want_x)


def test_arguments_traced_sharing_memory_must_keep_sharing_it_when_forward_writes_one():
    """Inductor's code for a traced view pair rebuilds them from one base: distinct tensors later
    ended in its untyped AssertionError; now an InputError, and the traced sharing still runs."""
    m = WritesX()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "y": 0})
    a = torch.randn(6, 4)
    cm(a, a.view(6, 4))
    with pytest.raises(pw.InputError, match=r"now: none; traced: x and y"):
        cm(torch.randn(6, 4), torch.randn(6, 4))
    a = torch.randn(3, 4)
    b = a.clone()
    torch.testing.assert_close(cm(a, a.view(3, 4)), m(b, b.view(3, 4)))


def test_sharing_memory_is_free_when_forward_writes_no_argument():
    m = Cross()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "ctx": 0})
    cm(torch.randn(6, 8), torch.randn(6, 8))
    assert cm._signature.mutated == () and cm._signature.shared_memory is None
    buf = torch.randn(12, 8)
    torch.testing.assert_close(cm(buf[:6], buf[6:]), m(buf[:6], buf[6:]))
    torch.testing.assert_close(cm(buf[:6], buf[:6].view(6, 8)), m(buf[:6], buf[:6]))


class WritesXReadsY(torch.nn.Module):
    def forward(self, x, y):
        x.add_(1)
        return ATTN(y * 2, y, y)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_strided_argument_sharing_memory_with_a_written_one_is_refused(backend):
    """The sharing check looked at the contiguous copy of a strided argument, which shares nothing:
    ``cm(buf.t(), buf)`` ran with y blind to x's write (output 0 where eager gives 32), and a first
    call on a transpose and a view of one buffer left it off by 3 (each ran on its own memory). The check now reads the arguments as the caller passed them."""
    m = WritesXReadsY()
    cm = pw.compile(m, _cfg(backend=backend), dynamic_arg_dims={"x": 0, "y": 0})
    cm(torch.randn(4, 4), torch.randn(4, 4))
    buf = torch.zeros(4, 4)
    with pytest.raises(pw.InputError, match="now: x and y; traced: none"):
        cm(buf.t(), buf)
    with pytest.raises(pw.InputError, match="now: x and y; traced: none"):
        cm(buf, buf[:1].expand(4, 4))  # a broadcast view of the written argument
    assert torch.equal(buf, torch.zeros(4, 4)), "nothing ran"

    class WritesBoth(torch.nn.Module):
        def forward(self, x, y):
            x.add_(1)
            y.mul_(3)
            return ATTN(x + y, x, x)

    first = pw.compile(WritesBoth(), _cfg(backend=backend, tag="writes_both"), dynamic_arg_dims={"x": 0, "y": 0})
    base = torch.zeros(4, 6)
    with pytest.raises(pw.InputError, match="'x' is strided and shares memory with 'y'"):
        first(base.t(), base.view(6, 4))  # x runs on a copy (a transpose is traced contiguous)


def test_overlapping_memory_in_two_storages_counts_as_sharing():
    """Two tensors on one block of memory through two storages (numpy views): grouping by storage
    missed it and Inductor's code was off by 1.55; address ranges catch it."""
    import numpy as np  # pinned in requirements.txt
    m = WritesX()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "y": 0})
    cm(torch.randn(6, 4), torch.randn(6, 4))
    block = np.zeros((8, 4), dtype=np.float32)
    x, y = torch.from_numpy(block[:6]), torch.from_numpy(block[2:])
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    with pytest.raises(pw.InputError, match="now: x and y; traced: none"):
        cm(x, y)


def test_read_only_arguments_may_share_memory_differently_from_the_trace():
    """Only sharing with a written argument matters: two read-only arguments passed as distinct
    tensors, then as slices of one buffer, were refused though the trace covers both."""

    class WritesXReadsAB(torch.nn.Module):
        def forward(self, x, a, b):
            x.add_(1)
            return ATTN(a + b + x, a, b)

    m = WritesXReadsAB()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "a": 0, "b": 0})
    cm(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    arena = torch.randn(6, 4)
    for a, b in ((arena[:3], arena[3:]), (torch.randn(3, 4), torch.randn(3, 4)), (arena[:3], arena[:3])):
        x = torch.randn(3, 4)
        want_x = x.clone()
        torch.testing.assert_close(cm(x, a, b), m(want_x, a, b))
        torch.testing.assert_close(x, want_x)


def test_calls_under_inference_mode_run_and_get_their_writes():
    """Inference tensors have no version counter: reading it failed every first call under
    ``torch.inference_mode()`` (untyped RuntimeError). Writes to a strided one are found by value."""
    m = WritesX()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "y": 0})
    with torch.inference_mode():
        for n in (4, 6):
            base, y = torch.randn(4, n), torch.randn(n, 4)
            want_base = base.clone()
            torch.testing.assert_close(cm(base.t(), y), m(want_base.t(), y))
            torch.testing.assert_close(base, want_base)
    reads = pw.compile(Cross(), _cfg(tag="reads_under_inference"), dynamic_arg_dims={"x": 0, "ctx": 0})
    with torch.inference_mode():
        x = torch.randn(5, 8)
        torch.testing.assert_close(reads(x, x.clone()), Cross()(x, x.clone()))


def test_rows_of_a_wider_buffer_with_a_dynamic_dim_run_in_place_without_a_copy():
    """Strides (1024, 1) of ``big[:n, :512]`` do not change with n: traced as they are, every size
    runs on the caller's tensor (a first version copied it on every call: ~780 us at 4096 rows)."""
    m = Cross()
    cm = pw.compile(m, _cfg(max_num_tokens=128), dynamic_arg_dims={"x": 0, "ctx": 0})
    big = torch.randn(128, 16)
    with counters.expect(recompiles=0):
        for n in (8, 3, 100):
            x = big[:n, :8]
            torch.testing.assert_close(cm(x, x), m(x, x))
            assert cm._signature.check((x, x), {})[2] == [], "no contiguous copy"


def test_what_forward_writes_is_seen_again_after_a_retrace():
    """Forward writes y only in training mode: after ``model.eval()`` (followed by a new trace) the
    old record of writes refused y as a view of x, naming a write that no longer happens."""

    class WritesInTraining(torch.nn.Module):
        def forward(self, x, y):
            if self.training:
                y.add_(1)
            return ATTN(x + y, x, x)

    m = WritesInTraining().train()
    cm = pw.compile(m, _cfg(), dynamic_arg_dims={"x": 0, "y": 0})
    cm(torch.randn(4, 4), torch.randn(4, 4))
    assert cm._signature.mutated == ("y",)
    m.eval()
    y = torch.randn(4, 4)
    with counters.expect(recompiles=1):
        torch.testing.assert_close(cm(y.view(4, 4), y), m(y.view(4, 4), y))
    assert cm._signature.mutated == () and cm._signature.shared_memory is None
