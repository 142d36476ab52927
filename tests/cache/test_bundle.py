"""Warm start without tracing (docs/design.md §5.5): bundles, in real processes.

Each worker run is a fresh Python process on one cache root; its report carries counter deltas,
the piecewise warnings it raised and whether every size equalled eager.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import textwrap
from collections import Counter

import pytest
import torch

import piecewise as pw
from piecewise.cache.store import encode_index, read_index
from piecewise.counters import counters
from piecewise.testing.toy import ToyTransformer

from cachehelp import run_worker

ALL_SIZES = ",".join(str(n) for n in range(1, 17))


def run(root: str, *args: str) -> tuple[dict, Counter]:
    """One worker process; its report and its counter deltas (0 for counters it did not bump)."""
    report = run_worker(root, *args)
    return report, Counter(report["counters"])


def bundle_entries(root: str) -> list[str]:
    """Entry dirs under `root` whose index says they hold a warm-start bundle."""
    out = []
    for f in glob.glob(os.path.join(root, "*", "rank_*", "*", "index.json")):
        if read_index(f)["meta"].get("kind") == "bundle":
            out.append(os.path.dirname(f))
    return sorted(out)


def bundle_file(root: str) -> str:
    (entry,) = bundle_entries(root)
    idx = read_index(os.path.join(entry, "index.json"))
    return os.path.join(root, *idx["artifacts"]["bundle"]["file"].split("/"))


@pytest.mark.parametrize("model", ["two_split", "toy2"])
def test_warm_process_runs_no_trace_and_no_compile(tmp_path, model):
    root = str(tmp_path / "c")
    cold, cc = run(root, "--model", model, "--check-sizes", ALL_SIZES)
    assert cold["equal"] and cc["dynamo_traces"] == 1 and cc["bundles_saved"] == 1
    warm, c = run(root, "--model", model, "--check-sizes", ALL_SIZES)
    assert warm["equal"], "warm start from the bundle differs from eager"
    assert (c["dynamo_traces"], c["graphs_seen"], c["compiler_invocations"], c["recompiles"]) == (0, 0, 0, 0)
    assert c["bundle_hits"] == 1 and c["cache_loads"] == cc["artifacts_saved"] > 0
    assert warm["warnings"] == []


@pytest.mark.parametrize("strategy, artifacts", [("fx", 6), ("inductor_partition", 2)])
def test_warm_process_with_inductor_and_compile_sizes(tmp_path, strategy, artifacts):
    root = str(tmp_path / "c")
    # linears as Inductor's extern mm (not the packed op, which calls torch itself): the patch below counts them
    args = ["--model", "toy2", "--backend", "inductor", "--sizes", "4", "--check-sizes", "1,4,5,16",
            "--split-strategy", strategy, "--no-packed-linear"]
    cold, cc = run(root, *args, "--then-patch-extern")
    assert cold["equal"] and cc["bundles_saved"] == 1 and cold["compiler_imported"]
    assert cold["patched_calls"] > 0, "the compiled pieces call no extern kernel: the patch check below cannot fail"
    warm, c = run(root, *args, "--then-patch-extern", "--then-compile")
    assert warm["equal"]
    assert (c["dynamo_traces"], c["compiler_invocations"], c["bundle_hits"]) == (0, 0, 1)
    # FX split: 3 distinct pieces x (general, size 4); Inductor partition: the whole graph x 2
    assert c["cache_loads"] == cc["artifacts_saved"] == artifacts
    # the CPU loads ran without Inductor's compiler modules (_torch/inductor_runtime.py) ...
    assert not warm["compiler_imported"]
    # ... and a patch of Inductor's extern kernels made after the load reaches the loaded pieces
    # as it reaches compiled ones (the patch imports the real namespace, which the stand-in follows)
    assert warm["patched_calls"] == cold["patched_calls"]
    # ... and a compile in the same process then imports Inductor as usual, the loaded model unchanged
    assert warm["then_equal"] is True


MODEL_SRC = '''
import torch
from torch import nn


class Leaf:
    def __init__(self, scale):
        self.scale = scale


class Inner:
    def __init__(self, scale):
        self.leaf = Leaf(scale)


class Deep:
    """A constructor argument kept three attribute levels down, out of the fingerprint's reach."""

    def __init__(self, scale):
        self.inner = Inner(scale)


