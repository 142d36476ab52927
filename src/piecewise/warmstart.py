"""Warm-start bundles: rebuild a compiled model without running Dynamo (docs/design.md §5.5).

A cold start saves, next to the piece artifacts, one *bundle* per tag, a `CompiledArtifact`: Dynamo's
transformed bytecode with its runtime globals and serialisable guards (`piecewise.trace`), the split
module and its pieces (FX graphs without metadata, `torch.fx._graph_pickler.GraphPickler`), the
stitching plan (`PiecewiseBackend.plan`) and the sha256 of every traced source file. `WarmStart` is
the lookup policy over those artifacts (which entries, in which order, what a miss reports). A warm start finds it
*before* tracing, under the *start key*: everything known before a trace - piecewise, torch and
Python versions, allow-listed environment, code-changing config, compiler hash, splitting ops, the
call's signature (`CallSignature.describe`), the forward's qualified name and a fingerprint of the
module's structure and settings (`module_fingerprint`).

Validation at load, any failure falling back to a normal trace with one log line (one warning for a
damaged bundle, which is also moved aside):

1. the bundle entry's index and the bundle's sha256 (`CacheEntry`, as for every artifact);
2. every traced source file still hashes to the recorded sha256 (an edit forces a retrace);
3. the values of globals ``forward`` read, as recorded at trace time (`piecewise.trace.changed_globals`),
   then PyTorch's own compatibility record (Python and torch versions, GPU) and the guards, evaluated on
   the first call's arguments - constructor arguments that change the graph change a guarded value
   (a tensor shape, a constant attribute, a container length) even when the fingerprint misses them;
4. every piece artifact of the compile entry loads (a missing one: trace, which recompiles just it).

A bundle lives in its own entry ``<root>/<start key>-<variant>/rank_<r>_<dp>/<tag>/`` with an index
and one artifact ``bundle``, so permissions, locking, checksums, quarantine and the CLI tools apply
unchanged. Its index meta names the compile entry (``compile_key``) holding the piece artifacts.
The *variant* (`bundle_variant`) is what only a trace knows: traced source hashes, the files of the
traced modules and the recorded values of the globals ``forward`` read. One start key can thus hold
several bundles (two scripts both defining ``__main__.Model``, a global set from the environment
with two values); a warm start tries them most recently saved or used first and takes the first
that validates. Saving prunes the tag's bundles to `BUNDLES_PER_TAG` (least recently saved or used
go first). A miss logs every candidate's reason at INFO, or - no bundle for the start key - which
start factors differ from the newest bundle of the tag.

Left out of the fingerprint, protected only by the guards: values hidden in objects the fingerprint
does not walk (attributes of attributes beyond two levels, ``__slots__``) and values of module
globals read by ``forward`` (directly, through an imported module's attributes, or in a global
dict: compared with their recorded values). Identity guards (on global functions, modules, classes) are not saved;
the traced source files' hashes stand in for them.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
import logging
import os
import pickle
import re
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

import filelock

from ._version import build_id
from .backend import PiecewiseBackend, remote_tier
from .cache.key import KEY_FORMAT, compute_key, diff_factors, env_factors, file_hashes
from .cache.store import (FACTORS, INDEX, LOCK, CacheEntry, CacheIndexError, check_permissions, current_rank, env_flag,
                          read_index, remove_tree, resolve_root)
from .compiled import CompiledPlan
from .counters import counters
from .errors import CompileError
from .split import SplitResult
from .state import autocast_state, storage_owner
from .trace import GuardsNotBuilt, Trace, Unrecordable, changed_globals, identity, rebuild

__all__ = ["BUNDLE_FORMAT", "BUNDLE", "CompiledArtifact", "WarmStart", "start_factors", "module_fingerprint", "encode_bundle", "decode_bundle",
           "stale_sources"]

log = logging.getLogger("piecewise")

#: Bump when the bundle's layout or meaning changes: old bundles then miss (different start key).
BUNDLE_FORMAT = 6
#: The artifact name of the bundle inside its entry.
BUNDLE = "bundle"

_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}
_PRIMITIVES = (int, float, bool, str, bytes, type(None), complex)
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks")


def _describe(v: Any, depth: int, memo: dict[int, Any]) -> Any:
    """A JSON-ready description of an attribute value, deep enough to tell constructor arguments
    apart, bounded so that a large object graph costs little."""
    if isinstance(v, _PRIMITIVES):
        return repr(v)
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__qualname__}.{v.name}"
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype), v.device.type, list(v.shape)]
    if isinstance(v, torch.nn.Module):
        return ["module", type(v).__qualname__]  # walked on its own by module_fingerprint
    try:  # a class, builtin or function held as an attribute (``self.act = torch.relu``, a forward set
        # on the instance): which one, and for a Python function what it closes over
        return list(identity(v)) if depth <= 0 or not isinstance(getattr(v, "__func__", v), types.FunctionType) \
            else _function_data(v, memo, depth)
    except Unrecordable:
        pass
    if depth <= 0:
        return type(v).__qualname__
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_describe(x, depth - 1, memo) for x in v]
        return [type(v).__name__, sorted(map(repr, items)) if isinstance(v, (set, frozenset)) else items]
    if isinstance(v, Mapping):
        return {str(k): _describe(x, depth - 1, memo) for k, x in v.items()}
    if id(v) in memo:
        return memo[id(v)]
    to_dict = getattr(v, "to_dict", None)
    if callable(to_dict) and not isinstance(v, type):  # configuration objects (transformers' PretrainedConfig)
        try:
            out = [type(v).__qualname__, json.dumps(to_dict(), sort_keys=True, default=_json_default)]
        except Exception as e:
            log.debug("%s.to_dict() failed (%s: %s); fingerprinted by type only", type(v).__qualname__, type(e).__name__, e)
            out = type(v).__qualname__
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        out = [type(v).__qualname__, {f.name: _describe(getattr(v, f.name, None), depth - 1, memo) for f in dataclasses.fields(v)}]
    elif hasattr(v, "__dict__") and not isinstance(v, type):
        out = [type(v).__qualname__, {k: _describe(x, depth - 1, memo) for k, x in sorted(vars(v).items())}]
    else:
        out = type(v).__qualname__
    memo[id(v)] = out
    return out


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _json_default(o: Any) -> Any:
    """JSON for what `json.dumps` cannot write, the same in every process: sets sorted (their
    order follows string hashes, which change per process), addresses dropped from reprs."""
    if isinstance(o, (set, frozenset)):
        return sorted(_ADDRESS.sub("", repr(x)) for x in o)
    return _ADDRESS.sub("", str(o))


def module_fingerprint(module: torch.nn.Module) -> str:
    """sha256 over every submodule's class, hook counts, types of its module/parameter/buffer dicts,
    parameters and buffers (name, type, dtype, device, shape, strides, offset, requires_grad), its
    other attributes (values described two levels deep), and which submodules, tensors and
    attribute objects are one object reached by two paths (tied weights, a config shared by every
    layer). It stands in for the per-parameter and per-submodule guards a bundle leaves out
    (`piecewise.trace`).

    Two instances of one class built with different arguments (layer count, width, eps, a flag)
    get different fingerprints, so they never share a bundle. Weights' values are not read."""
    h = hashlib.sha256()
    memo: dict[int, Any] = {}
    first: dict[int, str] = {}  # id -> first path: which modules, tensors and attribute objects are shared
    storages: dict[int, str] = {}  # which distinct tensors lie on one storage (a buffer viewing another)
    code: dict[type, str] = {}  # class -> its functions' description (`_class_code`), once a class

    def alias(obj: Any, path: str) -> str:
        if isinstance(obj, _PRIMITIVES):
            return ""
        return "=" + first[id(obj)] if first.setdefault(id(obj), path) != path else ""

    for name, m in module.named_modules(remove_duplicate=False):
        hooks = [len(getattr(m, d)) for d in _HOOK_DICTS if hasattr(m, d)]
        dicts = [type(getattr(m, d, None)).__qualname__ for d in ("_modules", "_parameters", "_buffers")]
        h.update(f"M{name}{alias(m, name)}:{type(m).__module__}.{type(m).__qualname__}:{hooks}:{dicts};".encode())
        for pname, p in list(m._parameters.items()) + list(m._buffers.items()):
            desc = None if p is None else [type(p).__qualname__, str(p.dtype), p.device.type, list(p.shape), list(p.stride()),
                                           p.storage_offset(), p.requires_grad]
            tied = alias(p, f"{name}.{pname}") if p is not None else ""
            shared = storage_owner(p, f"{name}.{pname}", storages) if p is not None and not tied else None
            h.update(f"P{pname}{tied}{'~' + shared if shared else ''}:{desc};".encode())
        attrs = {k + alias(v, f"{name}.{k}"): _describe(v, 2, memo)
                 for k, v in sorted(m.__dict__.items()) if k not in _MODULE_INTERNALS}
        attrs["__class_data__"] = _class_data(type(m), memo)
        if type(m) not in code:
            code[type(m)] = json.dumps(_class_code(type(m), memo), sort_keys=True, default=_json_default)
        h.update(json.dumps(attrs, sort_keys=True, default=_json_default).encode())
        h.update(code[type(m)].encode())
    return h.hexdigest()


