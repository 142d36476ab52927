"""One Dynamo trace of ``forward``, kept in a form that can be saved and rebuilt (docs/design.md §4.1, §5.5).

`capture` runs Dynamo's full-graph capture on the module's ``forward`` (no graph breaks), hands the
graph to a backend inside a tracing context that still lists the traced code objects, and returns a
`Trace`: the transformed bytecode with its runtime globals (Dynamo's `GraphRuntimeEnv`), the
backend's callable, the guards as a guard manager and - when they can be serialised - as bytes.

`Trace.function` builds the plain function every later call runs (guard-free dispatch: the guards
are never evaluated on the hot path). `dynamo_state` / `rebuild` turn the Dynamo half into bytes and
back, so a warm process can skip the trace entirely (see `piecewise.warmstart`).

This is the same machinery as PyTorch's ``torch.compile(...).aot_compile`` (``aot_compile_fullgraph``),
used directly so that the backend sees the traced source files (they enter the cache key) and so the
bundle can hold our own stitching plan next to Dynamo's state.

Guards kept for a warm start are those PyTorch can serialise, guards on the values of module globals
included (``torch.compile(...).aot_compile`` drops every global guard): identity guards
(``ID_MATCH``, ``FUNCTION_MATCH`` and kin) are left out, and so are the
per-parameter and per-submodule guards the module fingerprint already decides (`_fingerprinted`);
what they protect is covered by the bundle's source hashes and module fingerprint
(`piecewise.warmstart`). Dynamo rebuilds a loaded guard on a global from the saved globals, and
a module or class is saved by reference, so ``G['cfg'].SCALE == 2.0`` would be rebuilt with the live
value; the value each saved global guard compares is therefore recorded at trace time
(`Trace.global_values`, canonical data) and compared with the live one before a warm start
(`changed_globals`). A value with no canonical record means no bundle (logged).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import logging
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from .backend import SOURCE_META, is_state_source
from .state import note_read

__all__ = ["Trace", "trace", "rebuild"]

log = logging.getLogger("piecewise")


@dataclasses.dataclass
class Trace:
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
        global_values: what each saved guard on a global compares, recorded at trace time
            (``"<guard type> <source>"`` -> canonical value, `_recorded`); a warm start compares them
            with the live values (`changed_globals`).
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
    global_values: dict[str, Any] = dataclasses.field(default_factory=dict)

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
        from ._torch.dynamo import AOTCompilePickler, SerializedCode

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
            "global_values": self.global_values,
        }
        buf = io.BytesIO()
        pickler = AOTCompilePickler({}, buf)
        pickler.dump(state)
        if pickler.errors:
            raise RuntimeError(f"cannot serialise {list(pickler.errors.values())[:3]} held by the transformed code")
        return buf.getvalue()


def rebuild(data: bytes, compiled_fn: Callable[..., Any] | None, forward: types.FunctionType) -> Trace:
    """A `Trace` from `Trace.dynamo_state` bytes, calling `compiled_fn` for the graph (may be
    set later, before `Trace.function`: the guards can be checked before any artifact loads).

    `forward` is the live function that was traced (``type(module).forward``): its globals, closure
    and defaults are used; the guard manager is rebuilt against its globals. `traced_code` is empty
    (the bundle records source hashes instead).

    Raises:
        GuardsNotBuilt: the guards cannot be built against this process's state.
        Exception: anything unpickling raises (a bundle from another torch build, a module that no
            longer imports); callers fall back to tracing.
    """
    from ._torch.dynamo import AOTCompileUnpickler, SerializedCode, load_guard_manager, load_guards_state

    state = AOTCompileUnpickler({}, io.BytesIO(data)).load()
    env = dataclasses.replace(state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode),
                              closure=forward.__closure__, argdefs=forward.__defaults__, kwdefaults=forward.__kwdefaults__)
    original = SerializedCode.to_code_object(state["original_code"])
    live = forward.__code__
    if (original.co_code, original.co_consts, original.co_names, original.co_freevars) != (
            live.co_code, live.co_consts, live.co_names, live.co_freevars):
        raise ValueError(f"the bundle was traced from another {forward.__qualname__}")
    trace = Trace(env, state["backend_id"], compiled_fn, original, None, state["guards_state"], [],
                  global_values=state["global_values"])
    guards_state = load_guards_state(state["guards_state"])  # unpickling: what fails here is damage
    try:
        trace.guard_manager = load_guard_manager(guards_state, original, _runtime_scope(env, forward))
    except Exception as e:
        raise GuardsNotBuilt(f"{type(e).__name__}: {e}", trace) from e
    return trace


class GuardsNotBuilt(Exception):
    """A bundle's saved guards could not be rebuilt in this process: a guard reaches what this
    process does not have. Dynamo builds a guard on a dict's item from the key's position
    (``list(dict.keys(d))[3]``), so a registry filled in another order (transformers'
    ``_CAN_RECORD_REGISTRY``, one key per model class built so far) raises IndexError there. The
    bundle is intact and fits processes like the one that saved it: a miss, not damage.

    Attributes:
        trace: the rebuilt `Trace` without its guard manager, for `changed_globals`.
    """

    def __init__(self, why: str, trace: Trace) -> None:
        super().__init__(why)
        self.trace = trace


def _runtime_scope(env: Any, forward: types.FunctionType) -> dict[str, Any]:
    """The globals saved guards read in this process: the module's live values; names Dynamo
    installed (import aliases, its own globals) exist only in this scope, as they will for the
    transformed code."""
    return {**{a: importlib.import_module(m) for a, m in env.import_sources.items()}, **env.used_globals,
            **forward.__globals__}


def changed_globals(cap: Trace, forward: types.FunctionType) -> list[str]:
    """The saved guards on globals whose live value differs from the one recorded at trace time.

    Dynamo rebuilds a loaded guard with the value found in the saved globals; a module or class is
    saved by reference, so a guard reaching through one (``G['cfg'].SCALE == 2.0``, ``cfg`` set
    from an environment variable at import) would be rebuilt with the live value and always pass.
    Each recorded source is evaluated against this process's globals instead and compared with the
    recording (`_recorded`); one that cannot be read now counts as changed."""
    if not cap.global_values:
        return []
    import builtins

    scope = {"G": _runtime_scope(cap.runtime_env, forward), "L": {}}
    helpers = {**_closure_vars(), "__builtins__": builtins}
    out = []
    for key, was in cap.global_values.items():
        guard_type, source = key.split(" ", 1)
        try:
            now = _recorded(guard_type, eval(source, helpers, scope))  # noqa: S307 - a Dynamo source name we saved
        except Exception as e:
            out.append(f"{source} cannot be read ({type(e).__name__}: {e})")
            continue
        if now != was:
            out.append(f"{source} is {_show(now)}, traced with {_show(was)}")
    return out


def _closure_vars() -> dict[str, Any]:
    """The helper names Dynamo's source names may call (``___odict_getitem`` and kin)."""
    try:
        from ._torch.dynamo import guard_closure_vars

        return dict(guard_closure_vars())
    except Exception as e:  # another torch: sources of the plain kinds need none
        log.debug("Dynamo's guard closure helpers are not available here (%s: %s)", type(e).__name__, e)
        return {}


