"""transformers ``generate()`` on a compiled model, with a KV cache that piecewise owns.

``compiled.generate(...)`` and ``model.forward = compiled; model.generate(...)`` both reach the
compiled model with transformers' calling convention (``input_ids`` ``[batch, new_tokens]``,
``attention_mask``, ``position_ids``, a ``cache`` object, ``use_cache``, ``logits_to_keep``). A
`GenerationRoute` serves those calls with a second compiled model, a `GenerationStep`, whose KV
cache is static tensors allocated once per layer, ``[max_num_seqs, num_kv_heads, max_model_len,
head_dim]``, so their addresses never move across steps or ``generate()`` calls (what graph capture
needs). Each step's keys and values are written into it in place at the tokens' cache positions,
compiled into the piece before the attention splitting op (`write_kv_cache`; by the op itself in
the decode step with graphs), and the op `hf_cached_attention` attends over it; transformers' own cache object is
passed through untouched and only tells a new generation (a new cache object) from the next step
of the current one.

One trace serves prefill and decode, any batch size up to `max_num_seqs` and any length up to
`max_model_len` (batch and token dims are both dynamic): the counters show one Dynamo trace for
any number of ``generate()`` calls. That step captures no graphs: a graph replays one shape per
token count, and it has two dynamic sizes. Where graphs apply (a device with a graph platform, a
`cudagraph_mode` other than ``"none"``), decode steps (one new token a row, the last position's
logits) go to a second compiled step, tag ``<tag>_generate_decode``, traced once on the first
decode step: only the batch dim is dynamic, and it is the token count its graphs are captured and
padded for, capture sizes up to `max_num_seqs` (a pad row writes the cache at a slot no real row
of the call uses, and attends its own position plus whatever positions earlier calls left valid in
that slot; no real row reads a pad row's slot). Its batches are uniform decode, so
``full_and_piecewise`` replays full graphs there, and so does ``"auto"`` (the default) when the
attention op is the only splitting op in the model's graph: the step is one graph per batch size,
its attention op inside (attending the whole cache under the mask; a generation zeroes its rows
past the prompt once, so no stale non-finite value meets a zero weight). So generation shows two traces on a GPU
(prefill, decode) and one on the CPU, unless the model's step code branches on a size: the sizes
a step's trace does not hold for get a trace of their own, a size class of the step (OPT's mask
code branches on one new token), up to ``CompilationConfig.max_size_classes``. Left padding works through the
2-D ``attention_mask``: pad
positions are never attended by real tokens. ``use_cache=False`` runs the whole sequence each step
through the same compiled step.

Threads: a compiled ``generate()`` owns the module's ``forward`` for its call through the module's
generation lock (`piecewise.CompiledModel.generation_lock`), which every step takes too, so
generations on one module from several threads (through one compiled model or several) run one
after the other, and a generation nested in another on the same thread runs inside it (through
another compiled model: one KV cache holds one generation); what it sets as ``forward`` runs the
compiled model on its own thread only, so eager use of the module on other threads meanwhile is
eager. generate()'s own options are served as transformers serves them or refused by name
(`GENERATE_OPTIONS`); config flags asking every forward for more than logits
(``output_router_logits`` of mixture-of-experts configs, hidden states) are
turned off in the steps, since generate() reads only the logits.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import threading
import weakref
from typing import Any, NamedTuple

import torch

from ..backend import size_refusals_handled
from ..errors import CaptureError, ConfigError, InputError, SizeRefusedError
from ..forward_context import RuntimeMode, current_forward_context
from ..graphs.dispatch import batch_hint
from ..ops import normalize_op_name, resolve_splitting_ops, splitting_op
from ..split import is_splitting_node

__all__ = ["CACHED_ATTENTION_OP", "GenerationRoute", "GenerationStep", "hf_cached_attention", "generation_route"]

CACHED_ATTENTION_OP = "piecewise_models::hf_cached_attention"

log = logging.getLogger("piecewise")

#: model types whose forward, given no position ids, numbers the real tokens of the attention mask
#: (``cumsum(mask) * mask - 1``) rather than the positions from the cache length; among
#: transformers' text decoders only OPT's does (its model forward; BioGPT's embedding can, but its
#: model passes arange positions first). RoBERTa's family numbers from the token ids instead
#: (`GenerationRoute._default_positions`).
MASK_NUMBERED_POSITIONS = frozenset({"opt"})

class StepAttention(NamedTuple):
    """What `GenerationRoute` knows on the host about the step it runs, for `hf_cached_attention`.

    Attributes:
        length: cache positions the step attends over (``write_pos[-1] + 1``).
        unmasked: every row of the batch is valid at every position ``0..length-1`` (no left
            padding) and the step is a decode step (one new token a row, which sees all of them)
            or a whole prompt from position 0 (exactly SDPA's ``is_causal``): the op attends
            without the mask. Only set on the CPU, where finding it out reads no device.
    """

    length: int
    unmasked: bool = False


#: The running generation step's `StepAttention`, set by `GenerationRoute` around each step.
_step_attention: contextvars.ContextVar[StepAttention | None] = contextvars.ContextVar("piecewise_step_attention",
                                                                                      default=None)


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   write_pos: torch.Tensor) -> None:
    """Write a step's keys and values into the static cache in place, rows ``0..batch-1`` at
    positions `write_pos`. Traced into the piece before `hf_cached_attention` (every step but the
    decode step with graphs, where the op writes), so the write is part of that piece's compiled
    code (Inductor fuses it with the projection and rotary embedding that make the keys) instead
    of two eager calls a layer between pieces.

    Args:
        k_cache, v_cache: ``[max_num_seqs, num_kv_heads, max_model_len, head_dim]``.
        key, value: ``[batch, num_kv_heads, new_tokens, head_dim]`` (cast to the cache's dtype).
        write_pos: ``[new_tokens]`` int64, the cache position of each new token (every row the same).

    One ``index_put_`` on the whole cache tensor with broadcast row, head and position indices:
    Inductor turns the functionalized write back into an in-place store into the graph input. The
    same write through a view (``k_cache[:batch].index_copy_(...)``) made it copy the view twice per
    layer (out to a buffer and back), which is the whole cache rows of the batch.
    """
    rows = torch.arange(key.shape[0], device=k_cache.device)[:, None, None]
    heads = torch.arange(key.shape[1], device=k_cache.device)[None, :, None]
    at = (rows, heads, write_pos[None, None, :])
    k_cache.index_put_(at, key.to(k_cache.dtype))
    v_cache.index_put_(at, value.to(v_cache.dtype))


@splitting_op(CACHED_ATTENTION_OP, mutates_args=("k_cache", "v_cache", "out"))
def hf_cached_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_pos: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
) -> None:
    """Attend a step's queries over the static cache; the result goes into `out`. With `key` and
    `value` the op first writes them into the cache (``index_copy_`` into rows ``0..batch-1`` at
    `write_pos`, what `write_kv_cache` does in a piece); without them (None) the piece before has
    written them.

    Where the write happens is the step's choice (`cached_attention_forward`): in the piece before,
    compiled, except in the decode step with graphs. There a captured piece would write pad rows
    into the cache, which graph capture's check for values combined across tokens refuses for any
    compiled node (it cannot know that pad rows land in slots no real row reads); a splitting op
    is trusted with that, so the op writes.

    Args:
        query: ``[batch, num_heads, new_tokens, head_dim]``.
        key, value: ``[batch, num_kv_heads, new_tokens, head_dim]`` (value may have its own head
            dim) to write first, or None.
        k_cache, v_cache: ``[max_num_seqs, num_kv_heads, max_model_len, head_dim]``, rows
            ``0..batch-1`` read (and written when `key` is given); ``num_heads != num_kv_heads`` is
            grouped-query attention.
        write_pos: ``[new_tokens]`` int64, the cache position of each new token (the same for every
            row: rows are left-padded to one length), increasing.
        mask: ``[batch, 1, new_tokens, max_model_len]``, which cache positions each token sees
            (`attention_mask_for_step`: one mask a step, shared by every layer): additive (0 or
            -inf) in the model's dtype (its KV cache's), as a step builds it, so SDPA does not
            convert a bool mask on every layer (a mask of another dtype than the query's is
            converted here); a bool mask (True = attend) works too.
        scaling: multiplier of ``q @ k^T``.
        out: ``[batch, new_tokens, num_heads, value_head_dim]`` in the query dtype, overwritten.
            The caller allocates it in the piece before the op (`cached_attention_forward`), so
            under piecewise CUDA graphs the next piece reads it in place instead of copying the
            op's result into its graph's input buffer on every replay.

    Attends over cache positions ``0..write_pos[-1]`` only, so a decode step's cost follows the
    sequence, not the cache size. That length is a host value: the `GenerationRoute` running the
    step knows it (`StepAttention`), so there is no device read and no device sync per layer;
    called outside a route, the op reads ``write_pos[-1]`` (one host read). When the route also
    knows that no row is padded and the step is a decode step (the mask keeps every position) or
    a whole prompt from position 0 (the mask is exactly ``is_causal``), the op attends without
    it: SDPA's masked CPU path measured 57 against 38 us a call at SmolLM2's decode shape (batch
    1, 2 threads). Inside a full graph (`RuntimeMode.FULL`: captured once, replayed at every later
    position) no host value may be read or frozen, so it attends over the whole cache and the mask
    alone bounds each token. The mask comes built: per layer the op only writes the cache (when
    asked) and attends.
    """
    batch, heads = query.shape[0], query.shape[1]
    # Few dispatcher calls: on a GPU between piecewise graphs each one is host time the device
    # waits on. Views are taken once, dtype conversions only where the dtypes differ.
    keys, values = k_cache, v_cache
    if batch != k_cache.shape[0]:
        keys, values = k_cache[:batch], v_cache[:batch]
    if key is not None and value is not None:
        keys.index_copy_(2, write_pos, key if key.dtype == k_cache.dtype else key.to(k_cache.dtype))
        values.index_copy_(2, write_pos, value if value.dtype == v_cache.dtype else value.to(v_cache.dtype))
    ctx = current_forward_context()
    full = ctx is not None and ctx.runtime_mode == RuntimeMode.FULL
    step = None if full else _step_attention.get()
    if full:
        length = k_cache.shape[2]
    else:
        length = step.length if step is not None else int(write_pos[-1]) + 1
    causal = False
    if step is not None and step.unmasked:
        mask, causal = None, query.shape[2] > 1
    elif mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    if length != k_cache.shape[2]:
        keys, values = keys[:, :, :length], values[:, :, :length]
        if mask is not None:
            mask = mask[..., :length]
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    res = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                           is_causal=causal, enable_gqa=heads != k_cache.shape[1])
    out.copy_(res.transpose(1, 2))


def attention_mask_for_step(write_pos: torch.Tensor, kv_valid: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[batch, 1, new_tokens, max_model_len]`` (the head dim broadcast, as SDPA takes it, so no
    layer reshapes it), bool (True = attend), or additive in `dtype` (0 where seen, -inf where
    not: what SDPA would otherwise make of a bool mask on every layer): token ``t`` sees cache positions
    ``j <= write_pos[t]`` that are valid in `kv_valid` (``[batch, max_model_len]`` bool, False at
    pad positions), as transformers' eager masks do. A pad token that would see nothing (left
    padding: no real token before it) sees itself, so no row is fully masked (a fully masked row
    would be NaN, and a NaN value poisons every row that weights it by zero); one with real tokens
    before it (right padding) sees just those, not itself: its logits are what transformers reads
    for such a row's first new token. Built once a step, inside the compiled graph, for every
    layer's `hf_cached_attention`."""
    j = torch.arange(kv_valid.shape[1], device=kv_valid.device)
    causal = j[None, :] <= write_pos[:, None]  # [new_tokens, max_model_len]
    self_pos = j[None, :] == write_pos[:, None]
    valid_seen = causal[None] & kv_valid[:, None, :]  # [batch, new_tokens, max_model_len]
    alone = ~valid_seen.any(-1, keepdim=True)
    seen = (valid_seen | (alone & self_pos[None])).unsqueeze(1)
    if dtype is None or dtype == torch.bool:
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


@hf_cached_attention.register_fake
def _(query, key, value, k_cache, v_cache, write_pos, mask, scaling, out):
    return None


class GenerationStep(torch.nn.Module):
    """One generation step of a transformers causal LM over the piecewise-owned KV cache.

    ``forward(input_ids [B, T] int64, position_ids [B, T] int64, write_pos [T] int64, kv_valid
    [B or more, max_model_len] bool) -> logits [B, T, vocab]`` (``[B, 1, vocab]``, the last position's,
    when built with ``last_logits_only``: what ``generate()`` reads, and at a 128-token prefill of
    SmolLM2 the full-vocabulary projection of the other 127 positions is most of the step's
    work). The wrapped model's attention layers (built with ``attn_implementation="piecewise"``)
    find this step's caches in the keyword arguments transformers passes down to every attention
    call. `sharing` makes a second step over the same cache tensors.
    """

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int,
                 last_logits_only: bool = False, caches: "GenerationStep | None" = None) -> None:
        super().__init__()
        cfg = model.config
        self.model = model
        self.last_logits_only = last_logits_only
        layers = cfg.num_hidden_layers
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        shape = (max_num_seqs, kv_heads, max_model_len, head_dim)
        for i in range(layers):
            for kind in ("k", "v"):
                # never an inference tensor: a first generate() under torch.inference_mode() would
                # leave a cache no later call outside it could write
                with torch.inference_mode(False):
                    t = (getattr(caches, f"{kind}_cache_{i}") if caches is not None
                         else torch.zeros(shape, dtype=param.dtype, device=param.device))
                self.register_buffer(f"{kind}_cache_{i}", t, persistent=False)
        self.num_layers = layers
        #: kv_valid passed with every slot's row (``[max_num_seqs, max_model_len]``), not the batch's
        self.all_slots_kv_valid = False
        #: the model's ``output_*`` flags a config may set for every forward (`_output_flags`), and
        #: whether its forward can be told to leave each off
        self._output_flags = _output_flags(model)

    def sharing(self, last_logits_only: bool) -> "GenerationStep":
        """A step over the same model and the same cache tensors that returns the other logits."""
        shape = self.k_cache_0.shape
        return GenerationStep(self.model, shape[0], shape[2], last_logits_only=last_logits_only, caches=self)

    def caches(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return (tuple(getattr(self, f"k_cache_{i}") for i in range(self.num_layers)),
                tuple(getattr(self, f"v_cache_{i}") for i in range(self.num_layers)))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, write_pos: torch.Tensor,
                kv_valid: torch.Tensor) -> torch.Tensor:
        if self.all_slots_kv_valid:
            # the decode step with graphs: kv_valid holds every slot (a static shape and address, so
            # the batch is the trace's only dynamic size); the batch's rows are sliced here
            kv_valid = kv_valid[: input_ids.shape[0]]
        k_caches = tuple(getattr(self, f"k_cache_{i}") for i in range(self.num_layers))
        v_caches = tuple(getattr(self, f"v_cache_{i}") for i in range(self.num_layers))
        # The last position as an index tensor, not transformers' ``logits_to_keep=1`` (a slice): the
        # slice is a strided view [B, 1, H] that lm_head's matmul can fold into [B, H] without a copy
        # only when B == 1, so a first call with one sequence traced a step guarded on B == 1 (which
        # guard-free dispatch would not check). The gather makes [B, 1, H] contiguous at any B.
        keep = torch.full((1,), -1, dtype=torch.long, device=input_ids.device) if self.last_logits_only else 0
        # A step returns logits only: a config asking every forward for hidden states, attention
        # weights or router logits (config.output_hidden_states=True; output_router_logits=True in
        # mixture-of-experts configs) would record them through hooks no graph holds
        extra = {}
        for flag, accepted in self._output_flags:
            if getattr(self.model.config, flag, None) not in (None, False):
                if not accepted:
                    raise ConfigError(f"{type(self.model).__name__}'s config sets {flag}={getattr(self.model.config, flag)!r}, "
                                      f"and its forward takes no {flag} argument to turn it off for a generation step, "
                                      "which returns logits only; set model.config." + flag + " = False to generate")
                extra[flag] = False
        # The class's forward: ``self.model.forward`` may be the compiled model itself (generate()).
        out = type(self.model).forward(self.model, input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                       logits_to_keep=keep, **extra,
                                       pw_write_pos=write_pos,
                                       pw_mask=attention_mask_for_step(write_pos, kv_valid, self.k_cache_0.dtype),
                                       pw_k_caches=k_caches, pw_v_caches=v_caches,
                                       pw_write_in_op=self.all_slots_kv_valid)
        return out.logits


