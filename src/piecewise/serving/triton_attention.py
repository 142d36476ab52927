"""The reference decoder's attention as one Triton kernel (docs/design/generation.md).

On a GPU the host cost of the attention splitting op is paid once per layer per step between two
piecewise graphs, and SDPA over gathered cache rows costs about ten dispatcher calls (the gather,
the mask, the fused kernel, the copy into the output). `cached_attention` is one kernel launch:
each program computes one (token, query head) pair over that token's sequence slot of the static
KV cache, reading cache rows ``0..pos`` in blocks with an online softmax (running max and sum in
float32), and writes its row of `out` directly, so nothing is gathered, masked or copied. Decode
tokens and prefill tokens mix freely in one batch: every token reads only its own sequence's rows.

A prefill token re-reads its sequence's rows that the tokens before it read too (work grows with
prompt length squared over the block size); for the decode steps that dominate serving this is
the minimum the math needs, one pass over the rows each head reads.

Triton ships with CUDA builds of torch. Without a GPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests check it against SDPA.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["cached_attention", "triton_available"]

#: Cache rows read per loop iteration of a program; 64 rows of a 64-dim fp32 head is 16 KiB of
#: registers/shared memory per block, the size FlashAttention-style decode kernels commonly use.
BLOCK_N = 64


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cached_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, seq_ptr, pos_ptr, out_ptr, num_real_ptr, scale,
        stride_qt, stride_qh, stride_cs, stride_cp, stride_ch, stride_vs, stride_vp, stride_vh,
        stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
        HAS_NUM_REAL: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        kv_head = h // GROUP
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        pos = tl.load(pos_ptr + t)
        seq = tl.load(seq_ptr + t)
        if HAS_NUM_REAL:  # inside a full graph: rows at or past the device-side count are padding
            real = t < tl.load(num_real_ptr)
            pos = tl.where(real, pos, -1)  # a pad row reads no cache row and writes zeros
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        k_base = k_cache_ptr + seq * stride_cs + kv_head * stride_ch
        v_base = v_cache_ptr + seq * stride_vs + kv_head * stride_vh
        for start in range(0, pos + 1, BLOCK):
            rows = start + tl.arange(0, BLOCK)
            rows_ok = rows <= pos
            tile_ok = rows_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + rows[:, None] * stride_cp + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            s = tl.where(rows_ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            v = tl.load(v_base + rows[:, None] * stride_vp + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            total = total * alpha + tl.sum(p, axis=0)
            m = m_new
        result = acc / tl.where(total > 0, total, 1.0)  # a pad row: acc is zero, so is the result
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, result.to(out_ptr.dtype.element_ty), mask=d_ok)

    return cached_attention_kernel


def cached_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    num_real: torch.Tensor | None = None,
) -> None:
    """Write into `out` each token's causal attention over its sequence's cached rows.

    Args:
        q: [n, num_heads, head_dim]; the last dim contiguous.
        k_cache, v_cache: [slots, max_seq_len, num_kv_heads, head_dim], the last dim contiguous;
            ``num_heads`` a multiple of ``num_kv_heads`` (grouped-query attention).
        seq, pos: [n] int64, each token's sequence slot and position; token t reads rows
            ``k_cache[seq[t], 0..pos[t]]``, which must hold that sequence's keys and values.
        scale: multiplier of q·k.
        out: [n, num_heads, head_dim], `q`'s dtype, the last dim contiguous; overwritten.
        num_real: optional 0-d or [1] int tensor on the device: rows ``t >= num_real`` are padding
            and get zeros without reading the cache (full CUDA graphs, where the count must not
            be read on the host).

    One kernel launch, grid (n, num_heads); float32 accumulation, result in `out`'s dtype.
    """
    n, heads, head_dim = q.shape
    if n == 0:
        return
    if out.stride(-1) != 1:
        raise ValueError(f"cached_attention writes rows of out in place; out's last dim has stride {out.stride(-1)}, "
                         "pass a tensor whose last dim is contiguous (torch.empty_like(q) of a contiguous q)")
    q, k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cache, v_cache))
    seq, pos = seq.contiguous(), pos.contiguous()
    import triton

    kernel = _kernel()
    group = heads // k_cache.shape[2]
    has_num_real = num_real is not None
    kernel[(n, heads)](
        q, k_cache, v_cache, seq, pos, out, num_real if has_num_real else pos, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK=BLOCK_N,
        HAS_NUM_REAL=has_num_real,
    )