def _show(recorded: Any) -> str:
    """A record as the user wrote the value (``3.0``, ``'a'``), else the record itself, shortened."""
    if isinstance(recorded, tuple) and len(recorded) == 2 and recorded[0] in ("float", "complex"):
        return recorded[1]
    if isinstance(recorded, tuple) and len(recorded) == 2 and recorded[0] in ("bool", "int", "str", "bytes", "NoneType"):
        return repr(recorded[1])
    text = repr(recorded)
    return text if len(text) <= 80 else text[:77] + "..."


class Unrecordable(Exception):
    """A guarded global value with no canonical record (an object compared by ``==`` of its own)."""


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _canonical(v: Any, depth: int = 0) -> Any:
    """A picklable record of `v` (primitives, containers of them, dtypes, devices, enums, types)
    that compares equal exactly when the values do, type included (``2`` and ``2.0`` differ).

    Raises:
        Unrecordable: any other object (its ``==`` is its own), or nesting deeper than 32.
    """
    import enum

    t = type(v)
    if depth > 32:
        raise Unrecordable("nested too deep")
    if isinstance(v, enum.Enum):
        return ("enum", _type_name(t), v.name)
    if t in (bool, int, str, bytes, type(None)):
        return (t.__name__, v)
    if t in (float, complex):
        return (t.__name__, repr(v))  # repr: nan equals nan, -0.0 differs from 0.0
    if t in (torch.dtype, torch.device, torch.layout, torch.memory_format):
        return (t.__name__, str(v))
    if isinstance(v, type):
        return ("type", _type_name(v))
    if isinstance(v, (tuple, list)) and (t in (tuple, list, torch.Size) or hasattr(v, "_fields")):
        return (_type_name(t), tuple(_canonical(x, depth + 1) for x in v))
    if isinstance(v, dict) and t.__module__ in ("builtins", "collections"):
        return (_type_name(t), tuple((_canonical(k, depth + 1), _canonical(x, depth + 1)) for k, x in v.items()))
    if t in (set, frozenset):
        return (t.__name__, tuple(sorted((_canonical(x, depth + 1) for x in v), key=repr)))
    if t in (range, slice):
        return (t.__name__, tuple(_canonical(x, depth + 1) for x in (v.start, v.stop, v.step)))
    raise Unrecordable(f"a {_type_name(t)}")


