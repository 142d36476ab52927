"""The stand-ins for Inductor's compiler modules while artifacts load (compilers/inductor_runtime.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from piecewise.compilers.inductor_runtime import TORCH_EXTERN_KERNELS


def test_each_torch_extern_kernel_is_the_torch_function_inductor_registers():
    import torch._inductor.lowering  # noqa: F401  registers Inductor's extern kernels
    import torch._inductor.select_algorithm as select_algorithm

    for name in sorted(TORCH_EXTERN_KERNELS):
        assert getattr(select_algorithm.extern_kernels, name) is getattr(torch, name), name


def _fresh(code: str) -> str:
    """Run `code` in a fresh interpreter (this one has Inductor's compiler imported); its stdout."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


def test_stand_ins_answer_generated_code_and_leave_after_the_load():
    out = _fresh("""
        import sys, torch
        from piecewise.compilers.inductor_runtime import light_inductor_runtime
        names = ("torch._inductor.select_algorithm", "torch._inductor.graph")
        with light_inductor_runtime():
            from torch._inductor.select_algorithm import extern_kernels, AlgorithmSelectorCache
            from torch._inductor.graph import GraphLowering
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
        from piecewise.compilers.inductor_runtime import light_inductor_runtime
        with light_inductor_runtime():
            from torch._inductor.graph import GraphLowering  # the stand-in
            from torch._inductor.select_algorithm import PartialRender  # not stood in for: the real module
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

    from piecewise.compilers.inductor_runtime import light_inductor_runtime

    with light_inductor_runtime():
        import torch._inductor.select_algorithm as during
    assert during is real and sys.modules["torch._inductor.select_algorithm"] is real


def test_only_the_loading_thread_gets_the_stand_ins():
    out = _fresh("""
        import builtins, sys, threading
        from piecewise.compilers.inductor_runtime import light_inductor_runtime
        original = builtins.__import__
        loading, other_done = threading.Event(), threading.Event()
        seen = {}

        def loader():
            with light_inductor_runtime():
                from torch._inductor.graph import GraphLowering
                seen["loader"] = GraphLowering
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
        from piecewise.compilers.inductor_runtime import light_inductor_runtime
        with light_inductor_runtime():
            from torch._inductor.select_algorithm import extern_kernels  # as a generated wrapper binds it
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