def _function_data(fn: Any, memo: dict[int, Any], depth: int = 1) -> list[Any]:
    """A function told apart across processes: module, qualified name and code digest
    (`trace.identity`), and the values it closes over and its defaults (one function built twice
    with another constant, by a closure or ``exec``, is two functions)."""
    f = getattr(fn, "__func__", fn)
    out = list(identity(f))
    if isinstance(f, types.FunctionType):  # values `depth` levels deep (a function in them: its identity)
        out.append([_cell(c, depth - 1) for c in (f.__closure__ or ())])
        out.append(_describe(f.__defaults__, depth, memo))
        out.append(_describe(f.__kwdefaults__, depth, memo))
    return out


def _class_code(cls: type, memo: dict[int, Any]) -> dict[str, Any]:
    """The functions of a module's class and its bases up to `torch.nn.Module` (`_function_data`):
    the code the trace inlined. A forward replaced on the class (``LlamaRMSNorm.forward = f``, by
    a function from a file the trace never read) changes the fingerprint, so a bundle traced from
    the old code is not served."""
    out: dict[str, Any] = {}
    for c in cls.__mro__:
        if c is torch.nn.Module or c is object:
            break
        for k, v in vars(c).items():
            f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            if k not in out and isinstance(f, types.FunctionType):
                out[k] = _function_data(f, memo)
    return out


