"""`piecewise cache ls | show | verify | explain | clear | export | import` against real entries."""

import json
import os
import subprocess
import sys
import time

from cachehelp import WORKER, run_worker
from piecewise.cache import tools
from piecewise.cli import main


def _cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().out


def test_ls_show_verify(tmp_path, capsys):
    root = str(tmp_path / "r")
    run_worker(root)
    code, out = _cli(capsys, "cache", "--root", root, "ls")
    assert code == 0 and "2 entries" in out and "/rank_0_0/TwoSplitModel" in out and "3 artifacts" in out
    assert "1 artifacts" in out and "warm-start bundle" in out
    (entry,) = [e for e in tools.list_entries(root) if e.kind == "compile"]
    code, out = _cli(capsys, "cache", "--root", root, "show", entry.key[:6])
    assert code == 0 and '"splitting_ops"' in out
    code, out = _cli(capsys, "cache", "--root", root, "verify")
    assert code == 0 and out.strip().endswith("ok")
    art = next(f for f in os.listdir(os.path.join(entry.path, "artifacts")))
    with open(os.path.join(entry.path, "artifacts", art), "ab") as f:
        f.write(b"x")
    code, out = _cli(capsys, "cache", "--root", root, "verify")
    assert code == 1 and "checksum mismatch" in out


def test_verify_notes_a_bundle_whose_compile_entry_is_gone(tmp_path, capsys):
    root = str(tmp_path / "r")
    run_worker(root)
    (compiled,) = [e for e in tools.list_entries(root) if e.kind == "compile"]
    _cli(capsys, "cache", "--root", root, "clear", "--key", compiled.key)
    code, out = _cli(capsys, "cache", "--root", root, "verify")
    assert code == 0 and "compile entry" in out and "is gone" in out


def test_explain_names_the_differing_factor(tmp_path, capsys):
    root = str(tmp_path / "r")
    run_worker(root)
    run_worker(root, "--max-num-tokens", "32")
    a, b = (e.rel for e in tools.list_entries(root) if e.kind == "compile")
    code, out = _cli(capsys, "cache", "--root", root, "explain", a, b)
    assert code == 0 and "config.max_num_tokens" in out and "inputs" not in out
    code, out = _cli(capsys, "cache", "--root", root, "explain", a, a)
    assert "same key factors" in out


def test_export_import_roundtrip_and_warning_on_differing_factor(tmp_path, capsys):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    run_worker(src)
    archive = str(tmp_path / "cache.tgz")
    code, out = _cli(capsys, "cache", "--root", src, "export", archive)
    assert code == 0 and "exported 2 entries" in out  # the compile entry and its warm-start bundle
    # importing into a process whose environment matches: no warning, and the entry hits
    code, out = _cli(capsys, "cache", "--root", dst, "import", archive)
    assert code == 0 and "imported 2 entries" in out and "warning" not in out
    warm = run_worker(dst)
    c = warm["counters"]
    assert c["cache_hits"] == 1 and c["bundle_hits"] == 1 and "compiler_invocations" not in c and "dynamo_traces" not in c
    # a process that differs in an allow-listed env var is told which factor differs
    p = subprocess.run([sys.executable, "-m", "piecewise.cli", "cache", "--root", str(tmp_path / "dst2"), "import", archive],
                       env={**os.environ, "PIECEWISE_KEY_SALT": "other"}, capture_output=True, text=True)
    assert p.returncode == 0 and "env.PIECEWISE_KEY_SALT" in p.stdout, p.stdout + p.stderr


def test_import_refuses_paths_outside_the_root(tmp_path, capsys):
    import io
    import tarfile

    archive = str(tmp_path / "evil.tgz")
    with tarfile.open(archive, "w:gz") as tar:
        data = b"x"
        ti = tarfile.TarInfo("../escape.txt")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    code = main(["cache", "--root", str(tmp_path / "r"), "import", archive])
    assert code == 2 and not (tmp_path / "escape.txt").exists()


