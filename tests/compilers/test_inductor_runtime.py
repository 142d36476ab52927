"""The stand-ins for Inductor's compiler modules while artifacts load (_torch/inductor_runtime.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from piecewise._torch.inductor_runtime import TORCH_EXTERN_KERNELS


def test_each_torch_extern_kernel_is_the_torch_function_inductor_registers():
    import torch._inductor.lowering  # noqa: F401  registers Inductor's extern kernels
    import torch._inductor.select_algorithm as select_algorithm

    for name in sorted(TORCH_EXTERN_KERNELS):
        assert getattr(select_algorithm.extern_kernels, name) is getattr(torch, name), name


#: defines ``generated(source)``: runs `source` as a module Inductor's code cache loads (named as
#: its loader names them), the importer the stand-ins answer
_GENERATED = """
import types
def generated(source, _n=[0]):
    _n[0] += 1
    mod = types.ModuleType(f"torch._inductor.runtime.compile_tasks.test_wrapper_{_n[0]}")
    exec(source, mod.__dict__)
    return mod
"""


def _fresh(code: str) -> str:
    """Run `code` in a fresh interpreter (this one has Inductor's compiler imported); its stdout."""
    script = _GENERATED + textwrap.dedent(code)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


def test_stand_ins_answer_generated_code_and_leave_after_the_load():
    out = _fresh("""
        import sys, torch
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        names = ("torch._inductor.select_algorithm", "torch._inductor.graph")
        with light_inductor_runtime():
            w = generated("from torch._inductor.select_algorithm import extern_kernels, AlgorithmSelectorCache\\n"
                          "from torch._inductor.graph import GraphLowering")
            extern_kernels, AlgorithmSelectorCache, GraphLowering = w.extern_kernels, w.AlgorithmSelectorCache, w.GraphLowering
            assert extern_kernels.mm is torch.mm and extern_kernels.addmm is torch.addmm
            assert GraphLowering.save_output_code is None
            assert callable(AlgorithmSelectorCache.generate_example_value)
            assert "torch._inductor.lowering" not in sys.modules
        assert not any(n in sys.modules for n in names), "a stand-in outlived the load"
        import torch._inductor.select_algorithm as real
        assert hasattr(real, "PartialRender") and "torch._inductor.lowering" in sys.modules
        # the names bound during the load still answer, now from the real module
        assert extern_kernels.bias_addmm is real.extern_kernels.bias_addmm
        print("ok")
    """)
    assert out.strip() == "ok"


def test_any_other_name_imports_the_real_modules_in_their_own_order():
    out = _fresh("""
        import sys
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        with light_inductor_runtime():
            GraphLowering = generated("from torch._inductor.graph import GraphLowering").GraphLowering  # the stand-in
            # not stood in for: the real module
            PartialRender = generated("from torch._inductor.select_algorithm import PartialRender").PartialRender
            import torch._inductor.graph as graph, torch._inductor.select_algorithm as sa
            assert type(sys.modules["torch._inductor.graph"]).__name__ == "module"
            assert type(sys.modules["torch._inductor.select_algorithm"]).__name__ == "module"
            assert sa.PartialRender is PartialRender and graph.GraphLowering is not GraphLowering
        import torch._inductor
        assert torch._inductor.graph is sys.modules["torch._inductor.graph"]
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_process_that_imported_the_real_modules_keeps_them():
    import torch._inductor.select_algorithm as real

    from piecewise._torch.inductor_runtime import light_inductor_runtime

    with light_inductor_runtime():
        import torch._inductor.select_algorithm as during
    assert during is real and sys.modules["torch._inductor.select_algorithm"] is real


def test_only_the_loading_thread_gets_the_stand_ins():
    out = _fresh("""
        import builtins, sys, threading
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        original = builtins.__import__
        loading, other_done = threading.Event(), threading.Event()
        seen = {}

        def loader():
            with light_inductor_runtime():
                seen["loader"] = generated("from torch._inductor.graph import GraphLowering").GraphLowering
                loading.set()
                other_done.wait(300)

        def other():
            loading.wait(300)
            from torch._inductor.graph import GraphLowering  # while the load is under way
            seen["other"] = GraphLowering
            other_done.set()

        threads = [threading.Thread(target=loader), threading.Thread(target=other)]
        for t in threads: t.start()
        for t in threads: t.join()
        import torch._inductor.graph as graph
        assert seen["other"] is graph.GraphLowering, "another thread got the stand-in"
        assert seen["loader"] is not graph.GraphLowering and seen["loader"].save_output_code is None
        assert builtins.__import__ is original, "the import wrapper outlived the load"
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_patch_of_inductors_extern_kernels_reaches_what_loaded_through_the_stand_in():
    out = _fresh("""
        import sys, torch
        from unittest import mock
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        with light_inductor_runtime():
            extern_kernels = generated("from torch._inductor.select_algorithm import extern_kernels").extern_kernels
        assert extern_kernels.mm is torch.mm and "torch._inductor.lowering" not in sys.modules
        import torch._inductor.select_algorithm as real  # later, anyone imports Inductor
        patched = lambda *a: "patched"
        with mock.patch.object(real.extern_kernels, "mm", patched):
            assert extern_kernels.mm is patched
        assert extern_kernels.mm is torch.mm is real.extern_kernels.mm
        assert extern_kernels.bias_addmm is real.extern_kernels.bias_addmm
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_torch_kernel_replaced_for_a_while_during_a_load_is_not_kept():
    """Inductor's registry takes ``torch.addmm`` once, at its import; the stand-in took it at first
    use, so a replacement active during a warm first call (a profiler counting flops) stayed in
    every loaded model after the replacement ended (helper-25: errors up to 2.05 after it)."""
    out = _fresh("""
        import torch
        from unittest import mock
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        real_addmm = torch.addmm
        with mock.patch.object(torch, "addmm", lambda *a, **k: "profiled"):
            with light_inductor_runtime():
                extern_kernels = generated("from torch._inductor.select_algorithm import extern_kernels").extern_kernels
            first = extern_kernels.addmm  # the first call runs while the profiler's patch is on
        assert extern_kernels.addmm is real_addmm and first is real_addmm
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_import_wrapper_comes_back_after_another_library_dropped_it():
    """A library that wrapped ``__import__`` before a load and put its saved one back during the
    load dropped piecewise's wrapper too; later loads then imported the compiler (0.6 s) for good."""
    out = _fresh("""
        import builtins, sys
        from piecewise._torch import inductor_runtime as ir
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        builtin = builtins.__import__
        def library_wrapper(*a, **k):
            return builtin(*a, **k)
        builtins.__import__ = library_wrapper
        with light_inductor_runtime():
            builtins.__import__ = builtin  # the library uninstalls itself
        with light_inductor_runtime():
            lowering = generated("from torch._inductor.graph import GraphLowering").GraphLowering
        assert lowering is ir._GraphLowering and "torch._inductor.graph" not in sys.modules
        assert builtins.__import__ is builtin
        # a wrapper installed over piecewise's during a load keeps it on the chain, and is kept
        with light_inductor_runtime():
            outer = builtins.__import__
            builtins.__import__ = lambda *a, **k: outer(*a, **k)
            wrapped = builtins.__import__
        with light_inductor_runtime():
            assert builtins.__import__ is wrapped, "a wrapper over piecewise's was replaced"
            lowering = generated("from torch._inductor.graph import GraphLowering").GraphLowering
        assert lowering is ir._GraphLowering
        print("ok")
    """)
    assert out.strip() == "ok"


def test_an_inductor_module_first_imported_during_a_load_binds_the_real_modules():
    """``compile_fx`` binds ``GraphLowering`` at its top; imported for the first time during a load,
    it kept the stand-in and every later torch.compile failed (``_GraphLowering() takes no
    arguments``)."""
    out = _fresh("""
        import torch
        from piecewise._torch.inductor_runtime import light_inductor_runtime
        with light_inductor_runtime():
            import torch._inductor.compile_fx as compile_fx
        import torch._inductor.graph as graph
        assert compile_fx.GraphLowering is graph.GraphLowering
        import torch._inductor.config as inductor_config
        with inductor_config.patch(force_disable_caches=True):
            f = torch.compile(lambda a: (a @ a).relu(), backend="inductor")
            x = torch.randn(4, 4)
            assert torch.allclose(f(x), (x @ x).relu(), rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    assert out.strip() == "ok"
