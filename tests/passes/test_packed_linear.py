"""The packed-linear pass (`piecewise.passes.PackedLinear`): which matmuls it rewrites, that the
packed op gives eager's values, and that a packed copy follows its weight (in-place writes,
replacement, freeing). On a CPU that cannot pack bfloat16 the default pipeline leaves it out and
nothing is packed; the tests assert that instead."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import piecewise as pw
from piecewise._torch.onednn import packable_dtypes
from piecewise.passes import PackedLinear
from piecewise.passes.packed_linear import FLOAT32_MIN_OUT_FEATURES, FLOAT32_PACKED_ROWS, OP, PACKED, PackedWeights, pack_linears, runs_packed

from passhelp import GraphHarness

BF16 = torch.bfloat16 in packable_dtypes()


class MLP(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, bias: bool = False, hidden: int = 64) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, hidden, bias=bias, dtype=dtype)
        self.down = torch.nn.Linear(hidden, 32, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _harness_run(model: torch.nn.Module, dtypes, *xs):
    h = GraphHarness([PackedLinear(dtypes)])
    run = h.compile(lambda x: model(x))
    return h, [run(x) for x in xs]


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_linears_become_the_packed_op_and_equal_eager_bit_for_bit(bias):
    torch.manual_seed(0)
    model = MLP(torch.bfloat16, bias).eval()
    xs = [torch.randn(rows, 32, dtype=torch.bfloat16) for rows in (1, 8, 33)]
    h, outs = _harness_run(model, {torch.bfloat16}, *xs)
    expect = 2 if BF16 else 0
    assert h.after[str(OP)] == expect and set(h.rewrites) == {expect}
    assert h.after["aten.mm.default"] + h.after["aten.addmm.default"] == 2 - expect
    with torch.no_grad():
        for x, out in zip(xs, outs):
            assert torch.equal(out, model(x))  # oneDNN's bf16 matmul, the weight packed once


FP32 = torch.float32 in packable_dtypes()


def test_float32_linears_run_packed_only_for_wide_weights_at_decode_batch_rows():
    torch.manual_seed(0)
    model = MLP(torch.float32, bias=True, hidden=FLOAT32_MIN_OUT_FEATURES).eval()  # up wide, down narrow
    rows = (1, 2, 4, 8, 64, 65, 200)
    xs = [torch.randn(r, 32) for r in rows]
    before = pw.counters.weights_packed
    h, outs = _harness_run(model, {torch.float32}, *xs)
    # up rewritten (the op picks the kernel per call); down, too narrow to ever run packed, stays Inductor's mm
    assert h.after.get(str(OP), 0) == (1 if FP32 else 0)
    with torch.no_grad():
        for r, x, out in zip(rows, xs, outs):
            if FLOAT32_PACKED_ROWS[0] <= r <= FLOAT32_PACKED_ROWS[1]:
                torch.testing.assert_close(out, model(x))  # oneDNN's float32 sums: float32's rounding
            else:
                assert torch.equal(out, model(x)), r  # MKL's mm, as unpacked
    # up, packed on the first call of 4 rows, not before (1 and 2 rows ran mm); down never (32 outputs)
    assert pw.counters.weights_packed - before == (1 if FP32 else 0)
    assert not runs_packed(model.up.weight, 1) and runs_packed(model.up.weight, 8)
    assert not runs_packed(model.down.weight, 8)  # narrower than FLOAT32_MIN_OUT_FEATURES
    assert not runs_packed(model.up.weight.detach(), 8)  # not a parameter: F.linear


def test_float32_weights_are_left_to_mm_when_only_half_precision_is_packed():
    torch.manual_seed(0)
    model = MLP(torch.float32, bias=True).eval()
    x = torch.randn(5, 32)
    h, (out,) = _harness_run(model, {torch.bfloat16, torch.float16}, x)
    assert set(h.rewrites) == {0} and str(OP) not in h.after
    with torch.no_grad():
        assert torch.equal(out, model(x))


class Residual(torch.nn.Module):
    """``x + proj(x)``: Inductor folds the residual into ``addmm(x, x, w.T)``."""

    def __init__(self, dtype: torch.dtype, width: int = 32) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_residual_folded_into_addmm_is_packed_too(dtype):
    torch.manual_seed(0)
    model = Residual(dtype, FLOAT32_MIN_OUT_FEATURES).eval()
    xs = [torch.randn(rows, FLOAT32_MIN_OUT_FEATURES, dtype=dtype) for rows in (1, 8)]
    h, outs = _harness_run(model, {dtype}, *xs)
    rewritten = dtype in packable_dtypes()
    assert h.after.get(str(OP), 0) == int(rewritten) and h.after.get("aten.addmm.default", 0) == int(not rewritten)
    with torch.no_grad():
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x))


def test_an_activation_in_a_weights_place_is_not_packed():
    def f(a, b):
        return a @ b.t()  # the same graph as a linear, but b is no parameter

    h = GraphHarness([PackedLinear({torch.bfloat16})])
    run = h.compile(f)
    before = pw.counters.weights_packed
    for _ in range(3):
        a, b = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
        assert torch.equal(run(a, b), f(a, b))
    assert pw.counters.weights_packed == before  # F.linear: nothing packed, nothing kept
    assert pack_linears(torch.fx.Graph(), frozenset({torch.bfloat16})) == 0


def test_a_packed_copy_follows_in_place_writes_replacement_and_freeing():
    cache = PackedWeights()
    w = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16), requires_grad=False)
    if not BF16:
        assert PackedLinear({torch.bfloat16}).dtypes == frozenset()
        return
    before = pw.counters.weights_packed
    p1 = cache.get(w)
    assert cache.get(w) is p1 and len(cache) == 1 and cache.nbytes() == w.nbytes
    w.mul_(2)  # an in-place write moves the version counter: packed again
    p2 = cache.get(w)
    assert p2 is not p1 and cache.get(w) is p2
    w2 = torch.nn.Parameter(w.clone(), requires_grad=False)  # another tensor: its own copy
    assert cache.get(w2) is not p2 and len(cache) == 2
    assert pw.counters.weights_packed - before == 3
    del w, w2
    gc.collect()
    assert len(cache) == 0  # freed weights take their packed copies with them


def test_packed_copies_stop_at_the_memory_limit_with_one_warning(caplog):
    if not BF16:
        return
    w1, w2, w3 = (torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16), requires_grad=False) for _ in range(3))
    cache = PackedWeights(limit_bytes=2 * w1.nbytes)  # room for two copies
    with caplog.at_level("WARNING", logger="piecewise"):
        assert cache.get(w1) is not None and cache.get(w2) is not None
        assert cache.get(w3) is None and cache.get(w3) is None  # past the limit: runs unpacked
    warnings = [r.getMessage() for r in caplog.records if "packed CPU linear weights" in r.getMessage()]
    assert len(warnings) == 1 and "cpu_packed_linear=False" in warnings[0]
    assert cache.nbytes() == 2 * w1.nbytes
    w1.mul_(2)  # repacking a weight in place of its own copy fits
    assert cache.get(w1) is not None and cache.nbytes() == 2 * w1.nbytes
    del w1
    gc.collect()
    assert cache.nbytes() == w2.nbytes and cache.get(w3) is not None  # the freed copy's room is used again


def test_the_op_uses_the_weights_current_values():
    if not BF16:
        return
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.bfloat16), requires_grad=False)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    before = pw.counters.weights_packed
    assert torch.equal(OP(x, w, None), F.linear(x, w))
    with torch.no_grad():
        w.copy_(torch.randn(16, 8, dtype=torch.bfloat16))
    assert torch.equal(OP(x, w, None), F.linear(x, w))
    b = torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(OP(x, w, b), F.linear(x, w, b))
    assert pw.counters.weights_packed - before == 2


def test_cpu_packed_linear_is_on_by_default_for_every_packable_dtype_and_must_be_a_bool():
    from piecewise.passes import pipeline

    on = [p for p in pipeline(pw.CompilationConfig()) if isinstance(p, PackedLinear)]
    assert len(on) == (1 if packable_dtypes() else 0)
    if on:
        assert on[0].dtypes == packable_dtypes() & {torch.float32, torch.bfloat16, torch.float16}
    assert not any(isinstance(p, PackedLinear) for p in pipeline(pw.CompilationConfig(cpu_packed_linear=False)))
    with pytest.raises(pw.ConfigError, match="cpu_packed_linear"):
        pw.CompilationConfig(cpu_packed_linear="yes")


class Decoder(torch.nn.Module):
    """The linears of a decoder as users write them: fused QKV with bias, projections, an MLP, a
    head tied to the embedding; [B, T, C] activations (attention itself is not the point here)."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 32)
        self.qkv = torch.nn.Linear(32, 96, bias=True)
        self.proj = torch.nn.Linear(32, 32)
        self.mlp = MLP(torch.float32)
        self.head = torch.nn.Linear(32, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).split(x.shape[-1], dim=2)
        x = x + self.proj(torch.sigmoid(q * k) * v)
        x = x + self.mlp(x)
        return self.head(x)


