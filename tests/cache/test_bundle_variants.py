"""Several warm-start bundles per tag, deterministic start keys and the recorded values of globals.

In-process tests compile, drop the model (freeing its tag) and compile again, which goes through
the same bundle lookup as a new process; the tests that depend on what differs between processes
(``__main__`` scripts, ``PYTHONHASHSEED``) run real processes.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import piecewise as pw
import piecewise.testing.toy  # noqa: F401  registers piecewise_models::toy_attention
from piecewise.cache import tools
from piecewise.counters import counters

#: read by `Scaled.forward`: a module global the tests change between compiles
SCALE = 2.0
TABLE = {"scale": 2.0}


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.ops.piecewise_models.toy_attention(x, x, x)
        return self.lin(x) * SCALE * TABLE["scale"]


def _bundles(root: str) -> list[str]:
    return sorted(e.key for e in tools.list_entries(root) if e.kind == "bundle")


def _compile_and_check(root: str, **expect: int) -> None:
    """Compile `Scaled` with a fresh Dynamo state, as a new process would (Dynamo otherwise remembers
    that a global float changed and traces it as a graph input the next time)."""
    torch._dynamo.reset()
    model = Scaled()
    cm = pw.compile(model, pw.CompilationConfig(backend="eager", cache_dir=root, max_num_tokens=16), dynamic_arg_dims={"x": 0})
    with counters.expect(**expect):
        for n in (3, 1, 16):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x))
    del cm
    gc.collect()  # frees the tag: the next model gets the same one


@pytest.fixture
def scale(monkeypatch):
    def set_(value, table=2.0):
        monkeypatch.setattr(sys.modules[__name__], "SCALE", value)
        monkeypatch.setitem(TABLE, "scale", table)
    return set_


def test_each_value_of_a_global_keeps_its_own_bundle_and_starts_warm(tmp_path, scale):
    root = str(tmp_path / "c")
    for value in (2.0, 3.0):
        scale(value)
        _compile_and_check(root, dynamo_traces=1, bundles_saved=1)
    assert len(_bundles(root)) == 2
    for value in (2.0, 3.0, 2.0):
        scale(value)
        _compile_and_check(root, dynamo_traces=0, bundle_hits=1)
    scale(2.0, table=5.0)  # a dict value read by forward
    _compile_and_check(root, dynamo_traces=1, bundle_misses=1)
    scale(2, table=2.0)  # an int where a float was traced: Dynamo guards the type too
    _compile_and_check(root, dynamo_traces=1, bundle_misses=1)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


#: read by `Activated`: which function, builtin or class it applies, chosen before construction
#: (as a script picks one from the environment at import)
CHOICE = {"fn": _gelu, "builtin": torch.relu, "cls": torch.nn.ReLU}


class Activated(torch.nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.what = what
        self.act = CHOICE["builtin"]
        self.act_cls = CHOICE["cls"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.piecewise_models.toy_attention(x, x, x)
        h = self.lin(h)
        if self.what == "fn":
            return ACT(h)
        return self.act(h) if self.what == "builtin" else self.act_cls()(h)


ACT = _gelu


@pytest.mark.parametrize("what,values", [("fn", (_gelu, _silu)), ("builtin", (torch.relu, torch.tanh)),
                                         ("cls", (torch.nn.ReLU, torch.nn.Tanh))])
def test_which_function_builtin_or_class_is_used_keeps_its_own_bundle(tmp_path, monkeypatch, what, values):
    """A global naming one of two functions, an attribute holding one of two builtins or classes:
    their types are the same and Dynamo's identity guards are not saved, so the second process
    loaded the first one's bundle and ran the other function (outputs off by up to 1.9)."""
    root = str(tmp_path / "c")
    for value, traces in zip(values + values, (1, 1, 0, 0)):
        if what == "fn":
            monkeypatch.setattr(sys.modules[__name__], "ACT", value)
        else:
            monkeypatch.setitem(CHOICE, what, value)
        torch._dynamo.reset()
        model = Activated(what)
        cm = pw.compile(model, pw.CompilationConfig(backend="eager", cache_dir=root, max_num_tokens=16),
                        dynamic_arg_dims={"x": 0})
        with counters.expect(dynamo_traces=traces, bundle_hits=1 - traces):
            for n in (3, 1, 16):
                x = torch.randn(n, 8)
                torch.testing.assert_close(cm(x), model(x))
        del cm
        gc.collect()


