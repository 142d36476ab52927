"""The Dynamo backend: one `PiecewiseBackend` per compiled graph (docs/design.md §4.2).

Called by Dynamo with the FX graph and fake example inputs, it splits the graph at splitting ops,
compiles every non-splitting piece for each entry of the `EntryTable` (deduplicating identical
pieces), and returns the `StitchedForward` of a `CompiledForward` (`piecewise.compiled`). A warm
start makes the same `CompiledForward` from a saved `CompiledPlan` (`restore`). A second call on
the same instance is a recompile: it is counted and raised, never silently accepted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx

from ._torch.dispatch import enable_python_dispatcher
from ._torch.dynamo import unwrapped_by_dynamo
from ._torch.fx import CompileContext, TracingContext, detect_fake_mode
from ._torch.subclasses import FakeTensorMode
from .cache.key import KEY_FORMAT, compute_key, diff_factors, env_factors, input_signature, source_factors
from .cache.remote import claim_or_wait, remote_cache, remote_url
from .cache.store import CacheEntry, current_rank, resolve_root, shares_across_ranks
from .compilers import CompiledPiece, CompilerAdaptor, get_adaptor
from .compilers.inductor import dispatch_symbol
from .compilers.partition import uncuttable_ops
from .config import CompilationConfig
from .counters import counters
from .compiled import (CompiledForward, CompiledPlan, Load, Rebuild, Reuse, RunnerSpec, SIZE_REMEDY, SizeRefusal, Step, StitchedForward,
                       build_forward)
from .errors import CompileError, ConfigError, PiecewiseError, RecompileError
from .ops import op_exists, registered_splitting_ops, resolve_splitting_ops
from .graphs.install import graph_plan as plan_graphs
from .graphs.install import token_mixing
from .piece import EntryKind, EntryTable, PieceRunner, piece_fingerprint
from .split import SplitResult, fx_forward, is_splitting_node, shadowed_torch_functions, split_graph, written_inputs
from .tags import unique_tag
from .targets import CompileTarget

__all__ = ["PiecewiseBackend", "StitchedForward", "dynamo_backend", "size_refusals_handled"]

log = logging.getLogger("piecewise")

_refusals_handled: ContextVar[bool] = ContextVar("piecewise_size_refusals_handled", default=False)


@contextmanager
def size_refusals_handled() -> Iterator[None]:
    """Compiles inside this block belong to a caller that catches `SizeRefusedError` and serves
    the refused sizes with another compile (the generation route: one step per phase when a
    model's code branches on one new token). A trace specialised to some sizes is then logged at
    INFO, not as the WARNING that tells a direct caller its other sizes will raise."""
    token = _refusals_handled.set(True)
    try:
        yield
    finally:
        _refusals_handled.reset(token)


def remote_tier(config: CompilationConfig) -> Any:
    """The remote tier `config` names (its ``remote_cache`` or ``PIECEWISE_REMOTE_CACHE``), or None."""
    return remote_cache(remote_url(config.remote_cache), config.remote_connect_timeout_ms, config.remote_io_timeout_ms)


class PiecewiseBackend:
    """Compiles one Dynamo graph piecewise. See module doc.

    Attributes after the call: `split` (the `SplitResult`), `runners`, `table`, `traced_files`
    (source files Dynamo inlined), `timings` (seconds per phase), `graph_code` (readable split
    graph).
    """

    def __init__(self, config: CompilationConfig, tag: str, call_signature: Sequence[Any] | None = None,
                 preloaded: dict[str, Callable[..., Any]] | None = None, arg_aliases: Mapping[str, str] | None = None,
                 guarded_by_dynamo: bool = False) -> None:
        self.config = config
        #: how the traced function's own argument names read as the user wrote the call
        #: (``args[0]`` -> ``input_ids`` for a forward wrapped by a ``(*args, **kwargs)`` decorator)
        self.arg_aliases: dict[str, str] = dict(arg_aliases or {})
        #: Dynamo evaluates its guards on every call (``torch.compile(backend="piecewise")``): a size
        #: the trace does not hold for recompiles there instead of being refused
        self.guarded_by_dynamo = guarded_by_dynamo
        #: artifacts already loaded by a warm start that fell back to tracing, by name (not reloaded)
        self.preloaded: dict[str, Callable[..., Any]] = dict(preloaded or {})
        self.tag = tag
        self.call_signature = list(call_signature or [])
        self.cache: CacheEntry | None = None
        self.factors: dict[str, Any] = {}
        self.adaptor: CompilerAdaptor = get_adaptor(config.backend, config)
        self.split_ops = resolve_splitting_ops(config.splitting_ops) if config.mode == "piecewise" else ()
        #: the compiled graph (None until the first call)
        self.result: CompiledForward | None = None
        self.traced_files: set[str] = set()
        self.timings: dict[str, float] = {}
        self.graph_code = ""
        self._mixing: list[str] = []
        #: graph inputs that are the forward's own arguments (`_argument_inputs`), set by the trace
        self._argument_inputs: tuple[int, ...] = ()
        #: graph inputs a non-splitting op writes in place (`split.written_inputs`)
        self._written_inputs: tuple[int, ...] = ()
        self._input_names: list[str] = []  # graph inputs as the user names them, for messages
        self._cache_meta: dict[str, Any] | None = None
        #: size guards of the compile whose pieces a cache hit loaded (`_entry_sizes`), None: none
        self.inherited_sizes: SizeRefusal | None = None

    # what tests and tools read, from the compiled result
    @property
    def compiled(self) -> StitchedForward | None:
        return self.result.stitched if self.result is not None else None

    @property
    def split(self) -> SplitResult | None:
        return self.result.split if self.result is not None else None

    @property
    def runners(self) -> list[PieceRunner]:
        return self.result.runners if self.result is not None else []

    @property
    def table(self) -> EntryTable | None:
        return self.result.table if self.result is not None else None

    @property
    def graph_pool(self) -> Any:
        """The `graphs.wrapper.GraphPool` of captured graphs, or None."""
        return self.result.graphs.pool if self.result is not None and self.result.graphs is not None else None

    @property
    def stitched_wrappers(self) -> list[Any]:
        """Per-piece graph wrappers, in piece order ([] without piecewise graphs)."""
        return self.result.graphs.wrappers if self.result is not None and self.result.graphs is not None else []

    def prepare(self, example_inputs: Sequence[Any]) -> None:
        """Let the adaptor settle its per-process setup for the inputs' device (Inductor's CPU
        vector ISA, its runtime imports) before the trace; see `CompilerAdaptor.prepare`."""
        device = next((x.device.type for x in example_inputs if isinstance(x, torch.Tensor)), "cpu")
        self.adaptor.prepare(device, resolve_root(self.config.cache_dir))

    # -- phases -------------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.result is not None:
            counters.bump("recompiles", tag=self.tag)
            raise RecompileError(
                f"tag {self.tag!r} was asked to compile a second graph; an input changed in a way the first trace "
                "did not cover (dtype, rank, a dim not marked dynamic, a Python branch). Mark the dim dynamic or "
                "compile the variant under another tag"
            )
        counters.bump("graphs_seen", tag=self.tag)
        shadowed = shadowed_torch_functions(gm)
        if shadowed:
            raise CompileError(
                f"[{self.tag}] the traced code calls {', '.join(shadowed)}: a torch function replaced in its module. "
                "Compiled pieces look torch functions up by name when they run and would call the replacement where "
                "the trace recorded the original. Restore the torch function and override the caller instead (the "
                "module or model function that calls it, e.g. the model's activation module)")
        self.prepare(example_inputs)  # already done before the trace by piecewise.compile; cheap again
        self.traced_files = traced_source_files()
        graph_hash = hashlib.sha256(gm.code.encode()).hexdigest()  # before splitting rewrites the graph
        self._mixing = self._token_mixing(gm, example_inputs)
        self._argument_inputs = _argument_inputs(gm)
        self._written_inputs = written_inputs(gm, range(sum(n.op == "placeholder" for n in gm.graph.nodes)),
                                              frozenset(self.split_ops) | frozenset(registered_splitting_ops()))
        self._input_names = [_alias(n, self.arg_aliases) for n in _input_names(gm)]
        t0 = time.perf_counter()
        split = self._split(gm)
        self.timings["split"] = time.perf_counter() - t0
        self.timings["cache_load"] = 0.0
        fake_mode, fake_inputs = _fake_inputs(example_inputs)
        self._lease = self._rank_lock = None
        try:
            self.cache = self._open_cache(graph_hash, fake_inputs, split)
            t0 = time.perf_counter()
            self.result = self._compile(split, fake_mode, fake_inputs)
            self.timings["compile"] = time.perf_counter() - t0 - self.timings["cache_load"]
            self.graph_code = render_split_graph(split)
            if self.cache is not None and self.adaptor.machine_factors() != self.factors.get("machine"):
                # a compile failed under an assumed machine answer and was redone under the probed
                # one (Inductor's CPU ISA): the key no longer says what the code was built for
                log.warning("[%s] the compiler's machine answer changed while compiling (%s -> %s); this compile "
                            "is not saved, the next process compiles under the new answer", self.tag,
                            self.factors.get("machine"), self.adaptor.machine_factors())
                self.cache = None
            if self.cache is not None and (self.cache.saved or self.cache.index is None):
                self.cache.commit(self._cache_meta, self.factors, self.graph_code)
        finally:
            if self._lease is not None:
                self._lease.release()
            if self._rank_lock is not None:
                self._rank_lock.release()
        log.info(
            "[%s] %d pieces (%d compiled, %d distinct) split in %.3fs, compiled in %.3fs with %s",
            self.tag, len(split.items), len(self.runners), len({r.fingerprint for r in self.runners}),
            self.timings["split"], self.timings["compile"], self.adaptor.name,
        )
        return self.result.stitched

    def _token_mixing(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[str]:
        """Nodes that combine values across tokens (`graphs.setup.token_mixing`), when graphs may be
        captured for this graph; [] otherwise."""
        if self.config.cudagraph_mode == "none":
            return []
        symbol = dispatch_symbol(example_inputs)
        if symbol is None:
            return []
        return token_mixing(gm, symbol, frozenset(self.split_ops))

    def key_factors(self, graph_hash: str, example_inputs: Sequence[Any]) -> dict[str, Any]:
        """Every factor of the cache key, raw (docs/design.md §5.2)."""
        from ._version import build_id

        return {
            "key_format": KEY_FORMAT,
            "piecewise": build_id(),
            "torch": torch.__version__,
            "env": env_factors(),
            "config": self.config.code_factors(),
            "compiler": {"name": self.adaptor.name, "hash": self.adaptor.compute_hash()},
            "machine": self.adaptor.machine_factors(),
            "splitting_ops": sorted(self.split_ops),
            "sources": source_factors(self.traced_files),
            "inputs": input_signature(example_inputs, self.call_signature),
            "graph": graph_hash,
        }

    def _open_cache(self, graph_hash: str, example_inputs: Sequence[Any], split: SplitResult) -> CacheEntry | None:
        """The compile entry for this graph, opened: a hit whose pieces were compiled for sizes that
        include this trace's (`_entry_sizes`), else the first free size variant of the key (a miss,
        compiled into). None without a cache root, or when every variant holds other sizes."""
        self.factors = self.key_factors(graph_hash, example_inputs)
        root = resolve_root(self.config.cache_dir)
        if root is None:
            return None
        self._cache_meta = {
            "num_pieces": len(split.items),
            "num_compiled": len(split.items) - split.num_splitting,
            "adaptor": self.adaptor.name,
            "compile_targets": [e.target.key for e in EntryTable(self.config, dynamic=any(isinstance(x, torch.SymInt) for x in example_inputs)).entries],
        }
        hints = _dim_hints(example_inputs)
        base = compute_key(self.factors)
        for variant in range(SIZE_VARIANTS):
            key = base if variant == 0 else compute_key({**self.factors, "size_variant": variant})
            entry = CacheEntry(root, key, self.tag, rank=current_rank(), remote=remote_tier(self.config))
            if entry.open(self._cache_meta):
                if self._entry_sizes(entry, hints, variant):
                    counters.bump("cache_hits", tag=self.tag)
                    log.info("[%s] compile cache hit: %s", self.tag, entry.path)
                    return entry
                continue
            counters.bump("cache_misses", tag=self.tag)
            explain_miss(root, self.tag, self.factors, entry.path)
            if shares_across_ranks():
                # ranks of one job compile one at a time; the later ones load the first one's pieces
                self._rank_lock = entry.rank_compile_lock()
            if entry.remote is not None and not (self._rank_lock is not None and entry.sibling_indexes()):
                # compile once per fleet: take the entry's lease, or load what its holder publishes
                self._lease = claim_or_wait(entry.remote, entry.root, entry.rel, lambda: entry.open(self._cache_meta))
                if entry.index is not None:
                    if not self._entry_sizes(entry, hints, variant):
                        entry.index = None  # its holder compiled it for other sizes: compile here, unsaved
                        entry.writable = False
                        return entry
                    counters.bump("cache_hits", tag=self.tag)
                    log.info("[%s] compile cache hit after another process's compile: %s", self.tag, entry.path)
            return entry
        log.warning("[%s] the compile cache holds %d entries of this graph, each compiled for other sizes; compiling "
                    "this one in memory, unsaved", self.tag, SIZE_VARIANTS)
        return None

    def _entry_sizes(self, entry: CacheEntry, hints: Mapping[tuple[int, int | None], int], variant: int) -> bool:
        """Whether the pieces of `entry` (opened, a hit) hold for this trace's sizes: the size guards
        their compile took (saved as `SIZE_GUARDS`) hold at `hints`. Then those guards are kept in
        `inherited_sizes`, checked on every call as if this process had compiled the pieces (loading
        them adds no guard to the trace). An unreadable record counts as other sizes."""
        payload = entry.load_artifact(SIZE_GUARDS)
        if payload is None:
            if SIZE_GUARDS in entry.index.get("artifacts", {}):
                return False  # recorded but unreadable (reported and moved aside)
            self.inherited_sizes = None  # its compile took no size guard: it holds for every size
            return True
        try:
            stored = decode_size_guards(payload)
            failing = stored.failing(tuple(hints[(i, d)] for i, d, _ in stored.dims))
        except (KeyError, ValueError, TypeError, SyntaxError, AttributeError) as e:
            log.info("[%s] compile entry %s has an unreadable size record (%s: %s); not used", self.tag, entry.rel,
                     type(e).__name__, e)
            return False
        if failing:
            log.info("[%s] compile entry %s holds pieces compiled for other sizes (%s); size variant %d", self.tag,
                     entry.rel, failing[0], variant + 1)
            return False
        self.inherited_sizes = stored
        return True

    def _split(self, gm: torch.fx.GraphModule) -> SplitResult:
        for name in self.split_ops:
            if not op_exists(name):
                warnings.warn(f"splitting op {name!r} is not a registered torch op; check the name", stacklevel=3)
        partition = self.config.split_strategy == "inductor_partition"
        # Inductor partition: the whole graph is one piece; Inductor cuts its code at the ops
        result = split_graph(gm, () if partition else self.split_ops)
        if partition:
            targets = {n.target for n in gm.graph.nodes if is_splitting_node(n, frozenset(self.split_ops))}
            bad = uncuttable_ops(list(targets))
            if bad:
                raise ConfigError(f"[{self.tag}] split_strategy='inductor_partition' cannot cut at {bad}: Inductor "
                                  "decomposes or generates code for them, so they would be fused into a partition instead "
                                  "of running eagerly between partitions. Make the splitting op a torch.library custom op "
                                  "(piecewise.splitting_op), or use split_strategy='fx'")
            found = bool(targets)
        else:
            found = result.num_splitting > 0
        if self.config.mode == "piecewise" and not found:
            counters.bump("fallbacks", tag=self.tag)
            warnings.warn(
                f"[{self.tag}] piecewise mode found none of the splitting ops {list(self.split_ops)} in the graph; "
                "compiling it as one piece. Register attention with piecewise.splitting_op or set splitting_ops",
                stacklevel=3,
            )
        n_split = result.num_splitting
        counters.bump("pieces_seen", len(result.items), tag=self.tag)
        counters.bump("splitting_pieces", n_split, tag=self.tag)
        counters.bump("pieces_compiled", len(result.items) - n_split, tag=self.tag)
        return result

    def _compile(self, split: SplitResult, fake_mode: Any, fake_inputs: list[Any]) -> CompiledForward:
        """Propagate the fake inputs through the split module, compiling each distinct piece for
        every compile entry on the way; then build the `CompiledForward`."""
        by_name = {it.name: it for it in split.items}
        specs: list[RunnerSpec] = []
        callables: dict[str, list[Callable[..., Any]]] = {}
        steps: dict[str, tuple[Step, ...] | None] = {}
        progress = _progress(len(split.items) - split.num_splitting, f"compiling {self.tag}")
        sym_index = next((i for i, x in enumerate(fake_inputs) if isinstance(x, torch.SymInt)), None)
        device = next((x.device.type for x in fake_inputs if isinstance(x, torch.Tensor)), "cpu")
        symbol = dispatch_symbol(fake_inputs) if sym_index is not None else None
        table = EntryTable(self.config, dynamic=sym_index is not None)
        backend = self
        shape_env = getattr(fake_mode, "shape_env", None)
        origins: dict[int, str] = {}  # id of a guard a piece's compile added -> the user's line of that piece

        class _Propagate(torch.fx.Interpreter):
            def call_module(self, target, args, kwargs):
                item = by_name.get(target)
                if item is not None and not item.is_splitting:
                    fp = piece_fingerprint(item.graph, args)
                    if fp not in callables:
                        seen = len(getattr(shape_env, "guards", ()))
                        callables[fp], steps[fp] = backend._compile_piece(item.graph, args, table, symbol, fp)
                        added = getattr(shape_env, "guards", ())[seen:]
                        if added:
                            where = piece_source_line(item.graph)
                            origins.update((id(g), where) for g in added)
                    specs.append(RunnerSpec(item.name, item.index, fp))
                    progress.update(1)
                return super().call_module(target, args, kwargs)

        # Inference only: pieces compile without autograd (no joint graphs), whatever the caller's mode.
        with fake_mode, enable_python_dispatcher(), torch.no_grad():
            fake_outputs = _Propagate(split.split_module).run(*fake_inputs)
        progress.close()
        graph_plan = (plan_graphs(fake_inputs, fake_outputs, symbol, self._mixing, self._argument_inputs,
                                  self._written_inputs)
                      if sym_index is not None else None)
        # under "backed" dynamic shapes sizes 0 and 1 are refused by the call signature already
        lo = 2 if self.config.dynamic_shapes == "backed" else 1
        refusal = (size_refusal(fake_mode.shape_env, fake_inputs, self._input_names, lo, self.config.max_num_tokens,
                                origins)
                   if symbol is not None else None)
        refusal = merge_refusals(refusal, self.inherited_sizes)
        if refusal is not None and self.cache is not None and SIZE_GUARDS not in ((self.cache.index or {}).get("artifacts") or {}):
            # the sizes these pieces hold for, for a later trace of the same graph that hits this entry
            self.cache.save_artifact(SIZE_GUARDS, encode_size_guards(refusal))
        if refusal is not None and refusal.warning:
            if self.guarded_by_dynamo:
                log.info("[%s] %s; Dynamo's guards send other sizes to another compile (counted in recompiles)",
                         self.tag, refusal.warning)
            elif _refusals_handled.get():
                log.info("[%s] %s; other sizes get a trace of their own (a size class) on their first call",
                         self.tag, refusal.warning)
            else:
                log.warning("[%s] %s; other sizes are refused. %s", self.tag, refusal.warning, SIZE_REMEDY)
        plan = None
        if all(s is not None for s in steps.values()):
            plan = CompiledPlan(
                runners=tuple(specs), steps={fp: s for fp, s in steps.items() if s is not None}, sym_index=sym_index,
                graph_plan=graph_plan, cache_key=self.cache.key if self.cache is not None else None,
                cache_meta=self._cache_meta, traced_files=tuple(sorted(self.traced_files)),
                splitting=tuple(it.index for it in split.items if it.is_splitting), device=device, size_refusal=refusal)
        return build_forward(self.config, self.tag, split, table, specs, callables, sym_index, graph_plan, plan, refusal)

    # -- warm start (piecewise.warmstart) -------------------------------------------------------
    def plan(self) -> CompiledPlan:
        """How to rebuild this backend's compiled forward from the cache without tracing.

        Raises:
            CompileError: a piece has no saved artifact (its compile was not serialisable, or the
                cache is not writable), so a warm start could not rebuild it.
        """
        if self.result is None or self.result.plan is None:
            raise CompileError("a distinct piece has no saved artifact")
        if self.cache is None:
            raise CompileError("this compile was not saved (see the log)")
        return self.result.plan

    def restore(self, split: SplitResult, plan: CompiledPlan, cache: CacheEntry) -> StitchedForward:
        """The `StitchedForward` of `plan` over `split`, every compiled piece loaded from `cache`
        (an opened compile entry); nothing is traced or compiled.

        Raises:
            CompileError: an artifact is missing or unusable (it was reported and moved aside); the
                caller traces instead, which recompiles just that piece.
        """
        self.cache = cache
        self.traced_files = set(plan.traced_files)
        self.timings["cache_load"] = 0.0
        by_name = {it.name: it for it in split.items}
        table = EntryTable(self.config, dynamic=plan.sym_index is not None)
        callables: dict[str, list[Callable[..., Any]]] = {}
        for spec in plan.runners:
            if spec.fingerprint in callables:
                continue
            graph = by_name[spec.name].graph
            fx_forward(graph)  # an adaptor may read the piece's code (graphs from a bundle come without it)
            out: list[Callable[..., Any]] = []
            for step in plan.steps[spec.fingerprint]:
                if isinstance(step, Reuse):
                    out.append(out[step.entry])
                elif isinstance(step, Rebuild):
                    out.append(self.adaptor.compile(graph, (), CompileTarget()).fn)
                else:
                    fn = self._load_artifact(step.name, graph)
                    if fn is None:
                        raise CompileError(f"artifact {step.name} is not in the cache")
                    out.append(fn)
            callables[spec.fingerprint] = out
        n_split = split.num_splitting
        counters.bump("cache_hits", tag=self.tag)
        counters.bump("pieces_seen", len(split.items), tag=self.tag)
        counters.bump("splitting_pieces", n_split, tag=self.tag)
        counters.bump("pieces_compiled", len(split.items) - n_split, tag=self.tag)
        self.result = build_forward(self.config, self.tag, split, table, plan.runners, callables, plan.sym_index,
                                    plan.graph_plan, plan, plan.size_refusal)
        return self.result.stitched

    def _compile_piece(self, graph: torch.fx.GraphModule, args: Sequence[Any], table: EntryTable, symbol: Any,
                       fingerprint: str) -> tuple[list[Callable[..., Any]], tuple[Step, ...] | None]:
        """Compile one distinct piece for every entry: the callables in entry order, and how a warm
        start rebuilds them (None: some compile could not be saved)."""
        out: list[Callable[..., Any]] = []
        recipe: list[Step] = []
        restorable = True
        shared: CompiledPiece | None = None
        for entry in table.entries:
            if shared is not None and not self.adaptor.specializes_sizes:
                out.append(shared.fn)
                recipe.append(Reuse(0))
                continue
            target = CompileTarget(entry.target.compile_range, entry.target.size, symbol)
            name = f"{fingerprint[:32]}.{target.key}"
            loaded = self._load_artifact(name, graph)
            if loaded is not None:
                out.append(loaded)
                recipe.append(Load(name))
                continue
            t0 = time.perf_counter()
            try:
                piece = self.adaptor.compile(graph, args, target)
            except CompileError as e:
                if entry.kind is not EntryKind.SIZE or not out:
                    raise
                # A size this piece cannot specialise on runs the general/range code instead.
                log.warning("[%s] %s; using the symbolic compile for %s", self.tag, e, target.label)
                j = _symbolic_entry_for(table, entry.target.size)
                out.append(out[j])
                recipe.append(Reuse(j))
                continue
            counters.bump("compiler_invocations", tag=self.tag)
            log.debug("[%s] compiled a piece for %s in %.3fs", self.tag, target.label, time.perf_counter() - t0)
            saved = False
            if self.cache is not None and piece.payload is not None:
                readable = self.adaptor.unpack(piece.payload, graph) if self.config.artifact_format == "unpacked" else None
                saved = self.cache.save_artifact(name, piece.payload, readable)
                counters.bump("artifacts_saved", tag=self.tag)
            if saved:
                recipe.append(Load(name))
            elif not self.adaptor.saves_artifacts and self.adaptor.rebuilds_from_graph:
                recipe.append(Rebuild())
            else:
                restorable = False
            shared = shared or piece
            out.append(piece.fn)
        return out, (tuple(recipe) if restorable else None)

    def _load_artifact(self, name: str, graph: torch.fx.GraphModule) -> Callable[..., Any] | None:
        """A callable loaded from the cache, or None (not cached, or bad: reported and moved aside)."""
        if self.cache is None or not self.adaptor.saves_artifacts:
            return None
        slot = f"{self.cache.key}/{name}"  # an artifact of another entry (a size variant) is other code
        if slot in self.preloaded:
            return self.preloaded[slot]
        t0 = time.perf_counter()
        try:
            payload = self.cache.load_artifact(name)
            if payload is None and shares_across_ranks():
                payload = self.cache.sibling_artifact(name)
            if payload is None:
                return None
            try:
                fn = self.adaptor.load(payload, graph)
            except Exception as e:  # a verified artifact this torch cannot load: never crash the model
                self.cache.reject_artifact(name, f"artifact failed to load ({type(e).__name__}: {e})")
                return None
            counters.bump("cache_loads", tag=self.tag)
            self.preloaded[slot] = fn
            return fn
        finally:
            self.timings["cache_load"] += time.perf_counter() - t0


def _fake_inputs(example_inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Dynamo hands real tensors for user inputs; its fake mode memoises their symbolic fakes."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    return fake_mode, [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]


#: Placeholder meta key under which ``trace`` records the Dynamo source name of each graph input
#: (``"L['x']"``, ``"L['self']._modules['lin']._parameters['weight']"``): piecewise's own capture
#: (``fullgraph_capture``) leaves no ``grapharg`` on its placeholders, while its output graph keeps
#: the sources by input identity.
SOURCE_META = "piecewise_source"


def is_state_source(name: str) -> bool:
    """Whether a Dynamo source name is module state (``L['self']...``: a parameter, buffer or
    tensor attribute), not an argument of the forward (``L['x']``, ``L['self_scale']``)."""
    return name.startswith("L['self']")


def _argument_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Indices of the graph inputs that are the traced forward's own arguments, not module state,
    decided by each placeholder's Dynamo source: ``L['x']`` or ``L['self_scale']`` is an argument,
    ``L['self']...`` (a parameter, buffer or tensor attribute) is state. The source is Dynamo's
    ``grapharg`` where present (the ``torch.compile`` entry), else what ``trace`` recorded under
    `SOURCE_META`. An input with neither is taken for an argument: checking its address on every
    call can refuse a moved weight (``CaptureError``), never replay over a stale one."""
    out = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        name = node.meta.get(SOURCE_META) or getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        if not (isinstance(name, str) and is_state_source(name)):
            out.append(i)
    return tuple(out)