def test_a_compiled_bf16_model_equals_the_unpacked_compile_and_follows_new_weights(tmp_path):
    torch.manual_seed(0)
    model = Decoder().to(torch.bfloat16).eval()
    cfg = dict(cache_dir=str(tmp_path), max_num_tokens=64)
    packed = pw.compile(model, config=pw.CompilationConfig(tag="packed", cpu_packed_linear=True, **cfg),
                        dynamic_arg_dims={"input_ids": (0, 1)})
    plain = pw.compile(model, config=pw.CompilationConfig(tag="plain", cpu_packed_linear=False, **cfg),
                       dynamic_arg_dims={"input_ids": (0, 1)})
    before = pw.counters.snapshot()
    with torch.no_grad():
        for b, t in ((1, 9), (2, 1), (3, 17), (1, 1)):
            ids = torch.randint(0, 64, (b, t))
            assert torch.equal(packed(ids), plain(ids))
        # qkv, proj, up, down, the tied head: 5 weights, packed once each
        assert pw.counters.weights_packed - before["weights_packed"] == (5 if BF16 else 0)
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        ids = torch.randint(0, 64, (2, 5))
        assert torch.equal(packed(ids), plain(ids))
    assert pw.counters.recompiles == before["recompiles"]
    assert pw.counters.weights_packed - before["weights_packed"] == (10 if BF16 else 0)