def _callable_name(fn: Any) -> str:
    fn = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def _recorded(guard_type: str, value: Any) -> Any:
    """What a guard of `guard_type` compares about `value`, as a canonical record.

    Raises:
        Unrecordable: see `_canonical`.
    """
    if guard_type == "TYPE_MATCH":
        return _type_name(type(value))
    if guard_type in ("LENGTH_CHECK", "DICT_LENGTH"):
        return len(value)
    if guard_type == "DICT_KEYS_MATCH":
        if isinstance(value, dict) and value and all(type(k) is int for k in value) and all(map(callable, value.values())):
            # a hook dict (``_global_module_registration_hooks``): its keys are handle ids from a
            # process-wide counter, so the record is which hooks, in order
            return ("hooks", tuple(_callable_name(v) for v in value.values()))
        return tuple(_canonical(k) for k in dict.keys(value)) if isinstance(value, dict) else _canonical(tuple(value))
    if guard_type in _GLOBAL_IDENTITY_GUARDS:
        return identity(value)
    if guard_type == "TENSOR_MATCH":
        return (_type_name(type(value)), str(value.dtype), str(value.device), tuple(value.shape), tuple(value.stride()),
                bool(value.requires_grad))
    return _canonical(value)


#: identity guards on globals: not kept in a bundle, but recorded (`identity`) when they name a
#: function, class or builtin, and compared by name at a warm start
_GLOBAL_IDENTITY_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH"})


def identity(value: Any) -> Any:
    """A function (module, qualified name and code digest), class or builtin (module and name) as a
    record that tells two of them apart across processes.

    Raises:
        Unrecordable: any other object (identity has no meaning in another process).
    """
    from .fingerprint import code_digest

    value = getattr(value, "__func__", value)  # a bound method: its function
    code = getattr(value, "__code__", None)
    if isinstance(code, types.CodeType):
        return ("function", getattr(value, "__module__", None), getattr(value, "__qualname__", None), code_digest(code))
    if isinstance(value, type):
        return ("type", _type_name(value))
    if isinstance(value, (types.BuiltinFunctionType, types.ModuleType, types.MethodDescriptorType,
                          types.WrapperDescriptorType, types.MethodWrapperType)):
        return ("builtin", getattr(value, "__module__", None), getattr(value, "__qualname__", None) or getattr(value, "__name__", None))
    raise Unrecordable(f"a {_type_name(type(value))} compared by identity")