def _output_flags(model: torch.nn.Module) -> tuple[tuple[str, bool], ...]:
    """The ``output_*`` flags that ask `model`'s forward for more than logits (hidden states,
    attentions, router logits, and whatever its modules record: transformers'
    ``_can_record_outputs``), each with whether the class's forward takes it (by name, or through
    ``**kwargs`` it passes down), so a step can pass it False."""
    flags = {"output_hidden_states", "output_attentions", "output_router_logits"}
    for m in model.modules():
        recorded = getattr(type(m), "_can_record_outputs", None)
        if isinstance(recorded, dict):
            flags |= {f"output_{k}" for k in recorded}
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    return tuple((f, takes_kwargs or f in params) for f in sorted(flags))


def cached_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             scaling: float | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """The attention function's path inside a `GenerationStep` (the step's caches are in `kwargs`)."""
    layer = module.layer_idx
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    batch, heads, new_tokens, _ = query.shape
    k_cache, v_cache = kwargs["pw_k_caches"][layer], kwargs["pw_v_caches"][layer]
    if (key.shape[1], key.shape[-1], value.shape[1], value.shape[-1]) != (k_cache.shape[1], k_cache.shape[-1], v_cache.shape[1],
                                                                          v_cache.shape[-1]):
        raise ConfigError(f"{type(module).__name__} layer {layer} attends with keys of {key.shape[1]} heads x {key.shape[-1]} "
                          f"and values of {value.shape[1]} x {value.shape[-1]}, but its config gives the KV cache "
                          f"{k_cache.shape[1]} heads x {k_cache.shape[-1]} (num_key_value_heads, head_dim); piecewise's "
                          "generation cache cannot hold this architecture: generate with the model itself, uncompiled, "
                          "built with attn_implementation='sdpa'")
    write_pos = kwargs["pw_write_pos"]
    in_op = kwargs.get("pw_write_in_op", False)  # the decode step with graphs (see hf_cached_attention)
    if not in_op:
        write_kv_cache(k_cache, v_cache, key, value, write_pos)
    out = query.new_empty(batch, new_tokens, heads, value.shape[-1])  # written by the op, read in place next
    hf_cached_attention(query, key if in_op else None, value if in_op else None, k_cache, v_cache, write_pos,
                        kwargs["pw_mask"], scale, out)
    return out, None


#: keyword arguments of a transformers forward that mark the generation calling convention
_GENERATION_KWARGS = ("cache", "past_key_values", "use_cache", "attention_mask", "position_ids", "logits_to_keep",
                      "return_dict")
#: keyword arguments a step cannot honour
_UNSUPPORTED = ("inputs_embeds", "labels", "output_attentions", "output_hidden_states", "token_type_ids")
#: keyword arguments a step takes (`cache_position` is transformers' own numbering of the new tokens'
#: cache slots, which the route keeps itself); any other one set is refused
_STEP_KWARGS = frozenset(_GENERATION_KWARGS) | {"input_ids", "cache_position"}
#: forward flags whose default is True (every other flag's is False, as `output_router_logits`)
_DEFAULT_TRUE = frozenset({"is_causal"})