class Model(nn.Module):
    dim = 8

    def __init__(self, scale=2.0, width=8):
        super().__init__()
        self.lin = nn.Linear(8, width)
        self.out = nn.Linear(width, 8)
        self.deep = Deep(scale)

    def forward(self, x):
        x = torch.ops.piecewise_models.toy_attention(x.sin(), x, x)  # splitting op
        return self.out(torch.relu(self.lin(x))) * self.deep.inner.leaf.scale
'''


def _source(tmp_path, text=MODEL_SRC) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_editing_a_traced_source_file_forces_a_retrace(tmp_path):
    root, src = str(tmp_path / "c"), _source(tmp_path)
    run(root, "--source", src)
    assert run(root, "--source", src)[1]["bundle_hits"] == 1
    with open(src, "a") as f:
        f.write("\n# an edit that changes no code still changes the file\n")
    after, c = run(root, "--source", src)
    assert after["equal"] and (c["dynamo_traces"], c["bundle_hits"], c["bundle_misses"], c["bundles_saved"]) == (1, 0, 1, 1)
    again = run(root, "--source", src)[1]
    assert (again["dynamo_traces"], again["bundle_hits"]) == (0, 1)


def test_constructor_arguments_that_change_the_graph_never_share(tmp_path):
    root, src = str(tmp_path / "c"), _source(tmp_path)
    # width changes parameter shapes (the fingerprint sees it): separate bundle entries
    a, _ = run(root, "--source", src, "--model-args", '{"width": 8}')
    b, bc = run(root, "--source", src, "--model-args", '{"width": 12}')
    assert a["equal"] and b["equal"]
    assert bc["dynamo_traces"] == 1 and bc["bundle_hits"] == 0
    assert len(bundle_entries(root)) == 2
    for width in (8, 12):
        r, rc = run(root, "--source", src, "--model-args", json.dumps({"width": width}))
        assert r["equal"] and (rc["dynamo_traces"], rc["bundle_hits"]) == (0, 1)
    # scale sits where the fingerprint does not look: the bundle's guards refuse it, the model traces
    c, cc = run(root, "--source", src, "--model-args", '{"scale": 3.0}')
    assert c["equal"], "a bundle traced for scale=2.0 ran for scale=3.0"
    assert (cc["dynamo_traces"], cc["bundle_misses"]) == (1, 1)
    d, dc = run(root, "--source", src, "--model-args", '{"scale": 3.0}')
    assert d["equal"] and dc["bundle_hits"] == 1


def _flip(path: str, rng: random.Random) -> None:
    data = bytearray(open(path, "rb").read())
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    open(path, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def two_split_root(tmp_path_factory) -> str:
    """A cache root filled by one cold `two_split` worker process; tests damage copies of it."""
    root = str(tmp_path_factory.mktemp("two_split") / "c")
    run_worker(root, "--model", "two_split")
    return root


@pytest.mark.parametrize("damage", ["flip", "truncate", "index", "rechecksummed_junk", "rechecksummed_guards"])
def test_corrupt_bundle_falls_back_to_tracing_with_one_warning(tmp_path, two_split_root, damage):
    root = shutil.copytree(two_split_root, str(tmp_path / "c"))  # a cache root can move (§5.2)
    path = bundle_file(root)
    rng = random.Random(damage)
    if damage == "flip":
        _flip(path, rng)
    elif damage == "truncate":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "index":
        _flip(os.path.join(bundle_entries(root)[0], "index.json"), rng)
    else:  # valid checksums over bytes that are not a bundle (a foreign or buggy writer)
        import hashlib

        junk = b"\x80\x05not a pickle at all" * 10
        if damage == "rechecksummed_guards":  # a bundle whose saved guards are truncated: damage, not a miss
            import io
            import pickle

            from torch._dynamo.aot_compile import AOTCompilePickler, AOTCompileUnpickler

            body = pickle.loads(open(path, "rb").read())
            state = AOTCompileUnpickler({}, io.BytesIO(body["dynamo"])).load()
            state["guards_state"] = state["guards_state"][: len(state["guards_state"]) // 2]
            buf = io.BytesIO()
            AOTCompilePickler({}, buf).dump(state)
            body["dynamo"] = buf.getvalue()
            junk = pickle.dumps(body)
        open(path, "wb").write(junk)
        ipath = os.path.join(bundle_entries(root)[0], "index.json")
        idx = read_index(ipath)
        idx.pop("checksum")
        idx["artifacts"]["bundle"].update(sha256=hashlib.sha256(junk).hexdigest(), bytes=len(junk))
        open(ipath, "wb").write(encode_index(idx))
    r, c = run(root, "--model", "two_split", "--check-sizes", ALL_SIZES)
    assert r["equal"]
    assert len(r["warnings"]) == 1 and "piecewise cache" in r["warnings"][0], r["warnings"]
    assert (c["dynamo_traces"], c["cache_errors"], c["bundle_hits"], c["compiler_invocations"]) == (1, 1, 0, 0)
    healed, hc = run(root, "--model", "two_split")
    assert hc["bundle_hits"] == 1 and healed["warnings"] == []


def test_deleted_piece_artifact_falls_back_and_recompiles_only_it(tmp_path):
    root = str(tmp_path / "c")
    run_worker(root, "--model", "toy2")
    arts = sorted(glob.glob(os.path.join(root, "*", "rank_*", "*", "artifacts", "*.bin")))
    piece = next(a for a in arts if "bundle." not in os.path.basename(a))
    os.unlink(piece)
    r, c = run(root, "--model", "toy2", "--check-sizes", ALL_SIZES)
    assert r["equal"] and (c["dynamo_traces"], c["compiler_invocations"], c["bundle_misses"]) == (1, 1, 1)


def test_second_instance_in_one_process_starts_from_the_bundle(tmp_path):
    cfg = pw.CompilationConfig(backend="eager", cache_dir=str(tmp_path / "c"), max_num_tokens=32)
    first = pw.compile(ToyTransformer(2, dim=16), cfg, dynamic_arg_dims={"x": 0})
    first(torch.randn(3, 16))
    del first  # frees the tag, so the next model gets the same one (and the same start key)
    import gc

    gc.collect()
    model = ToyTransformer(2, dim=16)
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(dynamo_traces=0, bundle_hits=1, compiler_invocations=0, recompiles=0):
        for n in (5, 1, 32, 7):
            x = torch.randn(n, 16)
            torch.testing.assert_close(cm(x), model(x))
    assert cm.timings["dynamo"] == 0.0 and "bundle_load" in cm.timings


def test_a_bundle_holds_one_graph_for_pieces_of_one_fingerprint(tmp_path):
    from piecewise.split import SplitResult
    from piecewise.warmstart import decode_bundle

    root = tmp_path / "c"
    cfg = pw.CompilationConfig(backend="eager", cache_dir=str(root), max_num_tokens=32)
    cm = pw.compile(ToyTransformer(4, dim=16), cfg, dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 16))
    plan = cm.backend.plan()
    fingerprints = {spec.name: spec.fingerprint for spec in plan.runners}
    assert len(set(fingerprints.values())) < len(fingerprints)  # the repeated layers share a fingerprint
    traced = {it.name: it.graph for it in cm.backend.split.items}
    body = decode_bundle(open(bundle_file(str(root)), "rb").read())
    items = SplitResult.from_module(body["split_module"], plan.splitting).items
    assert [it.name for it in items] == list(traced)  # every piece, shared graphs included
    by_name = {it.name: it.graph for it in items}
    for name, fp in fingerprints.items():
        owner = next(n for n, f in fingerprints.items() if f == fp)
        assert by_name[name] is by_name[owner]
        # the shared graph runs the same ops as the piece's own (only placeholder names differ)
        assert [n.target for n in by_name[name].graph.nodes if n.op == "call_function"] == \
            [n.target for n in traced[name].graph.nodes if n.op == "call_function"]
    assert len({id(g) for g in by_name.values()}) == len(set(fingerprints.values())) + sum(it.is_splitting for it in items)
    # the traced split module keeps its own graphs
    assert len({id(g) for g in traced.values()}) == len(traced)


def test_debug_mode_always_traces(tmp_path):
    cfg = pw.CompilationConfig(backend="eager", cache_dir=str(tmp_path / "c"), debug=True)
    for _ in range(2):
        cm = pw.compile(ToyTransformer(1, dim=8), cfg, dynamic_arg_dims={"x": 0})
        with counters.expect(dynamo_traces=1, bundle_hits=0):
            cm(torch.randn(2, 8))
        del cm


def test_fingerprint_tells_constructor_arguments_apart():
    from piecewise.warmstart import module_fingerprint

    fp = module_fingerprint
    assert fp(ToyTransformer(2, dim=16)) == fp(ToyTransformer(2, dim=16, seed=5))  # weights' values do not count
    assert fp(ToyTransformer(2, dim=16)) != fp(ToyTransformer(3, dim=16))
    assert fp(ToyTransformer(2, dim=16)) != fp(ToyTransformer(2, dim=8))
    m = ToyTransformer(2, dim=16)
    m.blocks[1].norm1.eps = 1e-3
    assert fp(m) != fp(ToyTransformer(2, dim=16))


def test_disable_bundle_switch_always_traces_and_saves_no_bundle(tmp_path, monkeypatch):
    import gc

    monkeypatch.setenv("PIECEWISE_DISABLE_BUNDLE", "1")
    root = str(tmp_path / "c")
    cfg = pw.CompilationConfig(backend="eager", cache_dir=root)
    for _ in range(2):
        cm = pw.compile(ToyTransformer(1, dim=8), cfg, dynamic_arg_dims={"x": 0})
        with counters.expect(dynamo_traces=1, bundle_hits=0, bundle_misses=0, bundles_saved=0):
            cm(torch.randn(2, 8))
        del cm
        gc.collect()
    assert bundle_entries(root) == [] and os.listdir(root)  # the compile entry is still written


HF_SCRIPT = '''
import json, sys, torch
import piecewise as pw
from piecewise.hf import attention as hf
hf.register_hf_attention()
model = {"llama": hf.tiny_llama, "bert": hf.tiny_bert}[sys.argv[1]](2)
cm = pw.compile(model, pw.CompilationConfig(backend="eager"), dynamic_arg_dims={"input_ids": 1})
before = pw.counters.snapshot()
equal = True
for n in (5, 1, 12, 3):
    ids = torch.randint(0, 100, (1, n))
    got, ref = cm(input_ids=ids), model(input_ids=ids)
    key = "logits" if hasattr(ref, "logits") else "last_hidden_state"
    equal &= type(got) is type(ref) and torch.allclose(getattr(got, key), getattr(ref, key), atol=1e-5)
