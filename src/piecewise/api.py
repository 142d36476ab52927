"""`piecewise.compile`: the compile entry and guard-free dispatch (SPEC §4.1).

The first call marks the dynamic dims, traces the model once with Dynamo (``fullgraph=True``)
and compiles it through a `PiecewiseBackend`. Dynamo's transformed bytecode for ``forward`` is
captured with a bytecode hook and wrapped in a plain function; every later call runs that function
directly, so Dynamo's guards are never evaluated again.

Consequence, by design: Python branches that depend on shapes or on non-tensor arguments are frozen
to the first trace. Each call therefore checks, before running, that every input has the traced
dtype, device and rank, static dims of the traced size, dynamic dims <= ``max_num_tokens``, and
non-tensor arguments equal to the traced values; anything else raises `InputError`. With
``CompilationConfig(debug=True)`` calls go through Dynamo with recompiles forbidden, so a guard that
would have failed raises `GuardFailureError` instead of running stale code.

Compiled models are for inference: every call runs under ``torch.no_grad()`` and outputs carry no
autograd history.

The trace runs with ``backed_size_oblivious`` so a first call of size 1 does not specialise the
dynamic dim (Dynamo otherwise treats sizes 0 and 1 as constants).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .backend import PiecewiseBackend
from .config import CompilationConfig
from .counters import counters
from .errors import CompileError, ConfigError, GuardFailureError, InputError

__all__ = ["compile", "CompiledModel", "unique_tag"]

log = logging.getLogger("piecewise")

_tags_lock = threading.Lock()
_tags_used: set[str] = set()


def unique_tag(base: str) -> str:
    """`base`, or `base_<k>` with the smallest k making it unique among the live compiled regions
    of this process (a tag is released when its model is garbage collected), so a program that
    compiles its models in the same order gets the same tags - and cache entries - every run."""
    with _tags_lock:
        tag, k = base, 1
        while tag in _tags_used:
            tag = f"{base}_{k}"
            k += 1
        _tags_used.add(tag)
        return tag


def release_tag(tag: str) -> None:
    with _tags_lock:
        _tags_used.discard(tag)


@dataclasses.dataclass(frozen=True)
class _ArgSpec:
    """What one traced argument must look like on later calls."""

    name: str
    position: int | None  # index in *args, or None for a keyword
    kind: str  # "tensor" | "none" | "value"
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shape: tuple[int | None, ...] = ()  # None marks a dynamic dim
    value: Any = None


class CompiledModel:
    """A model compiled by `piecewise.compile`; call it like the model.

    Attributes:
        module: the wrapped `torch.nn.Module` (weights and buffers are used in place).
        config: the `CompilationConfig`.
        tag: this region's unique tag.
        backend: the `PiecewiseBackend` (None until the first call, and in mode ``"none"``).
        timings: seconds per phase of the first call (``dynamo`` trace, ``compile``, ``first_call``).
    """

    def __init__(self, module: torch.nn.Module, config: CompilationConfig, dynamic_arg_dims: Mapping[str, int | tuple[int, ...]]) -> None:
        self.module = module
        self.config = config
        self.tag = unique_tag(config.tag or type(module).__name__)
        weakref.finalize(self, release_tag, self.tag)
        self.backend: PiecewiseBackend | None = None
        self.timings: dict[str, float] = {}
        fn = type(module).forward
        self._forward_fn = fn
        self._params = [p for p in inspect.signature(fn).parameters.values()][1:]  # drop self
        names = [p.name for p in self._params]
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in self._params)
        self._dynamic: dict[str, tuple[int, ...]] = {}
        for name, dims in dynamic_arg_dims.items():
            if name not in names and not takes_kwargs:
                raise ConfigError(f"dynamic_arg_dims names {name!r}, which is not an argument of {type(module).__name__}.forward {names}")
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            self._dynamic[name] = dims
        self._specs: list[_ArgSpec] = []
        self._fast: Callable[..., Any] | None = None
        self._dynamo_fn: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    # -- calling ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.mode == "none":
            return self.module(*args, **kwargs)
        fast = self._fast
        with torch.no_grad():
            if fast is None:
                return self._first_call(args, kwargs)
            self._check(args, kwargs)
            if self.config.debug:
                return self._debug_call(args, kwargs)
            return fast(self.module, *args, **kwargs)

    forward = __call__

    def _debug_call(self, args: tuple, kwargs: dict) -> Any:
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._dynamo_fn(*args, **kwargs)
        except Exception as e:
            if "fail_on_recompile" in str(e) or type(e).__name__ == "RecompileError":
                raise GuardFailureError(
                    f"[{self.tag}] a guard of the first trace failed on this call, so guard-free dispatch would run code "
                    f"traced for other inputs: {e}"
                ) from e
            raise

    def _first_call(self, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            if self._fast is not None:
                return self(*args, **kwargs)
            self._specs = self._record_specs(args, kwargs)
            self._check(args, kwargs)
            for spec in self._specs:
                if spec.kind == "tensor":
                    t = args[spec.position] if spec.position is not None else kwargs[spec.name]
                    for d, s in enumerate(spec.shape):
                        if s is None:
                            torch._dynamo.mark_dynamic(t, d)
            self.backend = PiecewiseBackend(self.config, self.tag, call_signature=[_describe_spec(s) for s in self._specs])
            t0 = time.perf_counter()
            out, code = self._trace(args, kwargs)
            total = time.perf_counter() - t0
            counters.bump("dynamo_traces", tag=self.tag)
            self.timings = {"first_call": total, **self.backend.timings}
            self.timings["dynamo"] = max(0.0, total - sum(self.backend.timings.values()))
            fn = self._forward_fn
            fast = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            fast.__kwdefaults__ = fn.__kwdefaults__
            self._fast = fast
            log.info("[%s] first call %.3fs (dynamo %.3fs, split %.3fs, compile %.3fs)", self.tag, total,
                     self.timings["dynamo"], self.timings.get("split", 0.0), self.timings.get("compile", 0.0))
            return out

    def _trace(self, args: tuple, kwargs: dict) -> tuple[Any, types.CodeType]:
        import torch.fx.experimental._config as fx_config
        from torch._dynamo.convert_frame import register_bytecode_hook

        target = self._forward_fn.__code__
        captured: list[types.CodeType] = []

        def hook(old: types.CodeType, new: types.CodeType) -> None:
            if old is target:
                captured.append(new)

        handle = register_bytecode_hook(hook)
        try:
            self._dynamo_fn = torch.compile(self.module.forward, backend=self.backend, fullgraph=True)
            with fx_config.patch(backed_size_oblivious=True):
                out = self._dynamo_fn(*args, **kwargs)
        finally:
            handle.remove()
        if len(captured) != 1:
            raise CompileError(
                f"[{self.tag}] Dynamo produced {len(captured)} transformed versions of {type(self.module).__name__}.forward, "
                "expected 1. Dynamo skips frames inside torch itself: wrap a built-in module in a module of your own"
            )
        return out, captured[0]

    # -- input checks -------------------------------------------------------------------------
    def _record_specs(self, args: tuple, kwargs: dict) -> list[_ArgSpec]:
        named = [p for p in self._params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if len(args) > len(named):
            raise InputError(f"[{self.tag}] {len(args)} positional arguments given; pass the extra ones by name")
        slots: list[tuple[str, int | None, Any]] = []
        for i, p in enumerate(named):
            if i < len(args):
                slots.append((p.name, i, args[i]))
            elif p.name in kwargs:
                slots.append((p.name, None, kwargs[p.name]))
            # else: the default is frozen into the trace; passing it later fails the arity check
        known = {p.name for p in named}
        slots += [(k, None, v) for k, v in kwargs.items() if k not in known]  # through **kwargs
        specs: list[_ArgSpec] = []
        for name, pos, v in slots:
            dims = self._dynamic.get(name, ())
            if isinstance(v, torch.Tensor):
                for d in dims:
                    if d >= v.dim() or d < -v.dim():
                        raise InputError(f"dynamic_arg_dims marks dim {d} of {name!r}, but it has rank {v.dim()}")
                dyn = {d % v.dim() for d in dims}
                shape = tuple(None if d in dyn else s for d, s in enumerate(v.shape))
                specs.append(_ArgSpec(name, pos, "tensor", v.dtype, v.device, shape))
            elif dims:
                raise InputError(f"dynamic_arg_dims marks {name!r}, which is a {type(v).__name__}, not a tensor")
            elif v is None:
                specs.append(_ArgSpec(name, pos, "none"))
            else:
                specs.append(_ArgSpec(name, pos, "value", value=v))
        return specs

    def _check(self, args: tuple, kwargs: dict) -> None:
        max_n = self.config.max_num_tokens
        if len(args) + len(kwargs) != len(self._specs):
            self._check_arity(args, kwargs)
        for spec in self._specs:
            if spec.position is not None and spec.position < len(args):
                v = args[spec.position]
            elif spec.name in kwargs:
                v = kwargs[spec.name]
            else:
                raise InputError(f"[{self.tag}] argument {spec.name!r} was passed when traced but is missing now; pass it")
            if spec.kind == "tensor":
                if not isinstance(v, torch.Tensor):
                    raise InputError(f"[{self.tag}] {spec.name!r} was a tensor when traced but is {type(v).__name__} now")
                if v.dtype != spec.dtype:
                    raise InputError(f"[{self.tag}] {spec.name!r} has dtype {v.dtype}, compiled for {spec.dtype}; cast it with .to({spec.dtype})")
                if v.device != spec.device:
                    raise InputError(f"[{self.tag}] {spec.name!r} is on {v.device}, compiled for {spec.device}; move it there")
                shape = v.shape
                if len(shape) != len(spec.shape):
                    raise InputError(f"[{self.tag}] {spec.name!r} has rank {len(shape)}, compiled for rank {len(spec.shape)} {_fmt(spec.shape)}")
                for d, s in enumerate(spec.shape):
                    if s is None:
                        if shape[d] > max_n:
                            raise InputError(
                                f"[{self.tag}] {spec.name!r} dim {d} is {shape[d]}, above max_num_tokens={max_n}; "
                                "split the batch or raise max_num_tokens"
                            )
                    elif shape[d] != s:
                        raise InputError(
                            f"[{self.tag}] {spec.name!r} has shape {tuple(shape)}, compiled for {_fmt(spec.shape)}; dim {d} "
                            "is static. Mark it in dynamic_arg_dims or pass the traced size"
                        )
            elif spec.kind == "none":
                if v is not None:
                    raise InputError(f"[{self.tag}] {spec.name!r} was None when traced; compile another tag for calls that pass it")
            elif not (v is spec.value or v == spec.value):
                raise InputError(
                    f"[{self.tag}] {spec.name!r}={v!r} differs from the traced value {spec.value!r}; non-tensor arguments are "
                    "frozen into the trace. Compile another tag for this value"
                )

    def _check_arity(self, args: tuple, kwargs: dict) -> None:
        traced = {s.name for s in self._specs}
        given = {p.name for p in self._params[: len(args)]} | set(kwargs)
        extra, missing = sorted(given - traced), sorted(traced - given)
        raise InputError(
            f"[{self.tag}] arguments differ from the traced call: extra {extra}, missing {missing}; "
            "pass the same arguments every call"
        )

    def __repr__(self) -> str:
        return f"CompiledModel({type(self.module).__name__}, tag={self.tag!r}, mode={self.config.mode!r}, backend={self.config.backend!r})"


def _describe_spec(spec: _ArgSpec) -> list[Any]:
    """A JSON-ready description of one traced argument (enters the cache key)."""
    if spec.kind == "tensor":
        return [spec.name, "tensor", str(spec.dtype), spec.device.type, ["*" if s is None else s for s in spec.shape]]
    if spec.kind == "value":
        return [spec.name, "value", repr(spec.value)]
    return [spec.name, spec.kind]


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def compile(
    model: torch.nn.Module,
    config: CompilationConfig | None = None,
    *,
    dynamic_arg_dims: Mapping[str, int | tuple[int, ...]] | None = None,
) -> CompiledModel:
    """Compile `model` piecewise; returns a `CompiledModel` called like the model.

    Args:
        model: the module; its ``forward`` must have named arguments.
        config: a `CompilationConfig` (default: ``CompilationConfig()``).
        dynamic_arg_dims: argument name -> dim (or dims) whose size varies per call (the token
            count); each must be <= ``config.max_num_tokens``. Unmarked dims are static.

    Compilation happens on the first call. Every later call with a dynamic size in
    ``[1, max_num_tokens]`` runs without recompiling.

    Raises:
        ConfigError: `model` is not a module, or `dynamic_arg_dims` names no argument.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"piecewise.compile takes a torch.nn.Module, got {type(model).__name__}; wrap the function in a module")
    config = config or CompilationConfig()
    if dynamic_arg_dims is None:
        warnings.warn("piecewise.compile without dynamic_arg_dims compiles static shapes; every shape is frozen", stacklevel=2)
    return CompiledModel(model, config, dynamic_arg_dims or {})
