import pytest
import torch

import piecewise as pw
from piecewise.ops import normalize_op_name, registered_splitting_ops
from piecewise.testing.toy import toy_attention


@pytest.mark.parametrize(
    "spelling",
    [
        "piecewise_models::toy_attention",
        "piecewise_models.toy_attention",
        "piecewise_models::toy_attention.default",
        "piecewise_models.toy_attention.default",
        "torch.ops.piecewise_models.toy_attention",
        torch.ops.piecewise_models.toy_attention,
        torch.ops.piecewise_models.toy_attention.default,
        toy_attention,
    ],
)
def test_every_spelling_normalises_to_one_name(spelling):
    assert normalize_op_name(spelling) == "piecewise_models::toy_attention"


def test_bad_names_raise_config_error():
    with pytest.raises(pw.ConfigError):
        normalize_op_name("attention")
    with pytest.raises(pw.ConfigError):
        normalize_op_name(3)
    with pytest.raises(pw.ConfigError):
        pw.splitting_op("no_namespace")


def test_decorator_registers_op_and_split_point():
    @pw.splitting_op("pw_test_ops::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @double.register_fake
    def _(x):
        return torch.empty_like(x)

    assert "pw_test_ops::double" in registered_splitting_ops()
    assert torch.equal(torch.ops.pw_test_ops.double(torch.ones(2)), torch.full((2,), 2.0))


# -- DirectCall: a splitting op's Python function without the dispatcher, when that is the same call


@pw.splitting_op("pw_test_direct::write_add", mutates_args=("buf",))
def _write_add(x: torch.Tensor, buf: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    buf[: x.shape[0]].copy_(x)
    return x * scale + buf[: x.shape[0]]


@_write_add.register_fake
def _(x, buf, scale=2.0):
    return torch.empty_like(x)


class _Recorder:
    """Stands in for the op overload: records that the dispatcher path was taken."""

    def __init__(self, overload):
        self.overload, self.calls = overload, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.overload(*args, **kwargs)


def _direct():
    from piecewise.ops import direct_call

    d = direct_call(torch.ops.pw_test_direct.write_add.default)
    assert d is not None
    d.overload = _Recorder(d.overload)
    with torch.no_grad():
        d(torch.zeros(1, 4), torch.zeros(5, 4))  # the first call takes the dispatcher, for its output checks
    assert d.overload.calls == 1
    d.overload.calls = 0
    return d


def test_direct_call_equals_the_dispatcher_call_and_bumps_the_mutated_version():
    d = _direct()
    x = torch.randn(3, 4)
    buf_a, buf_b = torch.zeros(5, 4), torch.zeros(5, 4)
    with torch.no_grad():
        v_a, v_b = buf_a._version, buf_b._version
        via_dispatcher = torch.ops.pw_test_direct.write_add(x, buf_a)
        direct = d(x, buf_b, scale=2.0)
    assert d.overload.calls == 0  # the Python function ran without the dispatcher
    torch.testing.assert_close(direct, via_dispatcher, rtol=0, atol=0)
    torch.testing.assert_close(buf_b, buf_a, rtol=0, atol=0)
    assert buf_b._version - v_b == buf_a._version - v_a > 0


def test_direct_call_leaves_gradients_modes_subclasses_and_the_profiler_to_the_dispatcher():
    from torch.utils._python_dispatch import TorchDispatchMode

    d = _direct()
    x, buf = torch.randn(3, 4), torch.zeros(5, 4)

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class FunctionPassthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    cases = 0
    with torch.no_grad():
        with Passthrough():
            d(x, buf)
        cases += 1
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            d(x, buf)
        cases += 1
        with FunctionPassthrough():
            d(x, buf)
        cases += 1
    assert d.overload.calls == cases
    d(x.as_subclass(Sub), buf)  # a tensor subclass argument
    assert d.overload.calls == cases + 1
    d(x.clone().requires_grad_(), buf)  # a gradient is needed: the op's autograd kernel decides, as before
    assert d.overload.calls == cases + 2


def test_ops_with_a_device_kernel_or_not_registered_here_keep_the_dispatcher():
    from piecewise.ops import direct_call

    @pw.splitting_op("pw_test_direct::with_cpu_kernel", mutates_args=())
    def with_kernel(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @with_kernel.register_kernel("cpu")
    def _(x):
        return x + 2

    assert direct_call(torch.ops.pw_test_direct.with_cpu_kernel.default) is None
    assert direct_call(torch.ops.aten.add.Tensor) is None
    assert direct_call(torch.ops.pw_test_direct.write_add.default) is not None
    assert direct_call(torch.ops.pw_test_direct.write_add) is not None  # the packet Dynamo's graphs call


def test_compiled_splitting_pieces_call_the_op_directly_and_equal_eager():
    from piecewise.ops import DirectCall

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(16, 4))

        def forward(self, x):
            return torch.ops.pw_test_direct.write_add(torch.sin(x), self.buf, 3.0).cos()

    m = M()
    cm = pw.compile(m, pw.CompilationConfig(backend="eager", cache_dir=None, max_num_tokens=16), dynamic_arg_dims={"x": 0})
    for n in (3, 7, 1):
        x = torch.randn(n, 4)
        torch.testing.assert_close(cm(x), M()(x), rtol=1.3e-6, atol=1e-5)
    split_gm = cm.backend.result.stitched.split_gm
    targets = [node.target for item in cm.backend.split.items if item.is_splitting
               for node in split_gm.__dict__[item.name].__self__.graph.nodes if node.op == "call_function"]
    assert targets and all(isinstance(t, DirectCall) for t in targets)
    # the traced graph itself keeps the op overload (fingerprints and bundles see the op)
    traced = [n.target for item in cm.backend.split.items if item.is_splitting for n in item.graph.graph.nodes
              if n.op == "call_function"]
    assert [normalize_op_name(t) for t in traced] == ["pw_test_direct::write_add"]


def test_the_first_direct_call_runs_the_dispatchers_output_checks():
    from piecewise.ops import direct_call

    @pw.splitting_op("pw_test_direct::returns_its_input", mutates_args=())
    def returns_input(x: torch.Tensor) -> torch.Tensor:
        return x  # custom ops may not return an input: the dispatcher path refuses it

    d = direct_call(torch.ops.pw_test_direct.returns_its_input.default)
    with torch.no_grad(), pytest.raises(RuntimeError, match="alias"):
        d(torch.zeros(2))


def test_tensor_list_arguments_are_checked_too():
    from piecewise.ops import DirectCall

    with torch.no_grad():
        assert DirectCall._direct(([torch.zeros(1), torch.zeros(2)],), {})
    with torch.enable_grad():
        assert not DirectCall._direct(([torch.zeros(1), torch.zeros(2, requires_grad=True)],), {})


# Found by trying to break DirectCall: what the dispatcher does to arguments, the direct call must too.


@pw.splitting_op("pw_test_direct::typed", mutates_args=())
def _typed(x: torch.Tensor, s: float, dims: list[int]) -> torch.Tensor:
    assert isinstance(s, float) and isinstance(dims, list), (type(s), type(dims))  # the dispatcher converts
    return x * s + len(dims)


@_typed.register_fake
def _(x, s, dims):
    return torch.empty_like(x)


@pw.splitting_op("pw_test_direct::named", mutates_args=(), schema="(Tensor a, Tensor b, float alpha=2.0) -> Tensor")
def _named(x, y, scale=5.0):
    return x + y * scale


@_named.register_fake
def _(a, b, alpha=2.0):
    return torch.empty_like(a)


@pw.splitting_op("pw_test_direct::write_all", mutates_args=("xs",))
def _write_all(x: torch.Tensor, xs: list[torch.Tensor]) -> torch.Tensor:
    for t in xs:
        t.add_(1)
    return x.clone()


@_write_all.register_fake
def _(x, xs):
    return torch.empty_like(x)


@pw.splitting_op("pw_test_direct::autocast", mutates_args=())
def _autocast(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_autocast.register_fake(lambda x: torch.empty_like(x))
_autocast.register_autocast("cpu", torch.bfloat16)


def _compiled(forward, **kw):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("a", torch.zeros(2, 3))
            self.register_buffer("b", torch.zeros(2, 3))

    M.forward = forward
    m = M()
    return m, pw.compile(m, pw.CompilationConfig(backend="eager", cache_dir=None, max_num_tokens=16), dynamic_arg_dims={"x": 0})


@pytest.mark.parametrize("case", ["int_for_float_and_tuple_for_list", "keyword_named_by_the_schema", "autocast_kernel"])
def test_direct_calls_see_what_the_dispatcher_would_hand_the_function(case):
    forwards = {
        "int_for_float_and_tuple_for_list": lambda self, x: torch.ops.pw_test_direct.typed(x.sin(), 3, (1,)).cos(),
        "keyword_named_by_the_schema": lambda self, x: torch.ops.pw_test_direct.named(x.sin(), b=x).cos(),
        "autocast_kernel": lambda self, x: torch.ops.pw_test_direct.autocast(x.sin()).cos(),
    }
    m, cm = _compiled(forwards[case])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast_kernel" else torch.no_grad()
    with ctx, torch.no_grad():
        for n in (3, 5, 2):  # the first call takes the dispatcher; the later ones the direct call
            x = torch.randn(n, 3)
            want, got = m(x), cm(x)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


def test_tensors_mutated_inside_a_list_have_their_versions_bumped():
    m, cm = _compiled(lambda self, x: torch.ops.pw_test_direct.write_all(x.sin(), [self.a, self.b]).cos())
    with torch.no_grad():
        for n in (3, 4, 2):
            va, vb = m.a._version, m.b._version
            cm(torch.randn(n, 3))
            da, db = m.a._version - va, m.b._version - vb
            ea, eb = m.a._version, m.b._version
            m(torch.randn(n, 3))
            assert (da, db) == (m.a._version - ea, m.b._version - eb) == (2, 2)  # add_ in the body + the op's own bump