def size_refusal(shape_env: Any, fake_inputs: Sequence[Any], input_names: Sequence[str], lo: int,
                 max_num_tokens: int, origins: Mapping[int, str] | None = None) -> SizeRefusal | None:
    """What the trace decided from the dynamic sizes, as a `SizeRefusal` checked on every call;
    None when it holds for every size.

    Dispatch is guard-free, so whatever the trace decided from a size is frozen to the first call's
    sizes: a Python branch (``if x.shape[0] > 4``), a view that is one only when a batch is 1 (a
    strided ``[B, 1, H]`` folded into ``[B, H]`` by matmul's decomposition), two input dims taken
    to be equal (one symbol for both, or one a multiple of the other). The guards Dynamo and the
    pieces' compiles recorded say which sizes that code is right for. Every dynamic size is at most
    ``max_num_tokens`` (the call signature checks), so a guard on one size is evaluated at every
    size in ``[lo, max_num_tokens]``; a guard on several at a grid (both ends, the small sizes, the
    traced ones, a middle one). Each guard is turned into a Python function once (about a
    microsecond a size). A guard a size fails (or cannot be evaluated at, such as a division by
    zero) is kept and checked on each call; a tie between input dims is always kept.

    Raises:
        CompileError: a guard that some sizes fail reads the size of an input the graph does not
            take (forward read only its shape), so no call could be checked against it.
    """
    dims = _size_symbols(shape_env, fake_inputs, input_names)
    grid = _SizeGrid(lo, max_num_tokens, getattr(shape_env, "backed_var_to_val", None) or getattr(shape_env, "var_to_val", {}))
    kept, notes, warn = _refusing_guards(shape_env, _size_guards(shape_env, dims, grid, origins), dims, grid)
    for own, expr in dims.ties:
        if not expr.free_symbols <= dims.getters.keys():
            continue
        kept.append(_tie_guard(own, expr))
        notes.append(f"the trace took {dims.names[own]} == {dims.show(expr)} (inputs must keep the sizes' relation of the first call)")
    if not kept:
        return None
    syms = sorted({v for e in kept for v in e.free_symbols}, key=str)
    return SizeRefusal(dims=tuple((*dims.getters[v], dims.names[v]) for v in syms), symbols=tuple(syms), guards=tuple(kept),
                       notes=tuple(notes), warning="; ".join(warn))


