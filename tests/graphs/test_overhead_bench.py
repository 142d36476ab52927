"""The per-piece overhead benchmark (piecewise.bench.overhead) end to end on the fake platform: the
same code path the GPU run takes, with numbers that mean nothing here."""

import pytest
import torch

from piecewise.testing.graph_platform import fake_cpu_platform
from piecewise import counters
from piecewise.bench import overhead


def test_overhead_table_runs_every_row_and_does_its_arithmetic():
    with fake_cpu_platform() as plat:
        r = overhead.measure("cpu", layers=3, hidden=16, batch=4, dtype=torch.float32, steps=3, rounds=2, backend="eager")
    assert set(r["systems"]) == {"eager", "piecewise graphs", "piecewise full"}
    assert set(r["floor_items"]) == {"graph replay (1 kernel)", "eager op (x + 1)", "empty custom op (torch.ops)",
                                     "splitting op (custom op + copy)"}
    assert all(lo <= med <= hi for med, lo, hi in [*r["systems"].values(), *r["floor_items"].values()])
    per_layer = (r["systems"]["piecewise graphs"][0] - r["systems"]["piecewise full"][0]) / 3
    assert r["per_layer_us"] == pytest.approx(per_layer)
    assert r["ours_us"] == pytest.approx(per_layer - r["floor_us"])
    assert counters.by_tag["bench_overhead_piecewise"].graph_replays > 0
    assert counters.by_tag["bench_overhead_full"].graph_replays > 0
    text = overhead.render(r)
    assert "us a layer" in text and "| piecewise full |" in text and "| graph replay (1 kernel) |" in text


def test_no_captured_piece_copies_an_input_before_its_replay():
    """The splitting op writes a buffer the piece before allocated, as the attention ops do: the
    'ours' figure must not include a per-replay copy they do not pay (it did when the op returned a
    fresh clone)."""
    import piecewise as pw
    from piecewise.graphs.wrapper import Phase

    model = overhead.CloneSplitModel(3, 16, torch.float32, "cpu")
    with fake_cpu_platform():
        cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=8, cudagraph_capture_sizes=[4]),
                        dynamic_arg_dims={"x": 0})
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(cm(x), model(x))
    entries = [e for w in cm.backend.stitched_wrappers for e in w.entries.values() if e.phase is Phase.CAPTURED]
    assert len(entries) >= 3 and [e for e in entries if e.copied] == []


def test_the_model_equals_its_pieces_compiled():
    import piecewise as pw

    model = overhead.CloneSplitModel(2, 8, torch.float32, "cpu")
    cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=16), dynamic_arg_dims={"x": 0})
    with counters.expect(recompiles=0, splitting_pieces=2):
        for n in (3, 7, 16):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x))
