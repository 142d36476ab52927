"""No-op elimination on real post-grad-style graphs: op counts before and after, outputs equal
eager on fresh data for several sizes (the graphs are symbolic in the token count)."""

import torch
from passhelp import GraphHarness, op_counts

from piecewise.passes import NoOpElimination
from piecewise.passes.noop import eliminate_noops

VIEW = "aten.view.default"
SLICE = "aten.slice.Tensor"
SCATTER = "aten.slice_scatter.default"


def _check_equal(run, fn, sizes=(2, 3, 7), cols=6):
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, cols, generator=gen)
        torch.testing.assert_close(run(x), fn(x))


def test_reshape_chain_keeps_one_reshape():
    def fn(x):
        return x.reshape(-1, 2, 3).reshape(-1, 3, 2).reshape(-1, 6, 1) * 2

    h = GraphHarness([NoOpElimination()])
    run = h.compile(fn)
    _check_equal(run, fn)
    assert h.before[VIEW] == 3
    assert h.after[VIEW] == 1
    assert h.rewrites == [2]


def test_reshape_chain_back_to_the_input_shape_disappears():
    def fn(x):
        return x.reshape(-1, 2, 3).reshape(-1, 6) + 1

    h = GraphHarness([NoOpElimination()])
    run = h.compile(fn)
    _check_equal(run, fn)
    assert (h.before[VIEW], h.after[VIEW]) == (2, 0)


def test_full_slices_disappear_and_a_slice_to_minus_one_stays():
    def fn(x):
        full = x[:] + x[: x.shape[0]]  # to the end, and to the symbolic size itself
        return full, x[:, :-1] * 3

    h = GraphHarness([NoOpElimination()])
    run = h.compile(fn)
    _check_equal(run, fn)
    # before: x[:], x[:n], and x[:, :-1] (which Dynamo writes as x[:][:, :-1])
    assert h.before[SLICE] == 4
    assert h.after[SLICE] == 1
    kept = next(n for n in h.graph.nodes if str(n.target) == SLICE)
    assert kept.args[1:] == (1, 0, -1)


def test_slice_scatter_covering_everything_becomes_its_source_and_a_partial_one_stays():
    def fn(x):
        whole = torch.zeros_like(x)
        whole[:] = x * 4
        part = torch.zeros_like(x)
        part[:, 0:3] = x[:, 3:]
        return whole, part

    h = GraphHarness([NoOpElimination()])
    run = h.compile(fn)
    _check_equal(run, fn)
    # `part` writes dim 1 (partial: stays) into a scatter over all of dim 0 (full: goes)
    assert h.before[SCATTER] == 3
    assert h.after[SCATTER] == 1


def test_scatter_of_a_view_back_into_its_own_base_disappears_after_inductors_own_pass():
    """Inductor's ``remove_noop_ops`` (run first, as inside Inductor) drops the copy and the full
    slices but leaves ``slice_scatter(y, y[:, 1:4])``; ours removes it."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    def fn(x):
        y = x * 2
        y[:, 1:4] = y[:, 1:4]
        return y + 1

    h = GraphHarness([NoOpElimination()], before=[remove_noop_ops])
    run = h.compile(fn)
    _check_equal(run, fn)
    assert h.before[SCATTER] == 1
    assert h.after[SCATTER] == 0


def test_a_returned_no_op_view_of_an_input_is_kept():
    """Forwarding it would make the output the input tensor itself (Inductor's rule too)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x[0 : x.shape[0]], tracing_mode="symbolic")(torch.randn(4, 3))
    assert op_counts(gm.graph)[SLICE] == 1
    assert eliminate_noops(gm.graph) == 0
    assert op_counts(gm.graph)[SLICE] == 1