@dataclasses.dataclass
class _SizeSymbols:
    """Which graph input dim each size symbol of the trace is read from, and the input dims the trace
    tied to others (`_size_symbols`)."""

    getters: dict[Any, tuple[int, int | None]]  # symbol -> (graph input, dim or None for a SymInt)
    names: dict[Any, str]  # symbol -> how the user knows it (``x.shape[0]``)
    ties: list[tuple[Any, Any]]  # (symbol made for an input dim, the expression the trace gave it)

    def show(self, expr: Any) -> Any:
        """`expr` with its symbols written as the input dims they are."""
        import sympy

        return expr.xreplace({v: sympy.Symbol(self.names[v]) for v in expr.free_symbols})


def _size_symbols(shape_env: Any, fake_inputs: Sequence[Any], input_names: Sequence[str]) -> _SizeSymbols:
    """Each dynamic size of the graph inputs: a symbol read from the first tensor dim (else SymInt)
    that has it, named for the user; a dim whose size is another's (or an expression of others)
    gets a symbol of its own, tied to that expression."""
    import sympy

    out = _SizeSymbols({}, {}, [])
    tensor_dim_of: set[Any] = set()  # symbols already read from a tensor's dim
    for i, x in enumerate(fake_inputs):
        dims = [(None, x)] if isinstance(x, torch.SymInt) else (
            list(enumerate(x.shape)) if isinstance(x, torch.Tensor) else [])
        for d, size in dims:
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            where = input_names[i] if d is None else f"{input_names[i]}.shape[{d}]"
            if isinstance(expr, sympy.Symbol) and (expr not in out.getters or (d is not None and expr not in tensor_dim_of)):
                out.getters.setdefault(expr, (i, d))
                if d is not None or expr not in out.names:  # named by the first tensor dim that has it
                    out.names[expr] = where if d is not None else _dim_name(shape_env, expr, where)
            elif d is not None:  # this dim's size is another dim's (or an expression of them): check it
                own = sympy.Symbol(f"pw_dim_{i}_{d}", integer=True, nonnegative=True)
                out.getters[own], out.names[own] = (i, d), where
                out.ties.append((own, expr))
            if d is not None and isinstance(expr, sympy.Symbol):
                tensor_dim_of.add(expr)
    return out