def _class_data(cls: type, memo: dict[int, Any]) -> dict[str, Any]:
    """Data attributes of a module's class and its bases up to `torch.nn.Module` (``scale = 2.0`` set
    on the class): Dynamo guards them by reading the live class, so a saved guard cannot tell an old
    value from a new one."""
    out: dict[str, Any] = {}
    for c in cls.__mro__:
        if c is torch.nn.Module or c is object:
            break
        for k, v in vars(c).items():
            if k.startswith("__") or k in out or isinstance(v, (types.FunctionType, property, staticmethod, classmethod, type)):
                continue
            if callable(v) or hasattr(v, "__get__"):
                continue
            out[k] = _describe(v, 1, memo)
    return out


def start_factors(backend: Any, module: torch.nn.Module, call_signature: list[Any]) -> dict[str, Any]:
    """The start-key factors: what selects a bundle before any trace (see module doc)."""

    fwd = type(module).forward
    return {
        "kind": "warm_start",
        "bundle_format": BUNDLE_FORMAT,
        "key_format": KEY_FORMAT,
        "piecewise": build_id(),
        "torch": torch.__version__,
        "python": sys.version,
        "env": env_factors(),
        "config": backend.config.code_factors(),
        "compiler": {"name": backend.adaptor.name, "hash": backend.adaptor.compute_hash()},
        "machine": backend.adaptor.machine_factors(),
        "splitting_ops": sorted(backend.split_ops),
        "forward": f"{fwd.__module__}.{fwd.__qualname__}",
        # what a decorated forward closes over (values included: a decorator argument changes the graph)
        "closure": [_cell(c) for c in (fwd.__closure__ or ())],
        "call": list(call_signature),
        "module": module_fingerprint(module),
        # process state Dynamo guards on that would otherwise make bundles of two setups overwrite
        # each other: intra-op threads, global module hooks
        "threads": torch.get_num_threads(),
        "autocast": autocast_state(),  # the trace's dtypes follow it
        "global_hooks": [len(getattr(torch.nn.modules.module, d, {})) for d in _GLOBAL_HOOK_DICTS],
    }


def _cell(cell: types.CellType, depth: int = 1) -> Any:
    try:
        return _describe(cell.cell_contents, depth, {})
    except ValueError:  # an empty cell
        return None


def start_key(factors: Mapping[str, Any]) -> str:
    return compute_key(factors)


def traced_modules(codes: Any) -> dict[str, str]:
    """``{module name: real path of its file}`` for the modules of the traced code objects."""
    import inspect

    out = {}
    for code in codes:
        mod = inspect.getmodule(code)
        f = getattr(mod, "__file__", None)
        if mod is not None and f:
            out[mod.__name__] = os.path.realpath(f)
    return out


