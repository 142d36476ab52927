"""Pass uuids: equal for the same pass, different for changed source or options, stable across
processes, never from pickling; callables whose source cannot be read are rejected with a fix."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from torch._inductor.custom_graph_pass import CustomGraphPass

from piecewise import ConfigError
from piecewise.compilers.base import CompileTarget
from piecewise.config import CompileRange
from piecewise.passes import FunctionPass, NoOpElimination, PiecewisePass, PostGradPassManager, ReinplaceCustomOps, as_pass

PASS_MODULE = textwrap.dedent(
    """
    from piecewise.passes import PiecewisePass

    class Scale(PiecewisePass):
        def __init__(self, factor=2.0):
            self.factor = factor
            self._seen = []  # state, not an option

        def __call__(self, graph, context):
            self._seen.append(context.label)
            return {body}

    def fn_pass(graph):
        names = [n.name for n in graph.nodes if n.name in {{"a", "b", "c", "d"}}]  # a frozenset constant
        return {body}
    """
)


def _load(path, name, body="0"):
    path.write_text(PASS_MODULE.format(body=body))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_same_pass_twice_is_equal_and_an_option_change_differs(tmp_path):
    m = _load(tmp_path / "passes_a.py", "passes_a")
    assert m.Scale().uuid() == m.Scale().uuid() == m.Scale(2.0).uuid()
    assert m.Scale(3.0).uuid() != m.Scale().uuid()
    p = m.Scale()
    before = p.uuid()
    p(None, type("Ctx", (), {"label": "general"})())  # private state changes ...
    assert p.uuid() == before  # ... the uuid does not
    assert NoOpElimination().uuid() == NoOpElimination().uuid() != ReinplaceCustomOps().uuid()


def test_changed_source_differs_and_the_same_source_elsewhere_is_equal(tmp_path):
    a = _load(tmp_path / "passes_a.py", "passes_a", body="0")
    b = _load(tmp_path / "passes_b.py", "passes_a", body="1")
    assert a.Scale().uuid() != b.Scale().uuid()
    assert FunctionPass(a.fn_pass).uuid() != FunctionPass(b.fn_pass).uuid()
    # the same module checked out elsewhere: the path is not part of the uuid
    (tmp_path / "moved").mkdir()
    c = _load(tmp_path / "moved" / "passes_a.py", "passes_a", body="0")
    assert a.Scale().uuid() == c.Scale().uuid()
    assert FunctionPass(a.fn_pass).uuid() == FunctionPass(c.fn_pass).uuid()


def _make_threshold_pass(k):
    def threshold(graph):
        return k

    return threshold


def test_functions_hash_source_closure_and_code():
    assert FunctionPass(_make_threshold_pass(1)).uuid() == FunctionPass(_make_threshold_pass(1)).uuid()
    assert FunctionPass(_make_threshold_pass(1)).uuid() != FunctionPass(_make_threshold_pass(2)).uuid()
    first, second = (lambda g: 1), (lambda g: 2)  # one source line, two different lambdas
    assert FunctionPass(first).uuid() != FunctionPass(second).uuid()
    assert FunctionPass(first).uuid() == FunctionPass(first).uuid()


def test_a_lambda_without_readable_source_is_rejected_with_the_fix():
    with pytest.raises(ConfigError) as e:
        as_pass(eval("lambda graph: None"))
    msg = str(e.value)
    assert "cannot be read" in msg and "define it with `def` in a module file" in msg and "uuid()" in msg


def test_a_closure_over_an_object_without_stable_hash_is_rejected_naming_it():
    lock = threading.Lock()

    def locked(graph):
        with lock:
            return 0

    with pytest.raises(ConfigError, match="'lock'"):
        as_pass(locked)


class Holder(PiecewisePass):
    def __init__(self, thing):
        self.thing = thing

    def __call__(self, graph, context):
        return 0


def test_a_public_option_without_stable_hash_is_rejected_and_private_state_is_fine():
    with pytest.raises(ConfigError, match="config()"):
        as_pass(Holder(threading.Lock()))
    p = Holder(4)
    p._lock = threading.Lock()  # never pickled, never hashed
    assert as_pass(p) is p


def test_a_class_built_by_exec_is_rejected():
    ns = {"PiecewisePass": PiecewisePass}
    exec("class Dyn(PiecewisePass):\n    def __call__(self, graph, context):\n        return 0\n", ns)
    with pytest.raises(ConfigError, match="override uuid"):
        as_pass(ns["Dyn"]())


class TracedInductorPass(CustomGraphPass):
    def __init__(self, uid):
        self.uid = uid

    def __call__(self, graph):
        pass

    def uuid(self):
        return self.uid


def test_inductor_passes_keep_their_own_uuid_and_none_is_rejected():
    assert as_pass(TracedInductorPass(b"\x01")).uuid() == as_pass(TracedInductorPass(b"\x01")).uuid()
    assert as_pass(TracedInductorPass(b"\x01")).uuid() != as_pass(TracedInductorPass(b"\x02")).uuid()
    with pytest.raises(ConfigError, match="uuid"):
        as_pass(TracedInductorPass(None))


def test_manager_uuid_combines_passes_and_compile_target():
    m = PostGradPassManager([NoOpElimination(), ReinplaceCustomOps()])
    r1 = m.for_target(CompileTarget(compile_range=CompileRange(1, 8)))
    r2 = m.for_target(CompileTarget(compile_range=CompileRange(9, 16)))
    s4 = m.for_target(CompileTarget(size=4))
    assert len({m.uuid(), r1.uuid(), r2.uuid(), s4.uuid()}) == 4
    assert r1.uuid() == m.for_target(CompileTarget(compile_range=CompileRange(1, 8))).uuid()
    assert r1.pipeline_uuid() == s4.pipeline_uuid() == m.pipeline_uuid()
    assert PostGradPassManager([NoOpElimination()]).pipeline_uuid() != m.pipeline_uuid()
    assert PostGradPassManager([ReinplaceCustomOps(), NoOpElimination()]).pipeline_uuid() != m.pipeline_uuid()


def test_uuids_are_stable_across_processes(tmp_path):
    (tmp_path / "stable_passes.py").write_text(PASS_MODULE.format(body="0"))
    script = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import stable_passes
        from piecewise.passes import FunctionPass, NoOpElimination, ReinplaceCustomOps
        print(json.dumps([stable_passes.Scale(3.0).uuid(), FunctionPass(stable_passes.fn_pass).uuid(),
                          NoOpElimination().uuid(), ReinplaceCustomOps().uuid()]))
        """
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # a different str hash seed must not matter
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(tmp_path))
    try:
        import stable_passes
    finally:
        sys.path.remove(str(tmp_path))
    ours = [stable_passes.Scale(3.0).uuid(), FunctionPass(stable_passes.fn_pass).uuid(),
            NoOpElimination().uuid(), ReinplaceCustomOps().uuid()]
    assert theirs == ours