def test_a_float32_model_under_the_default_config_equals_the_unpacked_compile_at_every_size(tmp_path):
    torch.manual_seed(0)
    model = Decoder(vocab=FLOAT32_MIN_OUT_FEATURES).eval()  # the head is wide; the other linears narrow
    cfg = dict(cache_dir=str(tmp_path), max_num_tokens=64)
    default = pw.compile(model, config=pw.CompilationConfig(tag="default", **cfg), dynamic_arg_dims={"input_ids": (0, 1)})
    plain = pw.compile(model, config=pw.CompilationConfig(tag="plain", cpu_packed_linear=False, **cfg),
                       dynamic_arg_dims={"input_ids": (0, 1)})
    before = pw.counters.snapshot()
    with torch.no_grad():
        for b, t in ((1, 1), (2, 1), (8, 1), (1, 9), (3, 17), (1, 1)):  # rows b * t: 1, 2, 8, 9, 51, 1
            ids = torch.randint(0, FLOAT32_MIN_OUT_FEATURES, (b, t))
            out, ref = default(ids), plain(ids)
            if b * t < FLOAT32_PACKED_ROWS[0]:
                assert torch.equal(out, ref), (b, t)
            else:
                torch.testing.assert_close(out, ref)
                torch.testing.assert_close(out, model(ids))
    # the tied head only (1024 outputs; qkv, proj, up, down are narrow), packed once at the first batch of 8 rows
    assert pw.counters.weights_packed - before["weights_packed"] == (1 if FP32 else 0)
    assert pw.counters.recompiles == before["recompiles"]


WARM = textwrap.dedent("""
    import json, sys, torch, piecewise as pw
    sys.path.insert(0, sys.argv[1])
    from test_packed_linear import Decoder
    torch.manual_seed(0)
    model = Decoder().to(torch.bfloat16).eval()
    compiled = pw.compile(model, config=pw.CompilationConfig(max_num_tokens=64, cpu_packed_linear=True),
                          dynamic_arg_dims={"input_ids": 1})
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        out = compiled(ids)
    c = pw.counters
    print(json.dumps({"out": out.float().sum().item(), "compiled": c.compiler_invocations, "traces": c.dynamo_traces,
                      "packed": c.weights_packed}))
""")


def test_a_warm_process_loads_pieces_that_call_the_packed_op(tmp_path):
    env = dict(os.environ, PIECEWISE_CACHE_DIR=str(tmp_path / "cache"))
    here = os.path.dirname(os.path.abspath(__file__))

    def run() -> dict:
        p = subprocess.run([sys.executable, "-c", WARM, here], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        import json

        return json.loads(p.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["compiled"] > 0 and warm["compiled"] == 0 and warm["traces"] == 0
    assert warm["out"] == cold["out"] and warm["packed"] == cold["packed"] == (5 if BF16 else 0)