@dataclasses.dataclass(frozen=True)
class _SizeGrid:
    """The sizes a guard is evaluated at: every size in ``[lo, hi]`` for a guard on one size, a grid
    of `probes` for a guard on several (both ends, the small sizes, the traced one, a middle one)."""

    lo: int
    hi: int
    hints: Mapping[Any, Any]  # symbol -> the size the trace saw

    def probes(self, sym: Any) -> list[int]:
        lo, hi = self.lo, self.hi
        pick = {lo, lo + 1, lo + 2, 3, 4, 5, 7, 8, 16, hi // 2, hi - 1, hi, int(self.hints.get(sym, lo))}
        return sorted(n for n in pick if lo <= n <= hi)

    def points(self, order: list[Any]) -> Any:
        import itertools

        return ([(n,) for n in range(self.lo, self.hi + 1)] if len(order) == 1
                else itertools.islice(itertools.product(*(self.probes(v) for v in order)), 50000))


def _size_guards(shape_env: Any, dims: _SizeSymbols, grid: _SizeGrid,
                 origins: Mapping[int, str] | None) -> list[tuple[Any, str]]:
    """(guard expression, where the trace took it) for every guard the shape env recorded, then the
    ranges Dynamo inferred for the input sizes (after the guards: a range they already explain is
    not repeated, see `_refusing_guards`)."""
    import sympy

    candidates: list[tuple[Any, str]] = []
    for g in getattr(shape_env, "guards", ()):
        sloc = str(getattr(g, "sloc", "?")).strip()  # "<line>  # <file:line> in <fn> (<torch's frame>)"
        at = sloc.rsplit(" (", 1)[0].strip() if sloc.endswith(")") else sloc
        if at.startswith("(") and origins and id(g) in origins:  # only torch's frame: a piece's compile added it
            at = f"{origins[id(g)]} {at}"
        candidates.append((g.expr, at))
    ranges = getattr(shape_env, "var_to_range", {})
    for sym in list(dims.getters):
        vr = ranges.get(sym)
        if vr is not None:
            vlo, vhi = _bound(vr.lower, grid.lo), _bound(vr.upper, grid.hi)
            if vlo > grid.lo:
                candidates.append((sympy.Ge(sym, vlo), _INFERRED_RANGE))
            if vhi < grid.hi:
                candidates.append((sympy.Le(sym, vhi), _INFERRED_RANGE))
    return candidates


_INFERRED_RANGE = "the range Dynamo inferred"


def _refusing_guards(shape_env: Any, candidates: list[tuple[Any, str]], dims: _SizeSymbols,
                     grid: _SizeGrid) -> tuple[list[Any], list[str], list[str]]:
    """The guards of `candidates` some size fails (kept, to be checked on each call), with a note
    each saying which sizes the trace is right for (also the warning's parts).

    Raises:
        CompileError: see `size_refusal` (`_check_readable`).
    """
    refused: dict[Any, set[int]] = {}  # per symbol, the sizes its own guards refuse
    kept: list[Any] = []
    notes: list[str] = []
    warn: list[str] = []
    replace = getattr(shape_env, "replace", lambda e: e)  # a symbol the trace equated with another: that one
    lo, hi = grid.lo, grid.hi
    for expr, at in candidates:
        expr = replace(expr)
        syms = expr.free_symbols
        if not syms:
            continue
        if not syms <= dims.getters.keys():
            _check_readable(shape_env, expr, at, dims, grid)
            continue  # symbols of no input (unbacked): a trace with those refuses at trace time
        order = sorted(syms, key=str)
        failed = _failing_points(expr, order, grid.points(order))
        if not failed:
            continue
        note = f"the trace took {dims.show(expr)} at {at}"
        if len(order) == 1:
            bad = {p[0] for p in failed}
            if at == _INFERRED_RANGE and bad <= refused.get(order[0], set()):
                continue
            refused.setdefault(order[0], set()).update(bad)
            ok = [n for n in range(lo, hi + 1) if n not in bad]
            span = f"{ok[0]}..{ok[-1]}" if ok and ok[-1] - ok[0] + 1 == len(ok) else f"in {len(ok)} of the sizes"
            note += f", so it is right only for {dims.names[order[0]]} {span} (of {lo}..{hi})"
        kept.append(expr)
        notes.append(note)
        warn.append(note)
    return kept, notes, warn


def _check_readable(shape_env: Any, expr: Any, at: str, dims: _SizeSymbols, grid: _SizeGrid) -> None:
    """A guard on sizes of no graph input: fine unless some size fails it and one of those sizes is
    an input's the graph does not take (forward read only its shape).

    Raises:
        CompileError: that case, naming the size, the guard and the remedy.
    """
    import sympy

    syms = expr.free_symbols
    hints = grid.hints
    missing = [v for v in syms if v not in dims.getters and v in hints]
    if missing and _fails_somewhere(expr, sorted(syms, key=str), lambda v: grid.probes(v) if v in hints else [], grid.lo, grid.hi):
        shown = expr.xreplace({v: sympy.Symbol(dims.names.get(v) or _dim_name(shape_env, v, str(v))) for v in syms})
        raise CompileError(
            f"the traced code depends on {', '.join(_dim_name(shape_env, v, str(v)) for v in missing)} ({shown} at "
            f"{at}), the size of an input the graph does not take (forward reads only its shape), so guard-free "
            "dispatch could not check it on later calls. Pass the size as an int argument, or make forward "
            "independent of it")


def _tie_guard(own: Any, expr: Any) -> Any:
    """The guard that input dim `own` keeps the size `expr` the trace gave it."""
    import sympy

    return sympy.Eq(own, expr)


def _failing_points(expr: Any, order: list[Any], grid: Any) -> list[tuple[int, ...]]:
    """The points of `grid` (size tuples for the symbols in `order`) where `expr` is false or
    cannot be evaluated (a division by zero). A Python function of the expression is made once
    (`sympy.lambdify`, torch's size functions mapped to Python's); where that fails, each point is
    substituted into the expression (tens of microseconds a point)."""
    import sympy

    try:
        fn = sympy.lambdify(order, expr, modules=[_SIZE_FUNCTIONS, "math"])
    except Exception as e:  # an expression lambdify cannot print: substitute instead
        log.debug("size guard %s not made a Python function (%s)", expr, e)
        fn = None
    undefined = (ArithmeticError, TypeError, ValueError)  # a division by zero, an undecidable relation
    out = []
    for p in grid:
        try:
            ok = bool(fn(*p)) if fn is not None else bool(expr.xreplace({v: sympy.Integer(n) for v, n in zip(order, p)}))
        except NameError:  # a function the mapping lacks: substitute from here on
            fn = None
            try:
                ok = bool(expr.xreplace({v: sympy.Integer(n) for v, n in zip(order, p)}))
            except undefined:
                ok = False
        except undefined:  # a size the expression is undefined at: refuse it
            ok = False
        if not ok:
            out.append(p)
    return out


def _fails_somewhere(expr: Any, order: list[Any], probes: Callable[[Any], list[int]], lo: int, hi: int) -> bool:
    import itertools

    grid = itertools.islice(itertools.product(*(probes(v) or [lo] for v in order)), 50000)
    return bool(_failing_points(expr, order, grid))


def _floor_div(a: Any, b: Any) -> Any:
    return a // b


#: torch's sympy size functions (torch.utils._sympy.functions) as Python on ints, for lambdify
_SIZE_FUNCTIONS: dict[str, Any] = {
    "FloorDiv": _floor_div, "CleanDiv": _floor_div, "IntTrueDiv": lambda a, b: a / b, "FloatTrueDiv": lambda a, b: a / b,
    "ModularIndexing": lambda a, b, c: (a // b) % c, "Mod": lambda a, b: a % b, "PythonMod": lambda a, b: a % b,
    "Max": max, "Min": min, "TruncToInt": int, "ToFloat": float, "Identity": lambda a: a,
    "FloorToInt": lambda a: int(__import__("math").floor(a)), "CeilToInt": lambda a: int(__import__("math").ceil(a)),
    "PowByNatural": lambda a, b: a ** b, "FloatPow": lambda a, b: float(a) ** b,
}


def _dim_name(shape_env: Any, symbol: Any, default: str) -> str:
    """The dim a size symbol was made for, as the user writes it (``L['x'].size()[0]`` ->
    ``x.shape[0]``), else `default`."""
    sources = getattr(shape_env, "var_to_sources", {}).get(symbol) or []
    if not sources:
        return default
    name = sources[0].name
    return _pretty_source(name() if callable(name) else name)


def _pretty_source(name: str) -> str:
    """A Dynamo source name as the user writes it: ``L['x'].size()[0]`` -> ``x.shape[0]``."""
    import re

    name = re.sub(r"L\['([^']+)'\]", r"\1", name)
    return re.sub(r"\.size\(\)\[(\d+)\]", r".shape[\1]", name)


#: ops whose compile decides strides from sizes (the usual source of a guard a piece's compile
#: adds), most likely first: a view of a non-contiguous tensor, then the other layout changes
_LAYOUT_OPS = (("reshape", "view", "flatten", "unflatten", "as_strided"),
               ("expand", "permute", "transpose", "split", "chunk", "unbind", "select", "slice", "squeeze", "unsqueeze",
                "contiguous", "empty_like"))


def piece_source_line(graph: torch.fx.GraphModule) -> str:
    """The user's source line a piece's compile most likely added a size guard for: the innermost
    frame of the first reshape or view in the piece whose node records where it was traced, else of
    another layout op, else of the first node that does; ``"in a compiled piece"`` when none records
    it."""
    found: dict[int, str] = {}
    for node in graph.graph.nodes:
        trace = node.meta.get("stack_trace")
        if not trace:
            continue
        lines = [ln for ln in trace.strip().splitlines() if ln.strip()]
        at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].lstrip().startswith("File ")), None)
        if at is None:
            continue
        head = lines[at].strip()  # File "path", line N, in fn
        code = lines[at + 1].strip() if at + 1 < len(lines) else ""
        try:
            path, rest = head[len('File "'):].split('", line ', 1)
            line, fn = rest.split(", in ", 1)
        except ValueError:
            continue
        shown = f"{code}  # {os.path.basename(path)}:{line} in {fn}, while compiling its piece"
        name = str(getattr(node.target, "__name__", node.target))
        rank = next((i for i, ops in enumerate(_LAYOUT_OPS) if any(op in name for op in ops)), len(_LAYOUT_OPS))
        found.setdefault(rank, shown)
    return found[min(found)] if found else "in a compiled piece"


