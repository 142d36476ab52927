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


# -- module-level values a pass reads ---------------------------------------------------------------
import importlib  # noqa: E402
import itertools  # noqa: E402

_counter = itertools.count()


def _module(tmp_path, monkeypatch, source, name=None, **files):
    """Import `source` as a fresh module (importable by name, as a user's pass module is); `files`
    are more modules next to it."""
    name = name or f"uuid_mod_{next(_counter)}"
    d = tmp_path / f"pkg_{next(_counter)}"
    d.mkdir()
    for other, text in files.items():
        (d / f"{other}.py").write_text(textwrap.dedent(text))
        sys.modules.pop(other, None)
    (d / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(d))
    importlib.invalidate_caches()
    module = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    for other in files:
        monkeypatch.delitem(sys.modules, other, raising=False)
    return module


DICT_PASS = """
OPTIONS = {"add": 1.0, "names": ["a", "b"]}

def set_add(graph):
    return OPTIONS["add"]
"""


def test_a_dict_option_read_by_a_function_pass_enters_its_uuid(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, DICT_PASS)
    before = FunctionPass(m.set_add).uuid()
    assert FunctionPass(m.set_add).uuid() == before
    m.OPTIONS["add"] = 100.0
    changed = FunctionPass(m.set_add).uuid()
    assert changed != before
    m.OPTIONS["add"] = 1.0
    assert FunctionPass(m.set_add).uuid() == before
    # an unread global changes nothing; insertion order of a str-keyed dict changes nothing
    m.UNUSED = {"x": 1}
    m.OPTIONS = {"names": ["a", "b"], "add": 1.0}
    assert FunctionPass(m.set_add).uuid() == before


def test_nested_containers_dataclasses_and_enums_enter_the_uuid(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        import dataclasses, enum

        class Mode(enum.Enum):
            FAST = 1
            EXACT = 2

        @dataclasses.dataclass
        class Opts:
            scale: float
            mode: Mode
            ops: list

        RULES = [("mul", [1, 2, {"k": (3, 4)}]), ("add", [])]
        OPTS = Opts(2.0, Mode.FAST, ["a"])

        def rules_pass(graph):
            return len(RULES)

        def opts_pass(graph):
            return OPTS.scale
    """)
    r0, o0 = FunctionPass(m.rules_pass).uuid(), FunctionPass(m.opts_pass).uuid()
    m.RULES[0][1][2]["k"] = (3, 5)  # three levels down
    assert FunctionPass(m.rules_pass).uuid() != r0
    m.OPTS.mode = m.Mode.EXACT  # a mutable dataclass holding an enum
    o1 = FunctionPass(m.opts_pass).uuid()
    assert o1 != o0
    m.OPTS.ops.append("b")
    assert FunctionPass(m.opts_pass).uuid() not in (o0, o1)


def test_values_read_through_a_module_or_a_helper_enter_the_uuid(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        import pass_cfg as cfg

        LIMITS = {"max": 4}

        def _limit():
            return LIMITS["max"]

        def via_module(graph):
            return cfg.OPTION["scale"]

        def via_helper(graph):
            return _limit()
    """, pass_cfg='OPTION = {"scale": 2}\nOTHER = object()  # never read by a pass\n')
    a0, h0 = FunctionPass(m.via_module).uuid(), FunctionPass(m.via_helper).uuid()
    m.cfg.OPTION["scale"] = 3
    assert FunctionPass(m.via_module).uuid() != a0
    m.LIMITS["max"] = 8
    assert FunctionPass(m.via_helper).uuid() != h0


def test_a_helper_in_another_user_module_is_hashed_by_its_code_and_values(tmp_path, monkeypatch):
    helper = 'WEIGHTS = [1, 2]\n\ndef count(graph):\n    return sum(WEIGHTS)\n'
    src = "from pass_helpers import count\n\ndef counting(graph):\n    return count(graph)\n"

    def uuid(helper_source):
        return FunctionPass(_module(tmp_path, monkeypatch, src, "counting_mod", pass_helpers=helper_source).counting).uuid()

    a, b = uuid(helper), uuid(helper)
    c, d = uuid(helper.replace("sum", "max")), uuid(helper.replace("[1, 2]", "[1, 3]"))
    assert a == b and len({a, c, d}) == 3