def moved_modules(recorded: Mapping[str, str]) -> list[str]:
    """Recorded modules that this process imported from another file (another checkout, another
    script run as ``__main__``) or has not imported: the bundle's code is not the code in use."""
    out = []
    for name, path in recorded.items():
        live = sys.modules.get(name)
        f = getattr(live, "__file__", None) if live is not None else None
        if not f or os.path.realpath(f) != path:
            out.append(f"{name} (traced from {path}, now {f or 'not imported'})")
    return out


def stale_sources(recorded: Mapping[str, str]) -> list[str]:
    """The recorded source files that are gone or whose content changed since the bundle was made."""
    now = file_hashes(recorded)
    return [fn for fn, digest in recorded.items() if now.get(fn) != digest]


@dataclasses.dataclass
class CompiledArtifact:
    """One compiled region as saved for a warm start (the *bundle*): what the trace, the plan and the
    pieces are. A cold start builds it from its trace (`of`) and saves it; a warm start loads it
    (`load`), validates it (`stale`, `trace`) and restores the compiled forward from it (`restore`).
    The piece artifacts themselves stay in the compile entry the plan names (`CompiledPlan.cache_key`).

    Attributes:
        split_module: the traced graph split at the splitting ops (a `torch.fx.GraphModule` whose
            submodules are the pieces' FX graphs, without metadata); loaded, it has no runners.
        plan: the stitching plan (`piecewise.compiled.CompiledPlan`: runners, sizes, size refusal,
            compile entry).
        dynamo: Dynamo's half of the trace (`piecewise.trace.Trace.dynamo_state`: transformed
            bytecode, runtime globals, saved guards, recorded values of the globals it read).
        sources: sha256 (hex) of every traced source file, by path.
        modules: the file each traced module came from, by module name.
        piece_names: the runners installed in `split_module`'s ``__dict__`` (left out when saved,
            rebuilt from `plan` at load); empty for a loaded artifact.

    Saved as a pickled dict of format `BUNDLE_FORMAT` (the graphs by
    ``torch.fx._graph_pickler.GraphPickler``); a bundle of another format does not load.
    """

    split_module: torch.fx.GraphModule
    plan: CompiledPlan
    dynamo: bytes
    sources: dict[str, str]
    modules: dict[str, str]
    piece_names: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, backend: PiecewiseBackend, cap: Trace) -> CompiledArtifact:
        """The artifact of a cold start: `backend`'s split and plan after tracing `cap`.

        Raises:
            ValueError, RuntimeError, pickle.PicklingError: the trace cannot be saved
                (`Trace.dynamo_state`).
        """
        plan = backend.plan()
        return cls(backend.split.split_module, plan, cap.dynamo_state(), file_hashes(backend.traced_files),
                   traced_modules(cap.traced_code), [it.name for it in backend.split.items])

    def save(self) -> bytes:
        """The bundle bytes. The split module is pickled without its installed runners.

        Raises:
            Exception: a graph cannot be pickled (an op or constant GraphPickler does not support).
        """
        from ._torch.fx import GraphPickler

        split_module, plan = self.split_module, self.plan
        installed = {n: split_module.__dict__.pop(n) for n in self.piece_names if n in split_module.__dict__}
        # Compiled pieces of one fingerprint (a model's repeated layers) run the same artifact and differ
        # only in placeholder names: the bundle holds one graph for them all, which the decode shares
        # (62 piece graphs of SmolLM2 unpickle as 32).
        first: dict[str, str] = {}
        children = split_module._modules
        shared = {}
        for spec in plan.runners:
            owner = first.setdefault(spec.fingerprint, spec.name)
            if owner != spec.name and spec.name in children and owner in children:
                shared[spec.name] = children[spec.name]
                children[spec.name] = children[owner]
        try:
            graphs = GraphPickler.dumps(split_module, _graph_options())
        finally:
            children.update(shared)
            split_module.__dict__.update(installed)
        body = {"format": BUNDLE_FORMAT, "graphs": graphs, "plan": plan, "dynamo": self.dynamo, "sources": self.sources,
                "modules": self.modules}
        buf = io.BytesIO()
        pickle.dump(body, buf, protocol=pickle.HIGHEST_PROTOCOL)
        return buf.getvalue()

    @classmethod
    def load(cls, data: bytes) -> CompiledArtifact:
        """The artifact saved as `data` (`save`), its split module unpickled (a fresh
        `torch.fx.GraphModule` whose submodules are the pieces).

        Raises:
            ValueError: not a bundle of this format.
            Exception: anything unpickling raises (callers treat it as a damaged bundle).
        """
        from ._torch.fx import GraphPickler
        from ._torch.subclasses import FakeTensorMode

        body = pickle.loads(data)
        if not isinstance(body, dict) or body.get("format") != BUNDLE_FORMAT:
            raise ValueError("not a piecewise warm-start bundle of this format")
        gm = GraphPickler.loads(body["graphs"], FakeTensorMode())
        # Unpickled graph modules have no generated forward yet: the split module needs it now; a
        # piece gets it when something runs it (`fx_forward`), so Inductor pieces never pay for it.
        # GraphModule.recompile also regenerates every submodule (~5 ms a piece): shadowed here.
        gm._recompile_submodules = list
        try:
            gm.recompile()
        finally:
            del gm._recompile_submodules
        return cls(gm, body["plan"], body["dynamo"], body["sources"], body["modules"])

    def stale(self) -> str:
        """Why the traced code is not the code of this process ('' when it is): a traced source file
        gone or edited, or a traced module imported from another file (or not at all)."""
        stale = stale_sources(self.sources)
        if stale:
            return f"traced source {stale[0]} changed since the bundle was made"
        moved = moved_modules(self.modules)
        return f"module {moved[0]}" if moved else ""

    def trace(self, forward: types.FunctionType) -> Trace:
        """The saved trace rebuilt against `forward` (`piecewise.trace.rebuild`; no compiled graph yet).

        Raises:
            GuardsNotBuilt: the guards cannot be built in this process.
            Exception: see `rebuild`.
        """
        return rebuild(self.dynamo, None, forward)

    def restore(self, backend: PiecewiseBackend, compile_entry: CacheEntry) -> Any:
        """The compiled graph: `backend` restored from the plan, its pieces loaded from `compile_entry`.

        Raises:
            CompileError: a piece artifact is missing or bad (already reported).
        """
        split = SplitResult.from_module(self.split_module, list(self.plan.splitting))
        return backend.restore(split, self.plan, compile_entry)

    def variant(self, global_values: Mapping[str, Any]) -> str:
        """`bundle_variant` of this artifact, given its trace's recorded global values."""
        return bundle_variant(self.sources, self.modules, global_values, size_class(self.plan))


