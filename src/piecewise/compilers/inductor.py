"""The ``inductor`` adaptor: `torch._inductor.standalone_compile` per piece (docs/design.md §4.5).

The general and range compiles keep the piece's symbolic shapes (read from the ambient Dynamo
tracing context); a size compile re-specialises the piece on concrete shapes in a fresh fake mode,
so its graph holds no SymInt. Artifacts are compiled in AOT mode: `serialize()` yields one
self-contained byte string (the bundled AOTAutograd entry with its Inductor code), which is what
the cache stores and `load` turns back into a callable without running Inductor.

Post-grad passes (`piecewise.passes`): each compile installs a `PostGradPassManager` bound to its
`CompileTarget` as Inductor's ``post_grad_custom_post_pass`` (before any such pass given in
``inductor_options``, which still runs after it). The pipeline's uuid is part of `compute_hash`;
the manager's own uuid adds the target, so Inductor's FX graph cache keys differ per target too.
"""

from __future__ import annotations

import logging

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .._torch.inductor import COMPILER_MODULES, RUNTIME_MODULES, CustomGraphPass, size_oblivious_view_strides
from ..cache.key import storage_aliases
from ..errors import CompileError
from ..ops import resolve_splitting_ops
from ..passes import packed_linear as _packed_linear  # noqa: F401 - registers the op loaded pieces call
from . import isa_record
from .base import CompiledPiece, CompilerAdaptor, CompileTarget
from .._torch.inductor_runtime import light_inductor_runtime
from .partition import PartitionedCallable, PartitionMarker, partition_scope

log = logging.getLogger("piecewise")

__all__ = ["InductorAdaptor"]

#: what Inductor's generated wrapper modules and its runtime use (their first load pays for these;
#: ``debug`` is read on every call and otherwise comes with the compiler's imports)
_RUNTIME_MODULES = RUNTIME_MODULES
#: what generated code and Inductor's cache-hit path import that `light_inductor_runtime` stands in for
_COMPILER_MODULES = COMPILER_MODULES


class AliasingMarker(CustomGraphPass):
    """A post-grad pass that changes nothing; its uuid puts which graph inputs share a storage
    into Inductor's FX graph cache key."""

    def __init__(self, aliases: list[list[int]]) -> None:
        self.aliases = aliases

    def __call__(self, graph: Any) -> None:
        return None

    def uuid(self) -> Any:
        return f"piecewise-input-aliasing-{self.aliases}"