print(json.dumps({"equal": bool(equal), "counters": pw.counters.delta_since(before)}))
'''


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_transformers_models_start_warm_from_a_bundle(tmp_path, kind):
    """transformers wraps forward in decorators and rebuilds ModelOutput objects: the bundle carries
    the globals Dynamo installed for that and uses the live decorator closure."""
    import subprocess
    import sys

    env = {**os.environ, "PIECEWISE_CACHE_DIR": str(tmp_path / "c")}
    reports = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", HF_SCRIPT, kind], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        reports.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, warm = (Counter(r["counters"]) for r in reports)
    assert all(r["equal"] for r in reports)
    assert cold["dynamo_traces"] == 1 and cold["bundles_saved"] == 1
    assert (warm["dynamo_traces"], warm["compiler_invocations"], warm["bundle_hits"]) == (0, 0, 1)


def test_an_unexpected_failure_while_loading_a_bundle_falls_back_with_one_warning(tmp_path, monkeypatch):
    import gc
    import warnings

    from piecewise import warmstart as bundle

    cfg = pw.CompilationConfig(backend="eager", cache_dir=str(tmp_path / "c"))
    cm = pw.compile(ToyTransformer(1, dim=8), cfg, dynamic_arg_dims={"x": 0})
    cm(torch.randn(2, 8))
    del cm
    gc.collect()

    def broken(recorded):
        raise RuntimeError("simulated fault while validating a bundle")

    monkeypatch.setattr(bundle, "stale_sources", broken)
    model = ToyTransformer(1, dim=8)
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with counters.expect(dynamo_traces=1, bundle_hits=0, cache_errors=1, bundles_saved=1):
            x = torch.randn(3, 8)
            torch.testing.assert_close(cm(x), model(x))
    reported = [str(w.message) for w in caught if "piecewise cache" in str(w.message)]
    assert len(reported) == 1 and "simulated" in reported[0]


GLOBAL_SRC = '''
import os

