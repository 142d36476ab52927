"""`CompilationConfig.passes` and the built-in switches: accepted forms, validation, pipeline
order, and what enters the cache key (uuids, never objects)."""

import json

import pytest
import torch

from piecewise import CompilationConfig, ConfigError
from piecewise.compilers import get_adaptor
from piecewise.passes import FunctionPass, NoOpElimination, PackedLinear, PiecewisePass, ReinplaceCustomOps, pipeline


class Marker(PiecewisePass):
    def __init__(self, tag: str = "a") -> None:
        self.tag = tag

    def __call__(self, graph, context):
        return 0


def marker_fn(graph, context):
    return 0


def test_passes_accept_objects_classes_functions_and_importable_names():
    m = Marker("x")
    c = CompilationConfig(passes=[m, Marker, marker_fn, f"{__name__}:Marker", f"{__name__}:marker_fn"])
    assert c.passes[0] is m
    assert isinstance(c.passes[1], Marker) and c.passes[1].tag == "a"
    assert isinstance(c.passes[2], FunctionPass) and c.passes[2].name == "marker_fn"
    assert isinstance(c.passes[3], Marker)
    assert c.passes[4].uuid() == c.passes[2].uuid()
    assert CompilationConfig.from_dict({"passes": [f"{__name__}:Marker"]}).passes[0].uuid() == Marker().uuid()
    # idempotent: replace() re-validates the normalised passes
    assert c.replace(max_num_tokens=64).passes == c.passes


@pytest.mark.parametrize(
    "passes, words",
    [
        ("pkg.mod:attr", ["passes=", "list"]),
        ([42], ["42", "PiecewisePass"]),
        (["no_colon_here"], ["'package.module:attr'"]),
        (["piecewise_no_such_module_xyz:attr"], ["cannot import module", "piecewise_no_such_module_xyz"]),
        ([f"{__name__}:missing_attr"], ["no attribute", "missing_attr"]),
    ],
)
def test_bad_pass_entries_name_the_value_and_the_remedy(passes, words):
    with pytest.raises(ConfigError) as e:
        CompilationConfig(passes=passes)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("field", ["noop_elimination", "reinplace_custom_ops"])
def test_switches_must_be_bools(field):
    with pytest.raises(ConfigError, match=field):
        CompilationConfig(**{field: "yes"})


def test_pipeline_order_is_noop_then_user_passes_then_packed_linear_then_reinplace_and_switches_drop_builtins():
    from piecewise._torch.onednn import packable_dtypes

    a, b = Marker("a"), Marker("b")
    names = [type(p) for p in pipeline(CompilationConfig(passes=[a, b], cpu_packed_linear=False))]
    assert names == [NoOpElimination, Marker, Marker, ReinplaceCustomOps]
    names = [type(p) for p in pipeline(CompilationConfig(passes=[a, b]))]  # packed linears are on by default
    # where this CPU can pack weights in oneDNN
    packed = [PackedLinear] if packable_dtypes() else []
    assert names == [NoOpElimination, Marker, Marker, *packed, ReinplaceCustomOps]
    assert [p.tag for p in pipeline(CompilationConfig(passes=[a, b]))[1:3]] == ["a", "b"]
    # Inductor partitions that a graph platform may capture: no packed linears
    for mode in ("auto", "piecewise", "full"):
        names = [type(p) for p in pipeline(CompilationConfig(split_strategy="inductor_partition", cudagraph_mode=mode))]
        assert PackedLinear not in names
    names = [type(p) for p in pipeline(CompilationConfig(split_strategy="inductor_partition", cudagraph_mode="none"))]
    assert names == [NoOpElimination, *packed, ReinplaceCustomOps]
    assert pipeline(CompilationConfig(noop_elimination=False, reinplace_custom_ops=False, cpu_packed_linear=False,
                                      passes=[a])) == (a,)


def test_passes_enter_the_key_once_through_the_compiler_hash_not_the_config_factors():
    from piecewise.compilers import get_adaptor

    f1 = CompilationConfig(passes=[Marker("a")]).code_factors()
    assert not {"passes", "noop_elimination", "reinplace_custom_ops"} & set(f1)
    json.dumps(f1)  # plain data
    assert CompilationConfig(passes=[Marker("b")], noop_elimination=False).code_factors() == f1

    def h(config):
        return get_adaptor("inductor", config).compute_hash()

    base = h(CompilationConfig(passes=[Marker("a")]))
    assert h(CompilationConfig(passes=[Marker("a")])) == base
    assert h(CompilationConfig(passes=[Marker("b")])) != base
    assert h(CompilationConfig(passes=[Marker("a")], noop_elimination=False)) != base


def test_inductor_compiler_hash_follows_the_pipeline():
    def h(**kw):
        return get_adaptor("inductor", CompilationConfig(**kw)).compute_hash()

    assert h(passes=[Marker("a")]) == h(passes=[Marker("a")])
    assert h(passes=[Marker("a")]) != h(passes=[Marker("b")])
    assert h() != h(reinplace_custom_ops=False)


def test_pass_context_reports_the_target():
    from piecewise.compilers.base import CompileTarget
    from piecewise.config import CompileRange
    from piecewise.passes import PassContext

    r = PassContext(CompileTarget(compile_range=CompileRange(1, 8)))
    assert (r.compile_range, r.size, r.is_static, r.label) == (CompileRange(1, 8), None, False, "range [1, 8]")
    assert r.covers(8) and not r.covers(9)
    s = PassContext(CompileTarget(size=4))
    assert (s.size, s.is_static, s.covers(4), s.covers(3)) == (4, True, True, False)
    assert PassContext(CompileTarget()).covers(1000) and PassContext(CompileTarget()).label == "general"
