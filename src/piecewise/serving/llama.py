"""A reference Llama decoder written the way serving engines write models.

Tokens of every sequence in a step are flattened into one dimension (`num_tokens`), each with its
position and the slot of its sequence; there is no batch or padding dimension. Attention is the
splitting op ``piecewise_models::llama_attention``: it writes the step's keys and values into static
per-layer KV caches in place and then attends, so it stays eager while everything between two
attentions can be compiled and captured. Weights are random from a seed, or copied from a
transformers Llama-family checkpoint with `LlamaForCausalLM.from_hf` (Llama, Mistral, Qwen2, Qwen3:
grouped-query attention, biases, q/k norms, tied embeddings, default/linear/llama3 rope scaling);
nothing is downloaded.

The forward has no Python branching on tensor values and no data-dependent shapes outside the
attention op, so Dynamo traces it with ``fullgraph=True`` and a dynamic `num_tokens`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._torch.fx import torch_check
from ..errors import ConfigError, InputError
from ..forward_context import forward_context
from ..ops import splitting_op
from ..passes.packed_linear import cpu_linear

__all__ = ["LLAMA_ATTENTION_OP", "ROPE_TYPES", "SUPPORTED_HF_MODEL_TYPES", "LlamaBackbone", "LlamaConfig", "LlamaForCausalLM",
           "llama_attention"]

LLAMA_ATTENTION_OP = "piecewise_models::llama_attention"

#: Rotary embedding variants the reference decoder computes (transformers' ``rope_type`` names).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a reference decoder. Small by default: a CPU forward takes milliseconds.

    `max_num_seqs` and `max_seq_len` size the static KV cache (sequence slots x positions); a
    token's `seq_ids` entry must be < `max_num_seqs` and its position < `max_seq_len`.

    Raises:
        ConfigError (a ValueError): a field is out of range; the message names it.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_num_seqs: int = 8
    max_seq_len: int = 128
    dtype: torch.dtype = torch.float32
    # Variants of the Llama family (what `LlamaForCausalLM.from_hf` maps); the defaults are plain Llama.
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2; Llama's attention_bias sets it with o_bias)
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # biases on gate/up/down projections
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary embedding (Qwen3)
    tie_word_embeddings: bool = False  # lm_head shares embed_tokens' weight
    rope_type: str = "default"  # one of ROPE_TYPES: "default", "linear" or "llama3" (Llama 3.1 scaling)
    rope_factor: float = 1.0  # "linear" and "llama3": frequencies divided by it (long wavelengths, llama3)
    rope_low_freq_factor: float = 1.0  # "llama3" only
    rope_high_freq_factor: float = 4.0  # "llama3" only
    rope_original_max_position: int = 8192  # "llama3" only: the pretraining context length
    # None: the rotary frequencies are used in float32 as computed; a dtype: rounded to it first, as
    # a transformers model cast with .to(dtype) rounds its frequency buffer and then rotates by it
    rope_inv_freq_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_num_seqs", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"LlamaConfig.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention shares each kv head among num_heads // num_kv_heads query heads"
            )
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig.head_dim={self.head_dim} must be even; rotary embedding rotates pairs")
        value = self.rope_theta
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"LlamaConfig.rope_theta={value!r} must be a positive number")
        value = self.rms_norm_eps  # 0 is transformers' too: rsqrt(mean(x^2)) alone
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise ConfigError(f"LlamaConfig.rms_norm_eps={value!r} must be a finite number >= 0")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"LlamaConfig.dtype={self.dtype!r} must be a floating torch.dtype, e.g. torch.float32")
        for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"LlamaConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"LlamaConfig.rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"LlamaConfig.{name}={value!r} must be a positive number")
        if self.rope_inv_freq_dtype is not None and (not isinstance(self.rope_inv_freq_dtype, torch.dtype)
                                                     or not self.rope_inv_freq_dtype.is_floating_point):
            raise ConfigError(f"LlamaConfig.rope_inv_freq_dtype={self.rope_inv_freq_dtype!r} must be None or a floating "
                              "torch.dtype")
        value = self.rope_original_max_position
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"LlamaConfig.rope_original_max_position={value!r} must be a positive integer")
        if self.rope_type == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(
                f"LlamaConfig.rope_high_freq_factor={self.rope_high_freq_factor!r} must exceed "
                f"rope_low_freq_factor={self.rope_low_freq_factor!r} for rope_type='llama3'"
            )


@splitting_op(LLAMA_ATTENTION_OP, mutates_args=("k_cache", "v_cache", "out"))
def llama_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal grouped-query attention over a static KV cache; writes this step's k/v in place and
    the result into `out`.

    Args:
        q: [num_tokens, num_heads, head_dim].
        k, v: [num_tokens, num_kv_heads, head_dim], same dtype as `q`, to write first; or both
            None: the caller has written this step's rows already (`LlamaAttention` does, in the
            compiled piece before the op, where no graph pads the step: `kv_written_in_piece`).
        k_cache, v_cache: [max_num_seqs, max_seq_len, num_kv_heads, head_dim]; row
            ``[seq_ids[t], positions[t]]`` is overwritten with ``k[t]`` / ``v[t]``.
        positions: [num_tokens] int64, each token's position in its sequence.
        seq_ids: [num_tokens] int64, each token's sequence slot.
        scale: multiplier of q·k, usually ``head_dim ** -0.5``.
        out: [num_tokens, num_heads, head_dim] in `q`'s dtype, overwritten with the result. Token t
            attends to its own sequence's cached positions ``0..positions[t]``, which includes
            tokens written by this same call.

    The output argument is the pattern serving engines use for attention: the model allocates
    `out` (``torch.empty_like(q)``) in the piece before the op, so under piecewise CUDA graphs it
    lives at a fixed address in that piece's graph and the next piece reads it in place; an op
    that returned a fresh tensor would cost a copy into the next graph's input buffer on every
    replay (`graphs.wrapper`).

    Under a forward context only the first ``num_tokens`` rows are real: pad rows (appended after
    them by graph padding) are neither written to the cache nor attended, and their output is zero.
    Positions a token reads must have been written by this or an earlier call; the cache is not
    checked. Inside a full graph (runtime mode ``"full"``) the real count comes from the context's
    device tensor and pad rows write into the cache's last slot, a scratch slot no sequence owns,
    so the op has no Python branch on the count and replays correctly. On a CUDA device with Triton
    installed, attention is one kernel (`serving.triton_attention`); elsewhere SDPA.
    """
    ctx = forward_context()
    if (k is None or v is None) and ctx is not None and (ctx.runtime_mode == "full" or ctx.num_tokens < q.shape[0]):
        # the piece before wrote every row, pad rows included, over whatever slot and position they hold
        raise InputError(f"llama_attention got pad rows ({ctx.num_tokens} real of {q.shape[0]}, runtime mode "
                         f"{ctx.runtime_mode}) from a step whose compiled piece wrote the KV cache itself, which it "
                         "does only where no graph platform pads steps (kv_written_in_piece): register the graph "
                         "platform before compiling the model, or call it without pad rows")
    if ctx is not None and ctx.runtime_mode == "full" and ctx.num_tokens_device is not None:
        _attention_graph_safe(q, k, v, k_cache, v_cache, positions, seq_ids, scale, ctx.num_tokens_device, out)
        return
    t = q.shape[0]
    n = t if ctx is None else min(ctx.num_tokens, t)
    if n < t:  # pad rows: zero, and only the real rows go on (no views taken when there are none)
        out[n:].zero_()
        if n == 0:
            return
        q, k, v, out, positions, seq_ids = q[:n], k[:n], v[:n], out[:n], positions[:n], seq_ids[:n]
    elif n == 0:
        return
    if q.device.type == "cpu" and not _use_triton(q):
        _cpu_attention(q, k, v, k_cache, v_cache, positions, seq_ids, scale, out)
        return
    if k is not None and v is not None:
        k_cache.index_put_((seq_ids, positions), k)
        v_cache.index_put_((seq_ids, positions), v)
    _cached_attention(q, k_cache, v_cache, seq_ids, positions, scale, out)