import torch
from torch import nn

SCALE = float(os.environ.get("PW_TEST_SCALE", "2.0"))  # a module global read by forward


class Model(nn.Module):
    dim = 8

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x = torch.ops.piecewise_models.toy_attention(x, x, x)
        return self.lin(x) * SCALE
'''


def test_a_module_global_with_another_value_is_not_served_from_the_bundle(tmp_path):
    root, src = str(tmp_path / "c"), _source(tmp_path, GLOBAL_SRC)
    assert run(root, "--source", src)[1]["bundles_saved"] == 1
    assert run(root, "--source", src)[1]["bundle_hits"] == 1
    report = run_worker(root, "--source", src, env={"PW_TEST_SCALE": "3.0"})  # same source, other value
    c = Counter(report["counters"])
    assert report["equal"], "the bundle baked in SCALE=2.0 and ran with SCALE=3.0"
    assert (c["dynamo_traces"], c["bundle_misses"]) == (1, 1)


def test_the_same_module_name_from_another_checkout_is_not_served_from_the_bundle(tmp_path):
    """Two checkouts (or two scripts) define the same module and class with different code; the
    bundle recorded the first file, which still exists unchanged."""
    root = str(tmp_path / "c")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    v1 = _source(tmp_path / "v1")
    v2 = _source(tmp_path / "v2", MODEL_SRC.replace("* self.deep.inner.leaf.scale", "* self.deep.inner.leaf.scale * 3"))
    assert run(root, "--source", v1)[1]["bundles_saved"] == 1
    report, c = run(root, "--source", v2)
    assert report["equal"], "the bundle of checkout v1 ran for checkout v2"
    assert (c["dynamo_traces"], c["bundle_misses"]) == (1, 1)


def test_start_key_covers_class_data_closure_values_threads_and_global_hooks():
    import functools

    from piecewise.warmstart import module_fingerprint, start_factors
    from piecewise.backend import PiecewiseBackend

    class Scaled(torch.nn.Module):
        scale = 2.0

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * self.scale

    m = Scaled()
    before = module_fingerprint(m)
    Scaled.scale = 3.0  # class data: Dynamo's saved guard would read the live class
    assert module_fingerprint(m) != before

    def scaled(s):
        def deco(f):
            @functools.wraps(f)
            def w(self, x):
                return f(self, x) * s
            return w
        return deco

    backend = PiecewiseBackend(pw.CompilationConfig(backend="eager"), "t")

    def factors_for(s):
        cls = type("Deco", (torch.nn.Module,), {"forward": scaled(s)(lambda self, x: x)})
        return start_factors(backend, cls(), [])

    assert factors_for(2.0)["closure"] != factors_for(3.0)["closure"]
    base = start_factors(backend, m, [])
    threads = torch.get_num_threads()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, i, o: o)
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        other = start_factors(backend, m, [])
    finally:
        handle.remove()
        torch.set_num_threads(threads)
    assert other["threads"] != base["threads"] and other["global_hooks"] != base["global_hooks"]


class _Tied(torch.nn.Module):
    """Embedding and head share one weight when `tied` (the pattern of tied LM heads)."""

    def __init__(self, tied: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.Linear(8, 8, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(x)))


def test_tied_weights_and_shared_objects_enter_the_fingerprint():
    from piecewise.warmstart import module_fingerprint as fp

    assert fp(_Tied(True)) != fp(_Tied(False))
    assert fp(_Tied(True)) == fp(_Tied(True, seed=3))
    shared, separate = ToyTransformer(2, dim=8), ToyTransformer(2, dim=8)
    cfg = {"eps": 1e-5}
    for block in shared.blocks:
        block.cfg = cfg  # one object reached from two layers
    for block in separate.blocks:
        block.cfg = dict(cfg)
    assert fp(shared) != fp(separate)


def test_an_untied_model_is_not_served_the_tied_models_bundle(tmp_path):
    """Dynamo passes a tied weight to the graph once and guards the aliasing; the bundle leaves that
    guard to the fingerprint, which must send the untied model to a trace of its own."""
    import gc

    cfg = pw.CompilationConfig(backend="eager", cache_dir=str(tmp_path / "c"))
    tied = pw.compile(_Tied(True), cfg, dynamic_arg_dims={"x": 0})
    tied(torch.randn(3, 8))
    del tied
    gc.collect()
    model = _Tied(False, seed=1)
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(dynamo_traces=1, bundle_hits=0):
        x = torch.randn(4, 8)
        torch.testing.assert_close(cm(x), model(x))


def test_saved_guards_of_the_reference_decoder_do_not_reach_into_the_module(tmp_path):
    """Every guard on the module tree (types, eps, config fields, the shared config, ModuleList key
    order) is decided by the fingerprint, so the saved guards hold no copy of the module: without
    this, a 32-layer decoder's bundle carried 1.1 MB of guards that took 0.45 s to rebuild."""
    import pickle

    from torch._dynamo.package import load_guards_state

    from piecewise.serving import LlamaConfig, LlamaForCausalLM

    root = str(tmp_path / "c")
    lcfg = LlamaConfig(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_num_seqs=4, max_seq_len=16)
    model = LlamaForCausalLM(lcfg, seed=0)
    cm = pw.compile(model, pw.CompilationConfig(backend="eager", cache_dir=root),
                    dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
    cm(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]))
    body = pickle.loads(open(bundle_file(root), "rb").read())
    state = load_guards_state(pickle.loads(body["dynamo"])["guards_state"])
    names = [g.name for g in state.output_graph._guards]
    assert names and not [n for n in names if n.startswith("L['self']")], names
    assert "self" not in state.output_graph.local_scope or not isinstance(state.output_graph.local_scope["self"], torch.nn.Module)


def test_guards_left_to_the_fingerprint_are_only_those_it_records():
    from piecewise.trace import _fingerprint_covers as covers

    m = ToyTransformer(2, dim=8)
    m.deep = {"a": {"b": {"c": 1}}}  # described two levels deep: "c" is beyond the fingerprint
    m.flat = (1, 2.0, "x")
    assert covers("L['self']._modules['blocks']._modules['1']", m)
    assert covers("L['self']._modules['blocks']._modules['1']._parameters", m)
    assert covers("L['self'].flat", m, by_value=True) and covers("L['self'].deep", m)
    assert not covers("L['self'].deep", m, by_value=True)
    assert not covers("L['self']._modules['blocks']._modules['7']", m)  # no such submodule
    assert not covers("L['self'].forward", m) and not covers("L['x']", m)


# -- globals read through modules, objects and dicts (case B01) ---------------------------------

VALUE_MODEL = '''
import os

