"""`CompilationConfig`: one frozen, validated record of how a model is compiled.

Derived values (the resolved compile ranges, the capture schedule) live in the objects that derive
them, never written back here. Validation runs in `__post_init__`, so an invalid config never
exists; every failure is a `ConfigError` naming the field and the remedy.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .targets import CompileRange

__all__ = ["CompilationConfig", "CompileRange", "MODES", "CUDAGRAPH_MODES"]

MODES = ("none", "full", "piecewise")
CUDAGRAPH_MODES = ("auto", "none", "piecewise", "full", "full_and_piecewise")
#: URL schemes of `CompilationConfig.remote_cache` (the `redis` client's)
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
#: how the trace treats dims marked dynamic (`CompilationConfig.dynamic_shapes`)
DYNAMIC_SHAPES = ("backed_size_oblivious", "backed", "unbacked")
#: where the graph is cut at splitting ops (`CompilationConfig.split_strategy`)
SPLIT_STRATEGIES = ("fx", "inductor_partition")
#: how compiled pieces are stored (`CompilationConfig.artifact_format`)
ARTIFACT_FORMATS = ("binary", "unpacked")
#: Inductor options the ``inductor_partition`` strategy sets itself, or cannot work with
PARTITION_OWNED_OPTIONS = ("graph_partition", "custom_should_partition_ops", "cpp_wrapper", "triton.cudagraphs")
#: the first torch release with every Inductor hook the ``inductor_partition`` strategy uses
PARTITION_MIN_TORCH = "2.9.1"

#: Fields that change generated code and therefore enter the cache key (docs/design.md §5.2). The rest
#: (cache_dir, tag, debug, ...) are cosmetic or locate the cache and must not split it.
CODE_FIELDS = (
    "mode",
    "backend",
    "splitting_ops",
    "compile_sizes",
    "compile_ranges",
    "max_num_tokens",
    "dynamic_shapes",
    "split_strategy",
    "artifact_format",  # changes no code, but what an entry holds: an unpacked entry always has its files
    "inductor_options",
    "passes",
    "noop_elimination",
    "reinplace_custom_ops",
    "cpu_packed_linear",
)
#: fields that configure the post-grad pass pipeline: they reach the key through the compiler hash
PASS_FIELDS = frozenset({"passes", "noop_elimination", "reinplace_custom_ops", "cpu_packed_linear"})


def _int_list(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (int, str)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{name}={value!r} must be a list of positive integers, e.g. {name}=[1, 8]")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} holds {v!r}; every entry must be a positive integer")
        out.append(v)
    return tuple(out)


def _passes(value: Any) -> tuple[Any, ...]:
    """`CompilationConfig.passes` as `PiecewisePass` objects (names imported, functions wrapped)."""
    from .passes.base import as_pass

    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"passes={value!r} must be a list of passes, e.g. passes=[{value!r}]")
    return tuple(as_pass(p) for p in value)


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """How `piecewise.compile` compiles one region of a model.

    Fields:
        mode: ``"none"`` runs the model eagerly (no Dynamo), ``"full"`` compiles the whole graph as
            one piece, ``"piecewise"`` cuts it at splitting ops and compiles each piece.
        backend: compiler adaptor name: ``"inductor"``, ``"eager"`` (split only, no codegen), or a
            name registered with `piecewise.compilers.register_adaptor`.
        splitting_ops: op names to cut at, in any spelling (``ns::op``, ``ns.op``,
            ``ns::op.default``) or op objects. ``None`` means every op registered with
            `piecewise.splitting_op`.
        compile_sizes: token counts that also get a static-shape compile (exact match wins).
        compile_ranges: range end points; ``[16, 256]`` gives ranges ``[1,16]``, ``[17,256]`` and
            ``[257, max_num_tokens]``, each compiled once. Empty means one general compile.
        max_num_tokens: the largest size of any dynamic dim the model is called with; larger
            calls raise `InputError` before running.
        cudagraph_mode / cudagraph_capture_sizes: graph capture (accelerators only; CPU resolves
            to ``"none"``). ``"piecewise"``: each compiled piece is a graph, splitting ops run
            eagerly between them; ``"full"``: the whole forward is one graph (splitting ops must
            be safe to capture); ``"full_and_piecewise"``: full graphs for batches declared
            uniform decode (`piecewise.graphs.batch_hint`), piecewise otherwise. ``"auto"``
            (default): ``"piecewise"``, except transformers ``generate()``'s decode step, whose
            calls are all uniform decode: one full graph per batch size there, when piecewise's
            attention op is the only splitting op in the model's graph (measured on an H200, 2026-12-04: piecewise graphs cost 23 us a
            layer of host time over one full graph). Not in the cache key (it changes no code).
        cudagraph_num_warmups: eager runs of every piece at every capture size before its graph
            is captured (>= 0; default 1, as vLLM). The first run of a kernel initialises lazy
            state (library handles, autotuning, allocator growth) that must not happen inside a
            capture; 0 captures on the first run. Not in the cache key (it changes no code).
        dynamic_shapes: how the trace treats the dims in ``dynamic_arg_dims``; in the cache key.
            ``"backed_size_oblivious"`` (default): a backed symbol with a hint, but size-oblivious
            reasoning, so a first call of size 1 does not specialise the dim (branches on ``n ==
            1`` take the general path) and no guard on 0/1 is added. ``"backed"``: Dynamo's plain
            dynamic dims; sizes 0 and 1 are specialised, so the first call must have at least 2
            there (refused with `InputError` otherwise) and code that branches on the size is
            frozen to the first call's branch. ``"unbacked"``: the dim is a symbol with no hint
            and no guards at all; any branch on the size (``if n > 1``, a data-dependent shape)
            fails the trace with `CompileError` naming the line - the strictest check that the
            graph is one graph for every size.
        split_strategy: where the graph is cut at splitting ops (in the cache key). ``"fx"``
            (default): the FX graph is split into pieces, identical pieces (transformer layers)
            are compiled once, splitting ops run between pieces as their Python function.
            ``"inductor_partition"``: the whole graph goes to Inductor once per compile target,
            Inductor cuts its generated code into partitions at the splitting ops (which run
            between them as fallback kernels), post-grad passes see the whole graph, and each
            partition is captured per size like an FX piece (`piecewise.compilers.partition`).
            Needs ``backend="inductor"``, ``mode="piecewise"`` and torch >= 2.9.1 (its
            ``custom_should_partition_ops``).
        artifact_format: how compiled pieces are kept in the compile cache (in the cache key, so an
            entry holds what its format promises). ``"binary"`` (default): one file per piece and
            compile target, the adaptor's payload (Inductor: its serialised AOT artifact).
            ``"unpacked"``: the same file, which is still what loads, plus the readable form
            beside it for debugging (``<artifact>.unpacked/``; Inductor: ``output_code.py``, the
            generated wrapper with its partitions, each kernel's source under ``kernels/``, the
            post-AOT graph; other adaptors: the piece's FX code), every file's size and sha256 in
            the entry's index (checked by ``piecewise cache verify``, listed by ``cache show``).
            Readable files stay local: the remote tier carries the binary only.
        cache_dir: root of the compile cache; ``None`` means ``PIECEWISE_CACHE_DIR`` or the
            platform's user cache dir.
        tag: the name of this compiled region (its own cache subdir and counters). ``None``
            derives one from the model class, made unique within the process.
        inductor_options: Inductor config patches for the ``inductor`` adaptor.
        passes: user post-grad passes, run by the ``inductor`` adaptor on every piece for every
            compile target, in order, between the two built-ins. Each entry is a
            `piecewise.passes.PiecewisePass`, a function ``(graph)`` or ``(graph, context)``, an
            Inductor ``CustomGraphPass``, or an importable name ``"package.module:attr"``; all are
            normalised to `PiecewisePass` objects here. The ``eager`` adaptor runs no passes.
        noop_elimination: run the built-in `piecewise.passes.NoOpElimination` first.
        reinplace_custom_ops: run the built-in `piecewise.passes.ReinplaceCustomOps` last.
        cpu_packed_linear: run a piece's linears whose weight is a CPU parameter on oneDNN with
            the weight packed once (the built-in `piecewise.passes.PackedLinear`, before the
            reinplace pass), where this CPU runs the dtype in oneDNN: bfloat16/float16 on every
            call (the same bits as eager's ``mm``), float32 weights of 1024 or more output
            features on calls of 4-64 rows (a decode batch; values within float32's rounding of
            ``mm``'s), other float32 calls on ``mm``. On by
            default; each packed weight keeps a packed copy of its size while it lives, so False
            gives that memory back (see the CPU guide for the speed it costs). Not applied with
            ``split_strategy="inductor_partition"`` unless ``cudagraph_mode="none"``.
        debug: check on every call that the first trace's Dynamo guards still hold (slow); also
            refuses sizes a trace does not hold for instead of tracing a size class for them.
        max_size_classes: traces one compiled model may hold for its dynamic sizes (>= 1; default
            4). A trace holds for the sizes its guards allow: a model that branches on a size (a
            transformers mask built differently for one token or one sequence) gives a trace that
            serves only part of ``[1, max_num_tokens]``. A call outside every trace so far gets a
            trace of its own (a *size class*: logged at INFO with the guard and its source line,
            counted in ``size_class_traces``, saved for warm starts like the first) until this many
            exist; then such calls raise `SizeRefusedError`. 1 refuses every size the first trace
            does not hold for. Not in the cache key.
        max_num_seqs: sequences (rows) the KV cache of transformers ``generate()`` holds: the
            largest batch one ``generate()`` call takes (`piecewise.hf.generate`).
        max_model_len: positions per sequence in that KV cache (prompt plus generated tokens),
            capped by the model's ``max_position_embeddings``. The cache is allocated on the first
            ``generate()`` call: ``2 x layers x max_num_seqs x kv_heads x max_model_len x head_dim``
            elements in the model's dtype.
        remote_cache: a Redis URL (``redis://host:port/db``, ``rediss://...``,
            ``unix:///path?db=N``) shared by a fleet as the compile cache's remote tier
            (`piecewise.cache.remote`); ``None`` means ``PIECEWISE_REMOTE_CACHE`` or no remote
            tier. Entries are signed with ``PIECEWISE_CACHE_KEY`` (docs/design.md §5.6). Not in
            the cache key: it says where entries live, not what they hold.
        remote_connect_timeout_ms / remote_io_timeout_ms: bounds on one Redis connect (100 ms)
            and one read or write (1000 ms); a call past them rests the tier for 30 s.

    Raises:
        ConfigError: on any invalid field, naming it and the remedy.

    Examples:
        >>> import piecewise as pw
        >>> config = pw.CompilationConfig(max_num_tokens=256, compile_ranges=[16], backend="eager")
        >>> [(r.start, r.end) for r in config.ranges()]
        [(1, 16), (17, 256)]
        >>> config.replace(max_num_tokens=512).max_num_tokens
        512
        >>> pw.CompilationConfig(max_num_token=256)
        Traceback (most recent call last):
            ...
        piecewise.errors.ConfigError: CompilationConfig: unknown field 'max_num_token'; did you mean 'max_num_tokens' or 'max_num_seqs' or 'max_model_len'?
    """

    mode: str = "piecewise"
    backend: str = "inductor"
    splitting_ops: tuple[Any, ...] | None = None
    compile_sizes: tuple[int, ...] = ()
    compile_ranges: tuple[int, ...] = ()
    cudagraph_mode: str = "auto"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    cudagraph_num_warmups: int = 1
    dynamic_shapes: str = "backed_size_oblivious"
    split_strategy: str = "fx"
    artifact_format: str = "binary"
    max_num_tokens: int = 512
    cache_dir: str | None = None
    tag: str | None = None
    inductor_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    passes: tuple[Any, ...] = ()
    noop_elimination: bool = True
    reinplace_custom_ops: bool = True
    cpu_packed_linear: bool = True
    debug: bool = False
    max_size_classes: int = 4
    max_num_seqs: int = 8
    max_model_len: int = 1024
    remote_cache: str | None = None
    remote_connect_timeout_ms: int = 100
    remote_io_timeout_ms: int = 1000

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not one of {MODES}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend={self.backend!r} must be an adaptor name such as 'inductor' or 'eager'")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ConfigError(f"cudagraph_mode={self.cudagraph_mode!r} is not one of {CUDAGRAPH_MODES}")
        if self.dynamic_shapes not in DYNAMIC_SHAPES:
            raise ConfigError(f"dynamic_shapes={self.dynamic_shapes!r} is not one of {DYNAMIC_SHAPES}")
        if self.artifact_format not in ARTIFACT_FORMATS:
            raise ConfigError(f"artifact_format={self.artifact_format!r} is not one of {ARTIFACT_FORMATS}")
        if self.split_strategy not in SPLIT_STRATEGIES:
            raise ConfigError(f"split_strategy={self.split_strategy!r} is not one of {SPLIT_STRATEGIES}")
        if self.split_strategy == "inductor_partition":
            if self.backend != "inductor":
                raise ConfigError(f"split_strategy='inductor_partition' is Inductor's partitioning, but backend="
                                  f"{self.backend!r}; set backend='inductor' or split_strategy='fx'")
            if self.mode != "piecewise":
                raise ConfigError(f"split_strategy='inductor_partition' cuts at splitting ops, which mode={self.mode!r} "
                                  "does not do; set mode='piecewise' or leave split_strategy='fx'")
            opts = self.inductor_options if isinstance(self.inductor_options, Mapping) else {}
            clash = sorted(k for k in opts if k in PARTITION_OWNED_OPTIONS
                           or (k == "triton" and isinstance(opts[k], Mapping) and "cudagraphs" in opts[k]))
            if clash:
                raise ConfigError(f"inductor_options sets {clash}, which split_strategy='inductor_partition' sets or cannot "
                                  "run with (it partitions at the splitting ops and wraps each partition itself; Inductor's "
                                  "C++ wrapper has no partition hook); drop them from inductor_options, or use "
                                  "split_strategy='fx'")
            why = partition_support()
            if why is not None:
                raise ConfigError(f"split_strategy='inductor_partition' needs Inductor's graph-partition hooks (torch >= "
                                  f"{PARTITION_MIN_TORCH}): {why}; upgrade torch or use split_strategy='fx'")
        w = self.cudagraph_num_warmups
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ConfigError(f"cudagraph_num_warmups={w!r} must be an integer >= 0 (eager runs before each capture)")
        if self.remote_cache is not None and (not isinstance(self.remote_cache, str)
                                              or not self.remote_cache.startswith(REMOTE_SCHEMES)):
            raise ConfigError(f"remote_cache={self.remote_cache!r} must be a Redis URL: redis://host:port/db, "
                              "rediss://host:port/db or unix:///path/to/socket?db=N")
        for name in ("max_num_tokens", "max_size_classes", "max_num_seqs", "max_model_len", "remote_connect_timeout_ms", "remote_io_timeout_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.splitting_ops is not None:
            if isinstance(self.splitting_ops, str):
                raise ConfigError(
                    f"splitting_ops={self.splitting_ops!r} must be a list of op names, e.g. [{self.splitting_ops!r}]"
                )
            set_(self, "splitting_ops", tuple(self.splitting_ops))
        sizes = _int_list("compile_sizes", self.compile_sizes)
        for s in sizes:
            if s > self.max_num_tokens:
                raise ConfigError(
                    f"compile size {s} exceeds max_num_tokens={self.max_num_tokens}; raise max_num_tokens or drop the size"
                )
        set_(self, "compile_sizes", tuple(sorted(set(sizes))))
        ends = _int_list("compile_ranges", self.compile_ranges)
        if list(ends) != sorted(set(ends)):
            raise ConfigError(f"compile_ranges={list(ends)} must be strictly increasing end points, e.g. [16, 256]")
        for e in ends:
            if e > self.max_num_tokens:
                raise ConfigError(
                    f"compile range end {e} exceeds max_num_tokens={self.max_num_tokens}; raise max_num_tokens or drop it"
                )
        set_(self, "compile_ranges", ends)
        if self.cudagraph_capture_sizes is not None:
            set_(self, "cudagraph_capture_sizes", _int_list("cudagraph_capture_sizes", self.cudagraph_capture_sizes))
        if self.tag is not None and (not isinstance(self.tag, str) or not self.tag or "/" in self.tag or self.tag.startswith(".")):
            raise ConfigError(f"tag={self.tag!r} must be a non-empty name without '/' or a leading '.'")
        if not isinstance(self.inductor_options, Mapping):
            raise ConfigError(f"inductor_options={self.inductor_options!r} must be a mapping of Inductor config names to values")
        set_(self, "inductor_options", dict(self.inductor_options))
        for name in ("noop_elimination", "reinplace_custom_ops"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.cpu_packed_linear, bool):
            raise ConfigError(f"cpu_packed_linear={self.cpu_packed_linear!r} must be True or False")
        set_(self, "passes", _passes(self.passes))

    # -- derived views -------------------------------------------------------------------------
    def ranges(self) -> tuple[CompileRange, ...]:
        """The compile ranges as inclusive `CompileRange`s covering ``[1, max_num_tokens]``.

        Empty when no `compile_ranges` are set (one general compile serves every size)."""
        if not self.compile_ranges:
            return ()
        out, start = [], 1
        for end in self.compile_ranges:
            out.append(CompileRange(start, end))
            start = end + 1
        if start <= self.max_num_tokens:
            out.append(CompileRange(start, self.max_num_tokens))
        return tuple(out)

    def code_factors(self) -> dict[str, Any]:
        """The fields that change generated code, as JSON-ready data (for the cache key). The pass
        fields (`PASS_FIELDS`) are left out: the adaptor that runs the passes puts their uuids in
        its `compute_hash` (Inductor's does; the eager adaptor runs no passes), so they enter the
        key once."""
        from .ops import normalize_op_name

        out: dict[str, Any] = {}
        for name in CODE_FIELDS:
            if name in PASS_FIELDS:
                continue  # they enter through the compiler hash of the adaptor that runs them
            v = getattr(self, name)
            if name == "splitting_ops" and v is not None:
                v = sorted({normalize_op_name(o) for o in v})
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, dict):
                v = {k: repr(v[k]) for k in sorted(v)}
            out[name] = v
        return out

    def replace(self, **changes: Any) -> "CompilationConfig":
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CompilationConfig":
        """Build from a mapping; unknown keys raise `ConfigError` naming them."""
        _check_field_names(data)
        return cls(**dict(data))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "CompilationConfig":
        """Build from ``PIECEWISE_CONFIG`` (a JSON object) plus ``PIECEWISE_MODE``,
        ``PIECEWISE_BACKEND`` and ``PIECEWISE_MAX_NUM_TOKENS``; `overrides` win."""
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        raw = env.get("PIECEWISE_CONFIG")
        if raw:
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"PIECEWISE_CONFIG is not valid JSON ({e}); give a JSON object") from None
            if not isinstance(parsed, dict):
                raise ConfigError(f"PIECEWISE_CONFIG={raw!r} is a JSON {type(parsed).__name__}; give a JSON object of fields")
            data.update(parsed)
        for key, field, conv in (
            ("PIECEWISE_MODE", "mode", str),
            ("PIECEWISE_BACKEND", "backend", str),
            ("PIECEWISE_MAX_NUM_TOKENS", "max_num_tokens", int),
        ):
            if key in env:
                try:
                    data[field] = conv(env[key])
                except ValueError:
                    raise ConfigError(f"{key}={env[key]!r} is not a valid {field}") from None
        data.update(overrides)
        return cls.from_dict(data)


def partition_support() -> str | None:
    """Why this torch cannot run ``split_strategy="inductor_partition"`` (the missing hooks named),
    or None. Needs ``torch._inductor.config.graph_partition`` and ``custom_should_partition_ops``,
    ``torch._inductor.utils.set_customized_partition_wrappers`` (and the slot it sets) and
    ``torch._inductor.scheduler.Scheduler.should_partition``. Imports Inductor (~1.5 s the first
    time in a process), so it runs only for that strategy (`piecewise._torch.inductor.partition_support`)."""
    from ._torch.inductor import partition_support as missing_hooks

    return missing_hooks()


def _check_field_names(names: Any) -> None:
    """Raise `ConfigError` for names that are not `CompilationConfig` fields, with close matches."""
    fields = [f.name for f in dataclasses.fields(CompilationConfig) if f.init]
    unknown = sorted(str(n) for n in names if n not in fields)
    if not unknown:
        return
    parts, guessed = [], True
    for name in unknown:
        close = difflib.get_close_matches(name, fields, n=3)
        guessed &= bool(close)
        parts.append(f"unknown field {name!r}" + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""))
    listing = "" if guessed else f" (fields: {', '.join(fields)})"
    raise ConfigError(f"CompilationConfig: {'; '.join(parts)}{listing}")


def _wrap_init(init: Any) -> Any:
    # The dataclass __init__ answers an unknown keyword with a bare TypeError; name it and its
    # close matches instead (also reached through replace() and dataclasses.replace()).
    @functools.wraps(init)
    def __init__(self: CompilationConfig, *args: Any, **kwargs: Any) -> None:
        _check_field_names(kwargs)
        init(self, *args, **kwargs)

    return __init__


CompilationConfig.__init__ = _wrap_init(CompilationConfig.__init__)  # type: ignore[method-assign]