#: compile entries one graph may have, each for the sizes its pieces' compiles held for (the key,
#: then the key with a ``size_variant``): traces of one graph at sizes on either side of a guard a
#: piece's compile took (a view that is one only for one token) must not load each other's pieces
SIZE_VARIANTS = 8
#: the artifact of a compile entry that records the size guards its compile took (`encode_size_guards`)
SIZE_GUARDS = "size_guards"


def _dim_hints(example_inputs: Sequence[Any]) -> dict[tuple[int, int | None], int]:
    """``(graph input, dim or None for a SymInt input) -> size`` of this trace's example inputs
    (the hint of a symbolic size); sizes without a hint are left out."""
    out: dict[tuple[int, int | None], int] = {}
    for i, x in enumerate(example_inputs):
        dims = [(None, x)] if isinstance(x, (int, torch.SymInt)) else (
            list(enumerate(x.shape)) if isinstance(x, torch.Tensor) else [])
        for d, v in dims:
            hint = v if isinstance(v, int) else getattr(v.node, "hint", None)
            if isinstance(hint, int):
                out[(i, d)] = hint
    return out


def _dim_symbol(i: int, d: int | None) -> Any:
    import sympy

    return sympy.Symbol(f"pw_in_{i}_{'s' if d is None else d}", integer=True, nonnegative=True)


