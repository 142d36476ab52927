"""The traced call's signature and the check every later call must pass (docs/design.md §4.1, §9).

Guard-free dispatch runs the code traced for the first call without asking Dynamo whether it still
applies. `CallSignature` stands in for the guards that matter for inputs: recorded at the first
call, checked before every later one (a few attribute reads per argument), it raises `InputError`
naming the argument and the remedy for anything the trace could not cover:

* tensors: dtype, device, rank, static dims; dynamic dims <= ``max_num_tokens``; the memory layout
  (a traced contiguous input that arrives strided runs on a contiguous copy, written back into it
  when forward wrote the copy in place; a transposed first input with a dynamic dim is traced
  contiguous, since its strides change with the size; any other layout change is an error);
  tensors that were one object in the traced call must still be one object;
* when forward writes a tensor argument in place (seen at the first call by the tensors' version
  counters), which arguments, as the caller passed them, share memory (one storage, or
  overlapping addresses) with a written one: the compiled code orders reads and writes for the
  traced sharing (two views of one buffer against distinct tensors), so other sharing is an error,
  and so is a strided argument that would run on a copy while sharing memory with a written one;
* ``None`` stays ``None``; other values (numbers, strings, flags, containers of them) must equal a
  snapshot of the traced value, type included (``1`` is not ``1.0``), so in-place edits of a
  list are caught; containers holding tensors are checked leaf by leaf;
* plain objects (a type without value equality, such as a cache object) are not copied: each call
  must pass an object of the traced type, and the compiled model checks the trace's Dynamo guards
  rooted at that argument on every call (`CallSignature.objects` names them);
* arguments left at their default must stay at it.
"""

from __future__ import annotations

import logging

import copy
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._torch import pytree
from .errors import InputError

log = logging.getLogger("piecewise")

__all__ = ["CallSignature", "version"]

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int | None, ...]  # None marks a dynamic dim
    contiguous: bool
    strides: tuple[int, ...] | None  # static strides of a traced non-contiguous tensor


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    name: str
    position: int | None  # index in *args, or None for a keyword
    kind: str  # "tensor" | "none" | "value" | "default" | "tree" | "object"
    tensor: TensorSpec | None = None
    value: Any = None  # snapshot (value/default) or (treespec, leaf specs) for a tree


def _fmt(shape: Sequence[int | None]) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def _has_value_equality(v: Any) -> bool:
    """Whether `v`'s type compares by value (defines ``__eq__`` beyond object identity)."""
    return type(v).__eq__ is not object.__eq__


def _is_object(v: Any) -> bool:
    """A plain object: not a tensor, container or None, and without value equality."""
    if v is None or isinstance(v, torch.Tensor) or not pytree.tree_is_leaf(v):  # registered containers are trees
        return False
    return not _has_value_equality(v)


@dataclasses.dataclass(frozen=True)
class ObjectLeaf:
    """A plain object inside a container argument: its type is checked, its content by guards."""

    type: type


#: a strided argument, the contiguous copy it runs on, and the copy's `version` when made
Copy = tuple[torch.Tensor, torch.Tensor, "int | None"]


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory without gaps or overlap (a permutation of a contiguous tensor)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: (d[1], d[0])):
        if stride != expected:
            return False
        expected *= size
    return True


