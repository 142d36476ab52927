import piecewise


def test_public_api_is_pinned():
    assert sorted(piecewise.__all__) == sorted([
        "BatchDescriptor", "CacheError", "CaptureError", "CompilationConfig", "CompileError", "CompileRange",
        "CompiledModel", "ConfigError", "ForwardContext", "GuardFailureError", "InputError", "PiecewiseError",
        "RecompileError", "SizeRefusedError", "SplitError", "TraceError", "compile", "compilers", "counters", "forward_context", "graphs",
        "mark_splitting_op", "passes", "splitting_op",
    ])
    for name in piecewise.__all__:
        assert hasattr(piecewise, name), name


def test_errors_share_one_base():
    for name in ("CacheError", "CaptureError", "CompileError", "ConfigError", "GuardFailureError", "InputError",
                 "RecompileError", "SizeRefusedError", "SplitError", "TraceError"):
        assert issubclass(getattr(piecewise, name), piecewise.PiecewiseError)
