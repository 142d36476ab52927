"""Module state the trace read, and a cheap way to notice that it changed.

A compiled forward reads more than its arguments: parameters and buffers (Dynamo lifts them into
graph inputs, so compiled code is specialised to their dtype, device, shape and strides, and a
captured graph to their addresses), tensors kept as plain module attributes, and the modules'
``training`` flags. Checking all of that on every call costs about 80 ns a tensor with Dynamo's
C++ tensor check (8 us for 100 tensors on a 2-core x86 machine), far above the dispatch budget.

Instead every change that goes through ``torch.nn.Module`` moves one process-wide counter, the
*state epoch* (`epoch`), and a compiled model compares the epoch it last verified with the current
one on every call (one integer comparison). Only when the epoch moved does it describe its module
again (`describe`, O(parameters)) and compare the description with the one taken after the trace
(`diff`). What moves the epoch:

* parameter, buffer and submodule (re)assignment and registration (``m.w = nn.Parameter(...)``,
  ``m.cache = torch.zeros(...)`` for a buffer, ``register_buffer``, ``load_state_dict(assign=True)``,
  ``m.block = nn.Linear(...)``): torch's public global registration hooks;
* ``Module._apply``, behind ``.to()``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.double()``,
  ``.cuda()``, ``.cpu()``, ``.type()``, ``.to_empty()``, ``.share_memory()``;
* ``Module.train`` / ``.eval()``;
* forward hooks and pre-hooks registered on any module (``register_forward_hook``,
  ``register_forward_pre_hook``) or for every module (``register_module_forward_hook``,
  ``register_module_forward_pre_hook``): the trace inlined the hooks present at the time;
* ``register_parameter`` (``m.lin.bias = None`` registers a None parameter without torch's hook)
  and ``del m.attr``;
* removing a forward hook or pre-hook (``RemovableHandle.remove``, also behind ``with handle:``),
  which unregisters it from its module's dict without any torch hook (the compiled code kept
  running it); only module forward-hook handles, not a tensor's or optimizer's;
* a plain attribute assigned on a module of a compiled model's tree that a trace read
  (``norm.eps = 10.0``, ``attn.num_heads = 2``, ``block.use_gate = False``, ``m.act =
  some_callable``, ``m.training = False``, or ``m.scale = 2.0`` where forward did
  ``getattr(self, "scale", None)`` or read a class attribute ``scale``): ``Module.__setattr__`` is
  wrapped, and the wrapper moves the epoch for a *watched* module and name (`watch`). `describe`
  watches every module it walks, with the names the traces of the root read on it (`note_read`:
  `piecewise.trace` takes them from the sources of the trace's guards; all names when not known,
  as after a warm start); an attribute no trace read (``m.note = "x"``) moves nothing. One dict
  lookup a module assignment anywhere in the process, nothing on the call path.

Those without a hook in torch get a thin wrapper, installed on ``nn.Module`` (and the two global
registration functions) when the first model is compiled and taken off again when the last compiled model is
freed (`install`, `piecewise._torch.nn`). Dynamo compares
``Module.__setattr__`` by identity with ``torch.nn.Module.__setattr__`` read when it traces, so the
wrapper installed there is still recognised; a ``self.x = ...`` that forward itself runs is traced
through it (``torch.compiler.is_compiling()`` is its first test, so the trace reads none of this
module's state) and replayed by the compiled code with ``object.__setattr__``, moving no epoch.
Tensors held as plain attributes, in containers or on plain objects the module holds are checked
by identity on every call (`plain_tensors`), since assignments inside a container or an object
pass through no module. What is written past ``Module.__setattr__`` (``object.__setattr__(m,
...)``, ``m.__dict__[k] = v``, an attribute of a plain object the module holds, a class attribute)
stays the user's responsibility (see README "What to know").

Cost measured with ``benchmarks/module_attributes.py`` (SmolLM2-shaped, 397 modules): evaluating the
trace's own Dynamo guards on module attribute values instead took 10.8 us a call with the C++ guard
manager (its CONSTANT_MATCH / EQUALS_MATCH / ID_MATCH guards only; 48 us with type and hook-dict
guards), far above the dispatch budget; the epoch adds nothing to a call.
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from typing import Any

import torch

from ._torch.dispatch import is_any_autocast_enabled
from ._torch.nn import global_forward_hooks, install_module_patches, uninstall_module_patches

__all__ = ["epoch", "bump", "install", "watch", "watched", "note_read", "read_attributes", "describe", "diff",
           "TensorState", "CodeGuard", "plain_tensors", "check_plain_tensors", "MODULE_INTERNALS"]

#: the state epoch; read it through `epoch()` or as ``state.EPOCH`` on the hot path
EPOCH = 0
#: re-entrant: a finalizer (`_release`) may run in a garbage collection inside `install`
_lock = threading.RLock()
_installed = False
#: live compiled models that installed the patches (`install`); the last one freed removes them
_owners = 0


def epoch() -> int:
    """The current state epoch (an int that only grows)."""
    return EPOCH


def bump(*_: Any) -> None:
    """Move the epoch: some module state changed. Returns None so it can serve as a registration
    hook (a hook's non-None return value would replace the registered tensor)."""
    global EPOCH
    if torch.compiler.is_compiling():
        # Traced code that builds modules (transformers slices ``self.layers[:n]``, a new ModuleList)
        # would otherwise turn this into a guard on EPOCH and a constant written back every call.
        return
    EPOCH += 1  # a lost increment under a race still moves the epoch away from every reader's copy


def install(owner: Any = None) -> None:
    """Install the hooks and wrappers that move the epoch (`piecewise._torch.nn`; idempotent,
    process-wide). With `owner` (a compiled model), they stay while any such owner is alive and
    are taken off again when the last one is freed; without, they stay for the process."""
    global _installed, _owners
    with _lock:
        if owner is not None:
            _owners += 1
            finalizer = weakref.finalize(owner, _release)
            finalizer.atexit = False
        if _installed:
            return
        install_module_patches(bump, _bumping, _watching_setattr, _removing)
        _installed = True


def _release() -> None:
    """One owner of the patches was freed; the last one takes them off (`install`)."""
    global _installed, _owners
    with _lock:
        _owners -= 1
        if _owners == 0 and _installed:
            uninstall_module_patches()
            _installed = False


def _bumping(fn: Any, mark_handle: bool = False) -> Any:
    """`fn` moving the epoch after it runs; with `mark_handle`, the hook handle it returns is
    marked so that removing it moves the epoch too (`_removing`)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
            if mark_handle:
                try:
                    out._piecewise_module_hook = True
                except AttributeError:
                    pass
            return out
        finally:
            bump()

    wrapper.__piecewise_bumps__ = True  # type: ignore[attr-defined]
    return wrapper


class _Watch:
    """One watched module: a weak reference to it and the names whose assignment moves the epoch
    (None: every name but `_UNWATCHED_NAMES`)."""

    __slots__ = ("ref", "names")

    def __init__(self, ref: weakref.ref, names: frozenset[str] | None) -> None:
        self.ref, self.names = ref, names


#: id(module) -> `_Watch`, for every module of a compiled tree (`watch`); an entry goes with its
#: module (the reference's callback), so a reused id is never taken for a watched module
_WATCHED: dict[int, _Watch] = {}


def _unwatch(key: int, ref: weakref.ref) -> None:
    w = _WATCHED.get(key)
    if w is not None and w.ref is ref:
        del _WATCHED[key]


def watch(module: torch.nn.Module, names: Any = None) -> None:
    """Watch `module` (one module, not its tree): assigning one of `names` on it through
    ``Module.__setattr__`` moves the epoch from now on (see the module doc); `names` None: any
    name. ``training`` always counts. Watching again adds names (None takes in every name, for
    good): one module in two compiled trees keeps what either reads. Held weakly (keeps nothing
    alive). `describe` watches every module it walks, with the names a trace read on it."""
    key = id(module)
    w = _WATCHED.get(key)
    if w is None or w.ref() is not module:
        _WATCHED[key] = _Watch(weakref.ref(module, functools.partial(_unwatch, key)),
                               None if names is None else frozenset(names) | {"training"})
    elif w.names is not None and (names is None or not w.names.issuperset(names)):
        w.names = None if names is None else w.names | frozenset(names)


def watched(module: torch.nn.Module, name: str) -> bool:
    """Whether assigning `name` on `module` moves the epoch (`watch`)."""
    w = _WATCHED.get(id(module))
    return (w is not None and w.ref() is module and name not in _UNWATCHED_NAMES
            and (w.names is None or name in w.names))


class _Reads:
    """The plain attributes traces of one root module read: dotted paths, and the names by module path."""

    __slots__ = ("paths", "by_module")

    def __init__(self, paths: frozenset[str]) -> None:
        self.paths = paths
        by_module: dict[str, set[str]] = {}
        for p in paths:
            where, _, name = p.rpartition(".")
            by_module.setdefault(where, set()).add(name)
        self.by_module = {k: frozenset(v) for k, v in by_module.items()}


#: root module -> what its traces read (`note_read`), or None when a trace's reads are not known; a
#: module missing here counts as None
_READ: "weakref.WeakKeyDictionary[torch.nn.Module, _Reads | None]" = weakref.WeakKeyDictionary()


def note_read(module: torch.nn.Module, paths: Any) -> None:
    """Record the plain (non-tensor) attributes a trace of `module` read, as dotted paths from it
    (``"layers.0.norm.eps"``, ``"scale"``; `piecewise.trace` takes them from the trace's guards),
    so that `describe` compares those and no others and watches those names only: an attribute no
    forward reads (``m.note = "x"``) then changes nothing and costs nothing. `paths` None means
    the reads are not known: every plain attribute counts, from now on, for this module (the same
    when nothing was recorded, as after a warm start from a bundle, until a trace records). Several
    traces of one module (one model under two tags) add up."""
    if paths is None:
        _READ[module] = None
    elif module not in _READ or _READ[module] is not None:
        was = _READ.get(module)
        _READ[module] = _Reads(frozenset(paths) | (was.paths if was is not None else frozenset()))


def read_attributes(module: torch.nn.Module) -> frozenset[str] | None:
    """The plain attributes `describe` compares for `module` (`note_read`), as dotted paths; None: all."""
    r = _READ.get(module)
    return None if r is None else r.paths


def _watching_setattr(fn: Any) -> Any:
    """``Module.__setattr__`` moving the epoch after an assignment to a watched module of a name a
    trace of it read (`watch`). Its own function (not `_bumping`'s): Dynamo refuses to trace a
    module method whose code object is one of ``nn.Module``'s other methods', and `_bumping`'s
    wrappers share one code object."""
    def __setattr__(self: Any, name: str, value: Any) -> None:
        try:
            fn(self, name, value)
        finally:
            # is_compiling() first: under a trace of forward it is a constant and Dynamo reads none
            # of the watch state (a guard on it would fail once the traced tree is watched)
            if not torch.compiler.is_compiling():
                w = _WATCHED.get(id(self))
                if w is not None and (name in w.names if w.names is not None else name not in _UNWATCHED_NAMES):
                    bump()

    functools.update_wrapper(__setattr__, fn)
    __setattr__.__piecewise_bumps__ = True  # type: ignore[attr-defined]
    return __setattr__


def _removing(fn: Any) -> Any:
    """``RemovableHandle.remove`` moving the epoch for a module forward hook's handle only (marked
    by `_bumping`): a tensor's or an optimizer's hooks are no module state, and a loop removing
    one a step would otherwise make every compiled model describe its module again a step."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        finally:
            # marked at registration; a module forward hook registered before the first compile
            # (before `install`) is told by its extra dicts (with_kwargs / always_call), which
            # tensor, optimizer and state-dict hooks do not have
            if getattr(self, "_piecewise_module_hook", False) or getattr(self, "extra_dict_ref", ()):
                bump()

    wrapper.__piecewise_bumps__ = True  # type: ignore[attr-defined]
    return wrapper


def _override(d: dict[str, Any]) -> Any:
    """What is set as ``forward`` on a module instance (``norm.forward = MethodType(f, norm)``, a
    builtin, a callable object), else None. piecewise's own compiled model, set by
    ``model.forward = compiled`` around ``generate()``, is not code the trace inlined: None."""
    v = d.get("forward")
    return None if getattr(v, "_piecewise_compiled_model", False) else v


def _class_forward(cls: type) -> tuple[tuple[Any, ...], Any]:
    """The class dicts along `cls`'s MRO up to the first that defines ``forward`` and that raw
    entry (a function, or a descriptor such as ``functools.singledispatchmethod``, which builds a
    new object on every class access, so ``cls.forward`` cannot be compared by identity)."""
    chain = []
    for c in cls.__mro__:
        chain.append(c.__dict__)
        if "forward" in c.__dict__:
            return tuple(chain), c.__dict__["forward"]
    return tuple(chain), None


class CodeGuard:
    """The forward every module of a tree runs, as when it was traced: each class's ``forward``
    and any function set as ``forward`` on an instance below the root. Replacing one moves no
    epoch (no hook sees ``LlamaRMSNorm.forward = f`` or ``norm.forward = ...``), so a compiled
    model checks these on every call: one identity test a class and one dict lookup a module
    (a new instance attribute is noticed by the summed sizes of the instance dicts, one C-level
    pass: about 8 us a call for SmolLM2's 396 modules and 11 classes on this project's 2-core
    machine, against a 40 ms decode step; the precise comparison runs only when a size moved).
    The root's own forward is left out: the compiled model calls the function it was compiled with."""

    __slots__ = ("classes", "dicts", "overrides", "size", "held")

    def __init__(self, module: torch.nn.Module) -> None:
        mods = list(module.modules())
        classes: dict[type, Any] = {}
        for m in mods:
            if type(m) not in classes:
                classes[type(m)] = _class_forward(type(m))
        self.classes = tuple((cls, chain, raw) for cls, (chain, raw) in classes.items())
        self.dicts = tuple(m.__dict__ for m in mods[1:])
        self.overrides = tuple(_override(d) for d in self.dicts)
        self.size = sum(map(len, self.dicts))
        self.held = tuple((d, v) for d, v in zip(self.dicts, self.overrides) if v is not None)

    def changed(self) -> str:
        """What was replaced since the trace ('' when nothing was)."""
        for cls, chain, raw in self.classes:
            if chain[-1].get("forward") is not raw or (len(chain) > 1 and any("forward" in d for d in chain[:-1])):
                return f"{cls.__qualname__}.forward was replaced on the class"
        if all(d.get("forward") is v for d, v in self.held) and sum(map(len, self.dicts)) == self.size:
            return ""
        for d, was in zip(self.dicts, self.overrides):
            now = _override(d)
            if now is not was:
                return ("a forward was set on a submodule instance" if was is None else
                        "a forward set on a submodule instance was replaced" if now is not None else
                        "a forward set on a submodule instance was removed")
        self.size = sum(map(len, self.dicts))  # other attributes came or went: not code
        return ""


class TensorState(tuple):
    """(type name, dtype, device, shape, strides, storage offset) of one tensor; the layout the
    compiled code was specialised to. Addresses are kept apart (`describe` ``addresses``)."""

    __slots__ = ()

    def __str__(self) -> str:
        kind, dtype, device, shape, stride, offset = self
        return f"{kind} {dtype} on {device}, shape {list(shape)}, strides {list(stride)}"


def _tensor_state(t: torch.Tensor) -> TensorState:
    return TensorState((type(t).__name__, str(t.dtype), str(t.device), tuple(t.shape), tuple(t.stride()), t.storage_offset()))


def describe(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, int]]:
    """What of `module` a trace depends on that can change after it, by dotted path.

    Returns ``(layout, addresses)``: `layout` maps each parameter, buffer and tensor-valued plain
    attribute to its `TensorState` (None for a registered ``None``), each path at which a tensor
    already seen at another path is reached again (tied weights) to that first path, and each
    submodule's ``training`` flag and class and each non-tensor plain attribute a trace of `module`
    read (`note_read`; every one when that is not known) to their values (`_value`); `addresses`
    maps each tensor path to its ``data_ptr()``. Every module walked is watched (`watch`) for the
    names read on it: from then on an assignment to one of them moves the epoch. Cost: O(submodules + tensors + attributes): 1.3 ms for the
    8-layer reference decoder (91 tensors) on a busy 2-core machine, paid only when the epoch moved."""
    hooks, pre_hooks = global_forward_hooks()
    reads = _READ.get(module)
    read = None if reads is None else reads.paths
    layout: dict[str, Any] = {
        # hooks by their handle ids (unique and never reused, unlike id() of a freed function)
        "<global forward hooks>": (tuple(hooks), tuple(pre_hooks)),
    }
    addresses: dict[str, int] = {}
    first: dict[int, str] = {}  # id -> first path of each tensor object
    storages: dict[int, str] = {}  # storage address -> first path of a tensor over it

    def tensor(path: str, t: torch.Tensor) -> None:
        layout[path] = _tensor_state(t)
        addresses[path] = t.data_ptr()
        # Tied weights: the trace takes one tensor reached by two paths as one graph input, so
        # untying them (or tying two) changes what the compiled code reads even at equal layouts.
        same = first.setdefault(id(t), path)
        if same != path:
            layout[f"{path} <same tensor as>"] = same
        else:  # two tensors over one storage (a buffer that is a view of another): the trace
            # orders their reads and writes as aliases, so sharing or not sharing is a change too
            shared = storage_owner(t, path, storages)
            if shared is not None:
                layout[f"{path} <shares storage with>"] = shared

    for name, m in module.named_modules(remove_duplicate=False):
        watch(m, None if reads is None else reads.by_module.get(name, ()))
        prefix = f"{name}." if name else ""
        layout[f"{prefix}<class>"] = f"{type(m).__module__}.{type(m).__qualname__}"
        layout[f"{prefix}training"] = m.training
        layout[f"{prefix}<forward hooks>"] = (tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
        for kind in ("_parameters", "_buffers"):
            for pname, p in m.__dict__[kind].items():
                if p is None:
                    layout[prefix + pname] = None
                else:
                    tensor(prefix + pname, p)
        for aname, v in m.__dict__.items():
            if aname in _SKIPPED or aname.startswith("__"):
                continue
            if isinstance(v, torch.Tensor):
                tensor(prefix + aname, v)
            elif read is None or prefix + aname in read:  # settings such as eps, fixed into the trace
                # (an attribute absent at the trace that it looked for, ``getattr(self, "scale",
                # None)`` or a class attribute an instance one shadows, is in `read` too: set later,
                # it appears here and counts as a change)
                layout[prefix + aname] = _value(v)
    return layout, addresses


_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, str], ...] | None:
    """The devices autocast is on for and their dtypes, ``(("cpu", "torch.bfloat16"),)``; None when
    it is off everywhere. Compared between calls of a compiled model and part of the start key."""
    if not is_any_autocast_enabled():
        return None
    return tuple((d, str(torch.get_autocast_dtype(d))) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


def show_autocast(s: tuple[tuple[str, str], ...] | None) -> str:
    return "off" if not s else ", ".join(f"{d} {dt.removeprefix('torch.')}" for d, dt in s)


def storage_owner(t: torch.Tensor, path: str, seen: dict[int, str]) -> str | None:
    """The first path in `seen` whose tensor lies on `t`'s storage, else None (and `path` is
    recorded for it). Tensors without memory (meta, empty, tensor subclasses without storage)
    share nothing."""
    try:
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else 0
    except (RuntimeError, NotImplementedError):
        return None
    if not key:
        return None
    owner = seen.setdefault(key, path)
    return owner if owner != path else None


_PRIMITIVES = (int, float, bool, str, bytes, type(None), complex, torch.dtype, torch.device)
#: attributes every nn.Module has (parameter/buffer/submodule dicts, hook dicts, flags): described
#: through their own entries, never as plain attributes
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {"forward"}  # forward: the class's is traced
MODULE_INTERNALS = _MODULE_INTERNALS
#: plain attributes that code outside forward keeps on a model for itself and no forward reads:
#: transformers' ``generate()`` stores the length of the last static cache it built on the model
#: (``_previous_max_cache_length``, transformers/generation/utils.py, to size the next one), so
#: every generate() with a longer static cache would count as a change and trace again
_NOT_READ_BY_FORWARD = frozenset({"_previous_max_cache_length"})
_SKIPPED = _MODULE_INTERNALS | _NOT_READ_BY_FORWARD
#: names whose assignment on a watched module moves no epoch: an instance ``forward`` is compared on
#: every call (`CodeGuard`; ``model.forward = compiled`` around ``generate()`` sets and deletes it
#: every generation), and the bookkeeping no forward reads
_UNWATCHED_NAMES = frozenset({"forward"}) | _NOT_READ_BY_FORWARD


def _value(v: Any, depth: int = 2) -> Any:
    """A comparable description of an attribute value: primitives and containers of them (two
    levels deep) by value, type included (``1`` is not ``True`` nor ``1.0``), floats by their repr
    (``nan`` equals ``nan``, so a nan setting does not count as changed at every look; ``-0.0``
    differs from ``0.0``), anything else by type and identity (a new object of any value counts
    as a change, which traces again: never wrong, at worst a needless trace)."""
    if isinstance(v, (float, complex)):
        return (type(v).__name__, repr(v))
    if isinstance(v, _PRIMITIVES):
        return (type(v).__name__, v)
    if depth > 0 and isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value(x, depth - 1) for x in v))
    if depth > 0 and isinstance(v, dict):
        return ("dict", tuple((repr(k), _value(x, depth - 1)) for k, x in v.items()))
    if _is_plain_object(v):  # its tensors by identity: replaced in place on the object, a change
        return (type(v).__qualname__, id(v), tuple((k, id(x)) for k, x in vars(v).items() if isinstance(x, torch.Tensor)))
    return (type(v).__qualname__, id(v))