def encode_size_guards(refusal: SizeRefusal) -> bytes:
    """`refusal` as JSON bytes, its symbols renamed after the input dims they stand for."""
    import json

    names = {sym: _dim_symbol(i, d) for sym, (i, d, _) in zip(refusal.symbols, refusal.dims)}
    return json.dumps({"dims": [list(d) for d in refusal.dims], "guards": [str(g.xreplace(names)) for g in refusal.guards],
                       "notes": list(refusal.notes)}).encode()


def decode_size_guards(payload: bytes) -> SizeRefusal:
    """The `SizeRefusal` `encode_size_guards` wrote, over symbols named for its input dims.

    Raises:
        ValueError, KeyError, TypeError, SyntaxError: the record is not one.
    """
    import json

    import sympy

    from ._torch.sympy import size_functions

    data = json.loads(payload)
    dims = tuple((int(i), None if d is None else int(d), str(n)) for i, d, n in data["dims"])
    symbols = tuple(_dim_symbol(i, d) for i, d, _ in dims)
    scope = {**size_functions(), **{str(s): s for s in symbols}}
    guards = tuple(sympy.sympify(g, locals=scope) for g in data["guards"])
    notes = tuple(str(n) for n in data["notes"])
    if len(notes) != len(guards):
        raise ValueError("guards and notes differ in number")
    return SizeRefusal(dims=dims, symbols=symbols, guards=guards, notes=notes, warning="")


