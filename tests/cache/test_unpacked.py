"""``artifact_format="unpacked"``: each saved piece also kept as readable files, with a manifest of
sha256 per file in the index, checked by ``cache verify`` and listed by ``cache show``; the binary
is still what loads."""

import glob
import json
import os

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.cache import tools
from piecewise.cache.store import read_index
from piecewise.cli import main
from piecewise.testing.toy import TwoSplitModel

from cachehelp import CodeAdaptor


def _compile(model, root, **kw):
    cfg = CompilationConfig(cache_dir=root, max_num_tokens=16, artifact_format="unpacked", **kw)
    return pw.compile(model, cfg, dynamic_arg_dims={"x": 0})


def _records(root):
    (entry,) = [e for e in tools.list_entries(root) if e.kind == "compile"]
    return entry, read_index(os.path.join(entry.path, "index.json"))["artifacts"]


def _read(root, up, name):
    with open(os.path.join(root, *up["dir"].split("/"), *name.split("/")), "rb") as f:
        return f.read()


def test_artifact_format_is_validated_and_in_the_key():
    with pytest.raises(pw.ConfigError, match="artifact_format='zip' is not one of"):
        CompilationConfig(artifact_format="zip")
    assert CompilationConfig(artifact_format="unpacked").code_factors()["artifact_format"] == "unpacked"
    assert CompilationConfig().code_factors()["artifact_format"] == "binary"


@pytest.mark.parametrize("strategy", ["fx", "inductor_partition"])
def test_inductor_pieces_are_kept_readable_verified_and_still_load_from_the_binary(tmp_path, capsys, strategy):
    root = str(tmp_path / "c")
    model = TwoSplitModel()
    x = torch.randn(5, 8)
    cm = _compile(model, root, backend="inductor", split_strategy=strategy)
    torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
    entry, records = _records(root)
    assert len(records) == (3 if strategy == "fx" else 1)
    for rec in records.values():
        up = rec["unpacked"]
        assert up["dir"].endswith(".unpacked") and up["dir"].startswith(entry.rel)
        files = up["files"]
        assert {"piece.py", "output_code.py", "aot_forward_graph.txt"} <= set(files)
        kernels = [f for f in files if f.startswith("kernels/")]
        assert kernels and all(f.endswith(".cpp") for f in kernels)
        code = _read(root, up, "output_code.py").decode()
        assert "def call" in code
        for k in kernels:  # each kernel file is the C++ source cut out of the wrapper
            src = _read(root, up, k).decode()
            assert 'extern "C"' in src and src.strip() in code
        on_disk = glob.glob(os.path.join(root, *up["dir"].split("/"), "**", "*"), recursive=True)
        assert sorted(os.path.relpath(p, os.path.join(root, *up["dir"].split("/"))) for p in on_disk
                      if os.path.isfile(p)) == sorted(files)
    if strategy == "inductor_partition":
        (rec,) = records.values()
        code = _read(root, rec["unpacked"], "output_code.py").decode()
        assert "def partition_0" in code and "def partition_2" in code and "toy_attention" in code
    assert main(["cache", "--root", root, "verify"]) == 0
    assert main(["cache", "--root", root, "show", entry.rel]) == 0
    out = capsys.readouterr().out
    assert "output_code.py" in out and "kernels/" in out and "CHANGED" not in out

    # a readable file edited by hand is a problem for verify, and marked by show; the model still
    # loads its binary artifacts (0 compiles) and equals eager
    name, rec = next(iter(records.items()))
    path = os.path.join(root, *rec["unpacked"]["dir"].split("/"), "output_code.py")
    with open(path, "a") as f:
        f.write("# edited\n")
    assert main(["cache", "--root", root, "verify"]) == 1
    out = capsys.readouterr().out
    assert f"artifact {name}: readable file output_code.py: checksum mismatch" in out
    main(["cache", "--root", root, "show", entry.rel])
    assert "output_code.py" in (out := capsys.readouterr().out) and "CHANGED" in out
    os.unlink(path)
    problems, notes = tools.verify(root)
    assert problems == [] and any("readable file(s) absent (output_code.py)" in n for n in notes)
    del cm
    torch._dynamo.reset()
    with counters.expect(compiler_invocations=0, recompiles=0):
        cm = _compile(model, root, backend="inductor", split_strategy=strategy)
        for n in (1, 7, 16):
            x = torch.randn(n, 8)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)


class _BadNames(CodeAdaptor):
    name = "code_bad_names"

    def unpack(self, payload, graph):
        return {"piece.py": graph.code.encode(), "../escape.py": b"x", "/abs.py": b"y"}


def test_other_adaptors_keep_the_piece_code_and_unsafe_names_are_skipped(tmp_path, caplog):
    from piecewise.compilers import register_adaptor

    root = str(tmp_path / "c")
    model = TwoSplitModel()
    x = torch.randn(3, 8)
    with register_adaptor("code_bad_names", _BadNames):
        torch.testing.assert_close(_compile(model, root, backend="code_bad_names")(x), model(x))
    _, records = _records(root)
    for rec in records.values():
        assert list(rec["unpacked"]["files"]) == ["piece.py"]
        assert _read(root, rec["unpacked"], "piece.py").decode().lstrip().startswith("def forward")
    assert not glob.glob(os.path.join(str(tmp_path), "**", "escape.py"), recursive=True)
    assert not os.path.exists("/abs.py")
    assert sum("readable file '../escape.py'" in r.getMessage() for r in caplog.records) == 3
    json.dumps(records)  # the manifest is plain JSON