def _graph_options():
    from ._torch.fx import GraphPicklerOptions as Options

    # Any op (custom splitting ops included); node metadata dropped: a warm start only runs the code.
    return Options(ops_filter=None, node_metadata_key_filter=lambda key: False)


def encode_bundle(split_module: torch.fx.GraphModule, piece_names: list[str], plan: CompiledPlan, dynamo: bytes,
                  sources: dict[str, str], modules: dict[str, str]) -> bytes:
    """The bundle bytes (`CompiledArtifact.save`). `split_module` is pickled without the runners
    installed in its ``__dict__`` (names in `piece_names`); they are rebuilt from `plan` at load.

    Raises:
        Exception: a graph cannot be pickled (an op or constant GraphPickler does not support).
    """
    return CompiledArtifact(split_module, plan, dynamo, sources, modules, list(piece_names)).save()


def decode_bundle(data: bytes) -> dict[str, Any]:
    """The bundle's fields as a dict (`CompiledArtifact.load`): ``split_module``, ``plan``,
    ``dynamo``, ``sources``, ``modules`` and ``format``.

    Raises:
        ValueError: not a bundle of this format.
        Exception: anything unpickling raises (callers treat it as a damaged bundle).
    """
    art = CompiledArtifact.load(data)
    return {"format": BUNDLE_FORMAT, "split_module": art.split_module, "plan": art.plan, "dynamo": art.dynamo,
            "sources": art.sources, "modules": art.modules}


class _Laps:
    """Adds the seconds since the previous lap under each name."""

    def __init__(self, into: dict[str, float]) -> None:
        import time

        self.into, self.clock = into, time.perf_counter
        self.last = self.clock()

    def __call__(self, name: str) -> None:
        now = self.clock()
        self.into[name] = self.into.get(name, 0.0) + now - self.last
        self.last = now


def bundle_variant(sources: Mapping[str, str], modules: Mapping[str, str], global_values: Mapping[str, Any],
                   size_class: str = "") -> str:
    """What tells apart bundles of one start key, known only after a trace: the traced source files
    and their hashes, the files the traced modules came from (two scripts both run as ``__main__``,
    two checkouts), the recorded values of the globals ``forward`` read (a constant set from an
    environment variable) and the sizes the trace holds for (`size_class`: a model that branches
    on a size keeps one bundle per size class). Each variant is an entry of its own,
    ``<start key>-<variant>``."""
    parts: list[Any] = [sorted(sources.items()), sorted(modules.items()), sorted((k, repr(v)) for k, v in global_values.items())]
    if size_class:
        parts.append(size_class)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:8]