def _cpu_attention(q, k, v, k_cache, v_cache, pos, seq, scale, out):
    """`llama_attention`'s real rows on the CPU, where reading `seq` and `pos` on the host costs
    no device sync: they are read once, then

    * a single token (a batch-1 decode step) takes `_attend_one_token`;
    * a decode batch whose tokens all sit at one position in distinct slots (requests that started
      together) takes `_aligned_batch_attention`: one SDPA over every slot's rows, no mask;
    * more tokens than slots (a prefill in the batch) attends by sequence (`_attention_by_sequence`),
      over views of each slot's own rows;
    * any other batch (at most one token a slot, at different positions) gathers rows
      ``0..max(pos)`` (`_gathered_attention`: one SDPA, rows past each position zeroed and masked).

    No path lets a cache row past a token's position reach its result, so whatever an earlier
    occupant of a slot left there (an overflowed inf key included) does not matter. Measured on
    SmolLM2's shapes (30 layers, 2 threads, fp32; 256-row cache, 8 tokens): aligned 4.4 ms a step
    against 11.6 ms gathered. At mixed positions 100-199 by sequence took 9.6 against 17.0 ms, but
    on the suite's small decoder (short rows, 8-64 tokens) one call a sequence made the step
    slower than the gather (piecewise at 0.91-1.03 of the full graph where the gather gave
    0.81-0.90), so mixed positions keep the gather."""
    slots, positions = seq.tolist(), pos.tolist()
    if len(slots) == 1:
        _attend_one_token(q, k, v, k_cache, v_cache, slots[0], positions[0], scale, out)
        return
    if k is not None and v is not None:
        k_cache.index_put_((seq, pos), k)
        v_cache.index_put_((seq, pos), v)
    if len(slots) > k_cache.shape[0]:
        _attention_by_sequence(q, k_cache, v_cache, seq, pos, scale, out, (slots, positions))
    elif min(positions) == max(positions) and len(set(slots)) == len(slots):
        _aligned_batch_attention(q, k_cache, v_cache, seq, slots, positions[0] + 1, scale, out)
    else:
        length = max(positions) + 1
        out.copy_(_gathered_attention(q, k_cache[:, :length], v_cache[:, :length], seq, pos, scale))


def _aligned_batch_attention(q, k_cache, v_cache, seq, slots, length, scale, out):
    """Tokens of distinct slots, all at position ``length - 1``: each sees every row ``0..length-1``
    of its slot (all written by its own sequence), so one SDPA over those rows needs no mask. The
    rows are a view when the slots are consecutive and in order, else a gather (``index_select``)."""
    n = len(slots)
    if slots == list(range(slots[0], slots[0] + n)):
        keys, values = k_cache[slots[0]:slots[0] + n, :length], v_cache[slots[0]:slots[0] + n, :length]
    else:
        keys, values = k_cache[:, :length].index_select(0, seq), v_cache[:, :length].index_select(0, seq)
    res = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), scale=scale, enable_gqa=True
    )  # [n, num_heads, 1, head_dim]
    out.copy_(res.squeeze(2))


def _attend_one_token(q, k, v, k_cache, v_cache, slot, position, scale, out):
    """One token (a batch-1 decode step) on the CPU: its key and value written into cache row
    ``[slot, position]`` through a view (unless `k` is None: written by the piece before), then one SDPA over a view of the slot's rows
    ``0..position`` (every one visible: no mask, no gather). Each view is a single ``as_strided``
    where indexing, transposing and unsqueezing took three or four dispatcher calls (the op
    measured 95 us a layer before this path, 75 with the host reads shared, 67 with it, at
    SmolLM2's shapes on 2 threads; 30 layers a step). Same arithmetic as `_attention_by_sequence`,
    so the same values to the bit."""
    keys = _slot_rows(k_cache, k, slot, position)
    values = _slot_rows(v_cache, v, slot, position)
    res = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale,
                                                           enable_gqa=True)  # [1, num_heads, 1, head_dim]
    out.copy_(res.view(out.shape))


def _slot_rows(cache, new, slot, position):
    """Write `new` ([1, num_kv_heads, head_dim]; None: written already) into `cache` row
    ``[slot, position]`` and return the slot's rows ``0..position`` as SDPA reads them, ``[1,
    num_kv_heads, position + 1, head_dim]``: ``as_strided`` views of `cache` ([slots, max_seq_len,
    num_kv_heads, head_dim]).

    Raises:
        IndexError: ``[slot, position]`` is outside the cache (as ``index_put_`` would)."""
    if not (0 <= slot < cache.shape[0] and 0 <= position < cache.shape[1]):
        # a view past a row would write another slot's row where index_put_ raises: raise too
        raise IndexError(f"KV-cache row [{slot}, {position}] is outside the cache's {cache.shape[0]} slots x "
                         f"{cache.shape[1]} positions")
    s_seq, s_pos, s_head, s_dim = cache.stride()
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    base = cache.storage_offset() + slot * s_seq
    if new is not None:
        cache.as_strided((kv_heads, head_dim), (s_head, s_dim), base + position * s_pos).copy_(new.reshape(kv_heads, head_dim))
    return cache.as_strided((1, kv_heads, position + 1, head_dim), (s_seq, s_head, s_pos, s_dim), base)