class Viewing(torch.nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(8))
        self.register_buffer("count_view", self.count.view(8) if shared else torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return torch.ops.piecewise_models.toy_attention(self.lin(x) + self.count_view, x, x)


def test_buffers_sharing_storage_or_not_keep_their_own_bundle_and_compiled_pieces(tmp_path):
    """Two processes, one with distinct buffers, one with a buffer viewing the other: the second
    loaded the first one's bundle, then (traced) its compiled pieces; off by 2 either way. Both
    keys (piecewise's and, through a marker pass, Inductor's graph cache) now hold the aliasing."""
    from piecewise.cache.key import input_signature

    root = str(tmp_path / "c")
    for shared, traces in ((False, 1), (True, 1), (False, 0), (True, 0)):
        torch._dynamo.reset()
        eager, model = Viewing(shared), Viewing(shared)
        cm = pw.compile(model, pw.CompilationConfig(backend="inductor", cache_dir=root, max_num_tokens=16),
                        dynamic_arg_dims={"x": 0})
        with counters.expect(dynamo_traces=traces, bundle_hits=1 - traces):
            for n in (3, 1, 16):
                x = torch.randn(n, 8)
                with torch.no_grad():
                    torch.testing.assert_close(cm(x), eager(x))
        del cm
        gc.collect()
    a = torch.zeros(8)
    assert input_signature([a, a.view(2, 4), torch.zeros(3), a[1:]])["storage_aliases"] == [[0, 1], [0, 3]]
    assert "storage_aliases" not in input_signature([a, torch.zeros(8)])  # keys without aliasing are unchanged


def test_bundles_per_tag_are_bounded_least_recently_used_first(tmp_path, scale, monkeypatch, caplog):
    monkeypatch.setenv("PIECEWISE_BUNDLES_PER_TAG", "2")
    root = str(tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="piecewise"):
        for value in (2.0, 3.0):
            scale(value)
            _compile_and_check(root, dynamo_traces=1, bundles_saved=1)
        scale(2.0)
        _compile_and_check(root, bundle_hits=1)  # 2.0 is now the most recently used
        scale(4.0)
        _compile_and_check(root, dynamo_traces=1, bundles_saved=1)  # 3.0's bundle goes
    assert len(_bundles(root)) == 2
    assert any("removed 1 older warm-start bundle" in r.getMessage() for r in caplog.records)
    for value, hit in ((2.0, 1), (4.0, 1), (3.0, 0)):
        scale(value)
        _compile_and_check(root, bundle_hits=hit, dynamo_traces=1 - hit)


def test_cache_ls_shows_every_bundle_and_clear_removes_them(tmp_path, scale):
    root = str(tmp_path / "c")
    for value in (2.0, 3.0, 4.0):
        scale(value)
        _compile_and_check(root, bundles_saved=1)
    bundles = _bundles(root)
    assert len(bundles) == 3 and len({b.rsplit("-", 1)[0] for b in bundles}) == 1  # one start key, three variants
    key = bundles[0].rsplit("-", 1)[0]
    assert tools.clear(root, key=key) == 3 and _bundles(root) == []
    scale(2.0)
    _compile_and_check(root, dynamo_traces=1, bundle_misses=1)


def test_a_global_value_that_cannot_be_recorded_saves_no_bundle(tmp_path, monkeypatch, caplog):
    from piecewise import trace as capture

    def refuse(guard_type, value):
        raise capture.Unrecordable(f"a {type(value).__name__} (test)")

    monkeypatch.setattr(capture, "_recorded", refuse)
    root = str(tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="piecewise"):
        _compile_and_check(root, dynamo_traces=1, bundles_saved=0)
        _compile_and_check(root, dynamo_traces=1, bundle_hits=0)
    assert _bundles(root) == []
    assert any("cannot be recorded for a warm start" in r.getMessage() for r in caplog.records)


def test_a_miss_names_the_start_factor_that_differs(tmp_path, caplog):
    root = str(tmp_path / "c")
    _compile_and_check(root, bundles_saved=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        with caplog.at_level(logging.INFO, logger="piecewise"):
            _compile_and_check(root, dynamo_traces=1, bundle_misses=1)
    finally:
        torch.set_num_threads(threads)
    misses = [r.getMessage() for r in caplog.records if "no warm start" in r.getMessage()]
    assert len(misses) == 1 and "differs in threads" in misses[0], misses


def test_canonical_records_tell_values_and_types_apart():
    from piecewise.trace import Unrecordable, _canonical, _recorded

    assert len({_canonical(2), _canonical(2.0), _canonical(True)}) == 3
    assert _canonical(math.nan) == _canonical(float("nan")) and _canonical(0.0) != _canonical(-0.0)
    assert _canonical({"a": 1, "b": 2}) != _canonical({"b": 2, "a": 1})  # key order is guarded too
    assert _canonical({"b", "a", "c"}) == _canonical({"c", "a", "b"})
    assert _canonical((1, [torch.float16, "x"])) != _canonical((1, [torch.float32, "x"]))
    assert _recorded("TYPE_MATCH", object()) == "builtins.object"
    assert _recorded("DICT_KEYS_MATCH", {"a": 0, "b": 1}) != _recorded("DICT_KEYS_MATCH", {"b": 1, "a": 0})
    assert _recorded("TENSOR_MATCH", torch.zeros(2, 3)) != _recorded("TENSOR_MATCH", torch.zeros(3, 2))
    # hook dicts are keyed by handle ids, a process-wide counter: the hooks themselves are recorded
    assert _recorded("DICT_KEYS_MATCH", {3: math.sin, 4: math.cos}) == _recorded("DICT_KEYS_MATCH", {11: math.sin, 12: math.cos})
    assert _recorded("DICT_KEYS_MATCH", {3: math.sin, 4: math.cos}) != _recorded("DICT_KEYS_MATCH", {3: math.cos, 4: math.sin})
    with pytest.raises(Unrecordable):
        _canonical(object())
    with pytest.raises(Unrecordable):
        _canonical([lambda: 0])


# -- real processes -----------------------------------------------------------------------------

SCRIPT = '''
import json, torch
import piecewise as pw
import piecewise.testing.toy


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = torch.ops.piecewise_models.toy_attention(x, x, x)
        return self.lin(x) {op}


model = Model()
cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=16), dynamic_arg_dims={{"x": 0}})
x = torch.randn(5, 8)
print(json.dumps({{"equal": bool(torch.allclose(cm(x), model(x))), "counters": {{k: v for k, v in pw.counters.snapshot().items() if v}}}}))
'''


def _run(path: str, env: dict) -> dict:
    p = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_two_scripts_defining_main_model_alternate_and_both_start_warm(tmp_path):
    """``usage.py`` and ``usage_log.py`` both define ``__main__.Model``: same start key, each its own
    bundle (the traced ``__main__`` files differ), so alternating them no longer retraces forever."""
    scripts = []
    for name, op in (("usage.py", "+ 1"), ("usage_log.py", "* 2")):
        path = tmp_path / name
        path.write_text(SCRIPT.format(op=op))
        scripts.append(str(path))
    env = {**os.environ, "PIECEWISE_CACHE_DIR": str(tmp_path / "c")}
    reports = [_run(s, env) for s in scripts + scripts + scripts]
    assert all(r["equal"] for r in reports)
    traces = [r["counters"].get("dynamo_traces", 0) for r in reports]
    hits = [r["counters"].get("bundle_hits", 0) for r in reports]
    assert traces == [1, 1, 0, 0, 0, 0] and hits == [0, 0, 1, 1, 1, 1], (traces, hits)


FROZENSET_MODEL = '''
import json, sys, torch
import piecewise as pw
import piecewise.testing.toy
from piecewise.warmstart import module_fingerprint


def pick(x, mode="gelu"):
    if mode in {"relu", "gelu", "silu", "tanh", "sigmoid", "elu", "selu", "mish"}:  # a frozenset constant
        return torch.relu(x)
    return x


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.act = pick  # a function held as an attribute: its code enters the module fingerprint

    def forward(self, x):
        return self.act(self.lin(torch.ops.piecewise_models.toy_attention(x, x, x)))


model = Model()
const = next(c for c in pick.__code__.co_consts if isinstance(c, frozenset))
cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=16), dynamic_arg_dims={"x": 0})
x = torch.randn(5, 8)
equal = bool(torch.allclose(cm(x), model(x)))
print(json.dumps({"fingerprint": module_fingerprint(model), "order": repr(const), "equal": equal,
                  "counters": {k: v for k, v in pw.counters.snapshot().items() if v}}))
'''


def test_a_frozenset_constant_gives_one_fingerprint_under_every_hash_seed(tmp_path):
    path = tmp_path / "frozen_model.py"
    path.write_text(FROZENSET_MODEL)
    env = {**os.environ, "PIECEWISE_CACHE_DIR": str(tmp_path / "c")}
    reports = [_run(str(path), {**env, "PYTHONHASHSEED": seed}) for seed in ("1", "2", "3", "4")]
    assert len({r["order"] for r in reports}) > 1, "the seeds did not reorder the frozenset; the test proves nothing"
    assert len({r["fingerprint"] for r in reports}) == 1
    assert all(r["equal"] for r in reports)
    hits = [r["counters"].get("bundle_hits", 0) for r in reports]
    assert hits == [0, 1, 1, 1], hits


def test_code_digest_is_independent_of_the_hash_seed_and_follows_the_code():
    from piecewise.fingerprint import code_digest, const_repr

    src = "def f(x):\n    return x in {'a', 'b', 'c', 'd', 'e'}\n"
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            from piecewise.fingerprint import code_digest
            ns = {{}}
            exec(compile({src!r}, "f.py", "exec"), ns)
            print(code_digest(ns["f"].__code__))
        """)], env={**os.environ, "PYTHONHASHSEED": "7"}, capture_output=True, text=True, check=True).stdout.strip()
    ns: dict = {}
    exec(compile(src, "f.py", "exec"), ns)
    assert code_digest(ns["f"].__code__) == out
    exec(compile(src.replace("'e'", "'z'"), "f.py", "exec"), ns)
    assert code_digest(ns["f"].__code__) != out
    assert const_repr(frozenset({"b", "a"})) == const_repr(frozenset({"a", "b"})) == "frozenset('a','b')"


SLICING_SCRIPT = '''
import json, sys, torch
import piecewise as pw
import piecewise.testing.toy

for _ in range(int(sys.argv[1])):  # hook handles taken before the first compile shift every later handle id
    torch.nn.Linear(1, 1).register_forward_hook(lambda *a: None)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = torch.ops.piecewise_models.toy_attention(x, x, x)
        for blk in self.blocks[:2]:  # a new ModuleList: Dynamo traces the global registration hooks
            x = blk(x)
        return x


model = Model()
cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=16), dynamic_arg_dims={"x": 0})
x = torch.randn(5, 8)
print(json.dumps({"equal": bool(torch.allclose(cm(x), model(x))),
                  "counters": {k: v for k, v in pw.counters.snapshot().items() if v}}))
'''


def test_hook_handle_ids_that_differ_between_processes_do_not_miss_the_bundle(tmp_path):
    """A forward that slices a ModuleList runs the global module-registration hooks, which Dynamo
    guards by their dict's keys: handle ids, a process-wide counter. The bundle records which hooks
    instead, so a process that took other hook handles first still starts warm."""
    path = tmp_path / "slicing.py"
    path.write_text(SLICING_SCRIPT)
    env = {**os.environ, "PIECEWISE_CACHE_DIR": str(tmp_path / "c")}
    reports = []
    for extra in ("0", "5", "0"):
        p = subprocess.run([sys.executable, str(path), extra], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        reports.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert all(r["equal"] for r in reports)
    assert [r["counters"].get("bundle_hits", 0) for r in reports] == [0, 1, 1]


REGISTRY_ORDER = '''
import json, sys, torch, transformers
import piecewise as pw
from piecewise.hf import attention as hf
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

# as if this process had built other transformers models first: their classes precede Llama's
for i in range(int(sys.argv[1])):
    dict.__setitem__(_CAN_RECORD_REGISTRY, f"<class 'other.Model{i}'>", {})
hf.register_hf_attention()
models = []
for attn in ("piecewise", "sdpa"):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, eos_token_id=None)
    torch.manual_seed(0)
    models.append(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval())
ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(1))
kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3)
compiled = pw.compile(models[0], pw.CompilationConfig(backend="eager", max_model_len=64, max_num_seqs=2))
got = compiled.generate(ids, **kw)
with torch.no_grad():
    equal = bool(torch.equal(got, models[1].generate(ids, **kw)))
print(json.dumps({"equal": equal, "counters": {k: v for k, v in pw.counters.snapshot().items() if v}}))
'''


def test_a_bundle_traced_after_other_model_classes_is_a_miss_in_a_process_without_them(tmp_path):
    """transformers registers each model class a process builds in ``_CAN_RECORD_REGISTRY`` (a dict,
    in build order), and Dynamo guards the key order of this model's item through the item's key
    position. A process that built fewer classes cannot even build that guard (IndexError): it used
    to set the other kind of process's intact bundle aside as damaged (a cache warning and
    cache_errors on every start, each kind undoing the other). Now that is a miss: each registry
    order keeps its own bundle and starts warm."""
    path = tmp_path / "registry_order.py"
    path.write_text(REGISTRY_ORDER)
    env = {**os.environ, "PIECEWISE_CACHE_DIR": str(tmp_path / "c")}

    def run(others: int) -> dict:
        p = subprocess.run([sys.executable, str(path), str(others)], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "warm-start bundle does not load" not in p.stderr, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    reports = [run(n) for n in (3, 0, 0, 3)]
    assert all(r["equal"] for r in reports)
    got = [(r["counters"].get("dynamo_traces", 0), r["counters"].get("bundle_hits", 0),
            r["counters"].get("cache_errors", 0)) for r in reports]
    assert got == [(1, 0, 0), (1, 0, 0), (0, 1, 0), (0, 1, 0)], got
    assert len(_bundles(str(tmp_path / "c"))) == 2