#: guards on globals kept in a bundle: they compare values (numbers, strings, tuples, tensor
#: metadata, container sizes), not identities
_GLOBAL_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "TENSOR_MATCH", "LENGTH_CHECK", "DICT_LENGTH",
                                  "DICT_KEYS_MATCH", "TYPE_MATCH"})


#: globals of piecewise's own modules (Dynamo's import aliases for them): process bookkeeping such
#: as the state epoch (`piecewise.state`), which traced registration hooks read; not model inputs
_OWN_STATE = ("G['__import_piecewise_dot_", "G['__import_piecewise']")

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
        except Exception as e:
            log.debug("%s.to_dict() failed (%s: %s); %s is not taken as fingerprinted", type(value).__qualname__,
                      type(e).__name__, e, field)
            held = False
    else:
        held = field in getattr(value, "__dict__", {})
    return held and isinstance(getattr(value, field, None), _PRIMITIVE_VALUES)


def _record_sources(gm: torch.fx.GraphModule, example_inputs: Any, id_to_sources: dict[int, list[Any]]) -> None:
    """Put each graph input's Dynamo source name on its placeholder (`backend.SOURCE_META`), so the
    backend can tell the forward's arguments from module state by where Dynamo read them, not by
    the placeholder's name (an argument named ``self_scale`` becomes ``l_self_scale_``, much like
    the attribute ``self.scale``). Dynamo keys the sources by the identity of the real inputs; a
    tensor reached both ways (a buffer passed as an argument too) is recorded as the argument."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        sources = id_to_sources.get(id(value)) if isinstance(value, torch.Tensor) else None
        if sources:
            names = [s.name for s in sources]
            node.meta[SOURCE_META] = next((n for n in names if not is_state_source(n)), names[0])


def _fingerprinted(g: Any, root: torch.nn.Module) -> bool:
    """Guards that `piecewise.warmstart.module_fingerprint` already decides, left out of the saved
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


def trace(module: torch.nn.Module, args: tuple, kwargs: dict, backend: Callable[..., Any], *, full_guards: bool = False,
            object_args: tuple[str, ...] = ()) -> Trace:
    """Trace ``module.forward(*args, **kwargs)`` once with Dynamo (full graph) and compile the graph
    with `backend(gm, example_inputs)`.

    Args:
        full_guards: also build the unfiltered guard manager (debug mode checks every guard,
            identity and global guards included); otherwise the guard manager is the serialisable one.
        object_args: names of arguments that are plain objects (no value equality, e.g. a cache
            object): `Trace.object_guards` is then a guard manager of the guards rooted at them
            only, cheap enough to check on every call.

    Raises:
        torch._dynamo.exc.Unsupported: a graph break (the model cannot be captured as one graph).
        torch._dynamo.exc.UserError, ConstraintViolationError: dynamic-dim marking conflicts.
        Whatever `backend` raises.
    """
    from ._torch.dynamo import dynamo_timed, get_metrics_context, torch_function_mode_stack_state_mgr

    fn = type(module).forward
    with get_metrics_context(), dynamo_timed("piecewise_trace"), torch_function_mode_stack_state_mgr:
        gco, bi, compiled = _capture(module, fn, args, kwargs, backend)
        kept = _SavedGuardFilter(module, fn)
        guards_state, manager, why = _saved_guards(gco, module, fn, kept)
        if kept.unrecorded and guards_state is not None:
            guards_state, why = None, f"the guarded value of global {kept.unrecorded[0]} cannot be recorded for a warm start"
        if full_guards or manager is None:
            manager = _build_guards(gco, fn.__code__).guard_manager
        object_guards = _object_guards(gco, fn, object_args)
    # What of the module's plain attributes this trace read: `state.describe` compares those (an
    # assignment to one moves the epoch, `state.watch`), not attributes no forward reads.
    note_read(module, kept.read)
    return Trace(_runtime_env(gco), bi.backend_id, compiled, fn.__code__, manager, guards_state, list(gco.traced_code), why,
                   object_guards, global_values=kept.global_values)