def _cached_attention(q, k_cache, v_cache, seq, pos, scale, out):
    """Attention of each of the ``n`` tokens of `q` [n, num_heads, head_dim] over its sequence's
    cached rows ``0..pos``, written into `out` [n, num_heads, head_dim].

    On CUDA with Triton (`attention_impl` ``"auto"`` or ``"triton"``): one kernel for any mix of
    decode and prefill tokens, writing `out` directly (`serving.triton_attention`). Otherwise SDPA:

    * more tokens than slots (so a prefill is in the batch): `_attention_by_sequence`, one SDPA a
      sequence over a view of its own cache rows, because the gather copies ``max_seq_len``
      cache rows per token (at a 1024-token prefill of SmolLM2's shape, 150 MB a layer for the
      keys alone);
    * otherwise (at most one token a slot, as in a decode batch; a short prefill within that
      count takes it too): `_gathered_attention` over every cache row,
      one fused SDPA with grouped-query heads and a [n, max_seq_len] mask, reading nothing on the
      host (a GPU would sync per layer)."""
    if _use_triton(q):
        from .triton_attention import cached_attention

        cached_attention(q, k_cache, v_cache, seq, pos, scale, out)
    elif q.shape[0] > k_cache.shape[0]:
        _attention_by_sequence(q, k_cache, v_cache, seq, pos, scale, out)
    else:
        out.copy_(_gathered_attention(q, k_cache, v_cache, seq, pos, scale))


#: Values of ``PIECEWISE_LLAMA_ATTENTION``, which says what the reference decoder's attention op
#: runs: ``"auto"`` (the default: Triton on CUDA when it is installed, SDPA otherwise), ``"sdpa"``
#: (always SDPA: the reference, and a baseline for benchmarks) or ``"triton"`` (always Triton, on
#: any device; on the CPU only under ``TRITON_INTERPRET=1``, which is how the tests check the
#: kernel's logic against SDPA without a GPU).
ATTENTION_IMPLS = ("auto", "sdpa", "triton")
_attention_impl: str | None = None


def attention_impl() -> str:
    """The process's ``PIECEWISE_LLAMA_ATTENTION`` (read once, on the op's first call).

    Raises:
        ConfigError: the variable holds something other than `ATTENTION_IMPLS`.
    """
    global _attention_impl
    if _attention_impl is None:
        import os

        value = os.environ.get("PIECEWISE_LLAMA_ATTENTION", "auto").strip().lower() or "auto"
        if value not in ATTENTION_IMPLS:
            raise ConfigError(f"PIECEWISE_LLAMA_ATTENTION={value!r} is not one of {', '.join(ATTENTION_IMPLS)}; "
                              "unset it for the default ('auto')")
        _attention_impl = value
    return _attention_impl


def _use_triton(q: torch.Tensor) -> bool:
    impl = _attention_impl or attention_impl()
    if impl == "sdpa":
        return False
    if impl == "triton":
        return True
    if q.device.type != "cuda":
        return False
    from .triton_attention import triton_available

    return triton_available()


def _gathered_attention(q, k_cache, v_cache, seq, pos, scale):
    """The gather path of `_cached_attention`: no host read, so it also serves full graphs. The
    caches may be views of the first rows of each slot (every ``pos`` inside them).

    The rows are gathered with ``index_select`` (a row copy): advanced indexing ``k_cache[seq]``
    gives the same tensor through a general kernel that measured 4-5x slower on the CPU at
    SmolLM2's decode shapes (one thread: 60 against 12 us at batch 1, 433 against 116 us at batch
    8, 192 cache positions), twice a layer.

    Rows a token does not see are zeroed in the gathered copies, not only masked: they hold
    whatever an earlier occupant of the slot left there, and a masked inf or NaN key or value
    still turns SDPA's result into NaN (an fp16 key that overflowed in one request made another
    request's tokens all 0)."""
    visible = torch.arange(k_cache.shape[1], device=q.device)[None, :] <= pos[:, None]  # [n, max_seq_len]
    unseen = ~visible[:, :, None, None]
    keys = k_cache.index_select(0, seq).masked_fill_(unseen, 0).transpose(1, 2)  # [n, num_kv_heads, max_seq_len, head_dim]
    values = v_cache.index_select(0, seq).masked_fill_(unseen, 0).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True
    )  # [n, num_heads, 1, head_dim]
    return out.squeeze(2)


def _attention_by_sequence(q, k_cache, v_cache, seq, pos, scale, out, host=None):
    """`_cached_attention` by sequence: each run of consecutive tokens of one sequence attends in
    one SDPA call over a view of its slot's cache rows ``0..max(pos)``; each run's result is
    written into its rows of `out`. A run of one token (a decode token) sees every row of that
    view, so it needs no mask; a run at positions ``0..count-1`` in order (a whole prompt) is
    exactly SDPA's ``is_causal``; any other run (a chunk of a prompt after earlier chunks,
    tokens out of order) gets a ``[count, length]`` bool mask. Two host reads, `seq` and
    `pos` (device syncs on a GPU, where only batches with more tokens than slots take this
    path); the runs are found in Python from them, fewer dispatcher calls than
    ``unique_consecutive``.
    Correct for any token order: every token sees exactly its sequence's rows ``0..pos``,
    written before any token attends."""
    slots, positions = host if host is not None else (seq.tolist(), pos.tolist())
    n, start = len(slots), 0
    while start < n:
        slot, end = slots[start], start + 1
        while end < n and slots[end] == slot:
            end += 1
        count, run = end - start, positions[start:end]
        length = max(run) + 1
        keys = k_cache[slot, :length].transpose(0, 1)[None]  # [1, num_kv_heads, length, head_dim]
        values = v_cache[slot, :length].transpose(0, 1)[None]
        mask, causal = None, False
        if count > 1 and run == list(range(count)):
            causal = True
        elif count > 1:
            mask = (torch.arange(length, device=q.device)[None, :] <= pos[start:end, None])[None, None]  # [1, 1, count, length]
        whole = count == n  # one run (a batch-1 step): no views of q and out
        res = torch.nn.functional.scaled_dot_product_attention(
            (q if whole else q[start:end]).transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True
        )  # [1, num_heads, count, head_dim]
        (out if whole else out[start:end]).copy_(res[0].transpose(0, 1))
        start = end