class InductorAdaptor(CompilerAdaptor):
    name = "inductor"

    def __init__(self, config) -> None:
        super().__init__(config)
        from ..passes.manager import PostGradPassManager

        self.config_patches: dict[str, Any] = dict(config.inductor_options)
        self.passes = PostGradPassManager.from_config(config)
        self._hash: str | None = None
        self._root: str | None = None  # the cache root `prepare` was given (where an ISA probe is recorded)
        #: whether artifact loads run against `light_inductor_runtime` (`prepare` for a CPU device)
        self._light_loads = False
        #: splitting ops Inductor partitions at (split_strategy="inductor_partition"), else None
        self.partition_ops: tuple[str, ...] | None = (
            resolve_splitting_ops(config.splitting_ops) if config.split_strategy == "inductor_partition" else None)

    def compute_hash(self) -> str:
        if self._hash is None:
            from .._torch.inductor import config as inductor_config

            # The portable config dict excludes machine-local entries (paths, worker counts).
            with inductor_config.patch(self.config_patches):
                cfg = inductor_config.save_config_portable()
            blob = json.dumps(
                {
                    "torch": torch.__version__,
                    "inductor_config": {k: repr(v) for k, v in sorted(cfg.items())},
                    # Inductor leaves custom passes out of its portable config: hash their uuids
                    "passes": self.passes.pipeline_uuid(),
                    "post_grad_custom_post_pass": _custom_pass_ids(self.config_patches.get("post_grad_custom_post_pass")),
                },
                sort_keys=True,
            )
            self._hash = hashlib.sha256(blob.encode()).hexdigest()[:16]
        return self._hash

    @property
    def saves_artifacts(self) -> bool:
        return True

    def machine_factors(self) -> dict[str, Any]:
        """The CPU vector ISA Inductor's C++ kernels are built for (name and compiler flags, under
        this adaptor's config patches) and, with CUDA, the device's compute capability: kernels
        built for AVX-512 or sm_90 must not load on an AVX2 CPU or an sm_80 GPU sharing the cache
        (a remote tier or a copied root). Inductor's own caches leave the ISA out of their keys."""
        from .._torch.inductor import config as inductor_config
        from .._torch.inductor import cpu_vec_isa

        if not _patches_isa(self.config_patches):
            isa_record.assume(self._root)
        with inductor_config.patch(self.config_patches):
            isa = cpu_vec_isa.pick_vec_isa()
            cpu = {"isa": str(isa), "flags": isa.build_arch_flags() if isa else ""}
        cuda = list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
        return {"cpu_vec_isa": cpu, "cuda_capability": cuda}

    def compile(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any], target: CompileTarget) -> CompiledPiece:
        if self.partition_ops is None:
            return self._compile(graph, example_inputs, target)
        with partition_scope(self.partition_ops, example_inputs) as slots:
            piece = self._compile(graph, example_inputs, target)
        return CompiledPiece(PartitionedCallable(piece.fn, slots), piece.payload)

    def _compile(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any], target: CompileTarget) -> CompiledPiece:
        _drop_orphan_unbacked_symbols(example_inputs)
        try:
            art = self._standalone_compile(graph, example_inputs, target)
        except Exception as e:
            if _cant_split(e):
                art = self._compile_untiled(graph, example_inputs, target, e)
            elif not isa_record.probe_if_assumed(self._root):
                raise CompileError(f"Inductor failed to compile a piece for {target.label}: {type(e).__name__}: {e}") from e
            else:
                # the compiler rejected the vector ISA assumed from the CPU's flags; its probe answered otherwise
                try:
                    art = self._standalone_compile(graph, example_inputs, target)
                except Exception as e2:
                    raise CompileError(f"Inductor failed to compile a piece for {target.label}: {type(e2).__name__}: "
                                       f"{e2}") from e2
        try:
            payload = art.serialize()
        except Exception as e:  # unserialisable graph: still usable, just not cached
            log.info("a piece compiled for %s cannot be serialised, so it is not cached (%s: %s)", target.label,
                     type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            payload = None
        return CompiledPiece(art, payload)

    def _compile_untiled(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any], target: CompileTarget,
                         first: Exception) -> Any:
        """Compile again after Inductor's Triton code generation could not fit a kernel's loops into
        its tiling (``CantSplit``), with the rungs of `UNTILED_PATCHES` in turn; CompileError naming
        every attempt when none compiles.

        Seen with torch 2.11 on an H200: a transformers decoder's prompt step, whose pieces have two
        dynamic sizes (batch and new tokens), failed with ``CantSplit: 64*s70 not divisible by
        s44*s70``: a kernel's loops merged into ``new_tokens x hidden`` while its tiling had a
        ``batch x new_tokens`` group, a split Inductor cannot prove for symbolic sizes. Tiling and
        loop order are code-generation choices only: the kernels compute the same values."""
        errors = [f"{type(first).__name__}: {first}"]
        for patches in UNTILED_PATCHES:
            _drop_orphan_unbacked_symbols(example_inputs)  # the failed attempt may have left some
            try:
                art = self._standalone_compile(graph, example_inputs, target, extra_patches=patches)
            except Exception as e:
                errors.append(f"with {patches}: {type(e).__name__}: {e}")
                if _cant_split(e):
                    continue
                break
            log.warning("Inductor could not tile a kernel of a piece for %s (%s); compiled it with %s instead",
                        target.label, str(first).splitlines()[0][:200], patches)
            return art
        raise CompileError(f"Inductor failed to compile a piece for {target.label}: " + "; then ".join(errors)) from first

    def _standalone_compile(self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any], target: CompileTarget,
                            extra_patches: dict[str, Any] | None = None) -> Any:
        from .._torch.inductor import standalone_compile

        options = {"config_patches": {**self._patches_for(target), **(extra_patches or {})}}
        aliases = storage_aliases(example_inputs)
        if aliases:
            # Inputs on one storage (a buffer that views another): Inductor's graph cache key leaves
            # the aliasing out and returned code compiled for unaliased inputs (measured: off by 6
            # after a module's buffer was untied and traced again). A pass that changes nothing puts
            # the aliasing into that key, as piecewise's own key has it (`cache.key.input_signature`).
            patches = dict(options["config_patches"])
            user = patches.get("post_grad_custom_post_pass")
            user = list(user) if isinstance(user, (list, tuple)) else [user] if user else []
            patches["post_grad_custom_post_pass"] = _post_passes([AliasingMarker(aliases), *user])
            options["config_patches"] = patches
        with size_oblivious_view_strides():
            return self._standalone_compile_with(standalone_compile, graph, example_inputs, target, options)

    def _standalone_compile_with(self, standalone_compile: Any, graph: torch.fx.GraphModule, example_inputs: Sequence[Any],
                                 target: CompileTarget, options: dict[str, Any]) -> Any:
        if target.size is not None:
            if _takes_fake_mode(standalone_compile):
                inputs, fake_mode = _static_inputs(example_inputs, target.size, target.symbol)
                return standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs", options=options, aot=True,
                                          fake_mode=fake_mode)
            # torch 2.11 makes its own fake mode: hand it real (uninitialised) inputs
            inputs, _ = _static_inputs(example_inputs, target.size, target.symbol, fake=False)
            return standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs", options=options, aot=True)
        return standalone_compile(graph, list(example_inputs), dynamic_shapes="from_tracing_context", options=options,
                                  aot=True)

    def _patches_for(self, target: CompileTarget) -> dict[str, Any]:
        """The Inductor config patches of one compile: ours plus the pass manager for `target`."""
        patches = dict(self.config_patches)
        ours = [self.passes.for_target(target)] if self.passes.passes else []  # none: keep Inductor's cache shared across targets
        if self.partition_ops is not None:
            ours.append(PartitionMarker())
        if ours:
            user = patches.get("post_grad_custom_post_pass")
            user = list(user) if isinstance(user, (list, tuple)) else [user] if user else []
            patches["post_grad_custom_post_pass"] = _post_passes([*ours, *user])
        return patches

    def prepare(self, device: str, root: str | None = None) -> None:
        """Settle, before the trace or the first artifact load, the one-time per-process work the
        first compile or load would otherwise wait on.

        - Inductor's CPU vector-ISA question is answered from the CPU's flags without a test build
          (`piecewise.compilers.isa_record.assume`; a compile that then fails probes the compiler
          and compiles again). Inductor's own probe built and dlopened a test library per ISA:
          measured on this repository's 2-core machine, 2.8 s of a cold start on a cold Inductor
          cache (2.4 s of g++, 0.4 s of a child Python) and 0.4 s with a warm one, in every process.
          Not when this adaptor's config patches set ``cpp.vec_isa_ok`` or ``cpp.simdlen``:
          Inductor memoises its first answer per process, so it must be given under those patches,
          inside the compile.
        - This thread imports the Inductor runtime modules generated code imports (~0.15 s). On
          the CPU that leaves out ``select_algorithm`` and ``graph`` (0.6 s), which an artifact
          load does without (`inductor_runtime`) and a compile imports itself; on a GPU, whose
          loads have not run against the stand-ins, they are imported too."""
        self._root = root
        if device == "cpu" and not _patches_isa(self.config_patches):
            isa_record.assume(root)
        import importlib

        self._light_loads = device == "cpu"
        for name in _RUNTIME_MODULES if self._light_loads else (*_RUNTIME_MODULES, *_COMPILER_MODULES):
            importlib.import_module(name)

    def load(self, payload: bytes, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        from .._torch.inductor import AOTCompiledArtifact

        light = light_inductor_runtime() if self._light_loads else contextlib.nullcontext()
        if self.partition_ops is None:
            with light:
                fn = AOTCompiledArtifact.deserialize(payload)
        else:
            # Inductor wraps the partitions while it rebuilds the callable; no scheduling happens
            with partition_scope(self.partition_ops, gpu=True) as slots, light:
                fn = AOTCompiledArtifact.deserialize(payload)
        # A loaded artifact returns its outputs as a list; the piece's graph may return one value.
        out = (lambda *args: fn(*args)[0]) if _returns_single_value(graph) else fn
        return out if self.partition_ops is None else PartitionedCallable(out, slots)

    def unpack(self, payload: bytes, graph: torch.fx.GraphModule) -> dict[str, bytes]:
        """The artifact's readable form: ``piece.py`` (the piece's FX code), ``aot_forward_graph.txt``
        (the graph Inductor lowered, after AOTAutograd), ``output_code.py`` (Inductor's generated
        wrapper: ``call``, the partitions, the kernel launches) and ``kernels/<name>.<cpp|py>`` (each
        C++ or Triton kernel's source, cut out of the wrapper). What this torch's artifact does not
        carry is left out, logged; a payload that does not unpickle gives ``piece.py`` alone."""
        import pickle

        files = {"piece.py": graph.code.encode()}
        try:
            bundle = pickle.loads(payload)  # the payload this process just compiled: no foreign bytes
            entry = bundle[0] if isinstance(bundle, tuple) else bundle
            aot_graph = getattr(entry, "aot_forward_graph_str", None)
            source = getattr(getattr(getattr(entry, "compiled_fw", None), "result", None), "source_code", None)
        except Exception as e:  # another torch's artifact layout: the binary still loads
            log.info("no readable form of an Inductor artifact on this torch (%s: %s)", type(e).__name__, e)
            return files
        if aot_graph:
            files["aot_forward_graph.txt"] = str(aot_graph).encode()
        if source:
            files["output_code.py"] = source.encode()
            files.update(_kernel_sources(source))
        else:
            log.info("this torch's Inductor artifact carries no generated source; unpacked form holds the piece only")
        return files


#: ``<name> = async_compile.<kind>(<signature>, r'''<source>''')`` in Inductor's generated wrapper
_KERNEL = r"^(\w+) = async_compile\.(\w+)\(.*?r?'''(.*?)'''"


def _kernel_sources(source: str) -> dict[str, bytes]:
    """``kernels/<name>.cpp`` (C++) or ``.py`` (Triton) for each kernel defined in Inductor's
    generated wrapper `source`."""
    import re

    out = {}
    for m in re.finditer(_KERNEL, source, re.S | re.M):
        name, kind, code = m.groups()
        ext = "py" if kind == "triton" else "cpp" if kind.startswith("cpp") else "txt"
        out[f"kernels/{name}.{ext}"] = code.strip("\n").encode() + b"\n"
    return out


def _patches_isa(patches: dict[str, Any]) -> bool:
    """Whether Inductor config patches change what its vector-ISA probe answers."""
    cpp = patches.get("cpp")
    nested = cpp if isinstance(cpp, dict) else {}
    return any(k in patches for k in ("cpp.vec_isa_ok", "cpp.simdlen")) or any(k in nested for k in ("vec_isa_ok", "simdlen"))


class _ChainedPasses(CustomGraphPass):
    """Several post-grad passes as one, for Inductor releases whose ``post_grad_custom_post_pass``
    takes a single pass (torch 2.11 and older; 2.13 takes a list). Runs them in order; its uuid
    combines theirs (None, bypassing Inductor's FX graph cache, when any has none)."""

    def __init__(self, passes: list[Any]) -> None:
        self.passes = passes

    def __call__(self, graph: Any) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        if any(u is None for u in ids):
            return None
        return hashlib.sha256(repr(ids).encode()).hexdigest()


def _post_passes(passes: list[Any]) -> Any:
    """The ``post_grad_custom_post_pass`` value running `passes` in order on this Inductor."""
    from .._torch.inductor import custom_graph_pass as cgp

    if len(passes) == 1 or hasattr(cgp, "get_custom_graph_passes"):  # the list form exists
        return passes[0] if len(passes) == 1 else passes
    return _ChainedPasses(passes)


def _custom_pass_ids(value: Any) -> list[str] | None:
    """Stable ids of Inductor custom passes given in ``inductor_options`` (None: none given). A
    pass without ``uuid()`` gets its qualified name: Inductor itself bypasses its cache for it.
    Inductor (2.13) takes one pass or a list of them."""
    if not value:
        return None
    out = []
    for p in value if isinstance(value, (list, tuple)) else (value,):
        u = p.uuid() if hasattr(p, "uuid") else None
        out.append(u.hex() if isinstance(u, bytes) else repr(u) if u is not None else f"{type(p).__module__}.{type(p).__qualname__}")
    return out


def _returns_single_value(graph: torch.fx.GraphModule) -> bool:
    out = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    return not isinstance(out.args[0], (tuple, list))


def _takes_fake_mode(fn: Callable[..., Any]) -> bool:
    """Whether this torch's ``standalone_compile`` accepts ``fake_mode`` (2.13 does, 2.11 not)."""
    import inspect

    return "fake_mode" in inspect.signature(fn).parameters


def _static_inputs(example_inputs: Sequence[Any], size: int, symbol: Any = None,
                   fake: bool = True) -> tuple[list[Any], Any]:
    """Concrete fake inputs for a size compile: the dispatch symbol becomes `size`. With
    ``fake=False``, real uninitialised tensors of those shapes (and None for the mode): the inputs'
    bytes are allocated for the compile's duration.

    Raises:
        CompileError: an input depends on a symbol other than the dispatch symbol, so a static
            compile could specialise a dim that varies independently at runtime.
    """
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .._torch.subclasses import FakeTensorMode

    symbol = symbol if symbol is not None else dispatch_symbol(example_inputs)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv()) if fake else None

    def concrete(v: Any) -> int:
        if isinstance(v, torch.SymInt):
            expr = v.node.expr
            free = expr.free_symbols
            if free - {symbol}:
                raise CompileError(
                    f"a size compile needs every dynamic dim to follow the token count, but {expr} depends on "
                    f"{sorted(map(str, free - {symbol}))}; drop compile_sizes or mark fewer dims dynamic"
                )
            return int(expr.xreplace({symbol: size}))
        return int(v)

    out: list[Any] = []
    with fake_mode or contextlib.nullcontext():
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                out.append(
                    torch.empty_strided(
                        [concrete(s) for s in x.shape],
                        [concrete(s) for s in x.stride()],
                        dtype=x.dtype,
                        device=x.device,
                        requires_grad=x.requires_grad,
                    )
                )
            elif isinstance(x, torch.SymInt):
                out.append(concrete(x))
            else:
                out.append(x)
    return out, fake_mode