def _capture(module: torch.nn.Module, fn: types.FunctionType, args: tuple, kwargs: dict,
             backend: Callable[..., Any]) -> tuple[Any, Any, Any]:
    """Dynamo's full-graph capture of `fn` bound to `module`, and `backend` run on its graph inside
    a tracing context that lists the traced code objects: ``(graph capture output, backend input,
    what the backend returned)``.

    Raises:
        torch._dynamo.exc.Unsupported: a graph break, or a forward with no tensor operations.
    """
    from ._torch.dynamo import Unsupported, convert_frame
    from ._torch.fx import TracingContext, tracing

    # The class's forward bound to the module, not ``module.forward``: that may be the compiled
    # model itself (``model.forward = piecewise.compile(model)``, the usual torch.compile idiom).
    out = convert_frame.fullgraph_capture(types.MethodType(fn, module), args, kwargs)
    gco = out.graph_capture_output
    bi = out.backend_input
    if bi is None:
        raise Unsupported("forward produced no graph (no tensor operations)")
    _record_sources(bi.graph_module, bi.example_inputs, gco.output_graph.tracked_fakes_id_to_source)
    ctx = TracingContext(bi.fake_mode)
    ctx.tensor_to_context = bi.tensor_to_context
    ctx.traced_code = list(gco.traced_code)
    with tracing(ctx):
        compiled = backend(bi.graph_module, bi.example_inputs)
    return gco, bi, compiled


class _SavedGuardFilter:
    """Dynamo's guard filter for the saved guards (`_saved_guards`): keeps the guards PyTorch can
    serialise that neither the module fingerprint (`_fingerprinted`) nor the source hashes (what
    ``forward`` closes over, identities of globals) stand in for. On the way it records what each
    guard on a global compares, as traced (`global_values`; a warm start compares it with the live
    value itself, `changed_globals`, with or without Dynamo's own global guards saved), the globals
    whose value cannot be recorded (`unrecorded`), and the plain module attributes the trace read
    (`read`, `_read_attributes`; None: not known)."""

    def __init__(self, module: torch.nn.Module, fn: types.FunctionType) -> None:
        from ._torch.dynamo import CheckFunctionManager

        self.module, self.fn = module, fn
        self.unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        # guards on what forward closes over (a decorator's wrapped function): a warm start uses the
        # live closure, whose code the source hashes cover
        freevars = fn.__code__.co_freevars
        self.closure_sources = tuple(p for v in freevars for p in (f"{v}.", f"{v}[", f"L['{v}']")) + tuple(freevars)
        self.global_values: dict[str, Any] = {}
        self.unrecorded: list[str] = []
        self.read: frozenset[str] | None = None
        self._read_known = False

    def __call__(self, entries: Any, with_globals: bool = True) -> list[bool]:
        if not self._read_known:
            self._read_known = True
            try:
                self.read = _read_attributes(entries, self.fn)
            except Exception as e:  # a guard named in a way not foreseen: every attribute counts
                log.debug("the attributes the trace read are not known (%s: %s)", type(e).__name__, e)
        keep = [not (g.guard_type in self.unsupported or any(t in self.unsupported for t in g.derived_guard_types)
                     or _fingerprinted(g, self.module) or (self.closure_sources and g.name.startswith(self.closure_sources))
                     or (g.is_global and g.guard_type not in _GLOBAL_VALUE_GUARDS))
                for g in entries]
        for g, k in zip(entries, keep):
            self._record_global(g, k)
        return [k and not (g.is_global and not with_globals) for g, k in zip(entries, keep)]

    def _record_global(self, g: Any, kept: bool) -> None:
        """Record what guard `g` on a global compares (`global_values`), if it is one."""
        if (not kept and g.is_global and g.guard_type in _GLOBAL_IDENTITY_GUARDS and g.has_value
                and not g.orig_guard.name.startswith(_OWN_STATE)
                and "hooks[" not in g.orig_guard.name  # keyed by handle ids; recorded as which hooks
                and not g.orig_guard.name.startswith("G['__builtins")):  # Python's builtins
            # which function, class or builtin a global names (``ACT = gelu`` or ``silu``,
            # chosen at import): Dynamo's identity guard is not saved, so record it by name
            try:
                self.global_values[f"{g.guard_type} {g.orig_guard.name}"] = _recorded(g.guard_type, g.value)
            except Unrecordable:
                pass  # another object: not recorded, as before (source hashes and the fingerprint stand in)
        if kept and g.is_global and not g.orig_guard.name.startswith(_OWN_STATE):
            name = g.orig_guard.name
            try:
                if not g.has_value:
                    raise Unrecordable("no value")
                self.global_values[f"{g.guard_type} {name}"] = _recorded(g.guard_type, g.value)
            except Exception as e:
                self.unrecorded.append(f"{name} ({g.guard_type}: {e})")