#: generate()'s own keyword arguments (transformers' ``GenerationMixin.generate`` parameters and the
#: options it takes from its ``**kwargs`` for itself, beyond generation config fields and forward
#: arguments) and how a compiled generate() treats each: served (used by generate() outside the
#: forward: on the logits, the tokens or the loop, as the model's own generate() uses it), or
#: refused by name with the reason (`GenerationRoute.check_generate`, before anything runs).
#: transformers passes some on to every forward call in its model kwargs (``tokenizer``,
#: ``assistant_tokenizer``), where the model's forward ignores them: a generation step drops
#: every one of these names that the model's forward does not name itself (`_GENERATE_ONLY`).
GENERATE_OPTIONS: dict[str, str] = {
    "inputs": "served: the prompt (input_ids)",
    "generation_config": "served: read by generate(), and by check_generate for the KV cache limits",
    "logits_processor": "served: runs on each step's logits",
    "stopping_criteria": "served: runs on the tokens after each step",
    "prefix_allowed_tokens_fn": "served: a logits processor",
    "synced_gpus": "served: generate()'s loop keeps stepping until every rank finished, up to max_model_len",
    "assistant_model": "refused: assisted decoding verifies candidate tokens and rolls the KV cache back, which "
                       "piecewise's generation KV cache does not",
    "streamer": "served: receives the tokens",
    "negative_prompt_ids": "served: read by guidance_scale's logits processor (guidance with the cache on is refused)",
    "negative_prompt_attention_mask": "served: as negative_prompt_ids",
    "custom_generate": "served: its decoding loop calls the forward, each call a generation step checked as any",
    "tokenizer": "served: stop_strings and token healing read it; passed on to the forward, which ignores it",
    "assistant_tokenizer": "refused with assistant_model (as assistant_model); alone it is ignored, as eager ignores it",
    "trust_remote_code": "served: lets custom_generate load its code",
}
#: names a generation step leaves out of a forward call (see `GENERATE_OPTIONS`)
_GENERATE_ONLY = frozenset(GENERATE_OPTIONS) | {"inputs_tensor"}
#: forward flags that only add outputs generate() never reads (the router logits of mixture-of-experts
#: models, and their auxiliary loss): a compiled generate() leaves them out of its forward calls
_UNREAD_BY_GENERATE = ("output_router_logits",)