import torch
from torch import nn
{imports}


class Model(nn.Module):
    dim = 8

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x = torch.ops.piecewise_models.toy_attention(x, x, x)
        return self.lin(x) * {expr}
'''

#: how forward reaches a constant set from PW_TEST_VALUE at import: (imports, expression)
VALUE_READS = {
    "module_attribute": ("import pwt_cfg", "pwt_cfg.X"),
    "nested_attribute": ("import pwt_cfg", "pwt_cfg.sub.X"),
    "from_package_import_module": ("from pwt_pkg import mod", "mod.X"),
    "global_dict_value": ('TABLE = {"scale": float(os.environ.get("PW_TEST_VALUE", "2.0")), "other": 1}', 'TABLE["scale"]'),
}


def _value_setup(tmp_path, read: str) -> tuple[str, dict]:
    (tmp_path / "pwt_cfg.py").write_text(
        'import os\nimport types\n\nX = float(os.environ.get("PW_TEST_VALUE", "2.0"))\nsub = types.SimpleNamespace(X=X * 10)\n')
    (tmp_path / "pwt_pkg").mkdir()
    (tmp_path / "pwt_pkg" / "__init__.py").write_text("")
    (tmp_path / "pwt_pkg" / "mod.py").write_text('import os\n\nX = float(os.environ.get("PW_TEST_VALUE", "2.0")) + 0.5\n')
    imports, expr = VALUE_READS[read]
    return _source(tmp_path, VALUE_MODEL.format(imports=imports, expr=expr)), {"PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("read", sorted(VALUE_READS))
def test_a_global_reached_through_a_module_object_or_dict_is_compared_with_its_traced_value(tmp_path, read):
    """The saved guard ``G['pwt_cfg'].X == 2.0`` was rebuilt at load from the live module (``== 3.0``)
    and always passed: the bundle compares what was recorded at trace time instead."""
    root = str(tmp_path / "c")
    src, env = _value_setup(tmp_path, read)

    def run_with(value: str) -> tuple[dict, Counter]:
        report = run_worker(root, "--source", src, env={**env, "PW_TEST_VALUE": value})
        return report, Counter(report["counters"])

    cold, c = run_with("2.0")
    assert cold["equal"] and (c["dynamo_traces"], c["bundles_saved"]) == (1, 1)
    other, c = run_with("3.0")
    assert other["equal"], f"the bundle traced with 2.0 ran with 3.0 ({read})"
    assert (c["dynamo_traces"], c["bundle_misses"], c["bundle_hits"], c["bundles_saved"]) == (1, 1, 0, 1)
    again, c = run_with("3.0")
    assert again["equal"] and (c["dynamo_traces"], c["bundle_hits"]) == (0, 1)
    back, c = run_with("2.0")  # the first value's bundle was kept next to the second's
    assert back["equal"] and (c["dynamo_traces"], c["bundle_hits"]) == (0, 1)
    assert len(bundle_entries(root)) == 2
