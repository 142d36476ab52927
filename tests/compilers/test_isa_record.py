"""Inductor's CPU vector-ISA answer, assumed from the CPU's flags or recorded from a probe
(`piecewise.compilers.isa_record`).

Each check runs in a fresh process: the answer is memoised per process.
"""

import json
import os
import subprocess
import sys

import pytest

CHECK = r'''
import json, sys
import torch
from torch._inductor import cpu_vec_isa
from piecewise.compilers import isa_record as I

root = sys.argv[1]
probes = []
orig = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda self, code: probes.append(str(self)) or orig(self, code)
if sys.argv[2] == "probe":
    I.probe(root)
    used = False
else:
    used = I.use_record(root)
if sys.argv[2] == "use" and not used:  # refused: what the probe would answer is not the question
    print(json.dumps({"used": used, "probes": probes}))
    sys.exit(0)
print(json.dumps({"used": used, "isa": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()],
                  "picked": str(cpu_vec_isa.pick_vec_isa()), "probes": probes}))
'''


def _run(root, mode):
    p = subprocess.run([sys.executable, "-c", CHECK, str(root), mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _record(root):
    (name,) = os.listdir(os.path.join(root, "isa"))
    return os.path.join(root, "isa", name)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    root = tmp_path_factory.mktemp("isa")
    os.chmod(root, 0o755)
    return root, _run(root, "probe")


def test_a_recorded_probe_answer_is_used_without_probing(probed):
    root, first = probed
    assert os.path.exists(_record(root))
    again = _run(root, "use")
    assert again["used"] and again["probes"] == []
    assert again["isa"] == first["isa"] and again["picked"] == first["picked"]


@pytest.mark.parametrize("damage", ["junk", "unknown_isa", "missing_key"])
def test_a_damaged_or_foreign_record_is_ignored_and_the_cpu_probed(probed, tmp_path, damage):
    root, first = probed
    other = tmp_path / "root"
    os.makedirs(other / "isa")
    os.chmod(other, 0o755)
    body = {"junk": "{not json", "unknown_isa": json.dumps({"valid_vec_isa": ["avx9000"]}),
            "missing_key": json.dumps({"isa": ["avx2"]})}[damage]
    with open(other / "isa" / os.path.basename(_record(root)), "w") as f:
        f.write(body)
    r = _run(other, "use")
    assert not r["used"] and r["probes"] == []  # refused before anything else


def test_a_record_another_user_could_write_is_not_trusted(probed, tmp_path):
    import shutil

    root, first = probed
    other = tmp_path / "shared"
    shutil.copytree(root, other)
    os.chmod(other, 0o777)
    assert not _run(other, "use")["used"]


ANSWER = r"""
import json, sys
import torch
from torch._inductor import cpu_vec_isa
from piecewise.compilers import isa_record as I

builds = []
orig = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda self, code: builds.append(str(self)) or orig(self, code)
if sys.argv[1] == "assume":
    I.assume(None)
valid = cpu_vec_isa.valid_vec_isa_list()
picked = cpu_vec_isa.pick_vec_isa()
print(json.dumps({"valid": [str(i) for i in valid], "picked": str(picked), "ok": bool(picked),
                  "flags": [i.build_arch_flags() for i in valid], "nelements": picked.nelements() if picked else 0,
                  "source": I.answer_source(), "builds": builds}))
"""


def _answer(mode, tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{mode}"))
    p = subprocess.run([sys.executable, "-c", ANSWER, mode], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_assumed_answer_is_inductors_probe_answer_without_a_build(tmp_path):
    """On the CPU running the suite: the same valid ISAs, picked ISA and compiler flags (AVX512-BF16
    and AMX-FP16 included) as Inductor's own probe, and no test program built."""
    probed = _answer("probe", tmp_path)
    assumed = _answer("assume", tmp_path)
    assert probed["source"] is None and assumed["source"] == "assumed"
    assert assumed["builds"] == []
    for k in ("valid", "picked", "ok", "flags", "nelements"):
        assert assumed[k] == probed[k], k
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert probed["builds"], "Inductor's probe builds at least one test program on x86"


COLD = r"""
import json, sys
import torch
from torch._inductor import cpu_vec_isa
import piecewise as pw
from piecewise.testing.toy import ToyTransformer

builds = []
orig = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda self, code: builds.append(str(self)) or orig(self, code)
patches = json.loads(sys.argv[2])
cm = pw.compile(ToyTransformer(1, dim=8), pw.CompilationConfig(backend="inductor", cache_dir=sys.argv[1],
                inductor_options=patches), dynamic_arg_dims={"x": 0})
x = torch.randn(3, 8)
ok = torch.allclose(cm(x), cm.module(x), rtol=1.3e-6, atol=1e-5)
from piecewise.compilers import isa_record as I
print(json.dumps({"builds": builds, "equal": ok, "source": I.answer_source(), "bundle_hits": pw.counters.bundle_hits}))
"""


def _cold(root, patches):
    p = subprocess.run([sys.executable, "-c", COLD, str(root), json.dumps(patches)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_cold_and_warm_starts_with_inductor_build_no_isa_test_program(tmp_path):
    root = tmp_path / "cold"
    cold = _cold(root, {})
    assert cold["equal"] and cold["builds"] == [] and cold["source"] == "assumed"
    warm = _cold(root, {})
    assert warm["bundle_hits"] == 1 and warm["equal"] and warm["builds"] == [] and warm["source"] == "assumed"
    assert not os.path.exists(root / "isa")  # nothing to record: no probe ran


def test_isa_settings_in_the_inductor_options_leave_the_question_to_the_compile(tmp_path):
    from piecewise.compilers.inductor import _patches_isa

    assert _patches_isa({"cpp.vec_isa_ok": False}) and _patches_isa({"cpp": {"simdlen": 256}})
    assert not _patches_isa({"max_autotune": False, "cpp": {"threads": 1}})
    r = _cold(tmp_path / "patched", {"cpp.vec_isa_ok": False})
    assert r["equal"] and r["source"] is None


REJECTING = r"""
import json, logging, sys
import torch
import torch._inductor
from torch._inductor import cpu_vec_isa
import piecewise as pw
from piecewise.compilers import isa_record as I
from piecewise.testing.toy import ToyTransformer

# a compiler that builds no vector ISA: its probe answers none, and a kernel build with one fails
cpu_vec_isa.VecISA.check_build = lambda self, code: False
failed = []
orig = torch._inductor.standalone_compile
def standalone_compile(*args, **kwargs):
    picked = str(cpu_vec_isa.pick_vec_isa())
    if picked != "INVALID_VEC_ISA":
        failed.append(picked)
        raise RuntimeError(f"g++: error: unrecognized command-line option for {picked}")
    return orig(*args, **kwargs)
torch._inductor.standalone_compile = standalone_compile
warnings = []
class H(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("piecewise").addHandler(H())
cm = pw.compile(ToyTransformer(1, dim=8), pw.CompilationConfig(backend="inductor", cache_dir=sys.argv[1]),
                dynamic_arg_dims={"x": 0})
x = torch.randn(5, 8)
ok = torch.allclose(cm(x), cm.module(x), rtol=1.3e-6, atol=1e-5)
import glob, os
print(json.dumps({"equal": ok, "failed": failed, "source": I.answer_source(), "warnings": warnings,
                  "valid": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()],
                  "indexes": len(glob.glob(os.path.join(sys.argv[1], "*", "rank_*", "*", "index.json"))),
                  "bundles_saved": pw.counters.bundles_saved, "cache_hits": pw.counters.cache_hits}))
"""


def test_a_compiler_that_rejects_the_assumed_isa_is_probed_and_the_piece_compiled_again(tmp_path):
    import platform

    root = tmp_path / "rejecting"

    def run():
        p = subprocess.run([sys.executable, "-c", REJECTING, str(root)], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first = run()
    assert first["equal"] and first["valid"] == []
    if platform.machine() not in ("x86_64", "AMD64"):
        return  # no vector ISA is assumed off x86 and Linux aarch64 without the flags
    assert len(first["failed"]) == 1 and first["source"] == "probed"
    assert any("vector ISA" in w for w in first["warnings"])
    with open(_record(root)) as f:
        assert json.load(f)["valid_vec_isa"] == []
    # the key was computed under the assumed ISA, so nothing of this compile is saved under it
    assert first["indexes"] == 0 and first["bundles_saved"] == 0
    assert any("machine answer changed" in w for w in first["warnings"])
    # the next process takes the recorded probe over the assumption: no failed build, saved
    again = run()
    assert again["equal"] and again["failed"] == [] and again["source"] == "record" and again["valid"] == []
    assert again["cache_hits"] == 0 and again["indexes"] >= 1  # compiled and saved under the probed answer


def test_the_probe_threads_import_nothing_beyond_probe_modules(tmp_path):
    """Two threads importing torch's modules at once can fail a circular import in one of them, so
    `probe` imports `PROBE_MODULES` on its caller first: with those imported, probing imports no
    module."""
    code = r"""
import importlib, json, sys
import torch
import piecewise.compilers.inductor
from piecewise.compilers import isa_record as I
for name in I.PROBE_MODULES:
    importlib.import_module(name)
before = set(sys.modules)
I.probe(None)
print(json.dumps({"new": sorted(set(sys.modules) - before)}))
"""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"new": []}


def test_the_cpu_vector_isa_is_in_the_cache_key(monkeypatch, tmp_path):
    """Kernels built for one ISA must miss on a machine with another (a shared Redis tier or a
    copied root): the picked ISA and its compiler flags are key factors, in both keys."""
    import torch
    from torch._inductor import cpu_vec_isa

    import piecewise as pw
    from piecewise.compilers.inductor import InductorAdaptor
    from piecewise.testing.toy import ToyTransformer

    cm = pw.compile(ToyTransformer(1, dim=8), pw.CompilationConfig(backend="inductor", cache_dir=str(tmp_path)),
                    dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 8))
    here = cm.backend.factors["machine"]["cpu_vec_isa"]
    assert here["isa"] == str(cpu_vec_isa.pick_vec_isa())
    adaptor = InductorAdaptor(pw.CompilationConfig())
    assert adaptor.machine_factors()["cpu_vec_isa"] == here
    other = next(i for i in cpu_vec_isa.supported_vec_isa_list if str(i) != here["isa"])
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: other)
    assert adaptor.machine_factors()["cpu_vec_isa"]["isa"] == str(other)
