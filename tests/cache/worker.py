"""A process that compiles a small model with piecewise and checks it against eager.

Prints one JSON line: counter deltas, warnings raised, and whether every size matched eager.
Exit status 3 when an output differs. Used by the cache tests to get real processes.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import cachehelp  # noqa: E402,F401  registers the "code" adaptor
import piecewise as pw  # noqa: E402
from piecewise.testing.toy import ToyTransformer, TwoSplitModel  # noqa: E402


def build(kind: str, source: str | None, kwargs: dict):
    if source:
        spec = importlib.util.spec_from_file_location("user_model", source)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # importable by name, as a user's model module is
        spec.loader.exec_module(mod)
        return mod.Model(**kwargs)
    return {"two_split": TwoSplitModel, "toy2": lambda **kw: ToyTransformer(**{"num_layers": 2, "dim": 16, **kw})}[kind](**kwargs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="two_split")
    ap.add_argument("--source", help="a .py file defining Model (a traced source file)")
    ap.add_argument("--model-args", default="{}", help="JSON keyword arguments for the model's constructor")
    ap.add_argument("--backend", default="code")
    ap.add_argument("--split-strategy", default="fx")
    ap.add_argument("--max-num-tokens", type=int, default=16)
    ap.add_argument("--sizes", default="")
    ap.add_argument("--splitting-ops", default="")
    ap.add_argument("--inductor-option", action="append", default=[], help="name=python-literal")
    ap.add_argument("--with-bias", action="store_true", help="pass a tensor for the optional 'bias' argument")
    ap.add_argument("--check-sizes", default="1,3,16")
    ap.add_argument("--sleep-after", type=float, default=0.0)
    ap.add_argument("--then-compile", action="store_true",
                    help="after the checks, compile another model (its own tag, a new graph) in this process")
    ap.add_argument("--no-packed-linear", action="store_true",
                    help="CompilationConfig(cpu_packed_linear=False): linears stay Inductor's extern mm")
    ap.add_argument("--then-patch-extern", action="store_true",
                    help="after the checks, patch Inductor's extern_kernels.<torch kernel> with counting "
                         "wrappers and call once more (a patch must reach loaded models as compiled ones)")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = build(args.model, args.source, json.loads(args.model_args))
    opts = {}
    for kv in args.inductor_option:
        k, v = kv.split("=", 1)
        opts[k] = eval(v)  # test-only CLI input
    cfg = pw.CompilationConfig(
        backend=args.backend, max_num_tokens=args.max_num_tokens, split_strategy=args.split_strategy,
        compile_sizes=[int(s) for s in args.sizes.split(",") if s],
        splitting_ops=[s for s in args.splitting_ops.split(",") if s] or None, inductor_options=opts,
        cpu_packed_linear=not args.no_packed_linear,
    )
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    before = pw.counters.snapshot()
    ok = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for n in [int(s) for s in args.check_sizes.split(",")]:
            x = torch.randn(n, getattr(model, "dim", 8))
            kw = {"bias": torch.ones(getattr(model, "dim", 8))} if args.with_bias else {}
            got = cm(x, **kw)
            if not torch.allclose(got, model(x, **kw), rtol=1e-4, atol=1e-4):
                ok = False
        elapsed = time.perf_counter() - t0
    # whether Inductor's compiler (its lowerings) was imported by the checks above
    compiler_imported = "torch._inductor.lowering" in sys.modules
    deltas = pw.counters.delta_since(before)  # the checks' counters, not the later compile's
    patched_calls = None
    if args.then_patch_extern:
        from unittest import mock

        import torch._inductor.select_algorithm as select_algorithm

        from piecewise._torch.inductor_runtime import TORCH_EXTERN_KERNELS

        patched_calls = 0

        def counting(fn):
            def call(*a, **k):
                nonlocal patched_calls
                patched_calls += 1
                return fn(*a, **k)
            return call

        names = [n for n in sorted(TORCH_EXTERN_KERNELS) if hasattr(select_algorithm.extern_kernels, n)]
        with contextlib.ExitStack() as stack:
            for n in names:
                stack.enter_context(mock.patch.object(select_algorithm.extern_kernels, n,
                                                      counting(getattr(select_algorithm.extern_kernels, n))))
            x = torch.randn(3, getattr(model, "dim", 8))
            ok = ok and bool(torch.allclose(cm(x), model(x), rtol=1e-4, atol=1e-4))
    then_equal = None
    if args.then_compile:
        other = ToyTransformer(num_layers=1, dim=24)
        other_cm = pw.compile(other, pw.CompilationConfig(backend=args.backend, max_num_tokens=args.max_num_tokens,
                                                          tag="then_compile"), dynamic_arg_dims={"x": 0})
        x = torch.randn(5, 24)
        then_equal = bool(torch.allclose(other_cm(x), other(x), rtol=1e-4, atol=1e-4))
        # the model loaded before the compile still runs as eager does
        x = torch.randn(3, getattr(model, "dim", 8))
        then_equal = then_equal and bool(torch.allclose(cm(x), model(x), rtol=1e-4, atol=1e-4))
    if args.sleep_after:
        time.sleep(args.sleep_after)
    report = {
        "compiler_imported": compiler_imported,
        "then_equal": then_equal,
        "patched_calls": patched_calls,
        "counters": deltas,
        "warnings": [str(w.message) for w in caught if "piecewise" in str(w.message)],
        "equal": ok,
        "seconds": elapsed,
        "pid": os.getpid(),
    }
    print(json.dumps(report))
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