def size_class(plan: CompiledPlan) -> str:
    """The size guards a trace holds for, as text ('' when it holds for every size)."""
    refusal = plan.size_refusal
    return "" if refusal is None else repr([str(g) for g in refusal.guards])


def bundle_entries(root: str, tag: str, rank_dir: str, key_glob: str = "*") -> list[tuple[float, str]]:
    """``(index mtime, entry path)`` of the bundle entries of `tag` under `root`, most recently
    saved or used first."""
    import glob


    out = []
    for f in glob.glob(os.path.join(glob.escape(root), key_glob, rank_dir, glob.escape(tag), INDEX)):
        if ".deleting." in f:
            continue
        try:
            if read_index(f)["meta"].get("kind") == "bundle":
                out.append((os.path.getmtime(f), os.path.dirname(f)))
        except (OSError, CacheIndexError):
            continue
    return sorted(out, reverse=True)


def prune_bundles(root: str, tag: str, rank_dir: str, keep: int, protect: str) -> int:
    """Remove the bundle entries of `tag` beyond the `keep` most recently saved or used (never
    `protect`, the one just saved); returns how many. Each goes under its writer lock, renamed
    aside first (`remove_tree`), so a process reading it meanwhile falls back to tracing."""

    removed = 0
    for _, path in bundle_entries(root, tag, rank_dir)[keep:]:
        if path == protect or check_permissions(root, path):
            continue
        try:
            with filelock.FileLock(os.path.join(path, LOCK), timeout=5):
                remove_tree(path)
        except (filelock.Timeout, OSError):
            continue
        removed += 1
        for d in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):  # rank dir, key dir, if empty
            try:
                os.rmdir(d)
            except OSError:
                break
    return removed


#: Bundle entries kept per tag (and rank) under one cache root: saving one more removes the least
#: recently saved or used beyond this many. Several setups of one tag (two scripts defining
#: ``__main__.Model``, a global set from the environment with two values, two layer counts) then
#: each start warm. Override with ``PIECEWISE_BUNDLES_PER_TAG`` (at least 1).
BUNDLES_PER_TAG = 8


def bundles_per_tag() -> int:
    try:
        return max(1, int(os.environ.get("PIECEWISE_BUNDLES_PER_TAG", BUNDLES_PER_TAG)))
    except ValueError:
        return BUNDLES_PER_TAG


#: tag -> why its last first call found no usable bundle (also logged at INFO), for reports such as
#: the demo's table
miss_reasons: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class StartSubject:
    """What a warm start is asked for, handed over by the compiled model.

    Attributes:
        config: the `CompilationConfig`.
        tag: the region's tag.
        module: the model (its fingerprint selects the bundle).
        forward_fn: ``type(module).forward`` (its globals run the transformed code).
        call_signature: the first call's `CallSignature.describe()`.
        frame_locals: ``frame_locals(args, kwargs)``, the locals ``forward`` sees for a call
            (what the bundle's guards read).
    """

    config: Any
    tag: str
    module: torch.nn.Module
    forward_fn: types.FunctionType
    call_signature: tuple[Any, ...]
    frame_locals: Any


