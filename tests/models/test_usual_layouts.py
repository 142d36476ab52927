"""One compile serves every size of a decoder written the usual way, with the default settings
(Inductor): nanoGPT's ``[B, T, ...]`` attention, fused QKV with a causal mask built from ``T``,
GQA with ``repeat_interleave`` and RoPE before the op (`usual_layouts`), and a transformers
forward. Where a model's own code branches on a size (transformers' mask code on a batch of one),
the sizes the first trace does not hold for get a trace of their own (a size class): served,
counted, saved for a warm start; refused only past `CompilationConfig.max_size_classes` or in
debug mode."""

import gc
import logging

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.errors import ConfigError, GuardFailureError, SizeRefusedError
from piecewise.hf import attention as hf

from usual_layouts import MODELS

#: batch x length grid: decode (1 token), short and long prompts, batch 1 and several
GRID = [(b, t) for b in (1, 2, 3, 8) for t in (1, 2, 7, 64, 512)]


def _check_grid(cm, model, first, seed):
    _check_grid_at(cm, model, [first, *GRID], seed)


@pytest.mark.parametrize("name,first", [("nanogpt", (2, 16)), ("nanogpt", (1, 1)), ("fused_qkv", (2, 16)),
                                        ("gqa_rope", (1, 1))])
def test_one_trace_serves_every_batch_and_length_cold_and_warm(name, first, tmp_path):
    """The pieces' compiles add no size guard (Inductor's view strides decided size-obliviously,
    `piecewise._torch.inductor`): one trace, every size, no recompile; a warm process the same."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    cfg = CompilationConfig(max_num_tokens=512, cache_dir=str(tmp_path))
    cm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with counters.expect(dynamo_traces=1, recompiles=0, size_class_traces=0):
        _check_grid(cm, model, first, seed=1)
    assert cm.backend.result.plan.size_refusal is None
    del cm
    gc.collect()
    torch._dynamo.reset()
    warm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with counters.expect(bundle_hits=1, dynamo_traces=0, compiler_invocations=0, recompiles=0, size_class_traces=0):
        _check_grid(warm, model, (3, 5), seed=2)


#: batch 1..4 x length 1..17, 1-token decode included
SDPA_GRID = [(b, t) for b in (1, 2, 3, 4) for t in (1, 2, 9, 17)]


@pytest.mark.parametrize("first", [(2, 1), (1, 9)], ids=["first_decode", "first_prompt"])
def test_one_trace_of_plain_sdpa_serves_every_batch_and_length_cold_and_warm(first, tmp_path):
    """nanoGPT's plain ``F.scaled_dot_product_attention`` (no splitting op: one piece). Inductor
    orders the attention inputs' strides (``[3C*T, d, 3C, 1]``) without a guard
    (`piecewise._torch.inductor.size_oblivious_stride_orders`): a first call at one token compiles
    (two strides tie there) and a first call at a prompt serves one token too. One trace, every
    size, no size class; a warm process loads it, tracing and compiling nothing."""
    torch.manual_seed(0)
    model = MODELS["sdpa"]().eval()
    cfg = CompilationConfig(max_num_tokens=64, cache_dir=str(tmp_path))
    cm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with counters.expect(dynamo_traces=1, compiler_invocations=1, recompiles=0, size_class_traces=0):
        _check_grid_at(cm, model, [first, *SDPA_GRID], seed=1)
    del cm
    gc.collect()
    torch._dynamo.reset()
    warm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with counters.expect(bundle_hits=1, dynamo_traces=0, compiler_invocations=0, recompiles=0, size_class_traces=0):
        _check_grid_at(warm, model, [(1, 1), (4, 17), (3, 1), (2, 9)], seed=2)


def test_size_classes_never_load_pieces_compiled_for_other_sizes(tmp_path, monkeypatch):
    """GQA by expand + reshape: a trace at one token of one sequence and a trace at one token of
    three have the same graph code, but the first's pieces were compiled under guards for batch 1
    (a view that is one only there). The compile cache keeps one entry per such size variant and
    checks the guards an entry's compile took before loading it, so no class runs another's code,
    in this process or in the next one (bundles off: it traces and meets the cache)."""
    torch.manual_seed(0)
    model = MODELS["expand_gqa"]().eval()
    cfg = CompilationConfig(max_num_tokens=512, cache_dir=str(tmp_path), tag="expand_gqa")
    sizes = [(1, 1), (2, 16), (3, 1), (1, 7), (8, 1), (5, 33)]
    cm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with counters.expect(recompiles=0):
        _check_grid_at(cm, model, sizes, seed=0)
    del cm
    gc.collect()
    torch._dynamo.reset()
    monkeypatch.setenv("PIECEWISE_DISABLE_BUNDLE", "1")
    for order in ([(3, 1), (1, 1), (2, 16)], [(2, 16), (5, 7), (8, 1), (1, 1)]):
        again = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
        with counters.expect(recompiles=0):
            _check_grid_at(again, model, order, seed=1)
        del again
        gc.collect()
        torch._dynamo.reset()


def _check_grid_at(cm, model, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    for b, t in sizes:
        ids = torch.randint(0, 256, (b, t), generator=gen)
        with torch.no_grad():
            want = model(ids)
        torch.testing.assert_close(cm(ids), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"batch {b} x {t}: {m}")


def _hf_check(cm, model, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    for b, t in sizes:
        ids = torch.randint(0, 256, (b, t), generator=gen)
        with torch.no_grad():
            want = model(input_ids=ids).logits
        torch.testing.assert_close(cm(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{b} x {t}: {m}")


HF_SIZES = [(1, 16), (1, 1), (2, 1), (3, 64), (2, 5), (1, 7), (8, 1), (1, 1)]


def test_a_transformers_forward_serves_one_sequence_and_a_batch_through_size_classes(tmp_path, caplog):
    """transformers' mask code branches on a batch of one (``batch_size != position_ids.shape[0]``):
    the first trace (batch 1) holds only there, the first batched call gets a second trace, named
    at INFO with the argument as the caller passed it; every later call is served by one of the two,
    and a warm process (first call in the other class) starts both from bundles, tracing nothing."""
    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    cfg = CompilationConfig(backend="eager", max_num_tokens=64, cache_dir=str(tmp_path), tag="hf_classes")
    cm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with caplog.at_level(logging.INFO, logger="piecewise"), counters.expect(dynamo_traces=2, size_class_traces=1, recompiles=0):
        _hf_check(cm, model, HF_SIZES, seed=0)
    assert "input_ids.shape[0] = 2 refused" in caplog.text and "size class 2 serves such calls" in caplog.text
    assert "masking_utils.py" in caplog.text and "args[" not in caplog.text and "kwargs[" not in caplog.text
    with counters.expect(dynamo_traces=0, size_class_traces=0, recompiles=0):
        _hf_check(cm, model, [(4, 3), (1, 2), (5, 1), (1, 1)], seed=1)
    del cm
    gc.collect()
    torch._dynamo.reset()
    warm = pw.compile(model, cfg, dynamic_arg_dims={"input_ids": (0, 1)})
    with counters.expect(dynamo_traces=0, compiler_invocations=0, bundle_hits=2, size_class_traces=0, recompiles=0):
        _hf_check(warm, model, [(2, 9), *HF_SIZES], seed=2)


class _Bands(torch.nn.Module):
    """Three branches on the size: three size classes."""

    def forward(self, x):
        n = x.shape[0]
        if n > 8:
            return x * 2
        if n > 3:
            return x - 1
        return x + 1


def _bands(x):
    n = x.shape[0]
    return x * 2 if n > 8 else x - 1 if n > 3 else x + 1


def test_size_classes_are_bounded_and_past_the_bound_refused_naming_the_setting():
    cfg = CompilationConfig(backend="eager", mode="full", max_num_tokens=16, max_size_classes=2)
    cm = pw.compile(_Bands(), cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(size_class_traces=1, recompiles=0):
        for n in (10, 5, 16, 4, 9):
            x = torch.randn(n, 3)
            torch.testing.assert_close(cm(x), _bands(x))
    with pytest.raises(SizeRefusedError, match=r"x.shape\[0\] = 2 refused: .*max_size_classes=2"):
        cm(torch.randn(2, 3))
    roomy = pw.compile(_Bands(), cfg.replace(max_size_classes=3, tag="roomy"), dynamic_arg_dims={"x": 0})
    with counters.expect(size_class_traces=2, recompiles=0):
        for n in (10, 5, 2, 1, 16, 4, 3, 9):
            x = torch.randn(n, 3)
            torch.testing.assert_close(roomy(x), _bands(x))


def test_debug_mode_refuses_the_sizes_a_trace_does_not_hold_for():
    cm = pw.compile(_Bands(), CompilationConfig(backend="eager", mode="full", max_num_tokens=16, debug=True),
                    dynamic_arg_dims={"x": 0})
    x = torch.randn(10, 3)
    torch.testing.assert_close(cm(x), x * 2)
    with counters.expect(size_class_traces=0, dynamo_traces=0):  # the trace's own guard fails first
        with pytest.raises(GuardFailureError, match=r"9 <= L\['x'\].size\(\)\[0\]"):
            cm(torch.randn(2, 3))


def test_max_size_classes_is_validated():
    with pytest.raises(ConfigError, match="max_size_classes=0 must be a positive integer"):
        CompilationConfig(max_size_classes=0)
    assert "max_size_classes" not in CompilationConfig().code_factors()


def test_torch_compile_entry_does_not_warn_that_sizes_are_refused(caplog):
    """Under ``torch.compile(backend="piecewise")`` Dynamo's own guards send another size class to
    another compile (a recompile it counts): the backend says so at INFO, with no warning."""
    model = _Bands()
    fn = torch.compile(model, backend="piecewise", dynamic=True, options={"backend": "eager", "mode": "full"})
    with caplog.at_level(logging.INFO, logger="piecewise"):
        for n in (10, 5, 2, 12):
            x = torch.randn(n, 3)
            torch.testing.assert_close(fn(x), _bands(x))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "refused" in r.getMessage()]


def test_a_guard_a_piece_compile_adds_names_the_users_line_of_that_piece():
    """A size guard added inside torch while a piece compiles (a fake kernel's stride computation)
    has only torch's frame; the refusal names the user's line in that piece instead: its first
    view or reshape (here nanoGPT's ``t.view(B, T, h, d)`` of a split, a non-contiguous view)."""
    from piecewise.backend import piece_source_line

    model = MODELS["nanogpt"]().eval()
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=64), dynamic_arg_dims={"input_ids": (0, 1)})
    cm(torch.randint(0, 256, (2, 5)))
    first = next(it for it in cm.backend.split.items if not it.is_splitting)
    assert piece_source_line(first.graph).startswith("q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2)")
    assert "usual_layouts.py:" in piece_source_line(first.graph)
