"""``torch.compile(model, backend="piecewise")``: recompiles are counted whichever entry was taken,
and after warm-up one graph serves every length."""

from __future__ import annotations

import logging

import pytest
import torch

import piecewise as pw
import piecewise.testing.toy  # noqa: F401  registers piecewise_models::toy_attention
from piecewise.counters import counters


class SeqModel(torch.nn.Module):
    """Hidden states ``[batch 1, seq, 8]`` with the token dim at 1, split at a splitting op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)[0]
        h = torch.ops.piecewise_models.toy_attention(h, h, h)
        return self.out(h.relu())[None]


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _compiled(model: torch.nn.Module):
    torch._dynamo.reset()
    return torch.compile(model, backend="piecewise", options={"backend": "eager"})


def _run_lengths(fn, model, lengths) -> None:
    for n in lengths:
        x = torch.randn(1, n, 8)
        torch.testing.assert_close(fn(x), model(x))


def test_a_new_length_is_a_counted_and_logged_recompile(caplog):
    model = SeqModel()
    fn = _compiled(model)
    with caplog.at_level(logging.INFO, logger="piecewise"):
        with counters.expect(recompiles=0, graphs_seen=1):
            _run_lengths(fn, model, [5])
        with counters.expect(recompiles=1, graphs_seen=1):
            _run_lengths(fn, model, [7])
    logged = [r.getMessage() for r in caplog.records if "Dynamo recompiled" in r.getMessage()]
    assert len(logged) == 1 and "size mismatch at index 1" in logged[0] and "forward" in logged[0], logged


def test_after_warm_up_at_length_1_and_another_no_length_up_to_64_recompiles():
    model = SeqModel()
    fn = _compiled(model)
    with counters.expect(recompiles=1):  # the second length: Dynamo makes the dim dynamic
        _run_lengths(fn, model, [1, 5])
    graphs = _unique_graphs()
    with counters.expect(recompiles=0, graphs_seen=0, dynamo_traces=0):
        _run_lengths(fn, model, range(1, 65))
    assert _unique_graphs() == graphs


def test_warm_up_at_two_lengths_above_1_leaves_one_counted_recompile_for_length_1():
    """Dynamo specialises sizes 0 and 1: its dynamic graph assumes ``2 <= x.size()[1]``, so the first
    call of length 1 compiles once more - counted like any other recompile, then never again."""
    model = SeqModel()
    fn = _compiled(model)
    with counters.expect(recompiles=1):
        _run_lengths(fn, model, [5, 7])
    with counters.expect(recompiles=1):
        _run_lengths(fn, model, range(1, 65))
    with counters.expect(recompiles=0):
        _run_lengths(fn, model, range(1, 65))


def test_marking_the_token_dim_dynamic_gives_one_graph_for_every_length_above_1():
    model = SeqModel()
    fn = _compiled(model)
    x = torch.randn(1, 6, 8)
    torch._dynamo.mark_dynamic(x, 1)
    with counters.expect(recompiles=0, graphs_seen=1):
        torch.testing.assert_close(fn(x), model(x))
        _run_lengths(fn, model, range(2, 65))


def test_graph_break_pieces_and_separate_frames_are_not_recompiles():
    class Breaks(SeqModel):
        def forward(self, x):
            h = self.lin(x)[0]
            h = torch.ops.piecewise_models.toy_attention(h, h, h)
            torch._dynamo.graph_break()
            return self.out(torch.ops.piecewise_models.toy_attention(h, h, h).relu())[None]

    a, b = Breaks(), SeqModel()
    torch._dynamo.reset()
    fa = torch.compile(a, backend="piecewise", options={"backend": "eager"})
    fb = torch.compile(b, backend="piecewise", options={"backend": "eager"})
    with counters.expect(recompiles=0):
        x = torch.randn(1, 4, 8)
        torch.testing.assert_close(fa(x), a(x))
        torch.testing.assert_close(fb(x), b(x))
    assert counters.graphs_seen >= 3


def test_options_are_config_fields_and_mode_is_refused():
    import pytest

    model = SeqModel()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not a piecewise setting"):
        torch.compile(model, backend="piecewise", mode="max-autotune")(torch.randn(1, 3, 8))
    torch._dynamo.reset()
    fn = torch.compile(model, backend="piecewise", options={"backend": "eager", "tag": "seq_entry"})
    fn(torch.randn(1, 3, 8))
    assert counters.by_tag["seq_entry"].graphs_seen == 1


@pytest.mark.parametrize("var,value,match", [("PIECEWISE_MAX_NUM_TOKENS", "lots", "PIECEWISE_MAX_NUM_TOKENS='lots'"),
                                             ("PIECEWISE_CONFIG", "{bad", "PIECEWISE_CONFIG is not valid JSON"),
                                             ("PIECEWISE_BACKEND", "nosuch", "backend='nosuch' is not a registered")])
def test_a_malformed_environment_config_is_a_config_error_the_caller_can_catch(monkeypatch, var, value, match):
    """Raised inside the backend, Dynamo wrapped it in BackendCompilerFailed, so ``except
    pw.ConfigError`` did not catch it; it now arrives as itself (one class, the same message)."""
    monkeypatch.setenv(var, value)
    fn = torch.compile(torch.nn.Linear(4, 4), backend="piecewise")
    with pytest.raises(pw.ConfigError, match=match) as info:
        fn(torch.randn(2, 4))
    assert isinstance(info.value, pw.errors.ConfigError) and type(info.value).__name__ == "ConfigError"


def test_a_mode_is_refused_as_a_config_error_the_caller_can_catch():
    fn = torch.compile(torch.nn.Linear(4, 4), backend="piecewise", mode="max-autotune")
    with pytest.raises(pw.ConfigError, match=r"mode='max-autotune'\) is not a piecewise setting"):
        fn(torch.randn(2, 4))
