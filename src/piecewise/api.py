"""`piecewise.compile`: the compile entry and guard-free dispatch (docs/design.md §4.1).

The first call marks the dynamic dims, traces the model once with Dynamo (full-graph capture,
`piecewise.trace`) and compiles it through a `PiecewiseBackend`. Dynamo's transformed bytecode for
``forward`` is wrapped in a plain function; every later call runs that function
directly, so Dynamo's guards are never evaluated again.

Consequence, by design: Python branches that depend on shapes or on non-tensor arguments are frozen
to the first trace. Each call therefore checks, before running, that every input has the traced
dtype, device and rank, static dims of the traced size, dynamic dims <= ``max_num_tokens``, and
non-tensor arguments equal to the traced values; anything else raises `InputError`. With
``CompilationConfig(debug=True)`` every call also evaluates the trace's Dynamo guards (kept from the
trace), so a guard that would have failed raises `GuardFailureError` instead of running stale code.

Module state the trace read is not frozen: a change through ``nn.Module`` (``.to()``, ``.train()``,
a reassigned parameter, a hook, a plain attribute the trace read such as ``norm.eps = 10.0``)
moves the state epoch (`piecewise.state`), and the next call traces again. Still frozen: Python
side effects in ``forward`` (a counter incremented per call runs once), and what is written past
``Module.__setattr__`` (``object.__setattr__``, an attribute of a plain object the module holds, a
class attribute changed on the class), which debug mode detects. Hooks on submodules are traced;
hooks on the model itself are refused (forward is called directly).

Compiled models are for inference: every call runs under ``torch.no_grad()`` and outputs carry no
autograd history.

With a cache root, the first call first looks for a warm-start bundle (`piecewise.warmstart`): when
one matches this module and call and its guards pass, the model is rebuilt from it without tracing
or compiling; otherwise it traces, and saves a bundle for the next process.

The trace runs with ``backed_size_oblivious`` so a first call of size 1 does not specialise the
dynamic dim (Dynamo otherwise treats sizes 0 and 1 as constants).
"""

from __future__ import annotations

import contextlib
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

from ._torch.dispatch import is_any_autocast_enabled
from . import state
from .backend import PiecewiseBackend
from .warmstart import StartSubject, WarmStart
from .trace import Trace, trace
from .config import CompilationConfig
from .counters import counters
from .errors import CompileError, ConfigError, GuardFailureError, InputError, PiecewiseError, SizeRefusedError, TraceError
from .inputs import CallSignature
from .registry import Registration, Registry
from .tags import current_registry, release_tag, unique_tag
from .threads import warn_if_oversubscribed

__all__ = ["bypasses_attention_interface", "compile", "CompiledModel", "unique_tag", "register_route"]

log = logging.getLogger("piecewise")
_UNSET = object()  # not recorded yet

#: call routes, tried in order when a model is compiled: ``factory(module, config, tag)`` returns a
#: callable ``route(args, kwargs)`` for modules it serves (else None); the route returns
#: ``NotImplemented`` for a call it leaves to the model's own compiled forward. The transformers
#: generation route (`piecewise.hf.generate`) registers itself this way, so this layer
#: imports nothing from the models above it.
_ROUTES: Registry[Callable[..., Any]] = Registry("call route")


def bypasses_attention_interface(module: torch.nn.Module) -> bool:
    """Whether transformers itself says `module`'s class picks its attention without transformers'
    attention interface (Bloom, Falcon, GPT-Neo, MPT, XGLM: such a class cannot attend through
    ``attn_implementation='piecewise'``): ``_can_set_attn_implementation()``, transformers' test of
    the modeling source for ``ALL_ATTENTION_FUNCTIONS.get_interface(``, run before it lets an
    implementation be set. False for a module without that test or when it fails (no claim)."""
    can_set = getattr(type(module), "_can_set_attn_implementation", None)
    try:
        return callable(can_set) and can_set() is False
    except Exception as e:
        log.debug("transformers' _can_set_attn_implementation() failed on %s (%s): no claim about its attention",
                  type(module).__name__, e)
        return False


def register_route(factory: Callable[..., Any]) -> Registration:
    """Add a call-route factory (see `_ROUTES`); registering one factory again replaces it in
    place. Returns a `Registration` (``.remove()`` or a ``with`` block undoes it)."""
    return _ROUTES.register(f"{factory.__module__}.{factory.__qualname__}", factory)