def plain_tensors(module: torch.nn.Module) -> list[tuple[Any, Any, Any]]:
    """Tensors held outside registered parameters and buffers anywhere in `module`: as plain
    attributes, in list, tuple or dict attributes (nested up to three levels), or as attributes of
    plain objects held there (``self.cfg.table``), as ``(container, key, value)`` for every step of
    the path to each (a container replaced on the way counts too). Reassigning one moves no epoch
    (``Module.__setattr__`` is not wrapped), so a compiled model checks their identity on every
    call (a few ns each; models keep state in buffers, so the list is usually empty)."""
    out: list[tuple[Any, Any, Any]] = []

    def walk(container: Any, key: Any, v: Any, depth: int) -> bool:
        if isinstance(v, torch.Tensor):
            out.append((container, key, v))
            return True
        if depth >= 3:
            return False
        if isinstance(v, (list, tuple)):
            inner, items = v, list(enumerate(v))
        elif isinstance(v, dict):
            inner, items = v, list(v.items())
        elif _is_plain_object(v):
            inner = vars(v)
            items = list(inner.items())
        else:
            return False
        found = False
        for k, x in items:
            found = walk(inner, k, x, depth + 1) or found
        if found:
            out.append((container, key, v))
        return found

    for m in module.modules():
        for aname, v in list(m.__dict__.items()):
            if aname in _MODULE_INTERNALS or aname.startswith("__"):
                continue
            walk(m.__dict__, aname, v, 0)
    return out