def dispatch_symbol(example_inputs: Sequence[Any]):
    """The sympy symbol of the first SymInt among `example_inputs` (the token count), or None."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            syms = x.node.expr.free_symbols
            if len(syms) == 1:
                return next(iter(syms))
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            for s in x.shape:
                if isinstance(s, torch.SymInt) and len(s.node.expr.free_symbols) == 1:
                    return next(iter(s.node.expr.free_symbols))
    return None


#: Inductor config patches tried in turn when a piece's Triton code generation raises CantSplit
#: (`InductorAdaptor._compile_untiled`): one-dimensional pointwise tiling, then also no loop
#: reordering at fusion (which can merge a node's loops into an order the kernel's groups cannot take).
UNTILED_PATCHES: tuple[dict[str, Any], ...] = (
    {"triton.max_tiles": 1},
    {"triton.max_tiles": 1, "loop_ordering_after_fusion": False},
)


def _cant_split(e: BaseException) -> bool:
    """Whether `e` (or an exception it chains) is Inductor's ``CantSplit`` from tiling a kernel."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ == "CantSplit" or "CantSplit" in str(cur).split("\n", 1)[0]:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _drop_orphan_unbacked_symbols(example_inputs: Sequence[Any]) -> None:
    """Forget the data-dependent (unbacked) size symbols the trace's shape environment still holds
    as freshly made but unbound, where none of them occurs in `example_inputs`' sizes, strides or
    values: nothing this compile traces can refer to them.

    Each piece compiles in the one shape environment of the whole trace (``from_tracing_context``),
    and Inductor's tracing of a piece refuses to start while such a symbol is pending
    (``PendingUnbackedSymbolNotFound``: "Pending unbacked symbols {u4} not in returned outputs
    [the piece's inputs]"). Seen with torch 2.11 on an H200: the decode step of transformers
    ``generate()`` compiled its first piece and the second one failed so; an earlier compile (or a
    fake run between pieces) had made the symbol and left it unbound. Symbols that do occur in the
    inputs stay pending, for the trace to bind as usual."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from .._torch.fx import detect_fake_mode

    mode = detect_fake_mode(list(example_inputs))
    env = getattr(mode, "shape_env", None)
    pending = getattr(env, "pending_fresh_unbacked_symbols", None)
    if not pending:
        return
    used: set[Any] = set()
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            used |= free_unbacked_symbols((*x.shape, *x.stride(), x.storage_offset()))
        elif isinstance(x, torch.SymInt):
            used |= free_unbacked_symbols(x)
    orphans = [s for s in pending if s not in used]
    if orphans:
        log.debug("dropping unbound data-dependent size symbols %s before compiling a piece", orphans)
        pending[:] = [s for s in pending if s in used]