class CompiledModel:
    """A model compiled by `piecewise.compile`; call it like the model.

    Attributes:
        module: the wrapped `torch.nn.Module` (weights and buffers are used in place).
        config: the `CompilationConfig`.
        tag: this region's unique tag.
        backend: the `PiecewiseBackend` (None until the first call, and in mode ``"none"``).
        timings: seconds per phase of the first call (``dynamo`` trace, ``compile``, ``first_call``).
    """

    #: set as ``module.forward`` (around ``generate()``, or by the user), this is not code a trace
    #: inlined: `state.CodeGuard` leaves it out
    _piecewise_compiled_model = True

    def __init__(self, module: torch.nn.Module, config: CompilationConfig, dynamic_arg_dims: Mapping[str, int | tuple[int, ...]],
                 *, size_class_of: CompiledModel | None = None) -> None:
        self.module = module
        self.config = config
        if size_class_of is None:
            self.tag = unique_tag(config.tag or type(module).__name__)
            weakref.finalize(self, release_tag, self.tag, current_registry())
        else:  # a size class shares its model's tag: its cache entries, bundles and counters
            self.tag = size_class_of.tag
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
        if config.mode != "none":
            from .compilers import get_adaptor

            get_adaptor(config.backend, config)  # an unknown adaptor name fails here, before any call
        self._signature = CallSignature(self._params, self._dynamic, self.tag, config.max_num_tokens,
                                        min_dynamic_size=2 if config.dynamic_shapes == "backed" else 0)
        # Callers that inspect ``model.forward`` (transformers' generate() does) see the model's own
        # parameters when the compiled model is assigned to it.
        self.__signature__ = inspect.signature(types.MethodType(fn, module))
        self._route = None
        if config.mode != "none" and size_class_of is None:
            self._route = next((r for f in _ROUTES.values() if (r := f(module, config, self.tag)) is not None), None)
        # Size classes (`_serve_size_class`): the traces that serve the sizes this model's own
        # trace does not hold for, the one that served the last call, and the bundle entries in use.
        self._size_class_of = size_class_of
        self._size_classes: list[CompiledModel] = []
        self._serving: CompiledModel | None = None
        self._bundle_keys: set[str] = set()
        self._guards: Any = None  # Dynamo's guard manager of the trace (debug mode checks it)
        self._object_guards: Any = None  # guards rooted at object arguments, checked every call
        self._fast: Callable[..., Any] | None = None
        # re-entrant: a first call that finds another thread compiled meanwhile calls the model,
        # whose state check takes the lock again
        self._lock = threading.RLock()
        # Module state the trace read (`piecewise.state`): verified again whenever the epoch moved.
        state.install(self)
        self._state_epoch = -1
        self._state_layout: dict[str, Any] = {}
        self._plain_tensors: list[Any] = []
        self._code_guard: state.CodeGuard | None = None  # the forwards the trace inlined (`_record_state`)
        self._skip_bundle = False
        self._autocast: Any = _UNSET  # the autocast state of the first call (`state.autocast_state`)

    # -- calling ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.config.mode == "none":
            if self.module.__dict__.get("forward") is self:  # model.forward = compiled: its own forward, not this again
                return self._forward_fn(self.module, *args, **kwargs)
            return self.module(*args, **kwargs)
        # Autocast is global state Dynamo guards and guard-free dispatch does not: code traced with
        # or without it would run silently in the other state (bf16 against fp32 matmuls). The
        # first call's state is kept; another one later is refused. One C call when never used.
        if is_any_autocast_enabled() or self._autocast is not None:
            now = state.autocast_state()
            if self._autocast is _UNSET:
                self._autocast = now
            elif now != self._autocast:
                raise InputError(f"[{self.tag}] called with autocast {state.show_autocast(now)}, compiled with autocast "
                                 f"{state.show_autocast(self._autocast)}: the compiled code keeps the dtypes of its trace. "
                                 "Call it in the autocast state of its first call, or compile a model for each state "
                                 "(CompilationConfig(tag=...)); casting the model (model.to(torch.bfloat16)) needs no autocast")
        if self._route is not None:
            with torch.no_grad():
                out = self._route(args, kwargs)
            if out is not NotImplemented:
                return out
        with torch.no_grad():
            if self._serving is None:
                try:
                    return self._call_own(args, kwargs)
                except SizeRefusedError as e:
                    if self._size_class_of is not None:
                        raise
                    return self._serve_size_class(args, kwargs, e)
            return self._serve_size_class(args, kwargs, None)

    forward = __call__

    def _call_own(self, args: tuple, kwargs: dict) -> Any:
        """This model's own trace on one call (the first call traces or starts warm).

        Raises:
            SizeRefusedError: the call's sizes fail a size guard of the trace (nothing ran).
        """
        fast = self._fast
        if self._plain_tensors:
            state.check_plain_tensors(self._plain_tensors)
        if (fast is None or (state.EPOCH != self._state_epoch and not self._state_unchanged())
                or not self._code_unchanged()):
            return self._first_call(args, kwargs)
        args, kwargs, copies = self._signature.check(args, kwargs)
        if self._object_guards is not None:
            self._check_object_guards(args, kwargs)
        if self.config.debug and self._guards is not None:
            self._check_guards(args, kwargs)
        out = fast(self.module, *args, **kwargs)
        if copies:
            self._signature.write_back(copies)
        return out

    def _serve_size_class(self, args: tuple, kwargs: dict, refused: SizeRefusedError | None) -> Any:
        """A call this model's own trace refused (`refused`), or one after another size class
        served the last call (`refused` None): the size class that served last is tried first, then
        the others and this model's own trace; when every one refuses the sizes, one more is traced
        (or started warm from its bundle) at this call's sizes, up to `CompilationConfig.max_size_classes`.

        A size class is a `CompiledModel` of the same module and tag; each refusal is raised before
        anything runs (`StitchedForward`), so trying another trace is free of side effects.

        Raises:
            SizeRefusedError: every trace refuses these sizes and no more may be made (the bound is
                reached, or ``debug=True``, which refuses them as a check).
        """
        tried: list[CompiledModel | None] = []
        error = refused
        order: list[CompiledModel | None] = [self._serving] if self._serving is not None else []
        order += [None] if refused is None else []
        order += [c for c in self._size_classes if c is not self._serving]
        for cls in order:
            tried.append(cls)
            try:
                out = self._call_own(args, kwargs) if cls is None else cls(*args, **kwargs)
            except SizeRefusedError as e:
                error = e
                continue
            self._serving = cls
            return out
        with self._lock:
            for cls in self._size_classes:  # made by another thread meanwhile
                if cls not in tried:
                    try:
                        out = cls(*args, **kwargs)
                    except SizeRefusedError as e:
                        error = e
                        continue
                    self._serving = cls
                    return out
            assert error is not None
            if self._fast is None:  # a warm start whose trace refused these sizes: the next bundle, or a trace
                out = self._start_size_class(self, args, kwargs)
                self._serving = None
                return out
            n = len(self._size_classes) + 2
            if self.config.debug or n > self.config.max_size_classes:
                why = ("debug=True refuses sizes a trace does not hold for" if self.config.debug else
                       f"max_size_classes={self.config.max_size_classes} traces already serve this model's other sizes; "
                       "raise CompilationConfig(max_size_classes)")
                raise SizeRefusedError(f"{error} ({why})") from None
            log.info("[%s] %s; size class %d serves such calls", self.tag, str(error).split("] ", 1)[-1], n)
            cls = CompiledModel(self.module, self.config, self._dynamic, size_class_of=self)
            cls._bundle_keys = self._bundle_keys  # shared: each class starts warm from a bundle no other one uses
            # counted against the bound even when its first run raises (an input eager refuses too):
            # its next call is a first call again, as for any model, never one more class
            self._size_classes.append(cls)
            out = self._start_size_class(cls, args, kwargs)
            if "bundle_load" not in cls.timings:  # traced, not started warm from a bundle
                counters.bump("size_class_traces", tag=self.tag)
            self._serving = cls
            return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate(...)`` (transformers), every forward running compiled: the
        same arguments and result as ``module.generate``. Equivalent to ``module.forward = compiled``
        followed by ``module.generate(...)``, without leaving the assignment behind.

        The call holds the module's generation lock (`generation_lock`) while ``module.forward`` is
        set, so generate() calls on one module from several threads, through one compiled model or
        several (``pw.compile(m, tag="a")`` and ``pw.compile(m, tag="b")``), run one after the
        other; what it sets runs this compiled model on this thread only (other threads calling the
        module meanwhile run its own forward), and the module is left as it was (an instance
        ``forward`` set before the call is set again, also when generate() raises). A generate()
        nested in another on the same thread (from a streamer or stopping criterion) runs inside it,
        through another compiled model; one through the same compiled model is refused
        (`InputError`: its KV cache holds one generation).

        generate()'s own options (``logits_processor``, ``stopping_criteria``, ``streamer``,
        ``stop_strings`` with ``tokenizer``, ``prefix_allowed_tokens_fn``, ``generation_config``,
        ``custom_generate``, ...) are served as the model's own generate() serves them; those
        piecewise's generation KV cache cannot serve (``assistant_model``, ``prompt_lookup_num_tokens``,
        ``prefill_chunk_size``, ``guidance_scale`` with the cache on) are refused by name (see
        `piecewise.hf.generate.GENERATE_OPTIONS`).

        In mode ``"none"`` this is the model's own ``generate`` (nothing compiled, no piecewise cache).

        Raises:
            AttributeError: the wrapped module has no ``generate``.
            ConfigError: the model's attention is not ``attn_implementation='piecewise'`` (a class whose
                attention bypasses transformers' attention interface, Falcon, GPT-Neo, Bloom, MPT, is named
                as such: it cannot be built that way).
            InputError: an option or input piecewise's generation cannot serve, named.
        """
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the compiled model instead")
        if self._route is None and self.config.mode == "none":  # eager: the model's own generate()
            with self.generation_lock(self.module):
                return self._generate_with_forward(generate, args, kwargs)
        if self._route is None:
            name = type(self.module).__name__
            impl = getattr(getattr(self.module, "config", None), "_attn_implementation", "?")
            if bypasses_attention_interface(self.module):
                raise ConfigError(
                    f"[{self.tag}] compiled generate() needs attention that goes through transformers' attention interface, "
                    f"so it reaches the KV cache piecewise owns; {name}'s attention classes do not use that interface "
                    "(transformers' _can_set_attn_implementation() is False), so it cannot be built with "
                    "attn_implementation='piecewise'. Generate with the model itself, uncompiled, or compile with "
                    "CompilationConfig(mode='none')")
            raise ConfigError(
                f"[{self.tag}] compiled generate() needs a transformers causal LM built with attn_implementation='piecewise' "
                "(call piecewise.hf.attention.register_hf_attention() first), so its attention reaches the KV cache piecewise "
                f"owns; {name} uses {impl!r}")
        with self.generation_lock(self.module):
            kwargs = self._route.check_generate(args, kwargs)
            with self._route.generating():
                return self._generate_with_forward(generate, args, kwargs)

    #: per module (weak keys), the lock that owns its instance ``forward`` for a generation (`generation_lock`)
    _generation_locks: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
    _generation_locks_guard = threading.Lock()

    @staticmethod
    def generation_lock(module: torch.nn.Module) -> Any:
        """The re-entrant lock (`threading.RLock`) that owns `module`'s instance ``forward`` for a
        generation: `generate` holds it while it sets ``module.forward`` and calls transformers'
        generate(), and a generation step (`piecewise.hf.generate`) while it takes that
        attribute off the module for its run. One lock per module, shared by every compiled model
        of it, held weakly (it goes with the module). Re-entrant, so a generate() nested in another
        on the same thread (a streamer's) takes it again.

        Example::

            with pw.CompiledModel.generation_lock(model):
                model.forward = compiled  # no compiled generate() on `model` runs meanwhile
                ...
                del model.forward
        """
        with CompiledModel._generation_locks_guard:
            lock = CompiledModel._generation_locks.get(module)
            if lock is None:
                lock = CompiledModel._generation_locks[module] = threading.RLock()
            return lock

    class _GenerationForward:
        """What a compiled generate() sets as its module's ``forward`` for the call: on the thread
        running that generate(), the compiled model (the innermost one, for generate() calls nested
        on the thread); on any other thread, what the module's ``forward`` was before (an instance
        forward set earlier, else the class's), so code using the module elsewhere meanwhile runs it
        as if nothing were set (an eager ``model(...)`` or ``model.generate(...)`` gets eager results)."""

        #: not code a trace inlined (`state.CodeGuard` leaves it out)
        _piecewise_compiled_model = True

        def __init__(self, module: torch.nn.Module, had: bool, previous: Any) -> None:
            self.module, self.had, self.previous = module, had, previous
            # transformers' generate() reads the forward's parameters (attention_mask, logits_to_keep)
            self.__signature__ = inspect.signature(types.MethodType(type(module).forward, module))

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            for module, forward in reversed(getattr(CompiledModel._generating, "stack", ())):
                if module is self.module:
                    return forward(*args, **kwargs)
            if self.had:
                return self.previous(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)

    #: per thread, ``stack``: the (module, forward) of each compiled generate() running on it, innermost last
    _generating = threading.local()

    def _generate_with_forward(self, generate: Any, args: tuple, kwargs: dict) -> Any:
        """``generate(*args, **kwargs)`` with every forward call of this thread on the module running
        this compiled model (`_GenerationForward`, set as ``module.forward``), then the module's
        instance ``forward`` exactly as before (absent, or what was set). The caller holds
        `generation_lock`, so no other thread sets or takes ``forward`` meanwhile."""
        module = self.module
        d = module.__dict__
        # mode "none": the model's own forward (calling this compiled model would call the module again)
        forward = self if self.config.mode != "none" else (lambda *a, **k: self._forward_fn(module, *a, **k))
        installed = None
        if not isinstance(d.get("forward"), CompiledModel._GenerationForward):  # else: nested in a generate() on this thread
            installed = CompiledModel._GenerationForward(module, "forward" in d, d.get("forward"))
            d["forward"] = installed  # as `module.forward = ...` does (a plain attribute lives in __dict__)
        local = CompiledModel._generating
        outer = getattr(local, "stack", ())
        local.stack = (*outer, (module, forward))
        try:
            return generate(*args, **kwargs)
        finally:
            local.stack = outer
            if installed is not None and d.get("forward") is installed:  # (one set meanwhile by the caller stays)
                if installed.had:
                    d["forward"] = installed.previous
                else:
                    d.pop("forward", None)

    def frame_locals(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The frame locals ``forward`` would see for this call (what Dynamo's guards read)."""
        fn = self._forward_fn
        # the traced code's own parameters: a decorator's (*args, **kwargs), not the wrapped signature
        bound = inspect.signature(fn, follow_wrapped=False).bind(self.module, *args, **kwargs)
        bound.apply_defaults()
        f_locals = dict(bound.arguments)
        # a decorated forward's guards also read the variables it closes over (the wrapped function)
        f_locals.update((name, cell.cell_contents) for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        return f_locals

    def _state_unchanged(self) -> bool:
        """The state epoch moved (`piecewise.state`): describe the module again. Same layout: record
        the epoch and go on. Otherwise follow the change: drop the compiled forward (the next
        first call traces again, or starts warm from a bundle for this layout), count a recompile
        and log what changed."""
        with self._lock:
            now = state.EPOCH
            layout, _ = state.describe(self.module)
            changes = state.diff(self._state_layout, layout)
            if not changes:
                self._state_epoch = now
                self._plain_tensors = state.plain_tensors(self.module)
                return True
            self._follow("; ".join(changes))
            return False

    def _code_unchanged(self) -> bool:
        """No submodule's forward was replaced since the trace (`state.CodeGuard`); else follow it."""
        why = self._code_guard.changed() if self._code_guard is not None else ""
        if not why:
            return True
        with self._lock:
            if self._code_guard is not None and self._code_guard.changed():
                self._follow(why)
                self._code_guard = None
        return False

    def _follow(self, changes: str) -> None:
        """Drop the compiled forward after a change the trace read: the next first call traces again."""
        log.info("[%s] module state the trace read changed after compile (%s); tracing again", self.tag, changes)
        counters.bump("recompiles", tag=self.tag)
        counters.bump("state_changes", tag=self.tag)
        self._fast, self.backend, self._guards, self._object_guards = None, None, None, None
        # Trace for real: a bundle is found by a fingerprint of the module, which may not see
        # what changed here (a hook swapped for another of the same count, in the same file).
        self._skip_bundle = True

    def _record_state(self) -> None:
        self._code_guard = state.CodeGuard(self.module)
        self._state_epoch = state.EPOCH
        self._state_layout, _ = state.describe(self.module)
        self._plain_tensors = state.plain_tensors(self.module)

    def _object_roots(self) -> tuple[str, ...]:
        """Frame locals the guards on object arguments start from: the argument's own name, or the
        ``**kwargs`` parameter's for an object passed through it."""
        named = {p.name for p in self._params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        var_kw = next((p.name for p in self._params if p.kind == p.VAR_KEYWORD), None)
        return tuple(dict.fromkeys(n if n in named or var_kw is None else var_kw for n in self._signature.objects))

    def _check_object_guards(self, args: tuple, kwargs: dict) -> None:
        """Object arguments: the trace read their attributes, so its guards on them must hold."""
        named = {p.name for p in self._params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        f_locals: dict[str, Any] = {}
        for s in self._signature.specs:
            if s.name not in self._signature.objects:
                continue
            if s.name in named:
                f_locals[s.name] = self._signature.value(s, args, kwargs)
            else:
                var_kw = next(p.name for p in self._params if p.kind == p.VAR_KEYWORD)
                f_locals[var_kw] = {k: v for k, v in kwargs.items() if k not in named}
        if not self._object_guards.check(f_locals):
            failed = self._object_guards.check_verbose(f_locals).verbose_code_parts
            raise InputError(
                f"[{self.tag}] an object argument differs from the traced one in what the trace read: "
                f"{failed[0].split('#')[0].strip() if failed else '?'}. The compiled code would use the traced values; pass an "
                "object in the traced state (same attribute values, tensors of the traced dtype and shape), or compile "
                "the variant as a model of its own under another CompilationConfig(tag=...)"
            )

    def _check_guards(self, args: tuple, kwargs: dict) -> None:
        """Debug mode: evaluate the first trace's Dynamo guards on this call's frame locals."""
        f_locals = self.frame_locals(args, kwargs)
        if not self._guards.check(f_locals):
            failed = self._guards.check_verbose(f_locals).verbose_code_parts
            raise GuardFailureError(
                f"[{self.tag}] a guard of the first trace fails on this call, so guard-free dispatch would run code "
                f"traced for other inputs: {failed[0] if failed else '?'}. Compile this variant under another tag"
            )

    def _first_call(self, args: tuple, kwargs: dict) -> Any:
        from ._torch.dynamo import compile_lock

        with self._lock:
            if self._fast is not None:
                return self(*args, **kwargs)
            if self.module._forward_hooks or self.module._forward_pre_hooks:
                raise ConfigError(
                    f"[{self.tag}] {type(self.module).__name__} has forward hooks; the compiled model calls forward "
                    "directly and would skip them. Register them on a submodule (they are traced) or apply them outside"
                )
            self._signature.record(args, kwargs)
            args, kwargs, copies = self._signature.check(args, kwargs)
            versions = self._signature.versions(args, kwargs)
            t0 = time.perf_counter()
            # Dynamo's frame callback holds its process-wide `compile_lock` while it traces and a
            # backend compiles; this trace (`trace.trace`, Dynamo's capture called directly), the
            # piece compiles and a warm start's loads hold it too: they share torch's
            # process-global state (torch.fx's symbolic-trace patcher, Inductor's bundlers), and
            # first calls of several models from several threads failed with "CURRENT_PATCHER is
            # None", taking plain torch.compile calls in other threads down with them. The first
            # run is outside it, as torch.compile's runs are: a splitting op may wait on another
            # thread that compiles (a rank's collective, a worker pool).
            with compile_lock, _collect_young_only(), self._refusals_served():
                start, fast = self._build_first(args, kwargs)
            # The compiled forward serves other calls only once its first run succeeded (they wait
            # for this lock meanwhile): a first run that raises (an input eager refuses too) keeps
            # nothing, and the next call records its own signature and traces (or starts warm).
            try:
                out = fast(self.module, *args, **kwargs)
            except SizeRefusedError:
                if start is not None and start.entry is not None:
                    # a bundle of another size class (its guards read no size): never this one again
                    self._bundle_keys.add(start.entry.key)
                self.backend = None
                raise
            self._after_first_run(versions, copies, args, kwargs)
            self._fast = fast
            total = time.perf_counter() - t0
            if start is not None and start.fast is not None:
                self.timings = {"first_call": total, **self.backend.timings, "bundle_load": start.seconds, "dynamo": 0.0,
                                **{f"bundle_{k}": v for k, v in start.phases.items()}}
                log.info("[%s] warm start from the bundle, no trace: first call %.3fs (%s)", self.tag, total,
                         ", ".join(f"{k} {v:.3f}s" for k, v in start.phases.items()))
                return out
            self.timings = {"first_call": total, **self.backend.timings}
            # the first call's wall time not spent in the backend's phases (trace, guards, first run);
            # a difference of clocks in one process, shown as measured (never clamped)
            self.timings["dynamo"] = total - sum(self.backend.timings.values())
            log.info("[%s] first call %.3fs (dynamo %.3fs, split %.3fs, compile %.3fs)", self.tag, total,
                     self.timings["dynamo"], self.timings.get("split", 0.0), self.timings.get("compile", 0.0))
            return out

    def _build_first(self, args: tuple, kwargs: dict) -> tuple[WarmStart | None, Callable[..., Any]]:
        """The compiled forward for this signature (the backend and guards set on the model): from
        a warm-start bundle when one matches, else a trace and piece compiles (saved as a bundle).
        Returns the warm start it opened, if any, and the forward."""
        # Object arguments need the guard manager of a live trace (a bundle does not keep one).
        start = None
        if not (self._signature.objects or self._skip_bundle):
            subject = StartSubject(self.config, self.tag, self.module, self._forward_fn,
                                   tuple(self._signature.describe()), self.frame_locals)
            start = WarmStart.open(subject, args, kwargs, exclude=frozenset(self._bundle_keys))
        if start is not None and start.fast is not None:
            self.backend, self._guards = start.backend, start.guards
            self._bundle_keys.add(start.entry.key)
            self._record_state()
            return start, start.fast
        self.backend = PiecewiseBackend(self.config, self.tag, call_signature=self._signature.describe(),
                                        preloaded=start.preloaded if start is not None else None,
                                        arg_aliases=self._arg_aliases())
        self.backend.prepare([*args, *kwargs.values()])
        with _marked_dynamic(self._signature.dynamic_tensors(args, kwargs), unbacked=self.config.dynamic_shapes == "unbacked"):
            cap = self._trace(args, kwargs)
        counters.bump("dynamo_traces", tag=self.tag)
        self._guards = cap.guard_manager
        self._object_guards = cap.object_guards
        fast = cap.function(self._forward_fn.__globals__)
        self._record_state()
        if start is not None:
            start.save(self.backend, cap)
            if start.saved_key is not None:
                self._bundle_keys.add(start.saved_key)
        return start, fast

    @staticmethod
    def _start_size_class(cls: CompiledModel, args: tuple, kwargs: dict) -> Any:
        """The first call of size class `cls` (or of a model whose warm start was refused): a bundle
        whose trace refuses these sizes is set aside (`_first_call`) and the next one tried; with
        none left, a trace at these sizes, which holds for them."""
        from .warmstart import bundles_per_tag

        for _ in range(bundles_per_tag() + 1):
            try:
                return cls._call_own(args, kwargs)
            except SizeRefusedError:
                if cls._fast is not None:
                    raise
        return cls._call_own(args, kwargs)

    def _refusals_served(self) -> Any:
        """While this model traces: sizes its trace does not hold for are served by size classes
        (`_serve_size_class`), so the backend logs them at INFO rather than warning that they raise."""
        from .backend import size_refusals_handled

        root = self._size_class_of or self
        if self.config.debug or self.config.max_size_classes <= len(root._size_classes) + 1:
            return contextlib.nullcontext()
        return size_refusals_handled()

    def _arg_aliases(self) -> dict[str, str]:
        """The traced function's argument references as the user names them: a forward wrapped by a
        ``(*args, **kwargs)`` decorator (transformers' ``@can_return_tuple``) is traced with
        ``args[0]`` and ``kwargs['input_ids']`` where the call passed ``input_ids``."""
        raw = list(inspect.signature(self._forward_fn, follow_wrapped=False).parameters.values())
        var_pos = next((p for p in raw if p.kind == p.VAR_POSITIONAL), None)
        var_kw = next((p for p in raw if p.kind == p.VAR_KEYWORD), None)
        named = [p.name for p in self._params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        out: dict[str, str] = {}
        if var_pos is not None:
            before = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in raw[:raw.index(var_pos)])
            skip = 1 - min(before, 1)  # ``(*args)`` alone: args[0] is the module
            for i, name in enumerate(named[max(before - 1, 0):]):
                out[f"{var_pos.name}[{i + skip}]"] = name
        if var_kw is not None:
            for p in self._params:
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    out[f"{var_kw.name}['{p.name}']"] = p.name
        return out

    def _after_first_run(self, versions: list[int], copies: list, args: tuple, kwargs: dict) -> None:
        """Which tensor arguments the first run wrote in place (`CallSignature.note_writes`), and
        the write-back of the contiguous copies it ran on."""
        self._signature.note_writes(versions, args, kwargs, copies)
        if self._signature.mutated:
            log.info("[%s] forward writes %s in place: every call checks which tensor arguments share memory",
                     self.tag, list(self._signature.mutated))
        if copies:
            self._signature.write_back(copies)

    def _trace(self, args: tuple, kwargs: dict) -> Trace:
        from torch.fx.experimental.symbolic_shapes import ConstraintViolationError, GuardOnDataDependentSymNode

        from ._torch.dynamo import TorchRuntimeError, Unsupported, UserError, automatic_dynamic_shapes
        from ._torch.fx import size_oblivious_patch

        try:
            # Dims are dynamic only where dynamic_arg_dims says so: Dynamo's automatic dynamic
            # shapes would otherwise make a second trace of the same code (after a state change,
            # or another instance) dynamic in whatever differed from the first.
            oblivious = self.config.dynamic_shapes == "backed_size_oblivious"
            with size_oblivious_patch(oblivious), automatic_dynamic_shapes(False):
                return trace(self.module, args, kwargs, self.backend, full_guards=self.config.debug,
                               object_args=self._object_roots())
        except (UserError, ConstraintViolationError, GuardOnDataDependentSymNode) as e:
            if "data-dependent" in str(e):
                raise CompileError(
                    f"[{self.tag}] the trace met a branch on a size it cannot decide "
                    f"({self.config.dynamic_shapes} dynamic shapes): {_caused_by(e)}. Make the code independent of the "
                    "size there, or compile with dynamic_shapes='backed_size_oblivious' (the default)"
                ) from e
            raise ConfigError(
                f"[{self.tag}] tracing failed: {str(e).splitlines()[0]}. Usually an input dim is tied to a dim marked "
                "dynamic but is not marked itself (add it to dynamic_arg_dims), or the model fixes a dim marked "
                "dynamic (remove it)"
            ) from e
        except Unsupported as e:
            own = _own_error_raised_in_trace(e)
            if own is not None:
                raise own from e
            raise CompileError(
                f"[{self.tag}] {type(self.module).__name__}.forward cannot be captured as one graph: "
                f"{str(e).splitlines()[0]}. Make the code traceable or register the op as a splitting op"
            ) from e
        except TorchRuntimeError as e:  # an op failed on the trace's fake tensors
            own = _own_error_raised_in_trace(e)
            if own is not None:
                raise own from e
            raise TraceError(
                f"[{self.tag}] tracing {type(self.module).__name__}.forward failed on its fake tensors "
                f"({self.config.dynamic_shapes} dynamic shapes): {_fake_failure(e)}. If eager raises the same, fix "
                "the input or the model; if eager runs at these sizes, the trace's symbolic sizes are the cause: a "
                "first call at other sizes, or dynamic_shapes='backed', may trace"
            ) from e

    def __repr__(self) -> str:
        return f"CompiledModel({type(self.module).__name__}, tag={self.tag!r}, mode={self.config.mode!r}, backend={self.config.backend!r})"


def _own_error_raised_in_trace(e: BaseException) -> PiecewiseError | None:
    """A piecewise error that piecewise's own traced code raised (a refusal in an attention
    function that meets an argument it cannot honour), rebuilt from Dynamo's record of it: Dynamo
    reports such a ``raise`` as a graph break ("Observed exception") whose cause names the
    exception class and its arguments, and the frame that raised it, not as the exception itself.
    Only a raise in a frame of the piecewise package is rebuilt, so a user's exception class of the
    same name stays the user's (reported as the graph break). None when the chain holds none."""
    import ast
    import os
    import re

    from . import errors

    package = os.path.dirname(os.path.abspath(errors.__file__)) + os.sep
    seen = 0
    x: BaseException | None = e
    while x is not None and seen < 8:
        m = re.match(r"raised exception (\w+)\((.*)\)\s*$", str(x), re.S)
        cls = getattr(errors, m.group(1), None) if m else None
        stack = getattr(x, "real_stack", None) or ()
        ours = bool(stack) and os.path.abspath(stack[-1].filename).startswith(package)
        if ours and isinstance(cls, type) and issubclass(cls, PiecewiseError):
            try:
                args = ast.literal_eval(f"({m.group(2)},)")
            except (ValueError, SyntaxError):
                args = (m.group(2),)
            return cls(*args)
        x, seen = x.__cause__ or x.__context__, seen + 1
    return None


def _fake_failure(e: BaseException) -> str:
    """What failed on the trace's fake tensors: Dynamo's "Explanation:" line (the op and its own
    error), else the error's first line."""
    for line in str(e).splitlines():
        if line.strip().startswith("Explanation:"):
            return line.strip()[len("Explanation:"):].strip()
    return _caused_by(e)


def _caused_by(e: BaseException) -> str:
    """The source line Dynamo blames for a data-dependent guard (its "Caused by:" line), else the
    error's first line."""
    lines = str(e).splitlines()
    for line in lines:
        if line.startswith("Caused by:"):
            return line[len("Caused by:"):].strip()
    return lines[0] if lines else type(e).__name__


_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_hint_overrides", "_specialize_on",
          "_has_dynamo_dim_marking", "_dynamo_unbacked_indices", "_dynamo_shape_ids", "_dynamo_unbacked_bounds")


@contextlib.contextmanager
def _collect_young_only():
    """Keep Python's cyclic GC off the objects that existed before the first call while it traces
    and compiles (``gc.freeze``, undone by ``gc.unfreeze`` after): a compile allocates enough to
    trigger full collections, each walking every torch, sympy and Inductor object. Measured on a
    2-core machine, a cold compile of a 2-piece model spent 0.53 s in the collector, 0.17 s with
    this. Nothing is leaked or kept from collection after the call. A no-op when the collector is
    off or the process froze objects itself (``gc.unfreeze`` would undo that)."""
    import gc

    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _marked_dynamic(pairs: list[tuple[torch.Tensor, int]], unbacked: bool = False):
    """Mark (tensor, dim) pairs dynamic (or unbacked) for one trace, then take the marks off again:
    marks left on a caller's tensor would make the next model's bundle guards refuse that tensor."""
    unmarked = [t for t, _ in pairs if not any(hasattr(t, m) for m in ("_dynamo_dynamic_indices", "_dynamo_unbacked_indices"))]
    from ._torch import dynamo

    try:
        for t, d in pairs:
            if unbacked:
                dynamo.mark_unbacked(t, d)
            else:
                dynamo.mark_dynamic(t, d)
        yield
    finally:
        for t in unmarked:
            for name in _MARKS:
                t.__dict__.pop(name, None)


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
    ``[1, max_num_tokens]`` runs without recompiling. Where the model's own code branches on a
    size (transformers' mask code on a batch of one), the sizes the first trace does not hold for
    get a trace of their own on their first call (a size class, up to
    ``config.max_size_classes``, counted in ``size_class_traces``, each saved for warm starts).

    Raises:
        ConfigError: `model` is not a module, or `dynamic_arg_dims` names no argument.

    Example::

        model = MyDecoder().eval()  # forward(self, input_ids: [batch, tokens] int64) -> logits
        compiled = piecewise.compile(model, piecewise.CompilationConfig(max_num_tokens=512),
                                     dynamic_arg_dims={"input_ids": (0, 1)})
        logits = compiled(input_ids)  # traced and compiled here; any batch x length after it
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"piecewise.compile takes a torch.nn.Module, got {type(model).__name__}; wrap the function in a module")
    config = config or CompilationConfig()
    compiled = CompiledModel(model, config, dynamic_arg_dims or {})
    warn_if_oversubscribed(model)  # once per process, in the background: a CPU model on a busy host (piecewise.threads)
    if dynamic_arg_dims is None and compiled._route is None and config.mode != "none":  # a generation route knows its own dims
        warnings.warn("piecewise.compile without dynamic_arg_dims compiles static shapes; every shape is frozen", stacklevel=2)
    return compiled