def _saved_guards(gco: Any, module: torch.nn.Module, fn: types.FunctionType,
                  keep: _SavedGuardFilter) -> tuple[bytes | None, Any, str]:
    """The guards a bundle saves, built through `keep`: ``(serialised guards or None, their guard
    manager or None, why they could not be serialised)``.

    Guards on the values of globals first; a global whose guard drags an unpicklable object along
    (a custom op's namespace) costs those guards, not the bundle: retry without them. Dicts whose
    key order Dynamo relies on (a ModuleList's ``_modules``): the fingerprint records module names
    in order, so the saved guards need not reach into the module."""
    from ._torch.dynamo import Hooks

    guards_state: bytes | None = None
    why = ""
    manager = None
    og = gco.output_graph
    key_order = og.guard_on_key_order
    for with_globals in (True, False):
        try:
            og.guard_on_key_order = {s for s in key_order if not _fingerprint_covers(s.name, module)}
            try:
                check = _build_guards(gco, fn.__code__, hooks=Hooks(guard_filter_fn=lambda e: keep(e, with_globals)),
                                      save=True, strict_error=True)
            finally:
                og.guard_on_key_order = key_order
            guards_state, manager = check.guards_state, check.guard_manager
            if not with_globals:
                log.info("Dynamo's guards on global values could not be saved (%s); the bundle compares the recorded "
                         "values itself", why)
            break
        except Exception as e:  # a guard PyTorch cannot serialise: run fine, just no warm bundle
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return guards_state, manager, why


def _object_guards(gco: Any, fn: types.FunctionType, object_args: tuple[str, ...]) -> Any:
    """A guard manager of the guards rooted at the arguments named in `object_args` (None: none)."""
    from ._torch.dynamo import Hooks

    if not object_args:
        return None
    roots = set(object_args)
    return _build_guards(gco, fn.__code__,
                         hooks=Hooks(guard_filter_fn=lambda es: [_guard_root(g.name) in roots for g in es])).guard_manager


def _runtime_env(gco: Any) -> Any:
    """Dynamo's runtime env of the transformed code, carrying the globals Dynamo installed for it
    (``___module_collections_<id>_c0`` and kin): those live in the module's dict of this process only."""
    env = gco.get_runtime_env()
    for name in env.external_refs:
        if name.startswith("___") and name not in env.used_globals and name not in env.import_sources and name in gco.f_globals:
            env.used_globals[name] = gco.f_globals[name]
    return env


def _self_roots(fn: types.FunctionType) -> tuple[str, ...]:
    """How the trace's guard sources name the module (``forward``'s first argument): ``self`` and
    ``L['self']``, or ``args[0]`` and ``L['args'][0]`` for a decorated forward taking ``*args``."""
    code = fn.__code__
    if code.co_argcount:
        name = code.co_varnames[0]
        return (name, f"L['{name}']")
    if code.co_flags & inspect.CO_VARARGS:
        name = code.co_varnames[code.co_argcount + code.co_kwonlyargcount]
        return (f"{name}[0]", f"L['{name}'][0]")
    return ()