class WarmStart:
    """The bundle side of one compiled model's first call.

    `open` looks the bundles of the start key up (newest first) and, when one validates, leaves
    `fast` (the transformed forward, ready to call), `backend` (a restored `PiecewiseBackend`) and
    `guards` set; otherwise `fast` is None and the caller traces, then calls `save`. `open` returns
    None when no bundle can be used or saved at all (cache disabled, mode ``none``).
    """

    def __init__(self, subject: StartSubject, root: str, key: str, factors: dict[str, Any]) -> None:
        self.subject = subject
        self.tag = subject.tag
        self.root = root
        self.key = key
        self.rank = current_rank()
        self.rank_dir = f"rank_{self.rank}_0"
        self.factors = factors
        #: the remote tier bundles and their compile entries are pulled from and published to
        self.remote = remote_tier(subject.config)
        #: the bundle entry that served this start (None: none did)
        self.entry: Any = None
        self.fast: Any = None
        self.backend: Any = None
        self.guards: Any = None
        self.seconds = 0.0
        #: seconds per warm-start phase: key (fingerprint and start key), prepare (adaptor's
        #: per-process setup), decode, guards (rebuild and checks), restore (artifact loads and stitching)
        self.phases: dict[str, float] = {}
        #: piece artifacts a failed warm start already loaded, handed to the tracing backend
        self.preloaded: dict[str, Any] = {}
        #: bundle entry keys this start may not use (`open`)
        self.exclude: frozenset[str] = frozenset()
        #: the key of the bundle entry `save` wrote (None: none)
        self.saved_key: str | None = None

    @classmethod
    def open(cls, subject: StartSubject, args: tuple, kwargs: dict, exclude: frozenset[str] = frozenset()) -> WarmStart | None:
        """The warm start of `subject` for this call (see class doc); `exclude`: bundle entry keys
        not to use (the size classes a compiled model already holds, or one whose trace refused
        this call's sizes)."""
        import time


        config = subject.config
        root = resolve_root(config.cache_dir)
        if root is None or config.mode == "none" or env_flag("PIECEWISE_DISABLE_BUNDLE"):
            return None
        t0 = time.perf_counter()
        call = list(subject.call_signature)
        backend = PiecewiseBackend(config, subject.tag, call_signature=call)
        backend.prepare([*args, *kwargs.values()])  # settles what machine_factors reads (Inductor's ISA)
        factors = start_factors(backend, subject.module, call)
        start = cls(subject, root, start_key(factors), factors)
        start.exclude = exclude
        start.phases["key"] = time.perf_counter() - t0
        if config.debug:
            return start  # debug mode always traces: it checks the full guards, identity guards included
        try:
            why = start._load(backend, args, kwargs)
        except Exception as e:  # nothing in the cache may crash the model: set the bundle aside, trace
            if start.entry is not None:
                start.entry.reject_artifact(BUNDLE, f"warm-start bundle does not load ({type(e).__name__}: {e})")
            why = f"the bundle is unusable ({type(e).__name__}: {e})"
        start.seconds = time.perf_counter() - t0
        start.preloaded = backend.preloaded
        if why:
            start.entry = None
            counters.bump("bundle_misses", tag=subject.tag)
            log.info("[%s] no warm start: %s; tracing", subject.tag, why)
            miss_reasons[subject.tag] = why
        else:
            counters.bump("bundle_hits", tag=subject.tag)
            miss_reasons.pop(subject.tag, None)
        return start

    def _candidates(self) -> list[Any]:
        """The opened bundle entries of this start key, most recently saved or used first."""

        found = bundle_entries(self.root, self.tag, self.rank_dir, key_glob=f"{self.key}-*")
        if not found and self.remote is not None:  # read through: the fleet's bundles of this start key
            from .cache.remote import BUNDLES_PULLED

            for rel in self.remote.bundle_rels(self.rank_dir, self.tag, prefix=f"{self.key}-")[:BUNDLES_PULLED]:
                CacheEntry(self.root, rel.split("/")[0], self.tag, rank=self.rank, remote=self.remote).open(None)
            found = bundle_entries(self.root, self.tag, self.rank_dir, key_glob=f"{self.key}-*")
        out = []
        for _, path in found:
            key = os.path.basename(os.path.dirname(os.path.dirname(path)))
            if key in self.exclude:
                continue
            entry = CacheEntry(self.root, key, self.tag, rank=self.rank)
            if entry.open(None):
                out.append(entry)
        return out

    def _no_bundle(self) -> str:
        """Why no bundle exists for this start key: which start factors differ from the newest
        bundle of this tag (what changed since it was saved), or that there is none."""

        for _, path in bundle_entries(self.root, self.tag, self.rank_dir):
            try:
                with open(os.path.join(path, FACTORS)) as f:
                    old = json.load(f)
            except (OSError, ValueError):
                continue
            diff = diff_factors(old, json.loads(json.dumps(self.factors, default=str)))
            return (f"no bundle for this start key; the newest bundle of this tag ({os.path.relpath(path, self.root)}) "
                    f"differs in {', '.join(diff[:6]) or 'nothing recorded (a format change)'}")
        return f"no bundle of this tag under {self.root}"

    def _load(self, backend: Any, args: tuple, kwargs: dict) -> str:
        """Fill `fast`, `backend`, `guards` and `entry` from the first bundle of the start key that
        validates; returns why none did (every candidate's reason), or ''."""

        candidates = self._candidates()
        if not candidates:
            return "every bundle of this start key is in use for other sizes" if self.exclude else self._no_bundle()
        lap = _Laps(self.phases)
        reasons = []
        for entry in candidates:
            backend.adaptor.prepare(entry.index["meta"].get("device", "cpu"), entry.root)
            lap("prepare")
            try:
                why, artifact, cap = self._check(entry, args, kwargs, lap)
            except Exception as e:  # damaged beyond the checksum (or written by another build): report, set aside
                entry.reject_artifact(BUNDLE, f"warm-start bundle does not load ({type(e).__name__}: {e})")
                why = "the bundle is damaged"
            if not why:
                break
            reasons.append(why if len(candidates) == 1 else f"bundle {entry.key}: {why}")
        else:
            return "; ".join(reasons)
        self.entry = entry
        plan = artifact.plan
        if not isinstance(plan, CompiledPlan) or plan.cache_key != entry.index["meta"].get("compile_key"):
            raise ValueError("the bundle and its index name different compile entries")
        compile_entry = CacheEntry(entry.root, plan.cache_key, self.tag, rank=self.rank, remote=self.remote)
        if not compile_entry.open(dict(plan.cache_meta or {})):
            return f"its compile entry {plan.cache_key} is gone"
        try:
            cap.compiled_fn = artifact.restore(backend, compile_entry)
        except CompileError as e:  # a piece artifact is missing or bad (already reported)
            return str(e)
        except Exception as e:
            entry.reject_artifact(BUNDLE, f"warm-start bundle does not load ({type(e).__name__}: {e})")
            return "the bundle is damaged"
        lap("restore")
        self.backend, self.guards = backend, cap.guard_manager
        self.fast = cap.function(self.subject.forward_fn.__globals__)
        try:  # most recently used: kept longest when bundles of this tag are pruned
            os.utime(os.path.join(entry.path, "index.json"))
        except OSError:
            pass
        return ""

    def _check(self, entry: Any, args: tuple, kwargs: dict, lap: _Laps) -> tuple[str, CompiledArtifact | None, Any]:
        """Load one bundle and validate it for this process and call: ``(why not, artifact, trace)``.

        Raises:
            Exception: the bundle does not decode (damaged, or written by another build).
        """

        payload = entry.load_artifact(BUNDLE)
        if payload is None:
            return "the bundle entry has no usable bundle", None, None
        artifact = CompiledArtifact.load(payload)
        lap("decode")
        stale = artifact.stale()
        if stale:
            return stale, None, None
        unbuilt = ""
        try:
            cap = artifact.trace(self.subject.forward_fn)
        except GuardsNotBuilt as e:  # intact, made for processes unlike this one: a miss, nothing set aside
            cap, unbuilt = e.trace, str(e)
        changed = changed_globals(cap, self.subject.forward_fn)
        lap("guards")
        if changed:
            return f"a global read by forward changed since the trace: {changed[0]}", None, None
        if unbuilt:
            return f"its guards cannot be built in this process ({unbuilt})", None, None
        f_locals = self.subject.frame_locals(args, kwargs)
        if not cap.guard_manager.check(f_locals):
            failed = cap.guard_manager.check_verbose(f_locals).verbose_code_parts
            return f"a guard of the bundle fails for this instance or call ({failed[0] if failed else '?'})", None, None
        return "", artifact, cap

    def save(self, backend: Any, cap: Any) -> None:
        """After a trace: write the bundle for the next process (logged when it cannot be), then
        prune this tag's bundles to `bundles_per_tag`."""

        if backend.cache is None or not backend.cache.writable:
            return
        try:
            artifact = CompiledArtifact.of(backend, cap)
            data = artifact.save()
        except Exception as e:
            log.info("[%s] no warm-start bundle saved: %s: %s", self.tag, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        plan = artifact.plan
        key = f"{self.key}-{artifact.variant(cap.global_values)}"
        entry = CacheEntry(self.root, key, self.tag, rank=self.rank)
        entry.open(None)  # permissions (an unsafe directory is neither read nor written)
        entry.remote = self.remote  # published at its commit (not pulled: this process writes it)
        if entry.writable and entry.save_artifact(BUNDLE, data):
            meta = {"kind": "bundle", "compile_key": plan.cache_key, "device": plan.device}
            entry.commit(meta, self.factors, backend.graph_code)
            if entry.writable:
                self.saved_key = key
                counters.bump("bundles_saved", tag=self.tag)
                log.info("[%s] warm-start bundle saved as %s", self.tag, entry.rel)
                removed = prune_bundles(self.root, self.tag, self.rank_dir, bundles_per_tag(), entry.path)
                if removed:
                    log.info("[%s] removed %d older warm-start bundle(s) of this tag (kept %d)", self.tag, removed,
                             bundles_per_tag())
