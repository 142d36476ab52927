"""One Dynamo trace of ``forward``, kept in a form that can be saved and rebuilt (SPEC §4.1, §5.5).

`capture` runs Dynamo's full-graph capture on the module's ``forward`` (no graph breaks), hands the
graph to a backend inside a tracing context that still lists the traced code objects, and returns a
`Capture`: the transformed bytecode with its runtime globals (Dynamo's `GraphRuntimeEnv`), the
backend's callable, the guards as a guard manager and - when they can be serialised - as bytes.

`Capture.function` builds the plain function every later call runs (guard-free dispatch: the guards
are never evaluated on the hot path). `dynamo_state` / `rebuild` turn the Dynamo half into bytes and
back, so a warm process can skip the trace entirely (see `piecewise.cache.bundle`).

This is the same machinery as PyTorch's ``torch.compile(...).aot_compile`` (``aot_compile_fullgraph``),
used directly so that the backend sees the traced source files (they enter the cache key) and so the
bundle can hold our own stitching plan next to Dynamo's state.

Guards kept for a warm start are those PyTorch can serialise, guards on the values of module globals
included (``torch.compile(...).aot_compile`` drops every global guard): identity guards
(``ID_MATCH``, ``FUNCTION_MATCH`` and kin) are left out, and so are the
per-parameter and per-submodule guards the module fingerprint already decides (`_fingerprinted`);
what they protect is covered by the bundle's source hashes and module fingerprint
(`piecewise.cache.bundle`).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import logging
import re
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Capture", "capture", "rebuild"]

log = logging.getLogger("piecewise")


@dataclasses.dataclass
class Capture:
    """What one trace produced.

    Attributes:
        runtime_env: Dynamo's `GraphRuntimeEnv` (transformed bytecode, import aliases, globals).
        backend_id: the global name the bytecode calls the compiled graph by.
        compiled_fn: what the backend returned for the graph.
        original_code: the code object of the traced ``forward``.
        guard_manager: Dynamo's guard manager (checked per call in debug mode), or None.
        guards_state: the serialisable guards as bytes (None: a guard could not be serialised).
        traced_code: the code objects Dynamo inlined (their files enter the cache key).
        why_not_saved: why `guards_state` is None, for the log.
        object_guards: guard manager of the guards on object arguments (see `capture`), or None.
    """

    runtime_env: Any
    backend_id: str
    compiled_fn: Callable[..., Any] | None
    original_code: types.CodeType
    guard_manager: Any
    guards_state: bytes | None
    traced_code: list[types.CodeType]
    why_not_saved: str = ""
    object_guards: Any = None

    def function(self, module_globals: dict[str, Any]) -> types.FunctionType:
        """The transformed ``forward`` as a plain function ``f(self, *args, **kwargs)``.

        Its globals are a copy of `module_globals` (the module defining ``forward``) plus Dynamo's
        import aliases and the compiled graph under `backend_id`; the module's own dict is not
        touched. Builtins the bytecode names are passed too: torch 2.11's runtime env neither
        records them nor looks in ``__builtins__`` when it checks the names are all present."""
        import builtins

        refs = getattr(self.runtime_env, "external_refs", ())
        used = {r: getattr(builtins, r) for r in refs if r not in module_globals and hasattr(builtins, r)}
        return self.runtime_env.forward_callable(self.backend_id, self.compiled_fn,
                                                 extra_globals={**used, **module_globals})

    def dynamo_state(self) -> bytes:
        """The Dynamo half (bytecode, runtime globals, guards) as bytes for `rebuild`.

        Raises:
            ValueError: the guards could not be serialised (`why_not_saved`).
            RuntimeError, pickle.PicklingError: a runtime global cannot be pickled.
        """
        from torch._dynamo.aot_compile import AOTCompilePickler
        from torch._dynamo.package import SerializedCode

        if self.guards_state is None:
            raise ValueError(self.why_not_saved or "guards were not serialised")
        # The closure and defaults are the live function's (`rebuild` takes them from it): a
        # decorated forward closes over the undecorated function, which pickles by a name that
        # resolves to the decorator's wrapper.
        env = dataclasses.replace(self.runtime_env, bytecode=SerializedCode.from_code_object(self.runtime_env.bytecode),
                                  closure=None, argdefs=None, kwdefaults=None)
        state = {
            "runtime_env": env,
            "backend_id": self.backend_id,
            "original_code": SerializedCode.from_code_object(self.original_code),
            "guards_state": self.guards_state,
        }
        buf = io.BytesIO()
        pickler = AOTCompilePickler({}, buf)
        pickler.dump(state)
        if pickler.errors:
            raise RuntimeError(f"cannot serialise {list(pickler.errors.values())[:3]} held by the transformed code")
        return buf.getvalue()


def rebuild(data: bytes, compiled_fn: Callable[..., Any] | None, forward: types.FunctionType) -> Capture:
    """A `Capture` from `Capture.dynamo_state` bytes, calling `compiled_fn` for the graph (may be
    set later, before `Capture.function`: the guards can be checked before any artifact loads).

    `forward` is the live function that was traced (``type(module).forward``): its globals, closure
    and defaults are used; the guard manager is rebuilt against its globals. `traced_code` is empty
    (the bundle records source hashes instead).

    Raises:
        Exception: anything unpickling or rebuilding the guards raises (a bundle from another torch
            build, a module that no longer imports); callers fall back to tracing.
    """
    from torch._dynamo.aot_compile import AOTCompileUnpickler
    from torch._dynamo.package import SerializedCode, load_guard_manager, load_guards_state

    state = AOTCompileUnpickler({}, io.BytesIO(data)).load()
    env = dataclasses.replace(state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode),
                              closure=forward.__closure__, argdefs=forward.__defaults__, kwdefaults=forward.__kwdefaults__)
    original = SerializedCode.to_code_object(state["original_code"])
    live = forward.__code__
    if (original.co_code, original.co_consts, original.co_names, original.co_freevars) != (
            live.co_code, live.co_consts, live.co_names, live.co_freevars):
        raise ValueError(f"the bundle was traced from another {forward.__qualname__}")
    # Guards on globals read the module's live values; names Dynamo installed (import aliases, its
    # own globals) exist only in this scope, as they will for the transformed code.
    scope = {**{a: importlib.import_module(m) for a, m in env.import_sources.items()}, **env.used_globals,
             **forward.__globals__}
    guards = load_guard_manager(load_guards_state(state["guards_state"]), original, scope)
    return Capture(env, state["backend_id"], compiled_fn, original, guards, state["guards_state"], [])


#: guards on globals kept in a bundle: they compare values (numbers, strings, tuples, tensor
#: metadata, container sizes), not identities
_GLOBAL_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "TENSOR_MATCH", "LENGTH_CHECK", "DICT_LENGTH",
                                  "DICT_KEYS_MATCH", "TYPE_MATCH"})


_SUBMODULE_STEP = re.compile(r"\._modules\[(['\"])(.+?)\1\]")
_MODULE_DICTS = ("._modules", "._parameters", "._buffers")
_TENSOR_SLOT = re.compile(r"\._(parameters|buffers)\[(['\"])(.+?)\2\]$")
_ATTR_PATH = re.compile(r"\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?$")
#: guard types on module state that compare values or types (never identities) and that the
#: fingerprint decides when their path is one it describes (`_fingerprint_covers`)
_MODULE_VALUE_GUARDS = frozenset({"TYPE_MATCH", "CONSTANT_MATCH", "EQUALS_MATCH", "DICT_KEYS_MATCH", "DICT_LENGTH",
                                  "LENGTH_CHECK"})
_PRIMITIVE_VALUES = (int, float, bool, str, bytes, type(None), complex, torch.dtype, torch.device)


def _exactly_described(value: Any, depth: int = 2) -> bool:
    """Whether the fingerprint's description of an attribute value (two levels deep) pins it down
    exactly: primitives, and containers of them within that depth."""
    if isinstance(value, _PRIMITIVE_VALUES):
        return True
    if depth <= 0:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_exactly_described(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _exactly_described(v, depth - 1) for k, v in value.items())
    return False


def _fingerprint_covers(path: str, root: torch.nn.Module, by_value: bool = False) -> bool:
    """Whether `module_fingerprint` records the value and type at guard path `path` of `root`
    (``L['self']`` followed by submodule steps, then: nothing; a module's ``_modules`` /
    ``_parameters`` / ``_buffers`` dict; one of its parameter or buffer slots; an instance
    attribute, whose value counts only when `by_value` and the fingerprint describes it exactly;
    or a primitive field of an instance attribute that the fingerprint describes)."""
    for prefix in ("L['self']", "self"):
        if path.startswith(prefix):
            rest = path[len(prefix):]
            break
    else:
        return False
    m = root
    while (step := _SUBMODULE_STEP.match(rest)) is not None:
        sub = m._modules.get(step.group(2))
        if not isinstance(sub, torch.nn.Module):
            return False
        m, rest = sub, rest[step.end():]
    if rest == "" or rest in _MODULE_DICTS or _TENSOR_SLOT.fullmatch(rest):
        return True
    attr = _ATTR_PATH.fullmatch(rest)
    if attr is None or attr.group(1) not in m.__dict__ or attr.group(1).startswith("_"):
        return False
    value = m.__dict__[attr.group(1)]
    if attr.group(2) is None:  # its type and identity are recorded; its value when described exactly
        return _exactly_described(value) if by_value else not isinstance(value, torch.nn.Module)
    # one field deeper: the fingerprint describes dataclasses, objects with to_dict and plain
    # objects' __dict__ two levels deep, so a primitive field is recorded by value
    field = attr.group(2)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        held = field in {f.name for f in dataclasses.fields(value)}
    elif callable(getattr(value, "to_dict", None)):
        try:
            held = field in value.to_dict()
        except Exception:
            held = False
    else:
        held = field in getattr(value, "__dict__", {})
    return held and isinstance(getattr(value, field, None), _PRIMITIVE_VALUES)


def _fingerprinted(g: Any, root: torch.nn.Module) -> bool:
    """Guards that `piecewise.cache.bundle.module_fingerprint` already decides, left out of the saved
    guards because they are most of them (per parameter, per submodule) and rebuilding them costs
    more than the rest of a warm start: metadata of parameters and buffers, empty hook dicts and
    absent instance attributes of submodules, types of submodules and their dicts, values of
    their instance attributes (``eps``, a config's ``head_dim``), and which of them are the same
    object (``DUPLICATE_INPUT``; the fingerprint records aliasing). With none of them left, the
    saved guards no longer carry a pickled copy of the module tree (~35 KB a decoder layer)."""
    name = g.name
    if g.guard_type == "TENSOR_MATCH":
        return "._parameters[" in name or "._buffers[" in name
    if g.guard_type in ("EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT"):
        return name.startswith(("self", "L['self']"))
    if g.guard_type in _MODULE_VALUE_GUARDS:
        return _fingerprint_covers(name, root, by_value=g.guard_type != "TYPE_MATCH")
    if g.guard_type == "DUPLICATE_INPUT":
        other = getattr(getattr(g.orig_guard, "create_fn", None), "keywords", {}).get("source_b")
        other_name = getattr(other, "name", None)
        other_name = other_name() if callable(other_name) else other_name
        return (isinstance(other_name, str) and _fingerprint_covers(name, root)
                and _fingerprint_covers(other_name, root))
    return False


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, backend: Callable[..., Any], *, full_guards: bool = False,
            object_args: tuple[str, ...] = ()) -> Capture:
    """Trace ``module.forward(*args, **kwargs)`` once with Dynamo (full graph) and compile the graph
    with `backend(gm, example_inputs)`.

    Args:
        full_guards: also build the unfiltered guard manager (debug mode checks every guard,
            identity and global guards included); otherwise the guard manager is the serialisable one.
        object_args: names of arguments that are plain objects (no value equality, e.g. a cache
            object): `Capture.object_guards` is then a guard manager of the guards rooted at them
            only, cheap enough to check on every call.

    Raises:
        torch._dynamo.exc.Unsupported: a graph break (the model cannot be captured as one graph).
        torch._dynamo.exc.UserError, ConstraintViolationError: dynamic-dim marking conflicts.
        Whatever `backend` raises.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.guards import CheckFunctionManager
    from torch._dynamo.hooks import Hooks
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._dynamo.variables.torch_function import torch_function_mode_stack_state_mgr
    from torch._guards import TracingContext

    fn = type(module).forward
    with get_metrics_context(), dynamo_timed("piecewise_capture"), torch_function_mode_stack_state_mgr:
        # The class's forward bound to the module, not ``module.forward``: that may be the compiled
        # model itself (``model.forward = piecewise.compile(model)``, the usual torch.compile idiom).
        out = convert_frame.fullgraph_capture(types.MethodType(fn, module), args, kwargs)
        gco = out.graph_capture_output
        bi = out.backend_input
        if bi is None:
            raise torch._dynamo.exc.Unsupported("forward produced no graph (no tensor operations)")
        ctx = TracingContext(bi.fake_mode)
        ctx.tensor_to_context = bi.tensor_to_context
        ctx.traced_code = list(gco.traced_code)
        with torch._guards.tracing(ctx):
            compiled = backend(bi.graph_module, bi.example_inputs)

        unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        # guards on what forward closes over (a decorator's wrapped function): a warm start uses the
        # live closure, whose code the source hashes cover
        closure_sources = tuple(p for v in fn.__code__.co_freevars for p in (f"{v}.", f"{v}[", f"L['{v}']")) + tuple(fn.__code__.co_freevars)

        def serialisable(entries, with_globals=True):
            return [not (g.guard_type in unsupported or any(t in unsupported for t in g.derived_guard_types)
                         or _fingerprinted(g, module) or (closure_sources and g.name.startswith(closure_sources))
                         or (g.is_global and (not with_globals or g.guard_type not in _GLOBAL_VALUE_GUARDS)))
                    for g in entries]

        guards_state: bytes | None = None
        why = ""
        manager = None
        # Guards on the values of globals first; a global whose guard drags an unpicklable object
        # along (a custom op's namespace) costs those guards, not the bundle: retry without them.
        # Dicts whose key order Dynamo relies on (a ModuleList's ``_modules``): the fingerprint
        # records module names in order, so the saved guards need not reach into the module.
        og = gco.output_graph
        key_order = og.guard_on_key_order
        for with_globals in (True, False):
            try:
                og.guard_on_key_order = {s for s in key_order if not _fingerprint_covers(s.name, module)}
                try:
                    check = gco.build_guards(fn.__code__, hooks=Hooks(guard_filter_fn=lambda e: serialisable(e, with_globals)),
                                             save=True, strict_error=True)
                finally:
                    og.guard_on_key_order = key_order
                guards_state, manager = check.guards_state, check.guard_manager
                if not with_globals:
                    log.info("guards on global values could not be saved (%s); the bundle relies on source hashes for them", why)
                break
            except Exception as e:  # a guard PyTorch cannot serialise: run fine, just no warm bundle
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if full_guards or manager is None:
            manager = gco.build_guards(fn.__code__).guard_manager
        object_guards = None
        if object_args:
            roots = set(object_args)
            object_guards = gco.build_guards(
                fn.__code__, hooks=Hooks(guard_filter_fn=lambda es: [_guard_root(g.name) in roots for g in es])).guard_manager
    env = gco.get_runtime_env()
    # Globals Dynamo installed for the transformed code (``___module_collections_<id>_c0`` and kin)
    # live in the module's dict of this process only: carry them with the code.
    for name in env.external_refs:
        if name.startswith("___") and name not in env.used_globals and name not in env.import_sources and name in gco.f_globals:
            env.used_globals[name] = gco.f_globals[name]
    return Capture(env, bi.backend_id, compiled, fn.__code__, manager, guards_state, list(gco.traced_code), why,
                   object_guards)


_ROOT = re.compile(r"(?:L\[['\"](\w+)['\"]\]|([A-Za-z_]\w*))")


def _guard_root(name: str) -> str:
    """The frame local a guard's source starts from (``L['box'].scale`` and ``box.scale`` -> ``box``);
    "" for guards on no local (global state, ``G[...]``)."""
    m = _ROOT.match(name or "")
    if m is None or name.startswith("G["):
        return ""
    return m.group(1) or m.group(2)