_MODULE_STEPS = r"((?:\._modules\[(['\"])(?:(?!\2).)*\2\])*)"  # groups 1 (the steps) and 2
#: guards naming the attribute in their arguments, on the module their source names: Dynamo's
#: check that an attribute is absent from an instance dict (a class attribute read, ``forward``),
#: and ``hasattr`` / ``getattr(self, name, default)`` on an absent attribute
_ATTR_ARGUMENT_GUARDS = frozenset({"NOT_PRESENT_IN_GENERIC_DICT", "HASATTR"})
#: guards that pin a whole module by identity (a module Dynamo specialises, ``torch._dynamo.mark_static``
#: on its class): what the trace read inside it has no guard of its own
_IDENTITY_GUARDS = frozenset({"NN_MODULE", "ID_MATCH"})


def _read_attributes(entries: Any, fn: types.FunctionType) -> frozenset[str] | None:
    """The module's plain attributes the trace read, as dotted paths from the module
    (``"model.layers.0.input_layernorm.variance_epsilon"``), from the sources of its guards (every
    attribute whose value, type or identity the trace depends on has a guard, ``CONSTANT_MATCH
    L['self']._modules['norm'].eps`` and kin), with the attributes it found absent
    (`_ATTR_ARGUMENT_GUARDS`); module internals (``_modules``, ``_parameters``...) left out.
    None when they cannot be told: the module's name in the guards is not known, or a module of
    the tree is pinned by identity (`_IDENTITY_GUARDS`), so reads inside it have no guards."""
    from .state import MODULE_INTERNALS

    roots = _self_roots(fn)
    if not roots:
        return None
    root = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))
    # ``<root>._modules['a']._modules['b'].name``, or ``....__dict__['name']``
    attr = re.compile(rf"(?<![\w.\]'\"])(?:{root}){_MODULE_STEPS}\.(?:__dict__\[(['\"])(\w+)\3\]|([A-Za-z_]\w*))")
    module_only = re.compile(rf"(?:{root}){_MODULE_STEPS}")
    step = re.compile(r"\._modules\[(['\"])(.*?)\1\]")

    def path(steps: str, name: str) -> str:
        return ".".join([*(m.group(2) for m in step.finditer(steps)), name])

    out = set()
    for g in entries:
        name = g.name or ""
        for m in attr.finditer(name):
            found = m.group(4) or m.group(5)
            if found not in MODULE_INTERNALS:
                out.add(path(m.group(1), found))
        if g.guard_type in _ATTR_ARGUMENT_GUARDS or g.guard_type in _IDENTITY_GUARDS:
            m = module_only.fullmatch(name)
            if m is None:
                continue
            if g.guard_type in _IDENTITY_GUARDS:
                return None
            named = getattr(getattr(g.orig_guard, "create_fn", None), "keywords", {}).get("attr")
            if isinstance(named, str) and named not in MODULE_INTERNALS:
                out.add(path(m.group(1), named))
    return frozenset(out)


_ROOT = re.compile(r"(?:L\[['\"](\w+)['\"]\]|([A-Za-z_]\w*))")


def _guard_root(name: str) -> str:
    """The frame local a guard's source starts from (``L['box'].scale`` and ``box.scale`` -> ``box``);
    "" for guards on no local (global state, ``G[...]``)."""
    m = _ROOT.match(name or "")
    if m is None or name.startswith("G["):
        return ""
    return m.group(1) or m.group(2)


def _build_guards(gco: Any, code: Any, **kwargs: Any) -> Any:
    """``gco.build_guards(code, **kwargs)`` (Dynamo's guard manager from a finished capture), each
    call from fresh export information on the guards.

    A trace builds guards up to four times (saved guards with and without globals, the runtime
    manager, the object-argument guards). Each build records, on Dynamo's guard objects, which
    object every guard checked; torch 2.11 raises when a later build finds another object than the
    earlier one did (``Guarded object must be identical``), as transformers' ``config.
    per_layer_config`` gives a new view at every access: a plain forward of a transformers model
    with a cache failed its trace so. That record is only what the guard export reports; the
    checks themselves are built anew each time."""
    for guard in getattr(gco.output_graph, "guards", ()):
        for field in ("guard_types", "code_list", "obj_weakref", "guarded_class_weakref"):
            if getattr(guard, field, None) is not None:
                object.__setattr__(guard, field, None)
    return gco.build_guards(code, **kwargs)