def _attention_graph_safe(q, k, v, k_cache, v_cache, positions, seq_ids, scale, num_tokens_device, out):
    t = q.shape[0]
    real = torch.arange(t, device=q.device) < num_tokens_device
    seq = torch.where(real, seq_ids, k_cache.shape[0] - 1)
    pos = torch.where(real, positions, 0)
    k_cache[seq, pos] = k
    v_cache[seq, pos] = v
    if _use_triton(q):  # the kernel reads the real count on the device and zeroes pad rows itself
        from .triton_attention import cached_attention

        cached_attention(q, k_cache, v_cache, seq, pos, scale, out, num_real=num_tokens_device)
        return
    res = _gathered_attention(q, k_cache, v_cache, seq, pos, scale)  # no host read inside a graph
    out.copy_(torch.where(real[:, None, None], res, 0.0))


@llama_attention.register_fake
def _(q, k, v, k_cache, v_cache, positions, seq_ids, scale, out):
    # Without this, seq_ids (read by nothing but this op) keeps a symbolic size of its own and a
    # traced graph shows two dynamic dims where there is one, num_tokens.
    torch_check(seq_ids.shape[0] == q.shape[0])


@torch.compiler.assume_constant_result
def kv_written_in_piece(device_type: str) -> bool:
    """Whether `LlamaAttention` writes a step's keys and values into its KV cache itself, in the
    compiled piece before `llama_attention` (True), or hands them to the op (False).

    True where no graph platform is registered for `device_type` (the CPU): no step is ever
    padded there, so every row the piece writes is real, and the write fuses into the piece's
    compiled code. Measured on SmolLM2 (30 layers; the engine's batch-1 decode step, backbone
    under Inductor, the two ways alternating over 6 rounds in one process, on a shared 2-core
    machine): the step took 1.4 % less time than with two eager copies a layer inside the op at
    1 thread (medians 44.2 against 44.5 ms), 2.6 % less at 2 threads (24.7 against 25.4 ms). Under graph capture (CUDA, or a platform
    registered for the CPU) pad rows would write whatever their slots and positions hold, so the
    op writes the real rows only. Traced as a constant (`torch.compiler.assume_constant_result`):
    the device and the registered platforms do not change under a compiled model."""
    from ..graphs.platform import platform_names

    return device_type == "cpu" and "cpu" not in platform_names()


def _unpadded(num_tokens: int) -> bool:
    """An eager call (not traced) has no pad rows: no forward context, or one whose real count is
    all `num_tokens` rows and that is not a full graph's (``"full"`` runtime mode: the op writes
    there, with the real count read from the device). (A compiled piece never pads where
    `kv_written_in_piece` holds.)"""
    ctx = forward_context()
    return ctx is None or (ctx.runtime_mode != "full" and ctx.num_tokens >= num_tokens)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, normalised in float32, cast to the input dtype,
    then scaled by the weight (transformers' Llama order: in bfloat16 the product is rounded as
    there, where scaling in float32 first gave other logits, one bfloat16 step apart)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_inv_freq(
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    *,
    rope_type: str = "default",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
    rounded_to: torch.dtype | None = None,
) -> torch.Tensor:
    """Inverse rotary frequencies, [head_dim / 2] float32, computed as transformers computes them
    for `rope_type` (same float32 operations in the same order, so the values are bit-equal):
    ``"default"``, ``"linear"`` (divided by `factor`) or ``"llama3"`` (Llama 3.1: long wavelengths
    divided by `factor`, short ones kept, a smooth blend in between); with `rounded_to`, rounded to
    that dtype (`LlamaConfig.rope_inv_freq_dtype`) and back to float32."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if rope_type == "linear":
        inv_freq = inv_freq / factor
    elif rope_type == "llama3":
        low_freq_wavelen = original_max_position / low_freq_factor
        high_freq_wavelen = original_max_position / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope_type != "default":
        raise ConfigError(f"rope_type={rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return inv_freq if rounded_to is None else inv_freq.to(rounded_to).float()


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, **scaling: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each [num_tokens, head_dim] float32; `scaling` as in
    `rotary_inv_freq`.

    The frequencies are rebuilt from constants on every call rather than kept in a buffer, so
    casting the model with ``.to(torch.bfloat16)`` cannot round them; Dynamo folds them anyway.
    """
    inv_freq = rotary_inv_freq(head_dim, theta, positions.device, **scaling)  # [head_dim / 2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rope_scaling(c: LlamaConfig) -> dict[str, Any]:
    """`rotary_inv_freq` keywords for `c` (none for the default rotary embedding in float32)."""
    out: dict[str, Any] = {} if c.rope_inv_freq_dtype is None else {"rounded_to": c.rope_inv_freq_dtype}
    if c.rope_type == "default":
        return out
    return dict(out, rope_type=c.rope_type, factor=c.rope_factor, low_freq_factor=c.rope_low_freq_factor,
                high_freq_factor=c.rope_high_freq_factor, original_max_position=c.rope_original_max_position)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [num_tokens, heads, head_dim] by the angles behind `cos`/`sin` (float32,
    [num_tokens, head_dim]; half-split pairing). `cos`/`sin` are cast to `x`'s dtype and the
    rotation runs in it, as transformers' Llama does (in bfloat16 a float32 rotation rounds
    differently)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype)[:, None, :] + rotated * sin.to(x.dtype)[:, None, :]


