"""GPU tier of graph capture (marker `gpu`; skipped without CUDA by conftest, never deleted).

Real CUDA graphs: captured pieces replay into a pool owned by the backend instance.
"""

import gc

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.graphs import batch_hint
from piecewise.testing.toy import ToyTransformer

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16, 32]


def _model(seed=0, layers=3):
    return ToyTransformer(num_layers=layers, dim=64, seed=seed).cuda().eval()


def _compile(model, mode, backend="eager"):
    # "inductor_partition": the Inductor adaptor with split_strategy="inductor_partition"
    strategy = "inductor_partition" if backend == "inductor_partition" else "fx"
    cfg = CompilationConfig(backend="inductor" if strategy != "fx" else backend, split_strategy=strategy, max_num_tokens=64,
                            cudagraph_mode=mode, cudagraph_capture_sizes=SIZES)
    return pw.compile(model, cfg, dynamic_arg_dims={"x": 0})


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise"])
@pytest.mark.parametrize("backend", ["eager", "inductor", "inductor_partition"])
def test_every_capture_size_equals_eager_with_fresh_data(mode, backend):
    model = _model()
    cm = _compile(model, mode, backend)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cm(torch.randn(3, 64, device="cuda", generator=gen))
    for n in [*SIZES, 3, 5, 31, 40]:
        for uniform in (False, True):
            with batch_hint(uniform_decode=uniform):
                x = torch.randn(n, 64, device="cuda", generator=gen)
                torch.testing.assert_close(cm(x), model(x), rtol=2e-3, atol=2e-3)
    if mode == "piecewise":
        # FX pieces or Inductor partitions: 3 attention ops, 4 capturable pieces either way
        assert counters.by_tag[cm.tag].capturable_pieces == 4
        assert counters.by_tag[cm.tag].graphs_captured == len(SIZES) * 4


def test_replays_16_4_16_sharing_a_pool_stay_correct():
    model = _model()
    cm = _compile(model, "piecewise")
    cm(torch.randn(2, 64, device="cuda"))
    xs = [torch.randn(n, 64, device="cuda") for n in (16, 4, 16)]
    outs = [cm(x).clone() for x in xs]  # outputs live until the next forward: clone to keep
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, model(x), rtol=2e-3, atol=2e-3)


def test_second_model_captures_cleanly_after_first_is_deleted():
    a = _model(seed=1)
    ca = _compile(a, "piecewise")
    ca(torch.randn(3, 64, device="cuda"))
    del ca
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.synchronize()
    b = _model(seed=2)
    cb = _compile(b, "piecewise")
    for n in (3, 17, 32):
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(cb(x), b(x), rtol=2e-3, atol=2e-3)


def test_graphs_captured_equals_sizes_times_capturable_pieces():
    model = _model(layers=4)
    with counters.expect(capturable_pieces=5, graphs_captured=len(SIZES) * 5):
        cm = _compile(model, "piecewise")
        cm(torch.randn(3, 64, device="cuda"))
    assert cm.backend.graph_pool.total_pool_bytes > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_equals_sdpa_on_cuda(dtype):
    """The reference decoder's one-kernel attention (what its op runs on CUDA with Triton) against
    the SDPA path, on a mixed batch of decode tokens and prefills, and under a device-side count.
    CUDA builds of torch ship Triton: a CUDA machine without it fails here rather than skipping."""
    from piecewise.serving.llama import _gathered_attention
    from piecewise.serving.triton_attention import cached_attention

    gen = torch.Generator(device="cuda").manual_seed(1)
    slots, length, kv, heads, dim = 6, 300, 2, 8, 64
    k_cache = torch.randn(slots, length, kv, dim, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(slots, length, kv, dim, device="cuda", generator=gen).to(dtype)
    seq = torch.tensor([0] * 7 + [3] * 4 + [1, 2, 4, 5], device="cuda")
    pos = torch.tensor(list(range(7)) + list(range(200, 204)) + [299, 0, 64, 128], device="cuda")
    q = torch.randn(len(seq), heads, dim, device="cuda", generator=gen).to(dtype)
    want = _gathered_attention(q.float(), k_cache.float(), v_cache.float(), seq, pos, dim**-0.5)
    out = torch.full_like(q, float("nan"))
    cached_attention(q, k_cache, v_cache, seq, pos, dim**-0.5, out)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    out.fill_(float("nan"))
    cached_attention(q, k_cache, v_cache, seq, pos, dim**-0.5, out, num_real=torch.tensor(9, device="cuda"))
    torch.testing.assert_close(out[:9].float(), want[:9], rtol=tol, atol=tol)
    assert (out[9:] == 0).all()