def test_a_pass_class_reading_a_module_level_dict_changes_its_uuid(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        from piecewise.passes import PiecewisePass

        OPTIONS = {"eps": 1e-6}

        class Fuse(PiecewisePass):
            def __call__(self, graph, context):
                return OPTIONS["eps"] > 0

        class Plain(PiecewisePass):
            def __call__(self, graph, context):
                return 0
    """)
    before = m.Fuse().uuid()
    m.OPTIONS["eps"] = 1e-5
    assert m.Fuse().uuid() != before
    assert m.Plain().uuid() == m.Plain().uuid()


SET_PASS = """
NAMES = {"mul", "add", "sub", "div", "neg", "exp", "log"}
FROZEN = frozenset(NAMES)
BY_ARITY = {(2, "x"): "binary", (1, "y"): "unary", 3: "ternary"}

def set_pass(graph):
    return len(NAMES) + len(FROZEN) + len(BY_ARITY)
"""


def test_set_valued_options_give_one_uuid_whatever_the_hash_seed(tmp_path):
    (tmp_path / "seeded_pass.py").write_text(SET_PASS)
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import seeded_pass\n"
              "from piecewise.passes import FunctionPass\n"
              "print(list(seeded_pass.NAMES)); print(FunctionPass(seeded_pass.set_pass).uuid())\n")
    orders, uuids = set(), set()
    for seed in ("1", "2", "3"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip().splitlines()
        orders.add(out[-2])
        uuids.add(out[-1])
    assert len(orders) > 1  # the seeds really iterate the set in different orders ...
    assert len(uuids) == 1  # ... and the uuid does not see it


def test_a_value_without_a_deterministic_description_is_rejected_naming_it(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        import threading
        import torch

        LOCK = threading.Lock()
        SCALE = torch.ones(2)
        TABLE = {"inner": [object()]}

        def locking(graph):
            with LOCK:
                return 0

        def scaling(graph):
            return SCALE.sum()

        def nested(graph):
            return TABLE

        def helper():
            return SCALE

        def indirect(graph):
            return helper()
    """)
    with pytest.raises(ConfigError) as e:
        as_pass(m.locking)
    msg = str(e.value)
    assert "pass 'locking'" in msg and "'LOCK'" in msg and "_thread.lock" in msg
    assert "uuid()" in msg and "PiecewisePass" in msg and "config()" in msg
    with pytest.raises(ConfigError, match=r"'SCALE'.*torch\.Tensor"):
        as_pass(m.scaling)
    with pytest.raises(ConfigError, match=r"'TABLE'.*TABLE\['inner'\]\[0\].*builtins\.object"):
        as_pass(m.nested)
    with pytest.raises(ConfigError, match=r"pass 'indirect': module-level 'SCALE' read by helper"):
        as_pass(m.indirect)
    # the same through a CompilationConfig: it never exists with such a pass
    from piecewise import CompilationConfig

    with pytest.raises(ConfigError, match="'LOCK'"):
        CompilationConfig(backend="eager", passes=[m.locking])


def test_a_pass_class_reading_an_undescribable_global_is_rejected(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        from piecewise.passes import PiecewisePass

        class Registry:
            pass

        PATTERNS = Registry()

        class Matcher(PiecewisePass):
            def __call__(self, graph, context):
                return PATTERNS

        class OwnUuid(Matcher):
            def uuid(self):
                return "matcher-v1"
    """)
    with pytest.raises(ConfigError) as e:
        as_pass(m.Matcher())
    assert "pass 'Matcher'" in str(e.value) and "'PATTERNS'" in str(e.value) and "Registry" in str(e.value)
    assert as_pass(m.OwnUuid()).uuid() == "matcher-v1"  # the remedy the message names


def test_self_containing_values_and_sourceless_helpers_are_rejected(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        LOOP = {}
        LOOP["self"] = LOOP

        def looping(graph):
            return LOOP

        def calls(graph):
            return made(graph)
    """)
    with pytest.raises(ConfigError, match="contains itself"):
        as_pass(m.looping)
    ns = {}
    exec("def made(graph):\n    return 0\n", ns)
    m.made = ns["made"]
    with pytest.raises(ConfigError, match="cannot be read"):
        as_pass(m.calls)


