"""Re-inplacing functionalized mutating custom ops: graph-level op counts (no Inductor), then one
real Inductor compile proving no copy is left in the generated code of a piece."""

import re

import pytest
import torch
from passhelp import GraphHarness, drop_clones

import piecewise as pw
from piecewise import CompilationConfig
from piecewise.passes import ReinplaceCustomOps


@torch.library.custom_op("pw_test_passes::rotary_", mutates_args=("q", "k"))
def rotary_(pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """Scales q and k rows in place (a stand-in for rotary embeddings): q, k ``[n, d]``."""
    q.mul_(pos[:, None].cos())
    k.mul_(pos[:, None].sin())


@rotary_.register_fake
def _(pos, q, k):
    return None


@torch.library.custom_op("pw_test_passes::add_into_", mutates_args=("buf",))
def add_into_(buf: torch.Tensor, x: torch.Tensor) -> None:
    buf.add_(x)


@add_into_.register_fake
def _(buf, x):
    return None


AF = "auto_functionalized"
ROTARY = "pw_test_passes.rotary_.default"
ADD_INTO = "pw_test_passes.add_into_.default"
SCATTERS = ("aten.slice_scatter.default", "aten.select_scatter.default")


@pytest.fixture
def functionalized_v1():
    """AOTAutograd's v1 form (``enable_auto_functionalized_v2=False``): the one Inductor copies."""
    with torch._inductor.config.patch(enable_auto_functionalized_v2=False):
        yield


def qkv_rotary(x, pos, w):
    qkv = x @ w
    q, k, v = qkv.split(4, -1)
    torch.ops.pw_test_passes.rotary_(pos, q, k)
    return q * k + v


def test_mutated_slices_of_one_buffer_become_one_in_place_call(functionalized_v1):
    h = GraphHarness([ReinplaceCustomOps()])
    run = h.compile(qkv_rotary)
    w = torch.randn(4, 12)
    for n in (2, 5, 9):
        x, pos = torch.randn(n, 4), torch.randn(n)
        torch.testing.assert_close(run(x, pos, w), qkv_rotary(x, pos, w))
    assert h.before[AF] == 1 and sum(h.before[s] for s in SCATTERS) == 2
    assert h.after[AF] == 0 and h.after[ROTARY] == 1 and sum(h.after[s] for s in SCATTERS) == 0
    assert h.rewrites == [1]


def kv_cache_write(x, cache):
    torch.ops.pw_test_passes.add_into_(cache[0], x)
    torch.ops.pw_test_passes.add_into_(cache[1], x * 2)
    return cache[0] + cache[1]


def test_writes_into_layers_of_a_graph_input_happen_in_place(functionalized_v1):
    h = GraphHarness([ReinplaceCustomOps()])
    run = h.compile(kv_cache_write)
    for n in (2, 5):
        x, cache = torch.randn(n, 4), torch.randn(2, n, 4)
        expected_cache = cache.clone()
        expected = kv_cache_write(x, expected_cache)
        torch.testing.assert_close(run(x, cache), expected)
        torch.testing.assert_close(cache, expected_cache)
    assert h.before[AF] == 2 and h.before["aten.copy_.default"] == 1
    # both calls write the cache directly; the write-back scatters and the epilogue copy are gone
    assert h.after[AF] == 0 and h.after[ADD_INTO] == 2
    assert h.after["aten.copy_.default"] == 0 and sum(h.after[s] for s in SCATTERS) == 0


def copy_then_mutate(x):
    t = x * 2
    old = t.clone()
    torch.ops.pw_test_passes.add_into_(t, x)
    return t + old


def test_an_op_whose_old_value_is_read_afterwards_is_left_functional(functionalized_v1):
    """After Inductor drops the same-layout clone, `old` reads `t`'s pre-op contents after the op:
    writing in place would change the result, so the node must stay (Inductor then copies)."""
    h = GraphHarness([ReinplaceCustomOps()], before=[drop_clones])
    run = h.compile(copy_then_mutate)
    for n in (2, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(run(x), copy_then_mutate(x))
    assert h.rewrites == [0]
    assert h.after[AF] == 1


def test_v2_nodes_are_left_to_inductor():
    h = GraphHarness([ReinplaceCustomOps()])
    run = h.compile(qkv_rotary)
    x, pos, w = torch.randn(3, 4), torch.randn(3), torch.randn(4, 12)
    torch.testing.assert_close(run(x, pos, w), qkv_rotary(x, pos, w))
    assert h.rewrites == [0] and h.before["auto_functionalized_v2"] == 1


class RotaryModel(torch.nn.Module):
    """A piece that mutates slices of a fused QKV buffer, a splitting op, then a second piece."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 24, generator=torch.Generator().manual_seed(0)), requires_grad=False)

    def forward(self, x, pos):
        qkv = x @ self.w
        q, k, v = qkv.split(8, -1)
        torch.ops.pw_test_passes.rotary_(pos, q, k)
        y = torch.ops.piecewise_models.toy_attention(q, k, v)
        return y * 2


def _compile_and_get_code(reinplace: bool):
    import piecewise.testing.toy  # noqa: F401  (registers the toy_attention splitting op)
    from torch._inductor.utils import run_and_get_code

    model = RotaryModel()
    cfg = CompilationConfig(
        backend="inductor",
        max_num_tokens=16,
        reinplace_custom_ops=reinplace,
        # v1 functionalization; no Inductor FX cache, so the code is generated (and captured) here
        inductor_options={"enable_auto_functionalized_v2": False, "fx_graph_cache": False},
    )
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0, "pos": 0})
    x, pos = torch.randn(5, 8), torch.randn(5)
    out, codes = run_and_get_code(cm, x, pos)
    torch.testing.assert_close(out, model(x, pos))
    for n in (3, 11, 16):
        x, pos = torch.randn(n, 8), torch.randn(n)
        torch.testing.assert_close(cm(x, pos), model(x, pos))
    code = next(c for c in codes if "rotary_" in c)
    return code[code.index("def call") :]


def test_mutating_op_inside_a_piece_runs_in_place_in_the_generated_code():
    code = _compile_and_get_code(reinplace=True)
    call = next(line for line in code.splitlines() if "torch.ops.pw_test_passes.rotary_" in line)
    mm_out = re.search(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code).group(1)
    # q and k are views of the matmul's output buffer itself, and nothing is cloned
    assert call.count(f"reinterpret_tensor({mm_out},") == 2, call
    assert "clone" not in code

    # Without the pass, Inductor copies the QKV buffer before the op (what the pass removes).
    assert "clone" in _compile_and_get_code(reinplace=False)