def merge_refusals(a: SizeRefusal | None, b: SizeRefusal | None) -> SizeRefusal | None:
    """One `SizeRefusal` holding the guards of both (either may be None)."""
    if a is None or b is None:
        return a or b
    return SizeRefusal(dims=a.dims + b.dims, symbols=a.symbols + b.symbols, guards=a.guards + b.guards,
                       notes=a.notes + b.notes, warning="; ".join(w for w in (a.warning, b.warning) if w))


def _alias(name: str, aliases: Mapping[str, str]) -> str:
    """`name` with a leading argument reference replaced by the user's name for it (`aliases`:
    ``{"args[0]": "input_ids", "kwargs['input_ids']": "input_ids"}``)."""
    for own, user in aliases.items():
        if name == own or name.startswith((own + ".", own + "[")):
            return user + name[len(own):]
    return name


def _input_names(gm: torch.fx.GraphModule) -> list[str]:
    """Each graph input's name for messages: its Dynamo source as the user writes it, else the
    placeholder's name."""
    out = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        name = node.meta.get(SOURCE_META) or getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        out.append(_pretty_source(name) if isinstance(name, str) else node.name)
    return out


def _bound(v: Any, default: int) -> int:
    """An int bound of a value range, or `default` for an infinite one (torch's ``int_oo``)."""
    return int(v) if getattr(v, "is_Integer", False) else default


def _symbolic_entry_for(table: EntryTable, size: int) -> int:
    """Index of the general or range entry that would serve `size` without a size compile."""
    for i, e in enumerate(table.entries):
        r = e.target.compile_range
        if e.kind is EntryKind.GENERAL or (e.kind is EntryKind.RANGE and size in r):
            return i
    return 0