def _is_plain_object(v: Any) -> bool:
    """An instance of a user class holding its state in ``__dict__`` (a config object), not a
    module, class, function or module object (their state is described elsewhere or is code)."""
    return (hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type, types.FunctionType, types.ModuleType,
                                                            types.MethodType, torch.Tensor))
            and not callable(v))


def check_plain_tensors(held: list[tuple[Any, Any, Any]]) -> None:
    """Move the epoch when a tensor held outside parameters and buffers, or a container or object
    on the way to it, was replaced (see `plain_tensors`)."""
    try:
        for container, key, value in held:
            if container[key] is not value:
                bump()
                return
    except (KeyError, IndexError, TypeError):  # a container lost an entry: changed
        bump()


def diff(before: dict[str, Any], after: dict[str, Any], limit: int = 3) -> list[str]:
    """Readable differences between two `describe` layouts (or address maps), at most `limit`
    named, then a count of the rest."""
    out: list[str] = []
    keys = list(before) + [k for k in after if k not in before]
    changed = [k for k in keys if before.get(k, _ABSENT) != after.get(k, _ABSENT)]
    for k in changed[:limit]:
        a, b = before.get(k, _ABSENT), after.get(k, _ABSENT)
        out.append(f"{k or '<root>'}: {_show(a)} -> {_show(b)}")
    if len(changed) > limit:
        out.append(f"and {len(changed) - limit} more")
    return out


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


_VALUE_TYPES = frozenset(t.__name__ for t in _PRIMITIVES)


def _show(v: Any) -> str:
    if isinstance(v, TensorState):
        return str(v)
    if isinstance(v, int) and not isinstance(v, bool) and v > 1 << 16:
        return hex(v)
    if isinstance(v, tuple) and len(v) in (2, 3) and isinstance(v[0], str) and not isinstance(v[1], tuple):
        if v[0] in ("float", "complex"):  # an attribute value as `_value` records it: as written
            return v[1]
        if v[0] in _VALUE_TYPES:
            return repr(v[1])
        if isinstance(v[1], int):
            return f"a {v[0]} object (id {v[1]:#x})"  # compared by identity
    return repr(v)
