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
                           ("piecewise_manifest.json", json.dumps({"entries": [{"entry": "../victim", "factors": {}}]}).encode())]:
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