class LlamaAttention(nn.Module):
    """q/k/v projections, rotary embedding, the attention splitting op, o projection.

    Owns its layer's KV cache: buffers `k_cache` and `v_cache`, [max_num_seqs + 1, max_seq_len,
    num_kv_heads, head_dim] in `config.dtype`, not saved in the state dict. The extra last slot is
    scratch space for pad rows inside full graphs; no sequence uses it.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        cache_shape = (c.max_num_seqs + 1, c.max_seq_len, c.num_kv_heads, c.head_dim)
        with torch.inference_mode(False):  # written in place by every step, in inference mode or not
            self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=c.dtype), persistent=False)
            self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=c.dtype), persistent=False)

    def forward(self, x, cos, sin, positions, seq_ids):
        c = self.config
        q = self.q_proj(x).view(-1, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = self.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        if kv_written_in_piece(x.device.type) and (torch.compiler.is_compiling() or _unpadded(x.shape[0])):
            # the write fuses into this piece's compiled code (with the projections and rotary
            # that make k and v) instead of two eager copies a layer inside the op
            self.k_cache.index_put_((seq_ids, positions), k)
            self.v_cache.index_put_((seq_ids, positions), v)
            k = v = None
        out = torch.empty_like(q)  # written by the op: allocated in this piece, read in place by the next
        llama_attention(q, k, v, self.k_cache, self.v_cache, positions, seq_ids, c.head_dim**-0.5, out)
        return self.o_proj(out.reshape(-1, c.num_heads * c.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, positions, seq_ids):
        x = x + self.self_attn(self.input_norm(x), cos, sin, positions, seq_ids)
        return x + self.mlp(self.post_attention_norm(x))


class LlamaForCausalLM(nn.Module):
    """Llama decoder over flattened tokens with a static per-layer KV cache.

    ``LlamaForCausalLM(config, seed=0)`` builds the same weights for the same seed on any machine
    (drawn on the CPU in float32, then cast to `config.dtype`); ``seed=None`` leaves PyTorch's
    default initialisation, for weights loaded afterwards. `from_hf` copies a transformers
    checkpoint instead. Move it with ``.to(device)``; build another dtype through the config rather
    than ``.to(dtype)`` so the KV caches match.

    Calls mutate the KV caches: one call per decoding step, and `reset_kv_cache` between
    unrelated runs if stale entries matter to you (greedy decoding never reads a position it has
    not written in the same run).
    """

    def __init__(self, config: LlamaConfig | None = None, *, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config = config if config is not None else LlamaConfig()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        #: Token ids that end a request in the decode loop (`from_hf` takes them from the checkpoint).
        self.eos_token_ids: tuple[int, ...] = ()
        if seed is not None:
            self._init_weights(seed)
        self.to(config.dtype)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        # Unit-variance embeddings and fan-in-scaled projections keep the residual stream O(1);
        # residual outputs are shrunk by depth, and lm_head gives logits a std of ~2 so greedy
        # argmax has margins far above fp32 noise while tokens still vary from step to step.
        gen = torch.Generator().manual_seed(seed)
        depth_scale = 1.0 / math.sqrt(2 * self.config.num_layers)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                continue  # norms start at one
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
                continue
            if name == "embed_tokens.weight":
                std = 1.0
            elif name == "lm_head.weight":
                std = 2.0 / math.sqrt(param.shape[1])
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= depth_scale
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    @classmethod
    @torch.no_grad()
    def from_hf(
        cls,
        hf_model: nn.Module,
        *,
        max_num_seqs: int = 8,
        max_seq_len: int = 512,
        dtype: torch.dtype | None = None,
    ) -> LlamaForCausalLM:
        """The reference decoder with the weights of a transformers Llama-architecture decoder.

        Accepts a ``*ForCausalLM`` of model type llama, mistral, qwen2 or qwen3 (`SUPPORTED_HF_MODEL_TYPES`),
        or one wrapped by ``torch.compile`` (its ``_orig_mod`` is read):
        grouped-query attention, `head_dim` from the config, q/k/v/o and MLP biases where the
        checkpoint has them, per-head q/k norms (Qwen3), tied or untied embeddings (tied stay tied:
        `lm_head` shares `embed_tokens`' weight), RMSNorm epsilon, rope theta and rope scaling of
        type default, linear or llama3. Weights are copied (the HF model is left untouched) onto
        the HF model's device in `dtype` (default: the HF model's); `eos_token_ids` comes from the
        generation config (the model config only for a model without one) for the decode loop.
        Only the layers transformers' forward runs are copied: the first
        ``config.num_hidden_layers`` (a config lowered after the model was built runs fewer than
        it holds).

        Args:
            hf_model: the transformers ``*ForCausalLM`` (or a ``torch.compile``'d one).
            max_num_seqs: sequence slots of the static KV cache (`LlamaConfig.max_num_seqs`).
            max_seq_len: positions per slot of the static KV cache (`LlamaConfig.max_seq_len`).
            dtype: the copy's dtype; default the HF model's.

        Raises:
            ConfigError: another architecture (named, with what is supported), a model without an
                LM head, a config that runs no decoder layers, a forward hook, forward pre-hook or
                instance-level ``forward`` on any of its modules (or a global module hook) that
                transformers would run and the copied weights cannot carry, an activation other than
                SiLU (or its alias swish), a rope type not in `ROPE_TYPES`, partial rotary, a sliding
                window shorter than `max_seq_len` (a Llama config carrying one too: its attention
                ignores it, but transformers' generate() cache keeps only that many keys), a
                generation config whose greedy ``generate()`` is not plain greedy
                search, or weights that do not map one to one. Raised before anything is built or
                compiled.
        """
        hf_model = _unwrap_compiled(hf_model)
        config, tied = _config_from_hf(hf_model, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, dtype=dtype)
        device = next(hf_model.parameters()).device
        with torch.device("meta"):
            model = cls(config, seed=None)
        ours = model.state_dict(keep_vars=True)
        theirs = {_hf_param_name(k): v for k, v in hf_model.state_dict().items()}
        # layers past config.num_hidden_layers: built, but transformers' forward never runs them
        theirs = {k: v for k, v in theirs.items()
                  if not ((m := _LAYER_INDEX.match(k)) and int(m.group(1)) >= config.num_layers)}
        missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        mismatched = sorted(k for k in set(ours) & set(theirs) if ours[k].shape != theirs[k].shape)
        if missing or unexpected or mismatched:
            raise ConfigError(
                f"from_hf: the weights of {type(hf_model).__name__} do not map onto the reference decoder "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatch {mismatched[:5]}); "
                f"supported model types: {', '.join(SUPPORTED_HF_MODEL_TYPES)}"
            )
        # never inference tensors (from_hf under torch.inference_mode()): the KV caches are written
        # in place by every step, in inference mode or not
        with torch.inference_mode(False), torch.no_grad():  # inference_mode(False) turns grad mode on
            model.to_empty(device=device)
            if tied:  # to_empty makes new tensors per module: tie again
                model.lm_head.weight = model.embed_tokens.weight
            for name, param in model.state_dict(keep_vars=True).items():
                param.copy_(theirs[name])
            model.reset_kv_cache()  # to_empty left the caches uninitialised
        model.eos_token_ids = _hf_eos_token_ids(hf_model)
        return model.eval()

    def reset_kv_cache(self) -> None:
        """Zero every layer's KV cache in place (addresses are kept, so captured graphs stay valid)."""
        for layer in self.layers:
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every token of a flattened step.

        Args:
            input_ids: [num_tokens] int64, each < vocab_size.
            positions: [num_tokens] int64, each token's position in its sequence, < max_seq_len.
            seq_ids: [num_tokens] int64, each token's sequence slot, < max_num_seqs.

        Returns:
            [num_tokens, vocab_size] logits in `config.dtype`.

        Writes each token's keys and values into the KV caches at ``[seq_ids, positions]``. Index
        ranges are not checked (that would need a data-dependent branch).
        """
        return self.lm_head(self.hidden_states(input_ids, positions, seq_ids))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        """`forward` up to the final norm: [num_tokens, hidden_size] in `config.dtype` (same
        arguments and KV-cache writes as `forward`)."""
        c = self.config
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, **_rope_scaling(c))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, seq_ids)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden_size] -> [rows, vocab_size] logits: the vocabulary projection alone, for
        the few rows an engine samples from. On the CPU with the kernel a compiled piece's linear
        would take (`piecewise.passes.packed_linear.cpu_linear`: the weight packed for oneDNN in
        bfloat16, and in float32 for 4-64 rows, where MKL's ``mm`` of SmolLM2's 49152 x 576 weight
        took 1.8-2.3x the packed kernel's time at 4-8 rows); elsewhere ``nn.Linear``'s product.
        Equal to ``lm_head(hidden)`` within float rounding."""
        if hidden.device.type == "cpu":
            return cpu_linear(hidden, self.lm_head.weight, self.lm_head.bias)
        return self.lm_head(hidden)

    def backbone(self) -> "LlamaBackbone":
        """A module whose ``forward`` is `hidden_states`, to compile for an engine that projects
        only the rows it samples from (`greedy_decode`'s ``compute_logits``), as serving engines
        do: at a 1024-token prefill of SmolLM2 the full-vocabulary projection of every prompt
        token is 58 GFLOP, of which the engine needs the last token of each sequence."""
        return LlamaBackbone(self)


class LlamaBackbone(nn.Module):
    """`LlamaForCausalLM.hidden_states` as a module's ``forward`` (the decoder is its submodule:
    same weights, same KV caches)."""

    def __init__(self, decoder: LlamaForCausalLM) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.hidden_states(input_ids, positions, seq_ids)


# ---------------------------------------------------------------------------------------------
# transformers checkpoints

#: transformers ``model_type`` values `LlamaForCausalLM.from_hf` maps: decoders whose math is
#: Llama's up to biases, q/k norms, tied embeddings and rope scaling.
SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


#: model types whose transformers attention honours ``config.sliding_window`` (Llama's ignores it;
#: its generate() cache does not: `_config_from_hf`)
_WINDOWED_MODEL_TYPES = ("mistral", "qwen2", "qwen3")


def _hf_param_name(name: str) -> str:
    """Our state-dict name for a transformers ``*ForCausalLM`` one."""
    name = name.removeprefix("model.") if name.startswith("model.") else name
    return name.replace(".input_layernorm.", ".input_norm.").replace(".post_attention_layernorm.", ".post_attention_norm.")


def _unwrap_compiled(hf_model: nn.Module) -> nn.Module:
    """The model `torch.compile(model)` wraps (an ``OptimizedModule``; its ``_orig_mod``): the same
    forward, compiled, so the same weights and tokens. ConfigError for a hook on the wrapper itself,
    which its calls would run."""
    from .._torch.dynamo import OptimizedModule

    while isinstance(hf_model, OptimizedModule):
        hooks = [_hook_name(h) for d in (hf_model._forward_hooks, hf_model._forward_pre_hooks) for h in d.values()]
        if hooks:
            raise ConfigError(f"from_hf: the torch.compile wrapper (OptimizedModule) of {type(hf_model._orig_mod).__name__} "
                              f"has forward hooks {hooks}; the reference decoder copies weights only and would not "
                              "run them. Remove them, or serve the model through pw.compile(model).generate(...)")
        hf_model = hf_model._orig_mod
    return hf_model


def _hf_num_layers_run(hf_model: nn.Module) -> int:
    """How many decoder layers transformers' forward runs: ``self.layers[:config.num_hidden_layers]``
    (Llama, Mistral, Qwen2 and Qwen3 slice), so a config whose num_hidden_layers was lowered after
    the model was built runs the first layers only, and the rest are weights it never uses."""
    built = len(hf_model.model.layers)
    n = getattr(hf_model.config, "num_hidden_layers", None)
    return min(built, n) if isinstance(n, int) and not isinstance(n, bool) else built


_LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")


def _hf_eos_token_ids(hf_model: nn.Module) -> tuple[int, ...]:
    """The ids `generate()` stops at: its generation config's (None there: it never stops, even
    when the model config names one); the model config's only for a model without a generation config."""
    gen = getattr(hf_model, "generation_config", None)
    eos = gen.eos_token_id if gen is not None else getattr(hf_model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


#: generation-config fields that make transformers' greedy ``generate()`` change the logits before
#: its argmax (the logits processors it builds with ``do_sample=False``), each with the test for
#: the value that leaves them alone; the decode loop applies no logits processor
_GREEDY_PROCESSOR_FIELDS: dict[str, Callable[[Any], bool]] = {
    "repetition_penalty": lambda v: v is None or v == 1.0,
    "no_repeat_ngram_size": lambda v: not v,
    # decoder-only models too: transformers takes the prompt for the encoder input
    "encoder_repetition_penalty": lambda v: v is None or v == 1.0,
    "encoder_no_repeat_ngram_size": lambda v: not v,
    # not a logits processor: generate(do_sample=False) then runs beam search
    "num_beams": lambda v: v is None or v == 1,
    "bad_words_ids": lambda v: v is None,
    "sequence_bias": lambda v: v is None,
    # an empty list builds a processor that masks nothing
    "suppress_tokens": lambda v: v is None or (hasattr(v, "__len__") and len(v) == 0),
    "begin_suppress_tokens": lambda v: v is None or (hasattr(v, "__len__") and len(v) == 0),
    "forced_bos_token_id": lambda v: v is None,
    "forced_eos_token_id": lambda v: v is None,
    "min_length": lambda v: not v,
    "min_new_tokens": lambda v: not v,
    "exponential_decay_length_penalty": lambda v: v is None,
    "guidance_scale": lambda v: v is None or v == 1,
    "remove_invalid_values": lambda v: not v,
    "watermarking_config": lambda v: v is None,
}


#: `_GREEDY_PROCESSOR_FIELDS` whose processor transformers builds only with an EOS token to hold back
_EOS_ONLY_FIELDS = ("min_length", "min_new_tokens")


def _hf_silu_class() -> type:
    """transformers' SiLU activation class (what ``ACT2FN["silu"]`` builds), or `nn.SiLU`."""
    try:
        from transformers.activations import SiLUActivation

        return SiLUActivation
    except ImportError:
        return nn.SiLU


#: forward hooks transformers installs on a plain model, which leave its outputs as they are:
#: (function module, qualified name)
_HF_BENIGN_HOOKS = frozenset({
    # installed by the first forward with output_hidden_states / output_attentions; only records
    ("transformers.utils.output_capturing", "install_output_capuring_hook.<locals>.output_capturing_hook"),
    ("transformers.utils.output_capturing", "install_output_capturing_hook.<locals>.output_capturing_hook"),
    # enable_input_require_grads(): sets requires_grad on the embeddings' output, same values
    ("transformers.modeling_utils", "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"),
})


def _hook_name(hook: Any) -> str:
    fn = getattr(hook, "func", hook)  # functools.partial
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _benign_hook(hook: Any) -> bool:
    fn = getattr(hook, "func", hook)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) in _HF_BENIGN_HOOKS


def _check_no_forward_hooks(hf_model: nn.Module, skipped: set[int]) -> None:
    """ConfigError when a forward hook, a forward pre-hook, an instance-level ``forward`` or a
    global module hook can change what the transformers model computes: `from_hf` copies weights
    only, so the reference decoder would not run it and its tokens would silently differ. Hooks
    transformers installs itself that only record (`_HF_BENIGN_HOOKS`) pass; modules in `skipped`
    (layers the model's forward never runs) are not looked at."""
    from .._torch.nn import global_forward_hooks

    hooks_of_all, pre_hooks_of_all = global_forward_hooks()
    cls_name = type(hf_model).__name__
    remedy = ("the reference decoder copies weights only and would not run it, so its tokens would differ from the "
              "model's. Remove the hook (its handle's .remove(); an instance-level forward: del module.forward) or put its change into the weights before from_hf, "
              "or serve the transformers model itself through pw.compile(model).generate(...), which runs it")
    for kind, hooks in (("global forward hook", hooks_of_all), ("global forward pre-hook", pre_hooks_of_all)):
        for hook in hooks.values():
            if not _benign_hook(hook):
                raise ConfigError(f"from_hf: a {kind} ({_hook_name(hook)}, torch.nn.modules.module."
                                  f"register_module_forward{'_pre' if 'pre' in kind else ''}_hook) applies to every "
                                  f"module of {cls_name}; {remedy}")
    for name, module in hf_model.named_modules():
        if id(module) in skipped:
            continue
        where = f"{cls_name}.{name}" if name else cls_name
        if "forward" in module.__dict__:
            raise ConfigError(f"from_hf: {where} has its own forward attribute ({_hook_name(module.__dict__['forward'])}), "
                              f"which replaces {type(module).__name__}.forward; {remedy}")
        for kind, hooks in (("forward hook", module._forward_hooks), ("forward pre-hook", module._forward_pre_hooks)):
            for hook in hooks.values():
                if not _benign_hook(hook):
                    raise ConfigError(f"from_hf: {where} has a {kind} ({_hook_name(hook)}); {remedy}")


def _check_generation_config(hf_model: nn.Module) -> None:
    """ConfigError when the model's generation config makes greedy ``generate()`` process its
    logits (`_GREEDY_PROCESSOR_FIELDS`), pick another decoding mode than greedy search, or stop on
    text or time (`_STOPPING_FIELDS`): the decode loop's tokens would silently differ."""
    gen = getattr(hf_model, "generation_config", None)
    if gen is None:
        return
    # the minimum-length processors hold back EOS: transformers builds them only when there is one
    no_eos = () if _hf_eos_token_ids(hf_model) else _EOS_ONLY_FIELDS
    set_ = [f"{name}={getattr(gen, name)!r}" for name, default in _GREEDY_PROCESSOR_FIELDS.items()
            if not default(getattr(gen, name, None)) and name not in no_eos]
    if set_:
        raise ConfigError(
            f"from_hf: {type(hf_model).__name__}.generation_config sets {', '.join(set_)}, which transformers' greedy "
            "generate() applies to the logits before its argmax (num_beams: it searches beams instead); the decode loop takes the plain argmax, so its tokens "
            "would differ. Generate with pw.compile(model).generate(...), which runs transformers' own loop, or reset "
            "the field(s) on hf_model.generation_config before from_hf to decode without them")
    # the decoding algorithm greedy generate() picks from the rest (contrastive search from
    # penalty_alpha, DoLa from dola_layers, constrained beam search from force_words_ids, ...)
    import copy

    greedy = copy.deepcopy(gen)
    greedy.do_sample = False
    try:
        mode = greedy.get_generation_mode()
    except Exception as e:  # transformers refuses the combination itself
        mode = f"none ({type(e).__name__}: {e})"
    if str(getattr(mode, "value", mode)) != "greedy_search":
        raise ConfigError(
            f"from_hf: with do_sample=False, {type(hf_model).__name__}.generation_config selects the decoding mode "
            f"{getattr(mode, 'value', mode)!r} (transformers' GenerationConfig.get_generation_mode()), not greedy "
            "search; the decode loop is greedy, so its tokens would differ. Reset the fields that select it "
            "(penalty_alpha, dola_layers, force_words_ids, constraints, num_beam_groups) before from_hf")
    stops = [f"{name}={getattr(gen, name)!r}" for name in _STOPPING_FIELDS if getattr(gen, name, None) is not None]
    if stops:
        raise ConfigError(
            f"from_hf: {type(hf_model).__name__}.generation_config sets {', '.join(stops)}, which stops transformers' "
            "generate() where the decode loop would not (it stops at eos_token_ids and max_new_tokens); reset the "
            "field(s) before from_hf, or generate with pw.compile(model).generate(...)")


#: generation-config fields that stop transformers' greedy ``generate()`` on text or wall time
_STOPPING_FIELDS = ("stop_strings", "max_time")


def _config_from_hf(hf_model: nn.Module, *, max_num_seqs: int, max_seq_len: int,
                    dtype: torch.dtype | None) -> tuple[LlamaConfig, bool]:
    """`LlamaConfig` for a transformers model and whether its embeddings are tied; ConfigError
    for anything the reference decoder would compute differently."""
    cls_name = type(hf_model).__name__
    cfg = getattr(hf_model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    supported = ", ".join(SUPPORTED_HF_MODEL_TYPES)
    if model_type not in SUPPORTED_HF_MODEL_TYPES:
        raise ConfigError(f"from_hf: {cls_name} (model_type={model_type!r}) is not a Llama-architecture decoder "
                          f"the reference decoder implements; supported model types: {supported}")
    body, lm_head = getattr(hf_model, "model", None), getattr(hf_model, "lm_head", None)
    layers = getattr(body, "layers", None)
    if not isinstance(lm_head, nn.Linear) or layers is None or getattr(body, "embed_tokens", None) is None:
        raise ConfigError(f"from_hf: {cls_name} has no language-model head; pass the *ForCausalLM model "
                          "(AutoModelForCausalLM), not the bare decoder")
    num_run = _hf_num_layers_run(hf_model)
    if num_run < 1:
        raise ConfigError(f"from_hf: {cls_name} runs no decoder layers (config.num_hidden_layers="
                          f"{cfg.num_hidden_layers!r}); the reference decoder needs at least one")
    skipped = {id(m) for layer in list(layers)[num_run:] for m in layer.modules()}
    layers = list(layers)[:num_run]  # the layers its forward runs: what the checks below are about
    _check_no_forward_hooks(hf_model, skipped)
    _check_generation_config(hf_model)
    if lm_head.bias is not None:
        raise ConfigError(f"from_hf: {cls_name}.lm_head has a bias, which the reference decoder does not implement")
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN["swish"] is nn.SiLU
        raise ConfigError(f"from_hf: {cls_name} uses hidden_act={act!r}; the reference decoder's MLP is SwiGLU (silu)")
    # what each MLP calls: bound at construction, so a config edited afterwards does not change it
    acts = sorted({type(getattr(layer.mlp, "act_fn", None)).__name__ for layer in layers
                   if not isinstance(getattr(layer.mlp, "act_fn", None), (nn.SiLU, _hf_silu_class()))})
    if acts:
        raise ConfigError(f"from_hf: {cls_name}'s MLPs apply {', '.join(acts)}, not SiLU (its config says "
                          f"hidden_act={act!r}, edited after the model was built); the reference decoder's MLP is "
                          "SwiGLU (silu)")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ConfigError(f"from_hf: max_seq_len={max_seq_len!r} must be a positive integer (the KV cache's positions "
                          "per sequence)")

    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = dict(rope)
    if "rope_type" not in rope and isinstance(next(iter(rope.values()), None), dict):
        raise ConfigError(f"from_hf: {cls_name} has per-layer-type rope parameters {sorted(rope)}; not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"from_hf: {cls_name} uses rope_type={rope_type!r}, which the reference decoder does not "
                          f"implement; supported: {', '.join(ROPE_TYPES)}")
    rotary = getattr(body, "rotary_emb", None)
    held = getattr(rotary, "inv_freq", None)  # the frequencies the model rotates by
    held = held if isinstance(held, torch.Tensor) else None
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if held is None and partial not in (None, 1, 1.0):  # with the buffer, its length decides
        raise ConfigError(f"from_hf: {cls_name} uses partial_rotary_factor={partial!r}; only full rotary is implemented")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    scaling: dict[str, Any] = {}
    try:
        if rope_type in ("linear", "llama3"):
            scaling["rope_factor"] = float(rope["factor"])
        if rope_type == "llama3":
            scaling.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                           rope_high_freq_factor=float(rope["high_freq_factor"]),
                           rope_original_max_position=int(rope["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"from_hf: {cls_name}'s rope parameters {rope} lack {e.args[0]!r} for rope_type={rope_type!r}") from None

    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    # Mistral windows every layer whenever sliding_window is set (its mask ignores layer_types);
    # Qwen2 and Qwen3 window the layers layer_types names. Llama's attention and mask read neither
    # field, but generate()'s cache does (DynamicCache(config=...): a layer that layer_types names
    # sliding, or every layer when layer_types is unset, keeps only its last sliding_window - 1
    # keys), so a Llama config carrying a stray window generates windowed past that many tokens
    windowed = window is not None and (model_type == "mistral" or layer_types is None or "sliding_attention" in layer_types)
    if windowed and max_seq_len > window:
        how = ("attends within a sliding window of" if model_type in _WINDOWED_MODEL_TYPES else
               "has config.sliding_window set, which its attention ignores but transformers' generate() does not: "
               "its KV cache (DynamicCache from the config) keeps only the keys of the last")
        raise ConfigError(f"from_hf: {cls_name} {how} {window} tokens and the reference attention is fully causal; use "
                          f"max_seq_len <= {window} (got {max_seq_len})"
                          + ("" if model_type in _WINDOWED_MODEL_TYPES else
                             ", or set hf_model.config.sliding_window = None first (transformers then generates fully "
                             "causally too)"))

    attn, mlp = layers[0].self_attn, layers[0].mlp
    embed = body.embed_tokens.weight
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    theta = float(theta if theta is not None else 10000.0)
    # What the modules compute with, where it can differ from the config (a config edited after
    # the model was built, a model cast after it was built): their epsilon and frequencies
    eps = {float(m.variance_epsilon) for m in hf_model.modules()
           if isinstance(getattr(m, "variance_epsilon", None), float) and id(m) not in skipped}
    if len(eps) > 1:
        raise ConfigError(f"from_hf: {cls_name}'s RMSNorm modules use different epsilons {sorted(eps)}; the reference "
                          "decoder has one (rms_norm_eps)")
    rounded = None
    if held is not None:
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            raise ConfigError(f"from_hf: {cls_name}'s rotary embedding scales cos/sin by {rotary.attention_scaling}, "
                              "which the reference decoder does not implement")
        rounded = held.dtype if held.dtype != torch.float32 else None
    config = LlamaConfig(
        vocab_size=embed.shape[0],
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=num_run,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=eps.pop() if eps else float(cfg.rms_norm_eps),
        max_num_seqs=max_num_seqs,
        max_seq_len=max_seq_len,
        dtype=dtype if dtype is not None else embed.dtype,
        qkv_bias=attn.q_proj.bias is not None,
        o_bias=attn.o_proj.bias is not None,
        mlp_bias=mlp.gate_proj.bias is not None,
        qk_norm=hasattr(attn, "q_norm"),
        tie_word_embeddings=lm_head.weight is embed,
        rope_type=rope_type,
        rope_inv_freq_dtype=rounded,
        **scaling,
    )
    if held is not None:  # the frequencies this config gives, as the decoder computes them
        ours = rotary_inv_freq(head_dim, theta, **_rope_scaling(config))
        if held.shape != ours.shape or not torch.allclose(held.detach().float().cpu(), ours, rtol=1e-6, atol=0):
            raise ConfigError(
                f"from_hf: {cls_name}.model.rotary_emb rotates by {tuple(held.shape)[0]} frequencies that differ from the "
                f"{ours.shape[0]} its config gives (rope_type={rope_type!r}, rope_theta={theta}, head_dim={head_dim}"
                f"{f', partial_rotary_factor={partial}' if partial not in (None, 1, 1.0) else ''}): partial rotary, or "
                "a config edited after the model was built; build the transformers model from the config it has")
    return config, config.tie_word_embeddings