def version(t: torch.Tensor) -> int | None:
    """`t`'s version counter (bumped by every in-place write), or None for an inference tensor
    (made under ``torch.inference_mode()``), which has none."""
    return None if t.is_inference() else t._version


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[first, last + 1)`` of the bytes a tensor with elements can touch."""
    low = high = 0
    for size, stride in zip(t.shape, t.stride()):
        span = (size - 1) * stride
        if span < 0:
            low += span
        else:
            high += span
    start, item = t.data_ptr(), t.element_size()
    return start + low * item, start + (high + 1) * item


def _sharing_pairs(tensors: list[tuple[str, torch.Tensor]], written: frozenset[int]) -> frozenset[tuple[int, int]]:
    """Pairs ``(i, j)``, i < j, of indices into `tensors` where one is in `written` and the two share
    memory: one storage (what AOTAutograd's handling of a written input that aliases another keys
    on, even for disjoint slices), or overlapping address ranges (two storages on one memory, as
    from numpy or DLPack). Tensors without elements share nothing."""
    info = [(t.device, t.untyped_storage().data_ptr(), _extent(t)) if t.numel() else None for _, t in tensors]
    pairs = set()
    for i in written:
        if info[i] is None:
            continue
        device, storage, (lo, hi) = info[i]
        for j, other in enumerate(info):
            if j == i or other is None or other[0] != device:
                continue
            if other[1] == storage or (other[2][0] < hi and lo < other[2][1]):
                pairs.add((min(i, j), max(i, j)))
    return frozenset(pairs)


def _remedy_tag(name: str) -> str:
    return (f"compile the variant as a model of its own: piecewise.compile(model, CompilationConfig(tag='{name}_variant', ...), "
            "...) and call that one for it")


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether a non-tensor argument equals the traced one as the trace used it: types too, at
    every level (``[2]`` is not ``[2.0]``), dict keys in order (forward may iterate them), floats
    by their repr (``-0.0`` is not ``0.0``; ``nan`` is ``nan``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, (list, tuple)) and depth < 32:
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict) and depth < 32:
        return (list(a) == list(b)) and all(_same(a[k], b[k], depth + 1) for k in a)
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception as e:  # objects without a scalar ==
        log.debug("%s == %s raised %s: %s; taken as different", type(a).__qualname__, type(b).__qualname__,
                  type(e).__name__, e)
        return False


class CallSignature:
    """Records the first call's arguments; `check` validates later calls against them."""

    def __init__(self, params: Sequence[inspect.Parameter], dynamic: Mapping[str, tuple[int, ...]], tag: str,
                 max_num_tokens: int, min_dynamic_size: int = 0) -> None:
        self.params = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self.dynamic = dynamic
        self.tag = tag
        self.max_num_tokens = max_num_tokens
        #: the smallest size a dynamic dim may have (2 under ``dynamic_shapes="backed"``)
        self.min_dynamic_size = min_dynamic_size
        self.specs: list[ArgSpec] = []
        self.var_kw_order: list[str] = []
        #: where one tensor object was passed more than once: (spec index, leaf index in a
        #: container argument or None for the argument itself)
        self.alias_groups: list[tuple[tuple[int, int | None], ...]] = []
        self.required = 0  # specs that must be passed (not left at a default)
        self.objects: tuple[str, ...] = ()  # arguments recorded as plain objects
        #: tensor arguments (``name`` or ``name[leaf]``) the first call wrote in place
        self.mutated: tuple[str, ...] = ()
        #: indices into `tensors` of the arguments in `mutated`
        self.written: frozenset[int] = frozenset()
        #: when `mutated`: the pairs (indices into `tensors`) of the traced call's tensor arguments
        #: that share memory with a written one (None: forward writes no argument, so sharing
        #: cannot matter)
        self.shared_memory: frozenset[tuple[int, int]] | None = None
        self.names = frozenset(p.name for p in self.params)  # parameters forward names (not **kwargs)

    # -- recording ----------------------------------------------------------------------------
    def _tensor_spec(self, name: str, v: torch.Tensor, dims: tuple[int, ...]) -> TensorSpec:
        for d in dims:
            if d >= v.dim() or d < -v.dim():
                raise InputError(f"dynamic_arg_dims marks dim {d} of {name!r}, but it has rank {v.dim()}")
        dyn = {d % v.dim() for d in dims}
        shape = tuple(None if d in dyn else s for d, s in enumerate(v.shape))
        # a dense permutation of a contiguous tensor (a transpose) has strides that follow its sizes:
        # with a dynamic dim no later size has the traced strides, so the trace takes it contiguous
        # (every call runs on a contiguous copy). Other strides (rows of a wider buffer) stay fixed
        # across sizes and are traced as they are.
        contiguous = v.is_contiguous() or (bool(dyn) and _dense(v))
        return TensorSpec(v.dtype, v.device, shape, contiguous, None if contiguous else tuple(v.stride()))

    def record(self, args: tuple, kwargs: dict) -> None:
        self.mutated, self.written, self.shared_memory = (), frozenset(), None  # seen again after the run
        if len(args) > len(self.params):
            raise InputError(f"[{self.tag}] {len(args)} positional arguments given; pass the extra ones by name")
        known = self.names
        slots: list[tuple[str, int | None, Any, Any]] = []
        for i, p in enumerate(self.params):
            if i < len(args):
                slots.append((p.name, i, args[i], _MISSING))
            elif p.name in kwargs:
                slots.append((p.name, None, kwargs[p.name], _MISSING))
            elif p.default is not inspect.Parameter.empty:
                slots.append((p.name, None, _MISSING, p.default))
        slots += [(k, None, v, _MISSING) for k, v in kwargs.items() if k not in known]  # through **kwargs
        #: the order of the arguments passed through ``**kwargs``: forward may iterate them
        self.var_kw_order = [k for k in kwargs if k not in known]
        specs, first_index = [], {}
        for name, pos, v, default in slots:
            dims = self.dynamic.get(name, ())
            if v is _MISSING:
                if dims:
                    raise InputError(f"dynamic_arg_dims marks {name!r}, but the first call did not pass it")
                specs.append(ArgSpec(name, pos, "default", value=copy.deepcopy(default)))
                continue
            if isinstance(v, torch.Tensor):
                spec = ArgSpec(name, pos, "tensor", self._tensor_spec(name, v, dims))
                first_index.setdefault(id(v), []).append((len(specs), None))
            elif dims:
                raise InputError(f"dynamic_arg_dims marks {name!r}, which is a {type(v).__name__}, not a tensor")
            elif v is None:
                spec = ArgSpec(name, pos, "none")
            elif type(v).__module__ == "numpy":
                raise InputError(f"[{self.tag}] {name!r} is a numpy {type(v).__name__}; pass a torch tensor")
            elif _is_object(v):
                spec = ArgSpec(name, pos, "object", value=type(v))
            else:
                leaves, treespec = pytree.tree_flatten(v)
                if any(isinstance(x, torch.Tensor) or _is_object(x) for x in leaves):
                    for j, x in enumerate(leaves):
                        if isinstance(x, torch.Tensor):  # one tensor twice in a container is one trace input too
                            first_index.setdefault(id(x), []).append((len(specs), j))
                    leaf_specs = [self._tensor_spec(name, x, ()) if isinstance(x, torch.Tensor)
                                  else ObjectLeaf(type(x)) if _is_object(x) else copy.deepcopy(x) for x in leaves]
                    spec = ArgSpec(name, pos, "tree", value=(treespec, leaf_specs))
                else:
                    snapshot = copy.deepcopy(v)
                    # A value whose copy does not compare equal to it (a dataclass holding a tensor, a
                    # type whose == is not a plain bool) cannot be checked by value: guard it instead.
                    spec = (ArgSpec(name, pos, "value", value=snapshot) if _same(v, snapshot)
                            else ArgSpec(name, pos, "object", value=type(v)))
            specs.append(spec)
        self.specs = specs
        self.alias_groups = [tuple(ix) for ix in first_index.values() if len(ix) > 1]
        self.required = sum(s.kind != "default" for s in specs)
        self.objects = tuple(s.name for s in specs if s.kind == "object" or (
            s.kind == "tree" and any(isinstance(ls, ObjectLeaf) for ls in s.value[1])))

    def describe(self) -> list[list[Any]]:
        """JSON-ready description of the traced call (enters the cache key)."""
        out: list[list[Any]] = []
        for s in self.specs:
            if s.kind == "tensor":
                t = s.tensor
                out.append([s.name, "tensor", str(t.dtype), t.device.type, ["*" if d is None else d for d in t.shape],
                            t.contiguous])
            elif s.kind in ("value", "default"):
                out.append([s.name, s.kind, repr(s.value)])
            elif s.kind == "tree":
                out.append([s.name, "tree", str(s.value[0])])
            elif s.kind == "object":
                out.append([s.name, "object", f"{s.value.__module__}.{s.value.__qualname__}"])
            else:
                out.append([s.name, s.kind])
        return out

    def dynamic_tensors(self, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs to mark dynamic for the trace."""
        out = []
        for s in self.specs:
            if s.kind == "tensor":
                t = args[s.position] if s.position is not None else kwargs[s.name]
                out += [(t, d) for d, size in enumerate(s.tensor.shape) if size is None]
        return out

    # -- checking -----------------------------------------------------------------------------
    def _check_tensor(self, name: str, v: Any, t: TensorSpec) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            raise InputError(f"[{self.tag}] {name!r} was a tensor when traced but is {type(v).__name__} now")
        if v.dtype != t.dtype:
            raise InputError(f"[{self.tag}] {name!r} has dtype {v.dtype}, compiled for {t.dtype}; cast it with .to({t.dtype})")
        if v.device != t.device:
            raise InputError(f"[{self.tag}] {name!r} is on {v.device}, compiled for {t.device}; move it there")
        shape = v.shape
        if len(shape) != len(t.shape):
            raise InputError(f"[{self.tag}] {name!r} has rank {len(shape)}, compiled for rank {len(t.shape)} {_fmt(t.shape)}")
        for d, s in enumerate(t.shape):
            if s is None:
                if shape[d] > self.max_num_tokens:
                    raise InputError(f"[{self.tag}] {name!r} dim {d} is {shape[d]}, above max_num_tokens={self.max_num_tokens}; "
                                     "split the batch or raise max_num_tokens")
                if shape[d] < self.min_dynamic_size:
                    raise InputError(
                        f"[{self.tag}] {name!r} dim {d} is {shape[d]}, below {self.min_dynamic_size}: under "
                        "dynamic_shapes='backed' Dynamo specialises sizes 0 and 1, so the compiled code holds for sizes "
                        ">= 2 only. Pad the call to 2, or compile with dynamic_shapes='backed_size_oblivious'")
            elif shape[d] != s:
                raise InputError(f"[{self.tag}] {name!r} has shape {tuple(shape)}, compiled for {_fmt(t.shape)}; dim {d} "
                                 "is static. Mark it in dynamic_arg_dims or pass the traced size")
        if t.contiguous:
            if not v.is_contiguous():
                return v.contiguous()  # the compiled code assumes the traced (contiguous) layout
        elif tuple(v.stride()) != t.strides:
            raise InputError(f"[{self.tag}] {name!r} has strides {tuple(v.stride())}, compiled for {t.strides}; pass the "
                             "traced layout (or a contiguous tensor and recompile)")
        return v

    def check(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[Copy]]:
        """Validate a call; returns the arguments to run with (strided inputs made contiguous) and
        the `Copy` records (argument, contiguous copy, its version) to hand to `write_back` after the run.

        Raises:
            InputError: naming the argument and the remedy.
        """
        if len(args) + len(kwargs) != self.required:
            self._check_arity(args, kwargs)
        if len(self.var_kw_order) > 1:
            order = [k for k in kwargs if k not in self.names]
            if order != self.var_kw_order and sorted(order) == sorted(self.var_kw_order):
                raise InputError(f"[{self.tag}] keyword arguments {order} reach **kwargs in another order than traced "
                                 f"({self.var_kw_order}); forward may iterate them in that order. Pass them in the traced order")
        new_args: list | None = None
        copies: list[Copy] = []
        passed = args, kwargs
        for spec in self.specs:
            pos = spec.position
            if pos is not None and pos < len(args):
                v = args[pos]
            elif spec.name in kwargs:
                v = kwargs[spec.name]
            elif spec.kind == "default":
                continue
            else:
                raise InputError(f"[{self.tag}] argument {spec.name!r} was passed when traced but is missing now; pass it")
            kind = spec.kind
            if kind == "tensor":
                w = self._check_tensor(spec.name, v, spec.tensor)
                if w is not v:
                    copies.append((v, w, version(w)))
                    if pos is not None and pos < len(args):
                        new_args = new_args if new_args is not None else list(args)
                        new_args[pos] = w
                    else:
                        kwargs = {**kwargs, spec.name: w}
            elif kind == "none":
                if v is not None:
                    raise InputError(f"[{self.tag}] {spec.name!r} is a {type(v).__name__} now but was None when traced, so "
                                     f"the trace has no input for it. Pass it on the first call too, or {_remedy_tag(spec.name)}")
            elif kind == "tree":
                self._check_tree(spec, v)
            elif kind == "object":
                if type(v) is not spec.value:
                    raise InputError(f"[{self.tag}] {spec.name!r} is a {type(v).__qualname__}, traced with a "
                                     f"{spec.value.__qualname__}; pass an object of the traced type, or {_remedy_tag(spec.name)}")
            elif not _same(v, spec.value):
                if kind == "default" and isinstance(v, torch.Tensor):
                    raise InputError(f"[{self.tag}] {spec.name!r} is a tensor now but was left at its default "
                                     f"{spec.value!r} when traced, so the trace has no input for it. Pass it on the "
                                     f"first call too, or {_remedy_tag(spec.name)}")
                what = "was left at its default" if kind == "default" else "is frozen into the trace"
                raise InputError(f"[{self.tag}] {spec.name!r}={v!r} differs from the traced value {spec.value!r} (it {what}); "
                                 f"non-tensor arguments cannot change after the first call. Pass the traced value, or "
                                 f"{_remedy_tag(spec.name)}")
        for group in self.alias_groups:
            first = self._at(group[0], args, kwargs)
            if any(self._at(w, args, kwargs) is not first for w in group[1:]):
                names = [self.specs[i].name if j is None else f"{self.specs[i].name}[{j}]" for i, j in group]
                raise InputError(f"[{self.tag}] arguments {names} were one tensor when traced and differ now; the trace "
                                 "reads only one of them. Pass distinct tensors on the first call too")
        if self.shared_memory is not None:
            self._check_shared_memory(*passed, copies)
        return (tuple(new_args) if new_args is not None else args), kwargs, copies

    # -- arguments forward writes ----------------------------------------------------------------
    def tensors(self, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
        """The call's tensor arguments and tensor leaves of container arguments, in spec order, as
        ``(name or name[leaf], tensor)``."""
        out = []
        for spec in self.specs:
            if spec.kind == "tensor":
                v = self.value(spec, args, kwargs)
                if isinstance(v, torch.Tensor):
                    out.append((spec.name, v))
            elif spec.kind == "tree":
                leaves = pytree.tree_flatten(self.value(spec, args, kwargs))[0]
                out += [(f"{spec.name}[{j}]", x) for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        return out

    def versions(self, args: tuple, kwargs: dict) -> list[int | None]:
        """The tensor arguments' version counters (`version`), for `note_writes`."""
        return [version(t) for _, t in self.tensors(args, kwargs)]

    def note_writes(self, before: list[int | None], args: tuple, kwargs: dict,
                    copies: list[Copy]) -> None:
        """After the first run (on `args` as `check` returned them, with `versions` taken before
        it): record which tensor arguments forward wrote in place and, if any, which pairs of tensor
        arguments as the caller passed them shared memory with a written one. Inference tensors
        have no version counter: writes to them are not seen (nor is sharing checked for them).

        Raises:
            InputError: a strided argument that ran on a contiguous copy shares memory with a
                written argument: writes through one did not reach the other in this run.
        """
        tensors = self.tensors(args, kwargs)
        written = {i for i, ((_, t), v) in enumerate(zip(tensors, before)) if v is not None and version(t) != v}
        self.mutated = tuple(tensors[i][0] for i in sorted(written))
        self.written, self.shared_memory = frozenset(), None
        if not written:
            return
        original = {id(c): o for o, c, _ in copies}
        passed = [(name, original.get(id(t), t)) for name, t in tensors]
        self.written = frozenset(written)
        self.shared_memory = _sharing_pairs(passed, self.written)
        self._refuse_copies_in(self.shared_memory, passed, tensors, copies, "this call's in-place writes are incomplete")

    def _check_shared_memory(self, args: tuple, kwargs: dict, copies: list[Copy]) -> None:
        passed = self.tensors(args, kwargs)
        now = _sharing_pairs(passed, self.written)
        if now != self.shared_memory:
            def show(pairs: frozenset[tuple[int, int]]) -> str:
                return "; ".join(f"{passed[i][0]} and {passed[j][0]}" for i, j in sorted(pairs)) or "none"

            raise InputError(f"[{self.tag}] forward writes {list(self.mutated)} in place, and the tensor arguments sharing "
                             f"memory with them differ from the traced call (now: {show(now)}; traced: "
                             f"{show(self.shared_memory)}): the compiled code orders its reads and writes for the traced "
                             "sharing. Pass tensors that share memory as they did on the first call (clone a view to give it "
                             "memory of its own)")
        if copies:
            self._refuse_copies_in(now, passed, passed, copies, "nothing ran")

    def _refuse_copies_in(self, pairs: frozenset[tuple[int, int]], passed: list[tuple[str, torch.Tensor]],
                          ran: list[tuple[str, torch.Tensor]], copies: list[Copy],
                          outcome: str) -> None:
        """InputError if an argument that runs on a contiguous copy is in one of `pairs` (shares
        memory with an argument forward writes)."""
        copied = {id(o) for o, _, _ in copies} | {id(c) for _, c, _ in copies}
        for i, j in sorted(pairs):
            for k in (i, j):
                if id(passed[k][1]) in copied or id(ran[k][1]) in copied:
                    other = passed[j if k == i else i][0]
                    raise InputError(f"[{self.tag}] {passed[k][0]!r} is strided and shares memory with {other!r}, and forward "
                                     f"writes {list(self.mutated)} in place: it runs on a contiguous copy, which does not "
                                     f"see writes through {other!r} (nor they its); {outcome}. Pass it contiguous, or "
                                     "clone it")

    @staticmethod
    def write_back(copies: list[Copy]) -> None:
        """After a run on contiguous copies (`check`): copy each copy forward wrote in place back
        into the caller's tensor, as eager forward would have written it."""
        for original, copy_, made in copies:
            # an inference tensor's copy has no version counter: its values are compared instead
            if version(copy_) != made if made is not None else not torch.equal(original, copy_):
                original.copy_(copy_)

    def _at(self, where: tuple[int, int | None], args: tuple, kwargs: dict) -> Any:
        """The argument (or container leaf) an alias group names: (spec index, leaf index or None)."""
        v = self.value(self.specs[where[0]], args, kwargs)
        return v if where[1] is None else pytree.tree_flatten(v)[0][where[1]]

    def value(self, spec: ArgSpec, args: tuple, kwargs: dict) -> Any:
        return args[spec.position] if spec.position is not None and spec.position < len(args) else kwargs.get(spec.name)

    def _check_tree(self, spec: ArgSpec, v: Any) -> None:
        treespec, leaf_specs = spec.value
        leaves, now = pytree.tree_flatten(v)
        if now != treespec:
            raise InputError(f"[{self.tag}] {spec.name!r} has structure {now}, traced with {treespec}")
        for i, (x, ls) in enumerate(zip(leaves, leaf_specs)):
            if isinstance(ls, TensorSpec):
                if self._check_tensor(f"{spec.name}[{i}]", x, ls) is not x:
                    raise InputError(f"[{self.tag}] {spec.name!r} leaf {i} is not contiguous; pass contiguous tensors in containers")
            elif isinstance(ls, ObjectLeaf):
                if type(x) is not ls.type:
                    raise InputError(f"[{self.tag}] {spec.name!r} leaf {i} is a {type(x).__qualname__}, traced with a "
                                     f"{ls.type.__qualname__}; pass an object of the traced type")
            elif not _same(x, ls):
                raise InputError(f"[{self.tag}] {spec.name!r} leaf {i}={x!r} differs from the traced {ls!r}")

    def _check_arity(self, args: tuple, kwargs: dict) -> None:
        names = {p.name for p in self.params[: len(args)]} | set(kwargs)
        traced = {s.name for s in self.specs}
        required = {s.name for s in self.specs if s.kind != "default"}
        extra, missing = sorted(names - traced), sorted(required - names)
        if extra or missing:
            raise InputError(f"[{self.tag}] arguments differ from the traced call: extra {extra}, missing {missing}; "
                             "pass the same arguments every call")