def test_clear_while_another_process_compiles(tmp_path, capsys):
    root = str(tmp_path / "r")
    env = {**os.environ, "PIECEWISE_CACHE_DIR": root}
    p = subprocess.Popen([sys.executable, WORKER, "--backend", "inductor", "--model", "toy2", "--sizes", "4"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cleared = 0
    while p.poll() is None:
        cleared += tools.clear(root)
        time.sleep(0.2)
    out, err = p.communicate()
    assert p.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["equal"]
    assert tools.verify(root)[0] == []
    code, out = _cli(capsys, "cache", "--root", root, "clear")
    assert code == 0 and tools.list_entries(root) == []


def test_import_refuses_manifest_entries_that_escape_the_root(tmp_path):
    import io
    import tarfile

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (tmp_path / "root" / "victim").mkdir(parents=True)
    archive = str(tmp_path / "trav.tgz")
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in [("k/x.txt", b"x"),
                           ("piecewise_manifest.json", json.dumps({"format": 1, "entries": [{"entry": "../victim", "factors": {}}]}).encode())]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    assert main(["cache", "--root", str(tmp_path / "root"), "import", archive]) == 2
    assert (victim / "keep.txt").read_text() == "precious"
    assert (tmp_path / "root" / "victim").is_dir()


def test_show_by_tag_and_clear_leaves_no_empty_dirs(tmp_path, capsys):
    root = str(tmp_path / "r")
    run_worker(root)
    code, out = _cli(capsys, "cache", "--root", root, "show", "TwoSplitModel")
    assert code == 0 and "TwoSplitModel" in out
    _cli(capsys, "cache", "--root", root, "clear")
    assert os.listdir(root) == []


# -- explain: a traced source file shows its hash prefix and path --------------------------------------
MODEL = '''
import torch
import piecewise.testing.toy  # noqa: F401

class Model(torch.nn.Module):
    dim = 8

    def forward(self, x):
        y = torch.ops.piecewise_models.toy_attention(x.sin(), x, x)  # {comment}
        return torch.ops.piecewise_models.toy_attention(y * 2, y, y)
'''


def test_explain_shows_an_edited_source_files_hashes_and_path(tmp_path, capsys):
    import hashlib

    root = str(tmp_path / "r")
    src = tmp_path / "user_model.py"
    digests = []
    for comment in ("v1", "v2"):
        src.write_text(MODEL.format(comment=comment))
        digests.append(hashlib.sha256(src.read_bytes()).hexdigest())
        run_worker(root, "--source", str(src))
    a, b = sorted((e for e in tools.list_entries(root) if e.kind == "compile"), key=lambda e: e.created)
    code, out = _cli(capsys, "cache", "--root", root, "explain", a.rel, b.rel)
    assert code == 0
    (line,) = [ln.strip() for ln in out.splitlines() if "user_model.py" in ln]
    assert line == f"sources.user_model.py: sha256 {digests[0][:12]} ({src}) -> sha256 {digests[1][:12]} ({src})", out
    assert "<absent>" not in out


def _write_factors(path, factors):
    with open(path, "w") as f:
        json.dump(factors, f)
    return str(path)


def test_explain_a_source_file_present_on_one_side_only(tmp_path, capsys):
    from piecewise.cache.key import NOT_IN_KEY

    common = {"torch": "2", "sources": {"toy.py": "a" * 64, NOT_IN_KEY: {"toy.py": "/ckpt/a/toy.py"}}}
    second = {"torch": "2", "sources": {"toy.py": "a" * 64, "hf.py": "b" * 64,
                                        NOT_IN_KEY: {"toy.py": "/ckpt/b/toy.py", "hf.py": "/ckpt/b/models/hf.py"}}}
    fa, fb = _write_factors(tmp_path / "a.json", common), _write_factors(tmp_path / "b.json", second)
    _, _, lines = tools.explain(str(tmp_path), fa, fb)
    # toy.py moved but kept its content: not a difference; hf.py is named with its hash and path
    assert lines == [f"sources.hf.py (only in second): sha256 {'b' * 12} (/ckpt/b/models/hf.py)"]
    _, _, lines = tools.explain(str(tmp_path), fb, fa)
    assert lines == [f"sources.hf.py (only in first): sha256 {'b' * 12} (/ckpt/b/models/hf.py)"]
    # factor files written before paths were recorded still explain, without the path
    old = {"torch": "3", "sources": {"toy.py": "c" * 64}}
    _, _, lines = tools.explain(str(tmp_path), fa, _write_factors(tmp_path / "old.json", old))
    assert lines == [f"sources.toy.py: sha256 {'a' * 12} (/ckpt/a/toy.py) -> sha256 {'c' * 12} (path not recorded)",
                     'torch: "2" -> "3"']
    # a dotted factor name no longer breaks the value lookup, and a whole-factor absence shows the value
    _, _, lines = tools.explain(str(tmp_path), _write_factors(tmp_path / "e.json", {"env": {"A.B": "1"}}),
                                _write_factors(tmp_path / "f.json", {"env": {"A.B": "2"}, "graph": "g"}))
    assert lines == ['env.A.B: "1" -> "2"', 'graph (only in second): "g"']


def test_source_paths_are_recorded_but_not_in_the_key():
    from piecewise.cache.key import NOT_IN_KEY, compute_key, diff_factors, source_factors

    here = os.path.abspath(__file__)
    s = source_factors([here, "<string>"])
    assert list(s) == [os.path.basename(here), NOT_IN_KEY] and s[NOT_IN_KEY] == {os.path.basename(here): here}
    moved = {**s, NOT_IN_KEY: {os.path.basename(here): "/elsewhere/" + os.path.basename(here)}}
    assert compute_key({"sources": s}) == compute_key({"sources": moved}) == compute_key({"sources": {k: v for k, v in s.items() if k != NOT_IN_KEY}})
    assert diff_factors({"sources": s}, {"sources": moved}) == []
    assert diff_factors({"sources": s}, {"sources": {}}) == [f"sources.{os.path.basename(here)} (only in first)"]


def test_cache_tools_that_read_entries_do_not_import_torch(tmp_path):
    root = str(tmp_path / "r")
    run_worker(root)
    compiled = next(e for e in tools.list_entries(root) if e.kind == "compile")
    bundle = next(e for e in tools.list_entries(root) if e.kind == "bundle")
    probe = ("import json, sys, contextlib, io\nfrom piecewise.cli import main\nbuf = io.StringIO()\n"
             "with contextlib.redirect_stdout(buf):\n    rc = main(sys.argv[1:])\n"
             "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules, 'out': buf.getvalue()}))\n")
    archive = str(tmp_path / "x.tgz")
    for argv in (["ls"], ["show", compiled.key[:8]], ["verify"], ["explain", compiled.rel, bundle.rel],
                 ["export", archive], ["clear", "--key", bundle.key]):
        p = subprocess.run([sys.executable, "-c", probe, "cache", *argv, "--root", root], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        r = json.loads(p.stdout.strip().splitlines()[-1])
        assert r["rc"] == 0 and not r["torch"], (argv, r)
    assert [e.kind for e in tools.list_entries(root)] == ["compile"]
    # import compares the entry with this process's torch and compiler: it is the one that needs torch
    p = subprocess.run([sys.executable, "-c", probe, "cache", "import", archive, "--root", str(tmp_path / "r2")],
                       capture_output=True, text=True)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0 and "imported 2 entries" in r["out"], r


def test_import_accepts_compile_and_bundle_variant_entry_names_only():
    ok = ["0123456789abcdef0123/rank_0_0/TwoSplitModel", "0123456789abcdef0123-89abcdef/rank_1_0/m.v2"]
    bad = ["0123456789abcdef0123/rank_0_0/.hidden", "../0123456789abcdef/rank_0_0/t", "0123456789abcdef0123-/rank_0_0/t",
           "0123456789abcdef0123/rank_0_0/t/extra", "XYZ3456789abcdef0123/rank_0_0/t"]
    assert all(tools._ENTRY_NAME.fullmatch(n) for n in ok)
    assert not any(tools._ENTRY_NAME.fullmatch(n) for n in bad)


def _tree(root):
    """Every path under `root` with its bytes (None for a directory): what an import may change."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dirpath, f), root)] = fh.read()
    return out


def _tgz(path, members):
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return path


def test_import_refuses_every_broken_archive_in_one_line_and_writes_nothing(tmp_path, capsys):
    """Truncated anywhere (a copy cut short), not an archive, another format, no manifest, a
    missing file: exit status 2, one line naming the archive, the root exactly as it was."""
    import gzip

    src, root = str(tmp_path / "src"), str(tmp_path / "root")
    run_worker(src)
    good = str(tmp_path / "good.tgz")
    assert main(["cache", "--root", src, "export", good]) == 0
    run_worker(root, "--max-num-tokens", "32")  # the root already holds entries of its own
    before = _tree(root)
    data = open(good, "rb").read()
    cases = {}
    for cut in (len(data) // 2, 100, len(data) - 1, len(data) - 4, len(data) - 9):
        cases[f"cut at {cut} of {len(data)}"] = (data[:cut], "truncated or damaged")
    flipped = bytearray(data)
    flipped[-6] ^= 0xFF  # the gzip trailer's CRC
    cases["altered trailer"] = (bytes(flipped), "damaged")
    cases["text"] = (b"hello\n", "not an archive made by 'piecewise cache export'")
    cases["gzip of text"] = (gzip.compress(b"hello\n" * 100), "not an archive made by 'piecewise cache export'")
    import io
    import tarfile

    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:
        ti = tarfile.TarInfo("x")
        tar.addfile(ti, io.BytesIO(b""))
    cases["an uncompressed tar"] = (plain.getvalue(), "not a gzip'd tar")
    manifests = {"no manifest": [("k/x", b"x")],
                 "manifest not JSON": [("piecewise_manifest.json", b"{not json")],
                 "manifest of another format": [("piecewise_manifest.json", json.dumps({"format": 2, "entries": []}).encode())]}
    for name, members in manifests.items():
        cases[name] = (open(_tgz(str(tmp_path / "m.tgz"), members), "rb").read(), "piecewise_manifest.json")
    for name, (content, words) in cases.items():
        archive = str(tmp_path / "case.tgz")
        with open(archive, "wb") as f:
            f.write(content)
        code = main(["cache", "--root", root, "import", archive])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)
        assert words in err and archive in err, (name, err)
        assert _tree(root) == before, name
        assert main(["cache", "--root", str(tmp_path / "fresh"), "import", archive]) == 2
        assert not (tmp_path / "fresh").exists(), name  # not even the root is created
        capsys.readouterr()
    for missing in (str(tmp_path / "absent.tgz"), str(tmp_path)):
        assert main(["cache", "--root", root, "import", missing]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and missing in err
    # the whole archive still imports, into the root it left alone
    assert main(["cache", "--root", root, "import", good]) == 0
    assert len(tools.list_entries(root)) == 4