def test_an_artifact_copied_from_another_ranks_entry_keeps_its_verified_readable_files(tmp_path):
    from piecewise.cache.store import CacheEntry

    root, key = str(tmp_path), "k" * 20
    r0 = CacheEntry(root, key, "Model", rank=0)
    r0.save_artifact("a.general", b"x" * 10, {"output_code.py": b"def call(args): ...\n", "kernels/k0.cpp": b"int k;\n"})
    r0.save_artifact("b.general", b"y" * 10, {"output_code.py": b"def call(args): pass\n"})
    r0.commit({"m": 1}, {}, "")
    up = r0.saved["b.general"]["unpacked"]
    with open(os.path.join(root, *up["dir"].split("/"), "output_code.py"), "ab") as f:
        f.write(b"# edited\n")  # the sibling's readable file no longer matches its manifest
    r1 = CacheEntry(root, key, "Model", rank=1)
    r1.open({"m": 1})
    assert r1.sibling_artifact("a.general") == b"x" * 10
    copied = r1.saved["a.general"]["unpacked"]
    assert copied["dir"].startswith(f"{key}/rank_1_0/Model/") and sorted(copied["files"]) == ["kernels/k0.cpp", "output_code.py"]
    assert _read(root, copied, "kernels/k0.cpp") == b"int k;\n"
    assert r1.sibling_artifact("b.general") == b"y" * 10  # the binary verifies: it loads
    assert "unpacked" not in r1.saved["b.general"]  # an edited readable file is not copied as if it were good
    r1.commit({"m": 1}, {}, "")
    problems, notes = tools.verify(root)
    assert any("b.general: readable file output_code.py: checksum mismatch" in p for p in problems)  # rank 0's
    assert not any("rank_1_0" in p for p in problems)


def _entry_with_readable_files(root):
    from piecewise.cache.store import CacheEntry

    e = CacheEntry(root, "k" * 20, "Model")
    e.save_artifact("a.general", b"x" * 10, {"output_code.py": b"def call(args): ...\n"})
    e.commit({"m": 1}, {}, "")
    return e


def _rewrite_index(path, change):
    from piecewise.fingerprint import data_digest

    with open(path) as f:
        idx = json.load(f)
    change(idx["artifacts"]["a.general"])
    idx["checksum"] = data_digest({k: v for k, v in idx.items() if k != "checksum"})
    with open(path, "w") as f:
        json.dump(idx, f)


@pytest.mark.parametrize("how", ["dir_outside", "name_outside", "not_a_mapping", "no_files"])
def test_a_manifest_pointing_elsewhere_or_malformed_makes_the_index_bad_not_read(tmp_path, how):
    """The index checksum is no secret: a manifest edited to name files outside its artifact's
    folder (or of the wrong shape) is refused whole, like an artifact path leaving the root."""
    from piecewise.cache.store import CacheEntry, CacheIndexError

    root = str(tmp_path / "c")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"secret\n")
    e = _entry_with_readable_files(root)
    want = {"sha256": __import__("hashlib").sha256(b"secret\n").hexdigest(), "bytes": 7}
    change = {
        "dir_outside": lambda rec: rec["unpacked"].update(dir="../" * 6 + str(tmp_path).lstrip("/"),
                                                          files={"outside.txt": want}),
        "name_outside": lambda rec: rec["unpacked"]["files"].update({"../../../../../outside.txt": want}),
        "not_a_mapping": lambda rec: rec.update(unpacked={"dir": 5, "files": ["a"]}),
        "no_files": lambda rec: rec["unpacked"].pop("files"),
    }[how]
    index = os.path.join(e.path, "index.json")
    _rewrite_index(index, change)
    with pytest.raises(CacheIndexError, match="manifest|readable file"):
        read_index(index)
    problems, _ = tools.verify(root)
    assert len(problems) == 1 and "bad index" in problems[0]
    again = CacheEntry(root, "k" * 20, "Model")
    assert not again.open({"m": 1}) and counters.cache_errors == 1  # reported, moved aside: the pieces compile


def test_a_readable_file_replaced_by_a_fifo_is_changed_and_never_opened(tmp_path):
    root = str(tmp_path / "c")
    e = _entry_with_readable_files(root)
    up = e.saved["a.general"]["unpacked"]
    path = os.path.join(root, *up["dir"].split("/"), "output_code.py")
    os.unlink(path)
    os.mkfifo(path)  # opening it for reading would block until a writer came
    problems, _ = tools.verify(root)
    assert problems == ["k" * 20 + "/rank_0_0/Model: artifact a.general: readable file output_code.py: checksum mismatch"]


def test_a_corrupt_artifact_is_quarantined_with_its_readable_files(tmp_path):
    from piecewise.cache.store import CacheEntry

    root = str(tmp_path / "c")
    e = _entry_with_readable_files(root)
    rec = e.saved["a.general"]
    with open(os.path.join(root, *rec["file"].split("/")), "r+b") as f:
        f.write(b"y")
    again = CacheEntry(root, "k" * 20, "Model")
    assert again.open({"m": 1}) and again.load_artifact("a.general") is None
    assert not os.path.exists(os.path.join(root, *rec["unpacked"]["dir"].split("/")))
    moved = os.listdir(os.path.join(e.path, "quarantine"))
    assert any(m.startswith(os.path.basename(rec["unpacked"]["dir"])) for m in moved) and len(moved) == 2
