import operator

import torch
import torch.fx

from piecewise.ops import splitting_op
from piecewise.split import decompose_size_calls, split_graph, written_inputs

import piecewise.testing.toy  # noqa: F401  registers piecewise_models::toy_attention

ATTN = "piecewise_models::toy_attention"


@splitting_op("pw_test_split::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + 1, x - 1


@pair.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _graph(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, ex):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def test_items_sorted_by_integer_id_not_name():
    def f(x):
        for _ in range(6):  # 13 pieces: submod_10 must sort after submod_9
            x = torch.ops.piecewise_models.toy_attention(x.sin(), x, x)
        return x.cos()

    res = split_graph(_graph(f, torch.randn(4, 8)), [ATTN])
    assert [it.index for it in res.items] == sorted(it.index for it in res.items)
    assert len(res.items) == 13
    assert [it.is_splitting for it in res.items] == [i % 2 == 1 for i in range(13)]


def test_getitem_stays_with_tuple_producer():
    def f(x):
        a, b = torch.ops.pw_test_split.pair(x.sin())
        return a * b

    res = split_graph(_graph(f, torch.randn(4, 8)), ["pw_test_split::pair"])
    split_piece = next(it for it in res.items if it.is_splitting)
    targets = [n.target for n in split_piece.graph.graph.nodes if n.op == "call_function"]
    assert operator.getitem in targets
    # no piece receives a whole tuple: every placeholder of a compiled piece is a tensor or SymInt
    x = torch.randn(4, 8)
    torch.testing.assert_close(res.split_module(x), (f(x),))


def test_consecutive_splitting_ops_share_a_piece_and_order_is_kept():
    def f(x):
        y = torch.ops.piecewise_models.toy_attention(x, x, x)
        z = torch.ops.piecewise_models.toy_attention(y, y, y)
        return z + 1

    res = split_graph(_graph(f, torch.randn(3, 4)), [ATTN])
    assert [it.is_splitting for it in res.items] == [True, False]
    x = torch.randn(3, 4)
    torch.testing.assert_close(res.split_module(x)[0], f(x))


def test_no_split_points_gives_one_piece():
    res = split_graph(_graph(lambda x: x.sin() + 1, torch.randn(2, 2)), [ATTN])
    assert len(res.items) == 1 and not res.items[0].is_splitting


def test_whole_size_call_is_decomposed_per_dim():
    def f(x):
        s = x.size()
        y = torch.ops.piecewise_models.toy_attention(x, x, x)
        return y.reshape(s[0] * s[1]), y.new_zeros(s)

    x = torch.randn(5, 3)
    torch._dynamo.mark_dynamic(x, 0)
    gm = _graph(f, x)
    had_whole = any(n.op == "call_method" and n.target == "size" and len(n.args) == 1 for n in gm.graph.nodes)
    decompose_size_calls(gm)
    assert not any(n.op == "call_method" and n.target == "size" and len(n.args) == 1 for n in gm.graph.nodes)
    res = split_graph(gm, [ATTN])
    for it in res.items:
        for n in it.graph.graph.nodes:
            if n.op == "placeholder":
                assert not isinstance(n.meta.get("example_value"), torch.Size)
    assert had_whole
    args = [torch.randn(7, 3) if isinstance(a, torch.Tensor) else 7 for a in _example_args(gm)]
    torch.testing.assert_close(res.split_module(*args)[0], f(args[-1])[0])


def _example_args(gm):
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


@splitting_op("pw_test_split::write_cache", mutates_args=("cache",))
def write_cache(x: torch.Tensor, cache: torch.Tensor) -> None:
    cache[: x.shape[0]].copy_(x)


@write_cache.register_fake
def _(x, cache):
    return None


def test_written_inputs_names_arguments_written_outside_splitting_ops_through_any_view():
    """Read from the fake example values: a write through a view or slice counts, as do ``x[i] =``,
    ``+=``, ``x.__iadd__``, ``torch._foreach_add_`` (a list operand), ``out=`` and ``inplace=True``
    (the method and list spellings were missed at first); a write by a splitting op (a cache) and a
    read do not."""

    def fn(x, cache, step, rows, table, out, scale, act, counter, listed):
        torch.ops.pw_test_split.write_cache(x, cache)  # splitting op: not counted
        step.view(-1).add_(1)
        counter.__iadd__(1)
        torch._foreach_add_([listed], 1.0)
        rows[0] = x[0]
        table[:, 1:] += 1
        torch.mul(x, 2, out=out)
        torch.nn.functional.relu(act, inplace=True)
        return x * scale + step

    args = (torch.randn(3, 4), torch.zeros(8, 4), torch.zeros(1), torch.zeros(2, 4), torch.zeros(2, 3),
            torch.zeros(3, 4), torch.ones(4), torch.randn(3, 4), torch.zeros(2), torch.zeros(2))
    gm = _graph(fn, *args)
    names = [n.name.removeprefix("l_").rstrip("_") for n in gm.graph.nodes if n.op == "placeholder"]
    ops = frozenset({"pw_test_split::write_cache"})
    assert sorted(names[i] for i in written_inputs(gm, range(len(names)), ops)) == ["act", "counter", "listed", "out", "rows", "step",
                                                                                  "table"]
    unwritten = [names.index(n) for n in ("x", "cache", "scale")]
    assert written_inputs(gm, unwritten, ops) == ()
    assert names.index("cache") in written_inputs(gm, unwritten, frozenset()), "without the splitting op set the cache counts"