class _CacheReset:
    """A served cache object's ``reset``: its class's reset, after telling the route the object
    starts a new sequence (a cache reused across generate() calls with ``reset()`` between them, as
    transformers documents for a StaticCache; its next call is not the last generation's next
    step). Holds weak references only, so the cache and the route do not keep each other alive;
    a deep copy of the cache gets a reset of its own that tells no route.

    Raises:
        TypeError: from `weakref.ref` for an object that cannot be weakly referenced (not installed).
    """

    __slots__ = ("route", "cache")

    def __init__(self, route: "GenerationRoute | None", cache: Any) -> None:
        self.route = weakref.ref(route) if route is not None else None
        self.cache = weakref.ref(cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache()
        route = self.route() if self.route is not None else None
        if route is not None and cache is not None:
            if route._is_current(cache):
                route._cache_ref, route._past = None, 0
            route._served.discard(cache)
        return type(cache).reset(cache, *args, **kwargs) if cache is not None else None

    def __deepcopy__(self, memo: dict) -> "_CacheReset":
        copy = memo.get(id(self.cache()))
        return _CacheReset(None, copy) if copy is not None else self


class _CacheLength:
    """A served cache object's ``get_seq_length``: while the object is the route's current
    generation, the positions piecewise's KV cache holds for it (piecewise never fills
    transformers' own layers, whose length stays 0), else its class's answer. transformers reads
    it where a generate() starts, to skip the tokens a cache already holds, as it does for eager
    caches: a cache reused without ``reset()`` is then the continuation eager sees (a new prompt
    of one token is no longer taken for the next decode step of the last generation). Weak
    references only, as `_CacheReset`."""

    __slots__ = ("route", "cache")

    def __init__(self, route: "GenerationRoute | None", cache: Any) -> None:
        self.route = weakref.ref(route) if route is not None else None
        self.cache = weakref.ref(cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache()
        route = self.route() if self.route is not None else None
        if cache is None:
            return 0
        if route is not None and route._is_current(cache):
            return route._past
        return type(cache).get_seq_length(cache, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "_CacheLength":
        copy = memo.get(id(self.cache()))
        return _CacheLength(None, copy) if copy is not None else self


def _positions_held(cache: Any) -> int:
    """Positions a transformers cache object holds (its ``get_seq_length()``; 0 for an object
    without one). Piecewise's attention never writes transformers' cache objects, so a cache that
    holds positions was filled by something else."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return 0
    held = length()
    return int(held) if isinstance(held, (int, torch.Tensor)) else 0


def _named_parameters(fn: Any) -> frozenset[str]:
    """The parameter names of `fn` (a decorated forward's, through ``__wrapped__``), not ``*args`` or ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def cache_kind_problem(cache: Any) -> str | None:
    """What makes a transformers cache object's attention differ from plain full-precision
    attention over its keys, or None. Piecewise attends over its own full-precision KV cache, so a
    cache whose layers quantize keys and values (`QuantizedCache`: eager attends fp8 or int-rounded
    ones), keep extra indexer keys (sparse-attention models) or hold linear-attention state
    would be served with other values. Plain dynamic, static and sliding-window layers (offloaded
    or not) are served: their kind changes where keys are stored, not what is attended."""
    from transformers import cache_utils as cu

    kinds = [type(layer) for layer in getattr(cache, "layers", None) or ()]
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if isinstance(replicate, type):
        kinds.append(replicate)
    odd = tuple(c for c in (getattr(cu, n, None) for n in ("BaseQuantizedLayer", "DynamicIndexedLayer", "StaticIndexedLayer",
                                                           "LinearAttentionCacheLayerMixin")) if isinstance(c, type))
    plain = tuple(c for c in (getattr(cu, n, None) for n in ("DynamicLayer", "StaticLayer")) if isinstance(c, type))
    quantized = getattr(cu, "QuantizedCache", None)
    bad = sorted({k.__name__ for k in kinds if issubclass(k, odd) or not issubclass(k, plain)})
    if isinstance(quantized, type) and isinstance(cache, quantized) and not bad:
        bad = [type(cache).__name__]
    return f"{type(cache).__name__} with layers {', '.join(bad)}" if bad else None


class GenerationRoute:
    """Serves a compiled transformers causal LM's calls in the generation convention (see module
    doc). Built by `generation_route`; called by `piecewise.CompiledModel` for every call, it
    returns ``NotImplemented`` for a call that is not one (the model's own compiled forward runs).

    Limits, from the `CompilationConfig`: `max_num_seqs` rows a call (batch size) and
    `max_model_len` cache positions (prompt plus generated tokens but the last, which is returned,
    never fed back); a call above either raises `InputError` naming the field, before anything runs.
    """

    def __init__(self, model: torch.nn.Module, config: Any, tag: str) -> None:
        self.model = model
        self.config = config
        self.tag = tag
        self.max_num_seqs = config.max_num_seqs
        #: position ids a call leaves out are numbered over real tokens only (`_default_positions`)
        self._numbers_real_tokens = getattr(model.config, "model_type", None) in MASK_NUMBERED_POSITIONS
        #: the embeddings module that numbers positions from the token ids itself (RoBERTa's
        #: family: fairseq's numbering from ``padding_idx + 1``, pads kept at ``padding_idx``), if any
        self._ids_numbering = next((m for m in model.modules() if callable(getattr(m, "create_position_ids_from_input_ids", None))
                                    and isinstance(getattr(m, "padding_idx", None), int)), None)
        #: cache positions: the config's, capped by the model's own position limit
        self.max_model_len = min(config.max_model_len, getattr(model.config, "max_position_embeddings", None) or config.max_model_len)
        #: the limit named by refusals above `max_model_len`, and what raises it
        if self.max_model_len < config.max_model_len:
            self._length_limit = (f"the model's max_position_embeddings={self.max_model_len} (it caps "
                                  f"CompilationConfig.max_model_len={config.max_model_len}); shorten")
        else:
            self._length_limit = f"max_model_len={self.max_model_len}; raise CompilationConfig(max_model_len=...) or shorten"
        #: the step generate() uses (last position's logits); its caches are every step's caches
        self.step: GenerationStep | None = None
        #: compiled steps by (whether they return only the last position's logits, whether they are the
        #: decode step with graphs), each traced on first use
        self.compiled: dict[tuple, Any] = {}
        self._graphs: bool | None = None
        #: the decode step with graphs failed to capture: decode steps run on a general step
        self._decode_graphs_off = False
        self._decode_mode: str | None = None  # the decode step's cudagraph_mode, once decided
        self.kv_valid: torch.Tensor | None = None
        self._cache_ref: Any = None
        self._past = 0
        #: the batch of the call that started the cache object now continued (rows are slots)
        self._past_batch = 0
        #: per compiled step (by id), the trace whose layers were checked to reach the cache: a step
        #: that traced again after a state change is checked again
        self._verified: dict[int, Any] = {}
        #: the model config's plain public values when it was checked at compile (`config_values`,
        #: set by `generation_route`); compared at every sequence's first step, a change is followed
        #: (`_follow_config`)
        self._config_values: dict[str, Any] | None = None
        #: path of the decoder's layer list (the ModuleList of `num_hidden_layers` modules), if found
        self._layers_path = _layer_list_path(model)
        #: cache objects of generations this route served (a served one coming back after another
        #: generation started is an interleaved or nested generate(): its rows were overwritten)
        self._served: weakref.WeakSet[Any] = weakref.WeakSet()
        #: one step at a time, one compiled generate() at a time: the KV cache holds one generation
        self._step_lock = threading.Lock()
        self._generate_lock = threading.Lock()
        from ..api import CompiledModel

        #: the module's generation lock, shared with every compiled model of it (`CompiledModel.generation_lock`)
        self._module_lock = CompiledModel.generation_lock(model)
        #: the names the model's forward takes itself (a generate() option of the same name is then its argument)
        self._forward_names = _named_parameters(type(model).forward)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if not any(k in kwargs for k in _GENERATION_KWARGS):
            return NotImplemented
        # The module's generation lock (`CompiledModel.generation_lock`): a compiled generate() on
        # the module holds it while its forward is assigned, and the step takes that assignment off
        # the module while it runs (`_step`); re-entrant, so a step inside generate() just takes it.
        with self._module_lock:
            return self._serve(args, kwargs)

    def _serve(self, args: tuple, kwargs: dict) -> Any:
        if any(k in _GENERATE_ONLY and k not in self._forward_names for k in kwargs):
            # generate()'s own options that transformers passes on to the forward with its model
            # kwargs (tokenizer, with stop_strings), where the model's forward ignores them
            kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATE_ONLY or k in self._forward_names}
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        bad = [k for k in _UNSUPPORTED if kwargs.get(k) is not None and kwargs.get(k) is not False]
        # any other option transformers' forward takes (is_causal=False: bidirectional attention;
        # output_router_logits) changes what eager computes and the step never sees it
        bad += [k for k, v in kwargs.items() if k not in _STEP_KWARGS and k not in _UNSUPPORTED and v is not None
                and v is not (k in _DEFAULT_TRUE)]  # a flag at transformers' default changes nothing
        if bad or input_ids is None or len(args) > 1:
            unread = [k for k in bad if k in _UNREAD_BY_GENERATE]
            why = (f"; the step returns logits only, so it cannot return what {unread[0]} asks for (generate() never reads "
                   f"it: piecewise's compiled generate() leaves it out, or leave it out of model.generate())") if unread else ""
            raise InputError(f"[{self.tag}] the compiled generation step takes input_ids (and attention_mask, position_ids, "
                             f"cache, use_cache, logits_to_keep); got {bad or 'positional arguments'}{why}")
        if input_ids.dim() != 2:
            raise InputError(f"[{self.tag}] input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        input_ids = self._token_ids(input_ids)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        use_cache = kwargs.get("use_cache")
        if cache is None and (use_cache if use_cache is not None else getattr(self.model.config, "use_cache", False)):
            # As transformers' forward does: a call that caches without a cache object starts one and
            # returns it, so a loop that passes it back continues this sequence (without it, the
            # next call started over and attended its token alone)
            from transformers import DynamicCache

            cache = DynamicCache()
        positions = kwargs.get("position_ids")
        if (cache is None and kwargs.get("attention_mask") is None and isinstance(positions, torch.Tensor)
                and positions.shape[-1] > 1 and bool((positions.diff(dim=-1) != 1).any())):
            # transformers' mask code reads such positions as packed sequences (a block-diagonal mask,
            # masking_utils' find_packed_sequence_indices); the step attends the whole row causally
            raise InputError(f"[{self.tag}] position_ids restart or skip within a row, without attention_mask or a cache: "
                             "transformers attends each packed sequence alone there, piecewise's generation step attends "
                             "the whole row. Pass each sequence as its own row (left-padded, with attention_mask), or "
                             "call with consecutive positions")
        continuing = cache is not None and self._is_current(cache)
        odd = cache_kind_problem(cache) if cache is not None and not continuing else None
        if odd is not None:
            raise InputError(f"[{self.tag}] the cache passed in is a {odd}: eager attends what that cache keeps "
                             "(quantized keys and values, indexer keys or linear-attention state), piecewise's generation "
                             "step attends its own full-precision KV cache, so tokens would differ. Generate with the "
                             "default cache (or cache_implementation='static'), or with the model itself, uncompiled")
        if cache is not None and not continuing and self._was_served(cache):
            raise InputError(f"[{self.tag}] a generation resumed after another generation on this compiled model started "
                             "(generate() nested in a streamer or stopping criterion, interleaved from two threads, or "
                             "past_key_values of an earlier generate() passed back): piecewise's KV cache holds one generation "
                             "at a time and its rows were overwritten. Finish one generate() before the next, compile a "
                             "second model (another tag) for concurrent generations, or pass the whole sequence without "
                             "past_key_values")
        held = _positions_held(cache) if cache is not None and not continuing else 0
        if held:
            # A cache transformers or another model filled (a prefix cache, the past_key_values of an
            # eager call or of the model's own forward): generate() feeds only the tokens past it,
            # which would be attended against piecewise's own cache, holding none of the prefix.
            raise InputError(f"[{self.tag}] the cache passed in (cache= / past_key_values=) already holds {held} positions "
                             "that piecewise's generation KV cache does not (filled by an eager call, another model, or a "
                             "call of this compiled model without generation arguments); piecewise's cache starts empty "
                             "with each new cache object and cannot take them over. Pass the whole sequence without a "
                             "cache, start the sequence with use_cache=True so the cache this model returns continues "
                             "it, or generate with the model itself, uncompiled (attn_implementation='sdpa')")
        if not self._step_lock.acquire(blocking=False):
            # (steps from other threads wait for the module's generation lock: this is a step started
            # inside another on the same thread, from code the model runs)
            raise InputError(f"[{self.tag}] a generation step started inside another on this compiled model: piecewise's "
                             "KV cache holds one generation at a time; compile a second model (another tag) for the inner one")
        try:
            return self._step(kwargs, input_ids, cache, continuing)
        finally:
            self._step_lock.release()

    def _token_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` as the steps are traced for: int64 (eager's embedding takes any integer
        dtype, and generate() appends int64 tokens to an int32 prompt, so a step traced for the
        prompt's dtype would refuse its own decode steps) and contiguous. InputError for empty or
        non-integer ids."""
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise InputError(f"[{self.tag}] input_ids have dtype {input_ids.dtype}; token ids are integers (torch.int64, "
                             "as the model's tokenizer returns them)")
        if input_ids.numel() == 0:
            raise InputError(f"[{self.tag}] input_ids of shape {tuple(input_ids.shape)} hold no tokens; every sequence "
                             "needs at least one (a BOS token for an empty prompt)")
        # contiguous: a step's first call fixes its inputs' layout, and a prompt sliced from a buffer
        # (strides (12, 1)) followed by generated tokens (strides (1, 1)) was refused
        return input_ids.to(torch.int64).contiguous()

    def _check_vocabulary(self, ids: torch.Tensor) -> None:
        """InputError for a token id outside the input embedding's rows: eager raises IndexError in
        the embedding, a compiled kernel's bounds check is an untyped error (or none)."""
        try:  # transformers raises NotImplementedError where it cannot find a model's embedding
            embed = getattr(self.model, "get_input_embeddings", lambda: None)()
        except NotImplementedError:
            embed = None
        vocab = getattr(embed, "num_embeddings", None)
        if isinstance(vocab, int) and ids.numel() and not ids.is_floating_point():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab:
                raise InputError(f"[{self.tag}] input_ids hold token id {low if low < 0 else high}, outside the vocabulary "
                                 f"0..{vocab - 1} (the input embedding's rows); tokenize with the model's own tokenizer")

    def _step(self, kwargs: dict, input_ids: torch.Tensor, cache: Any, continuing: bool) -> Any:
        """One forward of the model through the route's compiled steps (what ``model.forward`` is
        while compiled generate() runs): checks, the KV-valid mask and positions, the step run, the
        output as transformers reads it.

        Raises:
            InputError: a call the route cannot serve (see `_check_call`, `_fill_valid`).
            ConfigError: the model changed since the first call (`_check_model_unchanged`).
        """
        batch, new = input_ids.shape
        past = self._past_for(cache)
        if past == 0:  # a sequence's first step (its prompt): what `check_generate` checks for generate(), for
            self._check_vocabulary(input_ids)  # model.forward = compiled and hand-written loops (one read a sequence)
            if self._config_values is not None:
                self._follow_config()
        self._check_call(batch, new, past, continuing)
        self._check_model_unchanged()
        keep = kwargs.get("logits_to_keep", 0)
        last_only = isinstance(keep, int) and not isinstance(keep, bool) and keep == 1
        compiled = self._ensure_compiled(input_ids.device, last_only, decode=new == 1 and last_only)
        decode_step = compiled is self.compiled.get((True, True))  # the decode step with graphs
        total = past + new
        valid = self._fill_valid(kwargs.get("attention_mask"), input_ids, past, total)
        if past == 0 and self._graphs_apply(input_ids.device) and self._decode_graph_mode() != "piecewise":
            self._clear_past_prompt(batch, total)
        write_pos = self._write_positions(decode_step, past, total, input_ids.device)
        position_ids = self._position_ids(kwargs.get("position_ids"), valid[:batch, :total], past, input_ids)
        compiled, logits = self._run_step(compiled, decode_step, input_ids, position_ids, write_pos, past, last_only)
        result = getattr(getattr(compiled, "backend", None), "result", None)
        if self._verified.get(id(compiled)) is not result:
            self._check_layers_reach_cache(compiled)
            self._verified[id(compiled)] = result
        self._past = total if cache is not None else 0
        if past == 0:
            self._past_batch = batch
        return self._step_output(logits, keep, last_only, cache, kwargs)

    def _check_call(self, batch: int, new: int, past: int, continuing: bool) -> None:
        """Refuse a call the route's cache cannot serve: new tokens on a filled cache, another batch
        on a continued cache, more sequences than slots, more positions than the cache holds.

        Raises:
            InputError: naming the case and the remedy.
        """
        if continuing and past > 0 and new > 1:
            # generate() feeds one token a row after the prompt; more tokens on a cache object this
            # route already filled means transformers re-feeds or verifies tokens (past_key_values
            # reused from an earlier generate(), assisted or prompt-lookup decoding, chunked
            # prefill), which needs a cache that rolls back: piecewise's would write them twice
            raise InputError(f"[{self.tag}] {new} new tokens on a generation cache that already holds {past} positions: "
                             "continuing from an earlier generate()'s past_key_values, assisted / prompt-lookup "
                             "decoding and chunked prefill are not supported by piecewise's generation KV cache; pass "
                             "the whole sequence to generate() without past_key_values, or generate with the model "
                             "itself, uncompiled (attn_implementation='sdpa')")
        if past > 0 and batch != self._past_batch:
            # rows are cache slots: another batch on the same cache would read other sequences'
            # keys (a loop that drops a finished row); eager fails on the size mismatch too
            raise InputError(f"[{self.tag}] {batch} sequences on a generation cache started with {self._past_batch}: "
                             "each row of a continued cache is one sequence's slot, so the batch cannot change "
                             "mid-generation; keep finished rows in the batch (as generate() does), or start a new "
                             "cache (call without past_key_values) for the new batch")
        if batch > self.max_num_seqs:
            raise InputError(f"[{self.tag}] {batch} sequences in one call, above max_num_seqs={self.max_num_seqs}; raise "
                             "CompilationConfig(max_num_seqs=...) or generate in smaller batches")
        if past + new > self.max_model_len:
            raise InputError(f"[{self.tag}] {past + new} positions (prompt plus generated tokens) do not fit the KV cache of "
                             f"{self._length_limit} the prompt / max_new_tokens")

    def _check_model_unchanged(self) -> None:
        """Refuse a model whose layers, dtype or device changed since the step's KV cache was made.

        Raises:
            ConfigError: naming the change and the remedy (compile again).
        """
        if self.step is not None and getattr(self.model.config, "num_hidden_layers", 0) > self.step.num_layers:
            # layers added after the first call (fewer layers use fewer of the caches, and are served)
            raise ConfigError(f"[{self.tag}] the model's config now has num_hidden_layers="
                              f"{self.model.config.num_hidden_layers}, but piecewise's generation KV cache was made for "
                              f"{self.step.num_layers} layers at the first call; compile the model again after adding "
                              "layers (pw.compile(model, ...))")
        if self.step is not None:
            param, cache_0 = next(self.model.parameters()), self.step.k_cache_0
            if (param.dtype, param.device) != (cache_0.dtype, cache_0.device):
                # the cache's keys would be rounded to the old dtype (bfloat16 keys of a float32 model:
                # other tokens, silently); a generation already under way would lose what it holds
                raise ConfigError(f"[{self.tag}] the model's parameters are now {param.dtype} on {param.device}, but "
                                  f"piecewise's generation KV cache was made {cache_0.dtype} on {cache_0.device} at the "
                                  "first call; compile the model again after casting or moving it (pw.compile(model, ...))")

    def _fill_valid(self, mask: Any, input_ids: torch.Tensor, past: int, total: int) -> torch.Tensor:
        """`kv_valid` filled for this call from transformers' `attention_mask` (2-D, 4-D, per layer
        type, or None): which of the first `total` positions of each row are real tokens.

        Raises:
            InputError: a mask that does not cover the positions, a 4-D mask the step does not
                attend (`_check_4d_mask`), or a row with no real token.
        """
        batch = input_ids.shape[0]
        valid = self.kv_valid
        if isinstance(mask, dict):  # one mask per layer type; full attention only (the route refuses others)
            mask = mask.get("full_attention", next(iter(mask.values()), None))
        if mask is not None and mask.dim() == 2 and mask.shape[1] == total:
            valid[:batch, :total].copy_(mask.bool())
        elif mask is not None and mask.dim() == 4:
            # A compilable cache's 4-D mask, built by transformers from its own (never filled) cache:
            # right for the prompt (its last query row holds every key that prompt may see), so read
            # the padding there; a later step only appends real tokens. The step attends causally
            # over that padding: any other 4-D mask (packed sequences, a prefix attended both ways)
            # is refused (`_check_4d_mask`).
            if past == 0:
                row = mask[:, 0, -1, :total]
                valid[:batch, :total].copy_(row if row.dtype == torch.bool else row == 0)
            else:
                valid[:batch, past:total].fill_(True)
            if past == 0 or input_ids.device.type == "cpu":  # elsewhere a device read a step: at the prompt only
                self._check_4d_mask(mask, valid[:batch, :total], past)
        elif mask is None:
            valid[:batch, :total].fill_(True)
        else:
            raise InputError(f"[{self.tag}] attention_mask of shape {tuple(mask.shape)} does not cover the {total} positions "
                             "of this sequence")
        if past == 0 and mask is not None and not bool(valid[:batch, :total].any(-1).all()):
            # (one read a sequence, at its prompt.) Eager attends such a row's queries uniformly over
            # every key, fully masked; the cache op lets a pad that sees nothing see itself.
            empty = [i for i in range(batch) if not bool(valid[i, :total].any())]
            raise InputError(f"[{self.tag}] attention_mask row {empty[0]} has no real token (all {total} positions are "
                             "padding): no output of that row means anything; drop the row, or give it a token (a BOS). "
                             "(generate(prefill_chunk_size=...) gives a left-padded row such a first chunk: generate "
                             "without it)")
        return valid

    def _clear_past_prompt(self, batch: int, total: int) -> None:
        """A full-graph decode step attends every cache position, the ones past a row's length
        under a -inf mask: a stale non-finite key or value there (an earlier generation's overflow)
        would make the row NaN (0 * inf), where pieces cut the cache at the length. So a generation
        clears the rows it uses past its prompt, once, at its prompt."""
        for c in (*self.step.caches()[0], *self.step.caches()[1]):
            c[:batch, :, total:].zero_()

    def _write_positions(self, decode_step: bool, past: int, total: int, device: torch.device) -> torch.Tensor:
        """The cache positions this call writes: the decode step with graphs reads one tensor in place."""
        if decode_step:  # graphs read it in place: one tensor, filled
            write_pos = self.decode_write_pos
            write_pos.fill_(past)
        else:
            write_pos = torch.arange(past, total, device=device)
        return write_pos

    def _position_ids(self, position_ids: Any, valid: torch.Tensor, past: int, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' `position_ids` as int64, or the route's own from `valid` when none are passed."""
        if isinstance(position_ids, torch.Tensor) and position_ids.dtype != torch.int64 and not (
                position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool):
            # int64, as input_ids: eager takes any integer dtype, and a step traced for one refused the other
            position_ids = position_ids.to(torch.int64)
        if position_ids is None:  # generate() passes them; a plain forward may not
            position_ids = self._default_positions(valid, past, input_ids)
        return position_ids

    def _run_step(self, compiled: Any, decode_step: bool, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  write_pos: torch.Tensor, past: int, last_only: bool) -> tuple[Any, torch.Tensor]:
        """Run the step: the decode step with graphs when it serves this batch, else a general step.
        Returns the step that ran and its logits."""
        batch, new = input_ids.shape
        total = past + new
        valid = self.kv_valid
        # ``model.forward`` is the compiled model while generate() runs: take it off for the step, so
        # the trace (and its saved guards) see the model as it is outside generate().
        assigned = self.model.__dict__.pop("forward", None)
        # No padding (read on the CPU only: elsewhere it would be a device sync a step) and a decode
        # step or a whole prompt: the mask keeps every position the op attends, so it is dropped.
        unmasked = (not decode_step and input_ids.device.type == "cpu" and (new == 1 or past == 0)
                    and bool(valid[:batch, :total].all()))
        step_token = _step_attention.set(StepAttention(total, unmasked))
        try:
            # the decode step with graphs takes every slot's row of kv_valid (a static shape and
            # address: its batch is then the only dynamic size); the general step the batch's rows.
            # Its batches are uniform decode (one new token a row), so `full_and_piecewise` replays
            # full graphs there.
            def run(step: Any, graphs: bool = False) -> torch.Tensor:
                with batch_hint(uniform_decode=True) if graphs else contextlib.nullcontext():
                    return step(input_ids, position_ids.expand(batch, new).contiguous(), write_pos,
                                valid if graphs else valid[:batch])

            logits = None
            if decode_step:
                try:
                    with size_refusals_handled():
                        logits = run(compiled, graphs=True)
                except (SizeRefusedError, CaptureError) as e:
                    # The decode step's trace took the batch size somewhere (GPT-2's strides at batch
                    # 1, Phi-3's cache write): this call, or every decode step after a failed
                    # capture, runs on a general step instead (no graphs), as eager serves it
                    if isinstance(e, CaptureError):
                        self._decode_graphs_off = True
                    log.log(logging.WARNING if isinstance(e, CaptureError) else logging.INFO,
                            "[%s] the decode step with graphs %s batch %d (%s); %s runs on the general step, without "
                            "graphs", self.tag, "failed to capture at" if isinstance(e, CaptureError) else "refused",
                            batch, e, "every decode step" if isinstance(e, CaptureError) else "this call")
                    compiled = self._ensure_compiled(input_ids.device, last_only, decode=False)
            if logits is None:
                compiled, logits = self._run_general(compiled, run)
        finally:
            _step_attention.reset(step_token)
            if assigned is not None:
                self.model.__dict__["forward"] = assigned
        return compiled, logits

    def _step_output(self, logits: torch.Tensor, keep: Any, last_only: bool, cache: Any, kwargs: dict) -> Any:
        """The step's output as transformers reads it: the logits it keeps (`logits_to_keep`), the cache."""
        if not last_only and isinstance(keep, int) and keep > 0:
            logits = logits[:, -keep:]
        elif isinstance(keep, torch.Tensor):  # positions to keep, as transformers reads a tensor
            logits = logits[:, keep.to(logits.device)]
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = CausalLMOutputWithPast(logits=logits)
        if cache is not None:
            out["cache"] = cache
        return out if kwargs.get("return_dict", True) is not False else out.to_tuple()

    def _check_4d_mask(self, mask: torch.Tensor, valid: torch.Tensor, past: int) -> None:
        """InputError unless the 4-D `mask` (``[batch, 1, new, keys >= total]``, bool or additive)
        is what the step attends: each real query token (not a pad) sees exactly the valid
        positions up to its own (`valid`: ``[batch, total]`` bool) and nothing past the sequence.
        transformers builds such masks for a static cache; a custom one (packed sequences, a
        prefix attended both ways, a bias) is attended by eager and would be replaced here."""
        batch, total = valid.shape
        new = total - past
        what = None
        if mask.shape[0] != batch or mask.shape[1] != 1 or mask.shape[2] != new or mask.shape[3] < total:
            what = f"shape {tuple(mask.shape)}, not [{batch}, 1, {new}, >= {total}]"
        else:
            if mask.dtype == torch.bool:
                sees = mask[:, 0]
            else:
                sees = mask[:, 0] == 0
                floor = torch.finfo(mask.dtype).min / 2 if mask.dtype.is_floating_point else -1
                if bool(((mask != 0) & (mask > floor)).any()):
                    what = "additive values other than 0 and the dtype's minimum (a bias, not a mask)"
            if what is None:
                j = torch.arange(mask.shape[3], device=valid.device)
                causal = j[None, :] <= torch.arange(past, total, device=valid.device)[:, None]  # [new, keys]
                seen = torch.zeros(batch, mask.shape[3], dtype=torch.bool, device=valid.device)
                seen[:, :total] = valid
                want = causal[None] & seen[:, None, :]  # [batch, new, keys]
                sees = sees.to(valid.device)
                differs = (sees != want).any(-1)  # [batch, new]
                # a pad query's row is not read, but it tells a mask from padding: transformers gives
                # it the causal row, or none or every position (a row that would see nothing)
                head = sees[..., :total]
                odd_pad = differs & ~head.all(-1) & head.any(-1)
                real = valid[:, past:]  # [batch, new]
                if bool((differs & real).any() | (odd_pad & ~real).any()):
                    what = "a query sees other positions than the causal ones that are not padding"
        if what is not None:
            raise InputError(f"[{self.tag}] a 4-D attention_mask ({what}): piecewise's generation step attends each "
                             "token causally over the non-padding positions, so a custom mask (packed sequences, a "
                             "prefix attended both ways) would be replaced. Pass a 2-D padding mask [batch, length], or "
                             "run the model itself, uncompiled (attn_implementation='sdpa')")

    def _default_positions(self, valid: torch.Tensor, past: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Position ids ``[1 or batch, new]`` (int64) for a call that passes none, as the model's own
        forward would make them: transformers' decoders number positions from the cache length,
        pads included (``arange(past, total)``: Llama, GPT-2, BioGPT and the rest); OPT numbers the
        real tokens of the attention mask, pads -1 (`MASK_NUMBERED_POSITIONS`); RoBERTa's family
        numbers the tokens that are not its padding id, with its own embeddings' function
        (``create_position_ids_from_input_ids``). `valid`: ``[batch, total]`` bool, False at pads;
        `input_ids`: this call's ``[batch, new]``. Rotary models give the same logits at real
        tokens either way (a row's offset cancels in q.k); learned absolute embeddings do not:
        numbering GPT-2's left-padded rows from the mask put its logits off by up to 30."""
        if self._ids_numbering is not None:
            emb = self._ids_numbering
            return emb.create_position_ids_from_input_ids(input_ids, emb.padding_idx, past)
        if self._numbers_real_tokens:
            return (valid.long().cumsum(-1) * valid - 1)[:, past:]
        return torch.arange(past, valid.shape[1], device=valid.device)[None]

    def _run_general(self, step: Any, run: Any) -> tuple[Any, torch.Tensor]:
        """Run the general step on this call, returning it and its logits. A step's trace can
        depend on the sizes (a model's mask code branching on ``q_length == 1``, as OPT's does):
        the sizes it does not hold for get a trace of their own on their first call, a size class
        of the step (`piecewise.CompiledModel`, up to ``CompilationConfig.max_size_classes``), the
        mechanism every entry point shares."""
        return step, run(step)

    @contextlib.contextmanager
    def generating(self) -> Any:
        """Hold the route for one compiled ``generate()`` call (`piecewise.CompiledModel.generate`,
        which holds the module's generation lock around it: a generate() from another thread waits
        for this one to end).

        Raises:
            InputError: another ``generate()`` on this compiled model is running on this thread
                (nested in a streamer or stopping criterion): the KV cache holds one generation at a time.
        """
        if not self._generate_lock.acquire(blocking=False):
            raise InputError(f"[{self.tag}] generate() on this compiled model while another generate() on it runs (nested in a "
                             "streamer or stopping criterion): piecewise's KV cache holds one generation at a time; compile "
                             "a second model (another tag) for the nested generation")
        try:
            yield
        finally:
            self._generate_lock.release()

    def check_generate(self, args: tuple, kwargs: dict) -> dict:
        """Before ``generate()`` runs: the options it can serve (`GENERATE_OPTIONS`), and the batch
        and prompt plus new tokens fit the KV cache. Returns the keyword arguments to call
        ``generate()`` with: `kwargs` without the forward flags whose outputs generate() never reads
        (``output_router_logits``: eager computes the router logits and drops them).

        Raises:
            InputError: naming `max_num_seqs` or `max_model_len` (the same limits a step checks, with
                the generated length transformers decides: `_generated_length`), or a token id
                outside the model's vocabulary, or input_ids that are empty or not integers (int32
                and other integer dtypes are served: the steps take int64); a cache object that
                still holds an earlier generate()'s positions (no ``reset()`` between), a cache
                that quantizes (`cache_kind_problem`, ``cache_implementation='quantized'``);
                speculative decoding, guidance with the cache on, chunked prefill.
            ConfigError: a `CompilationConfig.dynamic_shapes` the steps cannot be traced under.
        """
        self._check_generate(args, kwargs)
        return {k: v for k, v in kwargs.items() if k not in _UNREAD_BY_GENERATE}

    def _check_generate(self, args: tuple, kwargs: dict) -> None:
        self._check_dynamic_shapes()
        gen_cfg = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        speculative = [k for k in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
                       if kwargs.get(k, getattr(gen_cfg, k, None)) is not None]
        if speculative:
            raise InputError(f"[{self.tag}] generate({speculative[0]}=...) verifies candidate tokens and rolls the KV cache "
                             "back; piecewise's generation KV cache does not roll back. Generate without it, or generate with the "
                             "model itself, uncompiled (attn_implementation='sdpa')")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and self._is_current(cache) and self._past > 0:
            # transformers skips the tokens a cache holds, which it reads from the cache's own layers:
            # a DynamicCache piecewise served has none filled, so a new prompt would be taken for the
            # next step of the last generation (eager's generate() fails on such a reused cache)
            raise InputError(f"[{self.tag}] the cache passed to generate() already holds {self._past} positions of an "
                             "earlier generate() on this model: call cache.reset() between generations (or pass a new "
                             "cache); continuing a generation from its cache is not supported by piecewise's generation "
                             "KV cache")
        if cache is not None:
            odd = cache_kind_problem(cache)
            if odd is not None:
                raise InputError(f"[{self.tag}] generate() was given a {odd}: eager attends what that cache keeps "
                                 "(quantized keys and values, indexer keys or linear-attention state), piecewise's "
                                 "generation step its own full-precision KV cache. Generate with the default cache (or "
                                 "cache_implementation='static'), or with the model itself, uncompiled")
        implementation = kwargs.get("cache_implementation", getattr(gen_cfg, "cache_implementation", None))
        if implementation == "quantized":
            raise InputError(f"[{self.tag}] generate(cache_implementation='quantized') attends quantized keys and values "
                             "in eager; piecewise's generation step attends its own full-precision KV cache, so tokens "
                             "would differ. Generate with the default cache (or cache_implementation='static'), or with "
                             "the model itself, uncompiled")
        guidance = kwargs.get("guidance_scale", getattr(gen_cfg, "guidance_scale", None))
        cached = kwargs.get("use_cache", getattr(gen_cfg, "use_cache", True)) is not False
        if guidance is not None and guidance != 1 and cached:
            # its logits processor runs the model on the unconditional prompt with a cache object of
            # its own inside every step: a second sequence on the one generation cache
            raise InputError(f"[{self.tag}] generate(guidance_scale={guidance}) runs a second, unconditional generation "
                             "with a cache of its own inside each step; piecewise's generation KV cache holds one "
                             "generation at a time. Pass use_cache=False with it, or generate with the model itself, "
                             "uncompiled (attn_implementation='sdpa')")
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        self._check_vocabulary(self._token_ids(ids))
        chunk = kwargs.get("prefill_chunk_size", getattr(gen_cfg, "prefill_chunk_size", None))
        if isinstance(chunk, int) and 1 < chunk < ids.shape[1]:
            # the second chunk is several new tokens on a cache the route already filled, which it
            # refuses (it cannot tell them from tokens fed again); the first, all left padding, has no real token
            raise InputError(f"[{self.tag}] generate(prefill_chunk_size={chunk}) feeds the {ids.shape[1]}-token prompt in "
                             "chunks; piecewise's generation step takes a whole prompt at once (up to max_model_len) and "
                             "refuses several new tokens on a cache it already filled. Generate without prefill_chunk_size")
        total = self._generated_length(kwargs, ids.shape[1])
        def setting(name: str) -> int:
            value = kwargs.get(name, getattr(gen_cfg, name, None))
            return value if isinstance(value, int) and value > 1 else 1

        # generate() runs a row per beam, or per returned sequence when sampling: the cache holds rows
        widen = max(setting("num_beams"), setting("num_return_sequences"))
        rows = ids.shape[0] * widen
        if rows > self.max_num_seqs:
            how = f" ({ids.shape[0]} prompts x {widen} beams or returned sequences)" if widen > 1 else ""
            raise InputError(f"[{self.tag}] {rows} sequences in one generate() call{how}, above max_num_seqs="
                             f"{self.max_num_seqs}; raise CompilationConfig(max_num_seqs=...) or generate in smaller batches")
        # the last new token is returned, never fed back: the cache holds total - 1 positions
        if total is not None and total - 1 > self.max_model_len:
            raise InputError(f"[{self.tag}] prompt of {ids.shape[1]} tokens plus {total - ids.shape[1]} new ones needs "
                             f"{total - 1} positions (the last new token is not fed back), above {self._length_limit} "
                             "the prompt / max_new_tokens")

    def _check_dynamic_shapes(self) -> None:
        """ConfigError, before any trace, for a `CompilationConfig.dynamic_shapes` the generation
        steps cannot be traced under: ``"backed"`` specialises sizes 1, and every decode step feeds
        one token a sequence (each would be refused); ``"unbacked"`` cannot decide transformers'
        mask code's branches on the batch size (the trace fails)."""
        shapes = getattr(self.config, "dynamic_shapes", "backed_size_oblivious")
        if shapes in ("backed", "unbacked"):
            raise ConfigError(f"[{self.tag}] CompilationConfig(dynamic_shapes={shapes!r}) cannot serve generation steps: "
                              + ("it specialises size 1, and every decode step feeds one token a sequence"
                                 if shapes == "backed" else "transformers' mask code branches on the batch size, which "
                                 "unbacked sizes cannot decide") + "; compile the model with "
                              "dynamic_shapes='backed_size_oblivious' (the default) to generate")

    def _generated_length(self, kwargs: dict, prompt_len: int) -> int | None:
        """The length generate() will stop at (prompt plus new tokens), as transformers decides it:
        a setting comes from generate()'s keyword arguments, else the ``generation_config`` passed,
        else the model's ``generation_config`` (the first that is not None); ``max_new_tokens``
        wins over ``max_length`` wherever each was set; with neither set anywhere, transformers'
        default of 20 new tokens, capped at the model's ``max_position_embeddings``."""
        given, own = kwargs.get("generation_config"), getattr(self.model, "generation_config", None)

        def setting(name: str) -> Any:
            if name in kwargs:
                return kwargs[name]
            return next((getattr(c, name) for c in (given, own) if getattr(c, name, None) is not None), None)

        new = setting("max_new_tokens")
        if isinstance(new, int):
            return prompt_len + new
        length = setting("max_length")
        if length is not None:
            return length if isinstance(length, int) else None
        try:
            from transformers import GenerationConfig

            default = GenerationConfig._get_default_generation_params().get("max_length", 20)
        except AttributeError:  # a transformers without it: its documented default
            default = 20
        limit = getattr(self.model.config, "max_position_embeddings", None)
        total = prompt_len + default
        return min(total, limit) if isinstance(limit, int) else total

    def _check_layers_reach_cache(self, compiled: Any) -> None:
        """After a step's first call (its trace or warm start): every attention layer must have
        reached `hf_cached_attention`. A decoder layer that does not pass its keyword arguments on
        to attention (StableLM, Nemotron) or an attention class that bypasses transformers'
        attention interface (DiffLlama) never sees the step's cache, and would attend only to the
        new tokens.

        Raises:
            ConfigError: naming the model and how many layers reached the cache.
        """
        result = getattr(getattr(compiled, "backend", None), "result", None)
        if result is None:
            return
        op = torch.ops.piecewise_models.hf_cached_attention.default
        reached = sum(1 for item in result.split.items for n in item.graph.graph.nodes
                      if n.op == "call_function" and n.target is op)
        layers = self._layers_run()
        if reached != layers:
            raise ConfigError(f"[{self.tag}] {type(self.model).__name__} has {layers} attention layers, but its step reached "
                              f"piecewise's generation KV cache {reached} times, where it holds one attention call a layer "
                              "(its decoder layers do not pass attention keyword arguments through, its attention does not "
                              "use transformers' attention interface, or it attends twice a layer); generate with the "
                              "model itself, uncompiled (attn_implementation='sdpa')")
        # the cache is indexed by each attention's layer_idx: a layer run several times a step
        # (HRM's cycles) would write one slot for several layers
        indices = {m.layer_idx for m in self.model.modules() if isinstance(getattr(m, "layer_idx", None), int)}
        if indices and len(indices) < reached:
            raise ConfigError(f"[{self.tag}] {type(self.model).__name__}'s step reached piecewise's generation KV cache "
                              f"{reached} times, but its attention layers have only {len(indices)} distinct layer_idx "
                              "values, by which the cache is indexed (a layer run several times a step); generate with "
                              "the model itself, uncompiled (attn_implementation='sdpa')")

    def _layers_run(self) -> int:
        """Decoder layers a step runs now: the cache's layers, fewer when the config's count was
        lowered or layers were deleted from the layer list after the first call (transformers runs
        ``layers[:config.num_hidden_layers]``)."""
        layers = min(self.step.num_layers, getattr(self.model.config, "num_hidden_layers", self.step.num_layers))
        if self._layers_path is not None:
            try:
                layers = min(layers, len(self.model.get_submodule(self._layers_path)))
            except (AttributeError, TypeError):  # the list was removed or replaced by a non-list
                pass
        return layers

    def _follow_config(self) -> None:
        """The model config's plain values changed since compile checked them, or since the last
        change followed (``num_hidden_layers``
        lowered, a sliding window set, any field the trace may have read): what is still supported
        is traced again (every compiled step drops its trace, logged and counted in `recompiles` and
        `state_changes`); what is not is refused as at compile.

        Raises:
            ConfigError: the config now asks for attention the piecewise cache does not implement
                (`check_attention_supported`).
        """
        now = config_values(self.model.config)
        changed = [k for k in sorted(set(now) | set(self._config_values)) if now.get(k, _ABSENT) != self._config_values.get(k, _ABSENT)]
        if not changed:
            return
        what = "; ".join(f"config.{k} {self._config_values.get(k, _ABSENT)!r} -> {now.get(k, _ABSENT)!r}" for k in changed[:4])
        try:
            check_attention_supported(self.model, self.max_model_len)
        except ConfigError as e:
            raise ConfigError(f"[{self.tag}] the model's config changed after the first call ({what}): {e}") from None
        for compiled in self.compiled.values():
            with compiled._lock:
                compiled._follow(what)
        self._verified.clear()
        self._config_values = now

    def _was_served(self, cache: Any) -> bool:
        try:
            return cache in self._served
        except TypeError:  # not weak-referenceable: not tracked
            return False

    def _is_current(self, cache: Any) -> bool:
        """Whether `cache` is the cache object of the generation this route served last."""
        return self._cache_ref is not None and self._cache_ref() is cache

    def _past_for(self, cache: Any) -> int:
        """Positions already in the piecewise cache for this sequence: 0 for a new cache object (a
        new ``generate()``) or without one (``use_cache=False``: every step starts over)."""
        if cache is None:
            self._cache_ref = None
            return 0
        if not self._is_current(cache):
            try:
                ref = weakref.ref(cache)
            except TypeError:  # not weak-referenceable: keep it through a strong reference
                ref = lambda: cache  # noqa: E731
            self._cache_ref, self._past = ref, 0
            self._adopt(cache)
        return self._past

    def _adopt(self, cache: Any) -> None:
        """Take a new generation's cache object: beam search reorders its rows between steps
        (``cache.reorder_cache(beam_idx)``) and the rows that matter are in the piecewise cache, so
        reorder those (every layer's first ``len(beam_idx)`` rows, and their padding mask) in place,
        where the graphs read them; a crop (assisted decoding) is refused; a ``reset()`` makes the
        object's next use a new sequence (it is reused across generate() calls); and the object is
        remembered as served (`_was_served`)."""
        route = self

        def reorder_cache(beam_idx: torch.Tensor) -> None:
            if route.step is None:
                return
            rows = beam_idx.to(route.kv_valid.device)
            n = rows.shape[0]
            with torch.no_grad():
                for caches in route.step.caches():
                    for t in caches:
                        t[:n].copy_(t[:n].index_select(0, rows))
                route.kv_valid[:n].copy_(route.kv_valid[:n].index_select(0, rows))

        def crop(max_length: int) -> None:
            # assisted and prompt-lookup decoding drop rejected candidate tokens from the cache
            raise InputError(f"[{route.tag}] generate() asked to crop the KV cache to {max_length} positions (assisted or "
                             "prompt-lookup decoding): piecewise's generation KV cache does not roll back; generate "
                             "without assistant_model / prompt_lookup_num_tokens, or generate with the model "
                             "itself, uncompiled (attn_implementation='sdpa')")

        try:
            cache.reorder_cache = reorder_cache  # an instance attribute wins over the class's method
            cache.crop = crop
            if callable(getattr(type(cache), "reset", None)):
                cache.reset = _CacheReset(self, cache)
            if callable(getattr(type(cache), "get_seq_length", None)):
                cache.get_seq_length = _CacheLength(self, cache)
        except (AttributeError, TypeError):
            pass
        try:
            self._served.add(cache)
        except TypeError:  # not weak-referenceable
            pass

    def _graphs_apply(self, device: torch.device) -> bool:
        if self._graphs is None:
            from ..graphs.platform import resolve_platform

            self._graphs = self.config.cudagraph_mode != "none" and resolve_platform(device.type) is not None
        return self._graphs

    def _decode_graph_mode(self) -> str:
        """The decode step's `cudagraph_mode`: the configured one, where ``"auto"`` is ``"full"``
        when the generation attention op is the only splitting op the prompt step's graph holds
        (the decode step runs the same layers; every call of it is a uniform decode batch and that
        op is safe inside a full graph: one graph per batch size, no host time between pieces),
        else ``"piecewise"`` (a splitting op of the user's need not be safe inside a graph).
        Decided once, from the first compiled general step (a decode step always follows one)."""
        if self._decode_mode is not None:
            return self._decode_mode
        mode = self.config.cudagraph_mode
        if mode == "auto":
            general = next((c for k, c in self.compiled.items() if not k[1]), None)
            result = getattr(getattr(general, "backend", None), "result", None)
            if result is None:
                return "piecewise"  # nothing to read yet: not memoised
            split_ops = frozenset(resolve_splitting_ops(self.config.splitting_ops))
            ops = {normalize_op_name(n.target) for it in result.split.items if it.is_splitting
                   for n in it.graph.graph.nodes if is_splitting_node(n, split_ops)}
            others = sorted(ops - {CACHED_ATTENTION_OP})
            mode = "piecewise" if others else "full"
            if others:
                log.info("[%s] cudagraph_mode='auto': the decode step is captured piecewise, not as one full graph, since "
                         "the model calls splitting ops of its own (%s), which need not be safe inside a graph",
                         self.tag, ", ".join(others))
        self._decode_mode = mode
        return mode

    def _ensure_compiled(self, device: torch.device, last_only: bool, decode: bool = False) -> Any:
        """The compiled step returning the last position's logits (`last_only`, tag
        ``<tag>_generate``: what ``generate()`` asks for with ``logits_to_keep=1``) or every
        position's (tag ``<tag>_generate_all_logits``: other calls), built on first use over one
        set of cache tensors; for a `decode` call where graphs apply, the decode step with graphs
        (tag ``<tag>_generate_decode``, see the module doc)."""
        decode = decode and last_only and self._graphs_apply(device) and not self._decode_graphs_off
        key = (last_only, decode)
        if key in self.compiled:
            return self.compiled[key]
        import dataclasses

        from ..api import compile as pw_compile
        from ..graphs.capture_sizes import default_capture_sizes

        if self.step is None:
            self.step = GenerationStep(self.model, self.max_num_seqs, self.max_model_len, last_logits_only=True)
            with torch.inference_mode(False):  # written by every later call, in inference mode or not
                self.kv_valid = torch.zeros(self.max_num_seqs, self.max_model_len, dtype=torch.bool, device=device)
        step = self.step if last_only else self.step.sharing(last_logits_only=False)
        if decode:
            step = self.step.sharing(last_logits_only=True)
            step.all_slots_kv_valid = True
            # The batch dim is the token count of the graphs: capture sizes up to max_num_seqs (the
            # op slices the cache by the padded batch, so no pad row may reach past the slots).
            sizes = tuple(s for s in (self.config.cudagraph_capture_sizes or default_capture_sizes(self.max_num_seqs))
                          if s <= self.max_num_seqs) or (self.max_num_seqs,)
            mode = self._decode_graph_mode()
            config = dataclasses.replace(self.config, tag=f"{self.tag}_generate_decode", compile_sizes=(),
                                         compile_ranges=(), max_num_tokens=self.max_num_seqs,
                                         cudagraph_capture_sizes=sizes, cudagraph_mode=mode,
                                         # a batch its trace does not hold for runs on the general step
                                         max_size_classes=1)
            compiled = pw_compile(step, config, dynamic_arg_dims={"input_ids": 0, "position_ids": 0})
            with torch.inference_mode(False):
                self.decode_write_pos = torch.zeros(1, dtype=torch.long, device=device)
            self.compiled[key] = compiled
            return compiled
        # Batch and token dims are both dynamic, so size and range compiles (keyed by one token
        # count) do not apply to the step, nor do graphs: one symbolic compile serves it.
        suffix = "" if last_only else "_all_logits"
        config = dataclasses.replace(self.config, tag=f"{self.tag}_generate{suffix}",
                                     compile_sizes=(), compile_ranges=(), cudagraph_mode="none",
                                     cudagraph_capture_sizes=None,
                                     max_num_tokens=max(self.config.max_num_tokens, self.max_num_seqs, self.max_model_len))
        self.compiled[key] = pw_compile(step, config, dynamic_arg_dims={
            "input_ids": (0, 1), "position_ids": (0, 1), "write_pos": 0, "kv_valid": 0})
        return self.compiled[key]


def generation_route(module: torch.nn.Module, config: Any, tag: str) -> GenerationRoute | None:
    """A `GenerationRoute` for a transformers causal LM built with ``attn_implementation="piecewise"``,
    else None. Raises `ConfigError` for a generation model with another attention (its layers would
    not reach the piecewise cache)."""
    generate = getattr(module, "generate", None)
    cfg = getattr(module, "config", None)
    if generate is None or cfg is None or not hasattr(cfg, "num_hidden_layers") or getattr(cfg, "is_encoder_decoder", False):
        return None
    impl = getattr(cfg, "_attn_implementation", None)
    if impl != "piecewise":
        return None
    from ..api import bypasses_attention_interface

    if bypasses_attention_interface(module):
        raise ConfigError(f"{type(module).__name__} was built with attn_implementation='piecewise', but its attention classes "
                          "do not call transformers' attention interface (transformers' _can_set_attn_implementation() is "
                          "False), so its layers would never reach the KV cache piecewise owns. Generate with the model "
                          "itself, uncompiled, built with attn_implementation='sdpa'")
    route = GenerationRoute(module, config, tag)
    check_attention_supported(module, route.max_model_len)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and getattr(generation_config, "disable_compile", None) is not True:
        # With a static cache on an accelerator transformers' generate() wraps the forward in
        # torch.compile: Dynamo would trace piecewise's route around the compiled steps (graph
        # breaks, a recompile per batch and length, none of it in piecewise's counters)
        generation_config.disable_compile = True
        log.info("[%s] set %s.generation_config.disable_compile = True: generate() runs piecewise's compiled steps, "
                 "not transformers' own torch.compile of the forward", tag, type(module).__name__)
    route._config_values = config_values(cfg)  # what was checked: an edit before the first call is followed too
    _create_longrope_frequencies(module)
    return route


#: a config field absent on one side of a comparison (`GenerationRoute._follow_config`)
_ABSENT = "<absent>"


def config_values(cfg: Any) -> dict[str, Any]:
    """The plain public values of a transformers config (numbers, strings, flags, None, and lists,
    tuples and dicts of them), copied: what a generation step's trace may have read from it."""
    import copy

    def plain(v: Any) -> bool:
        if v is None or isinstance(v, (bool, int, float, str)):
            return True
        if isinstance(v, (list, tuple)):
            return all(map(plain, v))
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        return False

    return {k: copy.deepcopy(v) for k, v in vars(cfg).items() if not k.startswith("_") and plain(v)}


def _layer_list_path(model: torch.nn.Module) -> str | None:
    """The name of the model's decoder layer list: the `torch.nn.ModuleList` holding
    ``config.num_hidden_layers`` modules (``model.layers``, ``transformer.h``), or None."""
    n = getattr(model.config, "num_hidden_layers", None)
    return next((name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)


def check_attention_supported(module: torch.nn.Module, max_len: int) -> None:
    """Refuse attention the piecewise generation KV cache does not implement, from the model's
    config and rotary modules: sliding windows shorter than `max_len` positions, layer types other
    than full and sliding attention, dynamic NTK rotary scaling. Run at compile and again when the
    config changes after it (`GenerationRoute._follow_config`).

    Raises:
        ConfigError: naming what is not supported and the remedy.
    """
    cfg = module.config
    # Sliding windows: per layer in `layer_types` (Gemma2/3, Qwen2 with max_window_layers), or one
    # window for every layer in `sliding_window` without layer types (Mistral, Phi3). A window
    # that covers every position the cache can hold is full attention.
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    window = getattr(cfg, "sliding_window", None)
    if layer_types:
        sliding = "sliding_attention" in layer_types
        other = sorted(layer_types - {"full_attention", "sliding_attention"})
    else:
        sliding = window is not None and getattr(cfg, "use_sliding_window", True)
        other = []
    if other:
        raise ConfigError(f"{type(module).__name__} has attention layers of types {other}; the piecewise generation KV "
                          "cache implements full causal attention only. Compile it with attn_implementation='sdpa' and "
                          "mode='none', or generate without piecewise")
    if sliding and not (isinstance(window, int) and window >= max_len):
        raise ConfigError(f"{type(module).__name__} has a sliding window of {window} positions, below max_model_len="
                          f"{max_len}; the piecewise generation KV cache implements full causal attention only. Compile "
                          "it with attn_implementation='sdpa' and mode='none', lower CompilationConfig(max_model_len=...) "
                          "to the window, or generate without piecewise")
    # Doge keeps the keep_window_size strongest keys a query sees (a mask each layer builds from
    # its dynamic mask), which the step's own causal mask replaces: exact only within that window
    keep = getattr(cfg, "keep_window_size", None)
    if isinstance(keep, int) and max_len > keep:
        raise ConfigError(f"{type(module).__name__} masks all but the keep_window_size={keep} strongest keys per query, "
                          f"below max_model_len={max_len}; the piecewise generation KV cache attends every causal position. "
                          "Lower CompilationConfig(max_model_len=...) to the window, or generate with the model itself, "
                          "uncompiled (attn_implementation='sdpa')")
    # Llama 4's attention temperature on its NoPE layers grows with the position, which it reads
    # from the cache object's length; the steps pass none, so positions past floor_scale would be
    # scaled as position 0 (below it the temperature is exactly 1)
    floor = getattr(cfg, "floor_scale", None)
    if getattr(cfg, "attn_temperature_tuning", False) and isinstance(floor, (int, float)) and max_len > floor:
        raise ConfigError(f"{type(module).__name__} tunes its attention temperature from position {floor} "
                          f"(attn_temperature_tuning, floor_scale={floor}) on positions it reads from transformers' cache "
                          f"object, which piecewise's generation step does not fill; lower CompilationConfig(max_model_len"
                          f"=...) to {floor} or below, or generate with the model itself, uncompiled (attn_implementation='sdpa')")
    # Dynamic NTK rotary scaling recomputes its frequencies when a sequence outgrows the longest
    # seen so far, a branch on tensor values no single trace holds (transformers' dynamic_rope_update)
    dynamic = sorted({name or "model" for name, m in module.named_modules() if getattr(m, "rope_type", None) == "dynamic"})
    if dynamic:
        raise ConfigError(f"{type(module).__name__} uses dynamic rotary scaling (rope_type='dynamic' in {dynamic[0]}), "
                          "which recomputes its frequencies from the longest sequence seen so far, a data-dependent "
                          "branch piecewise cannot trace once for all lengths; generate with the model itself, uncompiled "
                          "(attn_implementation='sdpa'), "
                          "or use a fixed rope_type ('linear', 'llama3', 'yarn')")


def _create_longrope_frequencies(module: torch.nn.Module) -> None:
    """Run each long-RoPE rotary embedding once on one position, before any trace.

    transformers' longrope update (Phi3, Phi-4-mini) creates its long-factor frequencies as a plain
    attribute (``long_inv_freq``) on the first forward and picks long or short factors per call with
    ``torch.where``. Created inside the first trace, the attribute went from absent to a tensor after
    it, which is module state changing after the trace: the second ``generate()`` traced again.
    Created here, the trace sees it. One position is below any original context length, so the
    in-place ``inv_freq`` update writes the short factors it holds after construction."""
    for name, m in module.named_modules():
        if getattr(m, "rope_type", None) != "longrope" or getattr(m, "long_inv_freq", None) is not None:
            continue
        freq = getattr(m, "inv_freq", None)
        if not isinstance(freq, torch.Tensor):
            continue
        try:
            with torch.no_grad():
                m(torch.zeros(1, 1, 1, dtype=freq.dtype, device=freq.device),
                  torch.zeros(1, 1, dtype=torch.long, device=freq.device))
        except Exception as e:  # only a retrace is at stake: the trace creates the attribute itself
            log.info("%s: running the long-RoPE embedding once before the trace failed (%s: %s); the first "
                     "generate() creates its long_inv_freq and the second traces again", name or "model", type(e).__name__, e)