def explain_miss(root: str, tag: str, factors: dict[str, Any], path: str) -> None:
    """Log which key factors differ from the closest existing compile entry of the same tag.

    Closest: the fewest differing factors, ties to the newest. Warm-start bundles of the tag are
    skipped: their factors are start-key factors (module fingerprint, call signature), not a
    compile key's, so every structural factor would differ."""
    import glob
    import json

    from .cache.store import INDEX, CacheIndexError, read_index

    best: tuple[int, float, str, list[str]] | None = None  # (differences, -mtime, dir, names)
    for f in glob.glob(os.path.join(glob.escape(root), "*", "rank_*", glob.escape(tag), "cache_key_factors.json")):
        entry = os.path.dirname(f)
        if entry == path or f.startswith(path + os.sep):
            continue
        try:
            mtime = os.path.getmtime(f)
            with open(f) as fh:
                old = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(old, dict) or old.get("kind") == "warm_start" or "bundle_format" in old:
            continue
        try:
            if read_index(os.path.join(entry, INDEX))["meta"].get("kind") == "bundle":
                continue
        except (CacheIndexError, OSError, KeyError, TypeError, AttributeError):
            pass  # an entry without a (valid) index yet is still a compile entry to compare with
        names = diff_factors(old, factors)
        cand = (len(names), -mtime, entry, names)
        if best is None or cand[:2] < best[:2]:
            best = cand
    if best is None:
        log.info("[%s] compile cache miss: no compile entry for this tag under %s", tag, root)
        return
    log.info("[%s] compile cache miss: differs from %s in %s", tag, best[2],
             ", ".join(best[3]) or "nothing recorded (a format change)")


def render_split_graph(split: SplitResult) -> str:
    """Readable Python of the split module and each piece (written as computation_graph.py)."""
    parts = ["# split module\n", split.split_module.code]
    for it in split.items:
        kind = "splitting" if it.is_splitting else "compiled"
        parts.append(f"\n# ---- {it.name} (id {it.index}, {kind})\n")
        parts.append(it.graph.code)
    return "".join(parts)


def traced_source_files() -> set[str]:
    """Files of every code object Dynamo inlined into the graph being compiled."""
    codes = TracingContext.get_traced_code() or []
    return {c.co_filename for c in codes}


class _NoProgress:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, desc: str):
    if total > 1 and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="piece", leave=False)
    return _NoProgress()


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                   mode: str | None = None) -> Callable[..., Any]:
    """``torch.compile(model, backend="piecewise")``: a fresh backend per graph, config from the
    environment (`CompilationConfig.from_env`) with ``torch.compile(..., options={...})`` fields on top
    (``options={"backend": "eager", "max_num_tokens": 512}``).

    Dynamo decides shapes before a backend sees a graph: without ``dynamic=True`` or
    ``torch._dynamo.mark_dynamic(x, dim)`` the first graph is static, the first call with another
    length makes Dynamo recompile with that dim dynamic (automatic dynamic shapes), and a call of
    length 1 after a dynamic graph compiles once more (Dynamo specialises sizes 0 and 1). Every graph
    Dynamo hands over for a frame after its first is counted in ``recompiles`` and logged at INFO
    with Dynamo's reason; graph-break pieces of one compile are not recompiles.

    A piecewise error (a malformed ``PIECEWISE_CONFIG`` or ``PIECEWISE_MAX_NUM_TOKENS``, an unknown
    ``PIECEWISE_BACKEND``, a refused option) reaches the caller as itself, so ``except
    piecewise.ConfigError`` catches it, not wrapped in Dynamo's ``BackendCompilerFailed``.
    """
    try:
        return _dynamo_backend(gm, example_inputs, options, mode)
    except PiecewiseError as e:  # reaches the caller as itself, not wrapped in Dynamo's BackendCompilerFailed
        raise unwrapped_by_dynamo(e) from e.__cause__


def _dynamo_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None,
                    mode: str | None) -> Callable[..., Any]:
    if mode is not None:
        raise ConfigError(f"torch.compile(..., mode={mode!r}) is not a piecewise setting; pass CompilationConfig fields "
                          "as options={...} (e.g. options={'cudagraph_mode': 'full'})")
    config = CompilationConfig.from_env(**dict(options or {}))
    tag = unique_tag(config.tag or "torch_compile")
    recompile = _dynamo_recompile()
    if recompile is not None:
        counters.bump("recompiles", tag=tag)
        log.info("[%s] Dynamo recompiled %s (graph %s of that frame): %s", tag, *recompile)
        if not _warned_cache_recompile[0] and any(s in recompile[2] for s in _TRANSFORMERS_CACHE_MARKS):
            _warned_cache_recompile[0] = True
            warnings.warn(f"[{tag}] Dynamo recompiled on a transformers cache object ({recompile[2].splitlines()[0][:160]}): "
                          "under torch.compile, generate() runs transformers' own KV cache, whose state and lengths "
                          "Dynamo guards, so it recompiles as they first change. piecewise.compile(model).generate(...) "
                          "serves every batch and length with one trace over a cache piecewise owns", stacklevel=2)
    return PiecewiseBackend(config, tag, guarded_by_dynamo=True)(gm, example_inputs)


#: marks of transformers' cache objects in Dynamo's recompile reasons (`dynamo_backend` warns once)
_TRANSFORMERS_CACHE_MARKS = ("cache_utils.py", "['cache']", "['past_key_values']")
_warned_cache_recompile = [False]


_last_dynamo_compile: list[Any] = [None]  # weakref to the TracingContext of the last graph seen


def _dynamo_recompile() -> tuple[str, int, str] | None:
    """``(frame, frame compile number, Dynamo's reason)`` when the graph being compiled is the first
    of a Dynamo recompile (a frame compiled before: ``frame_compile_id > 0``), else None (a first
    compile, a later graph of the same compile after a graph break, or no Dynamo context). A
    compile is told apart by its tracing context: compile ids restart after ``torch._dynamo.reset()``."""
    import weakref

    cid = CompileContext.current_compile_id()
    ctx = TracingContext.try_get()
    n = getattr(cid, "frame_compile_id", None)
    if ctx is None or n is None:
        return None
    last = _last_dynamo_compile[0]
    if last is not None and last() is ctx:
        return None  # another graph of the same compile (a graph break)
    _last_dynamo_compile[0] = weakref.ref(ctx)
    if n == 0:
        return None
    reason = None
    try:
        from ._torch.dynamo import get_metrics_context

        reason = getattr(get_metrics_context(), "_metrics", {}).get("recompile_reason")
    except Exception as e:  # another torch: the count still holds
        log.debug("Dynamo's recompile reason is not readable here (%s: %s)", type(e).__name__, e)
    codes = getattr(ctx, "traced_code", None) or []
    code = codes[0] if codes else None  # the frame's own code comes first, then what it inlined
    where = f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else f"frame {cid}"
    return where, n + 1, reason or "reason not recorded by this torch"