def test_library_code_loggers_and_wrapped_helpers_are_described(tmp_path, monkeypatch):
    m = _module(tmp_path, monkeypatch, """
        import functools, logging, operator, os.path, sys
        import torch

        log = logging.getLogger("mypasses")
        TARGETS = {torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor}

        @functools.lru_cache(maxsize=None)
        def weight(n):
            return n * 2

        def uses_library(graph):
            log.debug("running %s", os.path.basename(__file__))
            print("x", file=sys.stderr)
            n = [node for node in graph.nodes if node.target in TARGETS and node.target is not operator.getitem]
            return weight(len(n)) if torch.float32 is not None else 0
    """)
    u = as_pass(m.uses_library).uuid()
    assert u == FunctionPass(m.uses_library).uuid()
    source = open(m.__file__).read()
    assert FunctionPass(_module(tmp_path, monkeypatch, source, m.__name__).uses_library).uuid() == u
    m2 = _module(tmp_path, monkeypatch, source.replace("n * 2", "n * 3"), m.__name__)
    assert FunctionPass(m2.uses_library).uuid() != u  # the lru_cache'd helper's code is hashed


E2E_PASS = """
import os
import torch
OPTIONS = {"add": float(os.environ.get("PW_TEST_ADD", "1.0")), "names": {"a", "b", "c"}}

def set_add(graph):
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.add.Tensor and node.args[1] == 0.5:
            node.args = (node.args[0], OPTIONS["add"])
"""

E2E_MODEL = """
import torch
import piecewise as pw

@pw.splitting_op("pw_test_uuid::flip")
def flip(q: torch.Tensor) -> torch.Tensor:
    return q.flip(0)

@flip.register_fake
def _(q):
    return torch.empty_like(q)

class M(torch.nn.Module):
    def forward(self, x):
        return torch.ops.pw_test_uuid.flip(x * 3 + 0.5)
"""

E2E_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import piecewise as pw
from e2e_model import M
from e2e_pass import set_add, OPTIONS
cm = pw.compile(M(), pw.CompilationConfig(max_num_tokens=16, passes=[set_add]), dynamic_arg_dims={"x": 0})
x = torch.arange(6.0).reshape(3, 2)
print(json.dumps({"got": cm(x).tolist(), "expected": (x * 3 + OPTIONS["add"]).flip(0).tolist(),
                  "cache_hits": pw.counters.cache_hits, "bundle_hits": pw.counters.bundle_hits}))
"""


def test_a_restart_with_another_module_level_option_recompiles_with_it(tmp_path):
    """Inductor (passes run there): two processes on one cache root, the pass's dict option set from
    the environment. The second must compute with its own value, not load the first one's code."""
    (tmp_path / "e2e_pass.py").write_text(E2E_PASS)
    (tmp_path / "e2e_model.py").write_text(E2E_MODEL)
    env = {**os.environ, "PIECEWISE_CACHE_DIR": str(tmp_path / "cache")}
    runs = {}
    for add in ("1.0", "100.0", "100.0"):
        p = subprocess.run([sys.executable, "-c", E2E_CHILD, str(tmp_path)], capture_output=True, text=True,
                           env={**env, "PW_TEST_ADD": add}, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.setdefault(add, []).append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, (second, third) = runs["1.0"][0], runs["100.0"]
    for r in (first, second, third):
        assert sum(r["got"], []) == pytest.approx(sum(r["expected"], []), rel=1e-6)
    assert first["got"][0] == pytest.approx([13.0, 16.0]) and second["got"][0] == pytest.approx([112.0, 115.0])
    assert second["cache_hits"] == 0 and second["bundle_hits"] == 0
    assert third["cache_hits"] == 1 or third["bundle_hits"] == 1  # the same value again does hit
