"""Inductor internals piecewise depends on.

Verified on torch 2.13.0 (CPU) and written against the 2.11 source (the GPU machine's build).
Inductor's modules are imported on first use of a name (``import torch`` does not import them: the
first costs ~1.5 s), so a name used inside a function costs what the direct import there cost; a
name this torch lacks raises ImportError where it is imported, as the direct import did (callers
that degrade, ``config.partition_support``, catch it as before).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from ._lazy import lazy_names

__all__ = ["size_oblivious_view_strides", "partition_support", "RUNTIME_MODULES", "COMPILER_MODULES", "ISA_PROBE_MODULES"]

#: name -> where in Inductor it lives, each with why piecewise needs it.
_NAMES = {
    # the compiler piecewise's Inductor adaptor drives (``compilers.inductor``): its config (patched
    # per piece, hashed for the cache key), ``standalone_compile`` and the artifact it saves
    "config": "torch._inductor.config",
    "standalone_compile": "torch._inductor:standalone_compile",
    "AOTCompiledArtifact": "torch._inductor.standalone_compile:AOTCompiledArtifact",
    # custom post-grad passes: piecewise's passes are Inductor custom graph passes (``passes``)
    "custom_graph_pass": "torch._inductor.custom_graph_pass",
    "CustomGraphPass": "torch._inductor.custom_graph_pass:CustomGraphPass",
    # the SIMD ISA Inductor's C++ kernels are built for: part of the cache key, recorded per cache
    # root (``compilers.isa_record``)
    "cpu_vec_isa": "torch._inductor.cpu_vec_isa",
    # graph partitioning at splitting ops (``compilers.partition``, ``config.partition_support``):
    # which ops Inductor decomposes or lowers, the partition wrapper slot, the scheduler's rule
    "select_decomp_table": "torch._inductor.decomposition:select_decomp_table",
    "lowering": "torch._inductor.lowering",
    "utils": "torch._inductor.utils",
    "is_gpu": "torch._inductor.utils:is_gpu",
    "scheduler": "torch._inductor.scheduler",
}
__getattr__ = lazy_names(_NAMES, globals())

#: Inductor's modules its generated wrapper modules and runtime use (a warm start imports them
#: ahead: their first load pays for these; ``debug`` is read on every call and otherwise comes
#: with the compiler's imports)
RUNTIME_MODULES = ("torch._inductor.async_compile", "torch._inductor.codegen.memory_planning",
                   "torch._inductor.hooks", "torch._dynamo.testing", "torch._inductor.debug")
#: what generated code and Inductor's cache-hit path import that
#: `piecewise._torch.inductor_runtime.light_inductor_runtime` stands in for
COMPILER_MODULES = ("torch._inductor.select_algorithm", "torch._inductor.graph")
#: what probing the ISA imports (Inductor's code cache and C++ builder pull in ~160 modules)
ISA_PROBE_MODULES = ("torch._inductor.codecache", "torch._inductor.cpp_builder", "torch.utils._filelock",
                     "torch.utils.cpp_extension")

log = logging.getLogger("piecewise")


@contextlib.contextmanager
def size_oblivious_view_strides() -> Iterator[None]:
    """While a piece compiles, let Inductor's ``view`` lowering decide a view's strides
    size-obliviously when the trace itself was size-oblivious (``backed_size_oblivious``).

    Why: ``torch._inductor.ir.View.create`` computes the strides of a view of a non-contiguous
    buffer with ``torch._subclasses.fake_impls._compute_stride(..., size_oblivious=<unbacked sizes
    only>)``. For backed dynamic sizes it then branches on ``size != 1`` for every dim, adding a
    guard ``Ne(s, 1)`` to the trace's shape environment: a nanoGPT-style
    ``y.transpose(1, 2).reshape(B, T, D)`` after attention made a trace at ``T = 16`` hold for
    ``T >= 2`` only, although the trace itself (and the eager adaptor) serves ``T = 1``. Decided
    size-obliviously, a dim of unknown size is taken to be other than 1: the strides found are
    valid for size 1 too (a size-1 dim's stride is never multiplied by a non-zero index), and
    where no view is found the lowering copies instead, which is right for every size. Dynamo's
    own fake kernels already decide views this way under ``backed_size_oblivious``.

    A no-op when the trace was not size-oblivious, or where this torch has no ``_compute_stride``
    (another torch: the guards then refuse or trace the sizes as before). Also enters
    `size_oblivious_stride_orders` (the stride orders Inductor requires of extern kernels'
    inputs, e.g. attention's), for the same reason.

    Patched: ``torch._subclasses.fake_impls._compute_stride`` (looked up by name by
    ``View.create`` at each call in torch 2.11-2.13), restored on exit. Callers hold torch's
    compile lock, so no other thread compiles meanwhile.
    """
    import torch.fx.experimental._config as fx_config

    try:
        import torch._subclasses.fake_impls as fake_impls
    except ImportError:  # pragma: no cover - another torch
        yield
        return
    original = getattr(fake_impls, "_compute_stride", None)
    if original is None or not fx_config.backed_size_oblivious:
        yield
        return

    @functools.wraps(original)
    def compute_stride(old_shape: Any, old_stride: Any, new_shape: Any, size_oblivious: bool = False) -> Any:
        return original(old_shape, old_stride, new_shape, size_oblivious=True)

    fake_impls._compute_stride = compute_stride
    try:
        with size_oblivious_stride_orders():
            yield
    finally:
        fake_impls._compute_stride = original


@contextlib.contextmanager
def size_oblivious_stride_orders() -> Iterator[None]:
    """While a piece compiles, let Inductor order a tensor's strides without guarding when the
    trace itself was size-oblivious (``backed_size_oblivious``).

    Why: Inductor turns a traced tensor's strides into a stride order it then requires of an
    extern kernel's input (``ir.get_stride_order`` -> ``ir.get_fill_order`` ->
    ``torch._inductor.utils.argsort_sym``), e.g. ``lowering.sdpa_constraint`` for
    ``F.scaled_dot_product_attention``. ``argsort_sym`` compares the strides with
    ``ShapeEnv.evaluate_expr``, which guards on the size hint. A nanoGPT-style query
    ``qkv(x).split(C, 2)[0].view(B, T, H, D).transpose(1, 2)`` has strides ``[3C*T, D, 3C, 1]``:
    at ``T = 9`` the comparison added the guard ``3C*T > 3C`` (the trace then served ``T >= 2``
    only), at ``T = 1`` the two strides tie, the comparison added ``T <= 1`` and Inductor's own
    check of the copy it made for the order failed (``AssertionError`` in
    ``ExternKernel.require_strides``), so no trace could compile for 1-token decode.

    Here each comparison is decided statically and size-obliviously (a dim of unknown size is
    taken to be other than 1, so the order found holds for size 1 too, where the size-1 dim's
    stride is never multiplied by a non-zero index), and one that stays undecided falls back to
    the size hint without a guard. The order is only a requirement (``require_stride_order``
    keeps an input whose strides are statically known to be in that order, and copies any other
    into that order), so any order is right at every size; the order only decides whether a copy
    is made. Ties keep the original order, as ``argsort_sym`` does.

    A no-op when the trace was not size-oblivious, or where this torch has no
    ``ir.argsort_sym`` (another torch: the guards then refuse or trace the sizes as before).

    Patched: the name ``argsort_sym`` in ``torch._inductor.ir`` (looked up by ``get_fill_order`` at
    each call; verified on torch 2.13.0), restored on exit. Callers hold torch's compile lock, so
    no other thread compiles meanwhile.
    """
    import torch.fx.experimental._config as fx_config

    try:
        import torch._inductor.ir as ir
    except ImportError:  # pragma: no cover - another torch
        yield
        return
    original = getattr(ir, "argsort_sym", None)
    if original is None or not fx_config.backed_size_oblivious:
        yield
        return

    import sympy
    import torch

    def less(shape_env: Any, a: Any, b: Any) -> bool:
        expr = sympy.Lt(a, b)
        if isinstance(expr, sympy.logic.boolalg.BooleanAtom):
            return bool(expr)
        static = shape_env._maybe_evaluate_static(expr, size_oblivious=True)
        if static is not None:
            return bool(static)
        return bool(shape_env.optimization_hint(a) < shape_env.optimization_hint(b))

    @functools.wraps(original)
    def argsort_sym(shape_env: Any, seq: Any, *, reverse: bool = False) -> list[int]:
        exprs = [(i, sympy.sympify(s.node.expr if isinstance(s, torch.SymInt) else s)) for i, s in enumerate(seq)]

        def cmp(x: tuple[int, Any], y: tuple[int, Any]) -> int:
            if less(shape_env, x[1], y[1]):
                return -1
            if less(shape_env, y[1], x[1]):
                return 1
            return (x[0] < y[0]) - (x[0] > y[0])  # a tie keeps the original order, as argsort_sym

        return [i for i, _ in sorted(exprs, key=functools.cmp_to_key(cmp), reverse=reverse)]

    ir.argsort_sym = argsort_sym
    try:
        yield
    finally:
        ir.argsort_sym = original


def partition_support() -> str | None:
    """Why this torch cannot run ``split_strategy="inductor_partition"`` (the missing hooks named),
    or None: Inductor's graph partitioning at custom ops needs ``torch._inductor.config.graph_partition``
    and ``custom_should_partition_ops``, ``torch._inductor.utils.set_customized_partition_wrappers``
    (and the slot it sets, ``_unstable_customized_partition_wrapper``) and
    ``torch._inductor.scheduler.Scheduler.should_partition``, all present in torch 2.13.0 (CPU).
    Imports Inductor (~1.5 s the first time in a process)."""
    import torch

    try:
        from torch._inductor import config as inductor_config
        from torch._inductor import scheduler, utils
    except ImportError as e:  # a torch built without Inductor
        return f"torch {torch.__version__} has no Inductor ({e})"
    missing = [name for obj, attr, name in (
        (inductor_config, "graph_partition", "torch._inductor.config.graph_partition"),
        (inductor_config, "custom_should_partition_ops", "torch._inductor.config.custom_should_partition_ops"),
        (utils, "set_customized_partition_wrappers", "torch._inductor.utils.set_customized_partition_wrappers"),
        (utils, "_unstable_customized_partition_wrapper", "torch._inductor.utils._unstable_customized_partition_wrapper"),
        (getattr(scheduler, "Scheduler", None), "should_partition", "torch._inductor.scheduler.Scheduler.should_partition"),
    ) if not hasattr(obj, attr)]
    return f"torch {torch.__version__} lacks {', '.join(missing)}" if missing else None
