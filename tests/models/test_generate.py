"""transformers generate() through piecewise: greedy tokens equal the same weights under
attn_implementation="sdpa" eager, for both entry paths, every cache spelling, left-padded batches,
and one trace for any batch size and prompt length."""

import copy
import itertools
import logging
import warnings

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.hf import attention as hf

from conftest import MIN_GREEDY_MARGIN, greedy_reference
from conftest import forward_assigned as _forward_assigned
from conftest import left_padded_prompts as _prompts

hf.register_hf_attention()


def _build(arch, attn, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "llama_untied_bias":  # untied lm_head, biases on q/k/v/o
        cfg = LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "opt":  # its mask code branches on one new token: a step per phase
        from transformers import OPTConfig

        common = {k: v for k, v in common.items() if k not in ("intermediate_size", "num_key_value_heads")}
        cfg = OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64)
    elif arch == "roberta":  # numbers positions from the token ids (fairseq), pad id 1
        from transformers import RobertaConfig

        common = {k: v for k, v in common.items() if k not in ("num_key_value_heads",)}
        cfg = RobertaConfig(**{**common, "pad_token_id": 1, "bos_token_id": 0, "max_position_embeddings": 260}, is_decoder=True,
                            type_vocab_size=1)
    elif arch == "gpt2":  # learned absolute position embeddings
        from transformers import GPT2Config

        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=512, pad_token_id=0, bos_token_id=1,
                         eos_token_id=None)
    else:
        raise AssertionError(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():  # random init gives logits of ~0.5 and near-ties; sharpen them
        model.get_output_embeddings().weight.mul_(50)
    return model


def _eager(arch, ids, mask, **kw):
    """Greedy sequences of the sdpa model (`greedy_reference`: every token won by a clear margin)."""
    return greedy_reference(_build(arch, "sdpa"), ids, mask, **kw)


def _config(**kw):
    kw.setdefault("backend", "eager")
    kw.setdefault("max_model_len", 256)
    return CompilationConfig(max_num_tokens=256, **kw)


_SPELLINGS = {"dynamic_cache": {}, "static_cache": {"cache_implementation": "static"}, "no_cache": {"use_cache": False}}
# every architecture through compiled.generate, and the forward-assigned path on Llama: 12 cases
_CASES = [(a, sp, "compiled.generate") for a in ("llama", "llama_untied_bias", "qwen2") for sp in _SPELLINGS] + [
    ("llama", sp, "forward_assigned") for sp in _SPELLINGS]


@pytest.mark.parametrize("arch,spelling,path", _CASES)
def test_greedy_tokens_equal_sdpa_eager(arch, spelling, path):
    spelling = _SPELLINGS[spelling]
    ids, mask = _prompts([5, 9, 2])
    kw = dict(max_new_tokens=10, **spelling)
    expected = _eager(arch, ids, mask, **kw)
    model = _build(arch, "piecewise")
    compiled = pw.compile(model, _config())
    if path == "compiled.generate":
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, **kw)
        assert "forward" not in model.__dict__, "generate() leaves no assignment behind"
    else:
        model.forward = compiled
        got = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert torch.equal(got, expected), f"\n{got.tolist()}\n{expected.tolist()}"
    assert counters.recompiles == 0


@pytest.mark.parametrize("strategy", ["fx", "inductor_partition"])
def test_inductor_pieces(strategy):
    """The first call has one sequence: transformers' ``logits_to_keep=1`` slice would have traced a
    step guarded on batch 1 (lm_head's matmul folds the strided [B, 1, H] only then), and Inductor's
    pieces built for it crashed or raised on the next, larger batch."""
    compiled = pw.compile(_build("llama", "piecewise"), _config(backend="inductor", split_strategy=strategy))
    # other batch sizes and prompt lengths after the first: the same compiled step
    for seed, (lengths, new) in enumerate((([7], 8), ([2, 11, 5], 4), ([4, 6], 3))):
        ids, mask = _prompts(lengths, seed=seed + 7)
        expected = _eager("llama", ids, mask, max_new_tokens=new)
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
        assert torch.equal(got, expected), (lengths, got.tolist(), expected.tolist())
    assert counters.recompiles == 0 and counters.by_tag[f"{compiled.tag}_generate"].dynamo_traces == 1


def test_inductor_steps_specialised_on_size_one_get_a_step_per_size_class():
    """GPT-2 slices its fused QKV projection; Inductor's stride rules specialise the step traced
    at batch 1 on batch 1 and on one new token or more. Generating at batch 1 and then 2 needs
    four steps (each class once); the route allowed three and the second call raised
    `SizeRefusedError` (so did Phi-3, GPT-J, CodeGen, Cohere, GLM and Persimmon)."""
    compiled = pw.compile(_build("gpt2", "piecewise"), _config(backend="inductor"))
    for seed, lengths in enumerate(([6], [5, 8], [3], [7, 2, 4])):
        ids, mask = _prompts(lengths, seed=seed + 20)
        expected = _eager("gpt2", ids, mask, max_new_tokens=3)
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
        assert torch.equal(got, expected), (lengths, got.tolist(), expected.tolist())
    tags = [t for t in counters.by_tag if t.startswith(f"{compiled.tag}_generate")]
    assert len(tags) <= 4 and all(counters.by_tag[t].dynamo_traces == 1 for t in tags), tags
    assert counters.recompiles == 0


def test_a_step_that_branches_on_one_new_token_gets_a_step_per_phase(caplog):
    """OPT's mask code branches on ``q_length == 1``: the step traced at the prompt does not hold
    for a decode step (one new token), so that phase gets a size class of its own once (the
    mechanism of every entry point, `CompiledModel`), and both serve every later call: tokens equal
    eager, one trace per phase, no recompile."""
    caplog.set_level(logging.INFO, logger="piecewise")
    compiled = pw.compile(_build("opt", "piecewise"), _config())
    for seed, (lengths, new) in enumerate((([5, 9, 2], 6), ([3], 4), ([1, 7], 3))):
        ids, mask = _prompts(lengths, seed=seed)
        expected = _eager("opt", ids, mask, max_new_tokens=new)
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
        assert torch.equal(got, expected), (lengths, got.tolist(), expected.tolist())
    assert "size class 2 serves such calls" in caplog.text
    # size classes serve what a trace does not hold for: the trace's size specialisation is no warning
    assert "other sizes get a trace of their own (a size class)" in caplog.text
    assert not [r.getMessage() for r in caplog.records if r.name == "piecewise" and r.levelno >= logging.WARNING]
    step = counters.by_tag[f"{compiled.tag}_generate"]
    assert (step.dynamo_traces, step.size_class_traces) == (2, 1)
    assert f"{compiled.tag}_generate_2" not in counters.by_tag and counters.recompiles == 0


@pytest.mark.parametrize("arch,side", [("gpt2", "left"), ("opt", "right"), ("roberta", "left"), ("roberta", "right"),
                                       ("llama", "right")])
def test_a_plain_forward_without_position_ids_numbers_positions_as_the_model_does(arch, side):
    """A call that passes no position ids (a plain forward on a padded batch) got them numbered
    over the mask's real tokens, pads 0; GPT-2's forward (like most decoders') numbers from the
    cache length, pads included: logits off by up to 30 at real tokens. OPT numbers real tokens
    with pads at -1 (a right pad's logits were off by 20), RoBERTa's family from the token ids that
    are not its pad id (off by 38). Rotary Llama is the same either way. Every position compared,
    the pads' too, where transformers reads a right-padded row's last position."""
    ids, mask = _prompts([5, 9, 2], seed=50)
    if arch == "roberta":
        ids = ids.masked_fill(mask == 0, 1)  # its pad id
    if side == "right":
        ids, mask = ids.flip(-1), mask.flip(-1)
    seen = mask.bool() if side == "left" else torch.ones_like(mask, dtype=torch.bool)  # a left pad sees nothing
    eager, compiled = _build(arch, "sdpa"), pw.compile(_build(arch, "piecewise"), _config())
    for kw in ({"use_cache": False}, {}):
        with torch.no_grad():
            want, got = eager(ids, attention_mask=mask, **kw).logits, compiled(ids, attention_mask=mask, **kw).logits
        torch.testing.assert_close(got[seen], want[seen], rtol=1e-4, atol=1e-4)
    assert counters.recompiles == 0


def test_a_right_padded_row_attends_its_real_tokens_like_eager():
    """Right padding (transformers warns, but runs it): a row's first new token comes from the
    logits at its last position, a pad, which eager computes attending the row's real tokens and
    not itself; piecewise's mask let every pad see itself: logits at pads off by up to 6.9 here,
    and other prompts' first new tokens differed."""
    ids, mask = _prompts([5, 9, 2], seed=3)
    ids, mask = ids.flip(-1), mask.flip(-1)  # the same rows, padded on the right
    expected = _eager("llama", ids, mask, max_new_tokens=6)
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert torch.equal(got, expected), f"\n{got.tolist()}\n{expected.tolist()}"
    # every position's logits, the pads' included (each pad has real tokens before it)
    with torch.no_grad():
        want = _build("llama", "sdpa")(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(compiled(ids, attention_mask=mask, use_cache=False).logits, want, rtol=1e-4, atol=1e-4)
    assert counters.recompiles == 0


def test_ten_generate_calls_of_any_batch_and_length_trace_once():
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    cases = [([1], 3), ([200], 5), ([4, 9], 7), ([1, 1, 1], 2), ([30, 2, 17, 5], 9), ([64] * 5, 4), ([3, 120, 7, 1, 2, 9], 6),
             ([11] * 7, 3), ([2, 4, 8, 16, 32, 64, 100, 128], 5), ([6], 12)]
    for lengths, new in cases:
        ids, mask = _prompts(lengths, seed=len(lengths) + new)
        expected = _eager("llama", ids, mask, max_new_tokens=new)
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
        assert torch.equal(got, expected), (lengths, new)
    step = counters.by_tag[f"{compiled.tag}_generate"]
    assert step.dynamo_traces == 1 and counters.recompiles == 0


@pytest.mark.parametrize("new", [1, 6])
def test_the_cached_attention_equals_the_math_with_a_bool_an_additive_or_no_mask(new):
    """The cache written by `write_kv_cache` (the piece before the op) or by `hf_cached_attention`
    itself (the decode step with graphs), then attended with the bool mask, the additive mask a step
    builds, and no mask (what a `GenerationRoute` asks for when no row is padded): a decode step (1
    new token, 9 cached) and a whole prompt from position 0 (6 tokens, plain causal) equal softmax
    attention written out, and the cache holds the new keys and values at their positions only."""
    from piecewise.hf.generate import (StepAttention, _step_attention, attention_mask_for_step, hf_cached_attention,
                                              write_kv_cache)

    g = torch.Generator().manual_seed(5)
    batch, heads, kv, dim, max_len = 3, 4, 2, 8, 16
    past = 0 if new > 1 else 9
    write_pos = torch.arange(past, past + new)
    valid = torch.ones(batch, max_len, dtype=torch.bool)
    q = torch.randn(batch, heads, new, dim, generator=g)
    k, v = torch.randn(batch, kv, new, dim, generator=g), torch.randn(batch, kv, new, dim, generator=g)
    k0, v0 = torch.randn(batch, kv, max_len, dim, generator=g), torch.randn(batch, kv, max_len, dim, generator=g)
    keys, values = k0.clone(), v0.clone()
    keys[:, :, past:past + new], values[:, :, past:past + new] = k, v
    keys, values = keys[:, :, :past + new].repeat_interleave(2, 1), values[:, :, :past + new].repeat_interleave(2, 1)
    scores = (q @ keys.transpose(-1, -2)) * dim**-0.5
    seen = torch.arange(past + new)[None, :] <= write_pos[:, None]
    want = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values).transpose(1, 2)
    for (mask_dtype, unmasked), in_op in itertools.product(((None, False), (torch.float32, False), (torch.float32, True)),
                                                          (False, True)):
        k_cache, v_cache = k0.clone(), v0.clone()
        out = torch.full((batch, new, heads, dim), float("nan"))
        mask = attention_mask_for_step(write_pos, valid, mask_dtype)
        assert mask.dtype == (mask_dtype or torch.bool)
        if not in_op:
            write_kv_cache(k_cache, v_cache, k, v, write_pos)
        token = _step_attention.set(StepAttention(past + new, unmasked))
        try:
            hf_cached_attention(q, k if in_op else None, v if in_op else None, k_cache, v_cache, write_pos, mask,
                                dim**-0.5, out)
        finally:
            _step_attention.reset(token)
        written = torch.zeros(max_len, dtype=torch.bool)
        written[past:past + new] = True
        assert torch.equal(k_cache[:, :, written], k) and torch.equal(v_cache[:, :, written], v)
        assert torch.equal(k_cache[:, :, ~written], k0[:, :, ~written]) and torch.equal(v_cache[:, :, ~written], v0[:, :, ~written])
        torch.testing.assert_close(out, want, rtol=1.3e-6, atol=1e-5, msg=f"mask {mask_dtype}, unmasked={unmasked}, in_op={in_op}")


def test_steps_attend_without_the_mask_only_when_no_row_is_padded(monkeypatch):
    """A batch with no padding: every step (the prompt, plain causal, and each decode token) drops
    the mask; a left-padded batch keeps it on every step. Tokens equal eager both ways."""
    from piecewise.hf import generate as hf_generate

    unmasked = []
    real = hf_generate.StepAttention

    def recording(length, drop=False):
        unmasked.append(drop)
        return real(length, drop)

    monkeypatch.setattr(hf_generate, "StepAttention", recording)
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    for lengths, want_unmasked in (([7, 7, 7], True), ([7, 3, 5], False)):
        ids, mask = _prompts(lengths, seed=4)
        expected = _eager("llama", ids, mask, max_new_tokens=5)
        unmasked.clear()
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
        assert torch.equal(got, expected), lengths
        assert unmasked == [want_unmasked] * 5, (lengths, unmasked)


def test_the_kv_cache_stays_at_one_address_across_generate_calls():
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    ids, mask = _prompts([4, 6])
    compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    route = compiled._route
    before = [t.data_ptr() for pair in route.step.caches() for t in pair]
    ids, mask = _prompts([9])
    compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
    assert [t.data_ptr() for pair in route.step.caches() for t in pair] == before


def test_a_first_generate_under_inference_mode_leaves_a_cache_later_calls_write():
    # the cache is allocated on the first generate(); under torch.inference_mode() it would be an
    # inference tensor, which a later call outside inference mode may not write in place
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    ids, mask = _prompts([4, 6])
    want = _eager("llama", ids, mask, max_new_tokens=4)
    with torch.inference_mode():
        first = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert not any(t.is_inference() for pair in compiled._route.step.caches() for t in pair)
    with torch.no_grad():
        again = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert torch.equal(first, want) and torch.equal(again, want)


def test_limits_are_typed_errors_before_any_compile():
    compiled = pw.compile(_build("llama", "piecewise"), _config(max_num_seqs=2, max_model_len=32))
    ids, mask = _prompts([3, 3, 3])
    with pytest.raises(pw.InputError, match="max_num_seqs=2"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    ids, mask = _prompts([3, 3])
    with pytest.raises(pw.InputError, match=r"6 sequences .*\(2 prompts x 3 beams or returned sequences\), above max_num_seqs=2"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2, num_beams=3)
    ids, mask = _prompts([30])
    with pytest.raises(pw.InputError, match=r"needs 33 positions \(the last new token is not fed back\), above max_model_len=32"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert counters.dynamo_traces == 0


def test_a_generation_that_fills_the_cache_exactly_is_served():
    """prompt + max_new_tokens = max_model_len + 1 needs max_model_len positions (the last token is
    never fed back); it was refused as one position too many."""
    compiled = pw.compile(_build("llama", "piecewise"), _config(max_num_seqs=2, max_model_len=32))
    ids, mask = _prompts([30, 27], seed=5)
    got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    assert got.shape == (2, 33)
    assert torch.equal(got, _eager("llama", ids, mask, max_new_tokens=3))


def test_layers_added_after_the_first_generate_are_a_typed_error_and_fewer_layers_are_served():
    """The KV cache is made for the layer count of the first call; a layer appended after it (the
    config raised to match) failed deep in the retrace with an untyped-looking "Observed exception"
    CompileError. Dropping a layer uses fewer caches and still gives eager's tokens."""
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    ids, mask = _prompts([5, 9, 2], seed=3)
    compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    extra = copy.deepcopy(model.model.layers[1])
    extra.self_attn.layer_idx = 2
    model.model.layers.append(extra)
    model.config.num_hidden_layers, model.config.layer_types = 3, ["full_attention"] * 3
    with pytest.raises(pw.ConfigError, match="num_hidden_layers=3.*made for 2 layers.*compile the model again"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    del model.model.layers[1:]
    model.config.num_hidden_layers, model.config.layer_types = 1, ["full_attention"]
    eager = _build("llama", "sdpa")
    del eager.model.layers[1:]
    eager.config.num_hidden_layers, eager.config.layer_types = 1, ["full_attention"]
    with torch.no_grad():
        want = eager.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3), want)


def test_generate_on_a_model_without_piecewise_attention_says_so():
    compiled = pw.compile(_build("llama", "sdpa"), _config())
    ids, mask = _prompts([3])
    with pytest.raises(pw.ConfigError, match="attn_implementation='piecewise'"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)


def _bypassing(arch, attn):
    """A tiny model of an architecture whose attention classes bypass transformers' attention
    interface (picked from their own table of classes), with `attn`."""
    from transformers import AutoModelForCausalLM, BloomConfig, FalconConfig

    cfg = (FalconConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4) if arch == "falcon" else
           BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


@pytest.mark.parametrize("arch", ["falcon", "bloom"])
def test_an_architecture_whose_attention_bypasses_the_interface_is_named_on_generate(arch):
    """Falcon cannot even be built with attn_implementation='piecewise' (its own table of attention
    classes raises a KeyError): telling its user to build it that way was a remedy that cannot work."""
    compiled = pw.compile(_bypassing(arch, "eager"), _config())
    ids, mask = _prompts([3])
    with pytest.raises(pw.ConfigError, match=r"attention classes do not use that interface .* Generate with the model itself"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    assert counters.dynamo_traces == 0


def test_an_architecture_built_with_piecewise_attention_it_never_calls_is_refused_at_compile():
    """Bloom accepts attn_implementation='piecewise' and never calls it: refused before any trace
    (it was refused only after a traced and compiled step; MPT's trace failed with Dynamo's words)."""
    with pytest.raises(pw.ConfigError, match=r"BloomForCausalLM was built with attn_implementation='piecewise', but its "
                                             r"attention classes do not call transformers' attention interface"):
        pw.compile(_bypassing("bloom", "piecewise"), _config())
    assert counters.dynamo_traces == 0


@pytest.mark.parametrize("spelling", ["compiled.generate", "forward_assigned"])
def test_mode_none_generates_with_the_model_itself(spelling):
    """mode='none' runs the model eagerly: its generate() is the model's own, and
    ``model.forward = compiled`` calls the model's forward (it recursed into itself until the stack
    ran out)."""
    ids, mask = _prompts([4, 7])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=5)
    want = _eager("llama", ids, mask, max_new_tokens=5)
    for model in (_build("llama", "sdpa"), _bypassing("falcon", "eager")):
        compiled = pw.compile(model, _config(mode="none"))
        if model.config.model_type == "falcon":
            with torch.no_grad():
                want = _bypassing("falcon", "eager").generate(ids, **kw)
        if spelling == "compiled.generate":
            got = compiled.generate(ids, **kw)
        else:
            with _forward_assigned(model, compiled), torch.no_grad():
                got = model.generate(ids, **kw)
        assert torch.equal(got, want), model.config.model_type
    assert counters.dynamo_traces == 0


def test_generate_under_torch_compile_gives_eager_tokens_and_says_once_why_it_recompiles(monkeypatch):
    """torch.compile(backend="piecewise") on the forward: transformers' own DynamicCache, whose
    state Dynamo guards (recompiles on the cache's first fill and on the keyword arguments passed),
    so the user is pointed at pw.compile once, and the tokens are eager's."""
    from piecewise import backend

    monkeypatch.setattr(backend, "_warned_cache_recompile", [False])
    model = _build("llama", "piecewise")
    model.forward = torch.compile(model.forward, backend="piecewise", options={"backend": "eager", "max_num_tokens": 256})
    try:
        for lengths in ([5, 3], [2, 7]):
            ids, mask = _prompts(lengths)
            with warnings.catch_warnings(record=True) as record, torch.no_grad():
                warnings.simplefilter("always")
                got = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
            assert torch.equal(got, _eager("llama", ids, mask, max_new_tokens=4))
            said = [str(w.message) for w in record if "Dynamo recompiled on a transformers cache object" in str(w.message)]
            assert len(said) == (1 if lengths == [5, 3] else 0), said
        assert counters.recompiles > 0
    finally:
        torch._dynamo.reset()


def test_plain_forward_still_runs_the_traced_forward():
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config(), dynamic_arg_dims={"input_ids": 1})
    ids, _ = _prompts([6])
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, _build("llama", "sdpa")(ids).logits, rtol=1e-4, atol=1e-4)


def test_smollm2_chat_answer_streams_and_equals_eager_for_both_engines(session_dir):
    """Real weights: SmolLM2-135M-Instruct answers a chat turn through compiled generate() and through
    the reference decoder's loop with the same tokens as transformers eager; the streamed text is
    the answer. Shares the weight cache dir with tests/models/test_weights.py."""
    import os

    from piecewise.hf import chat, gguf as weights

    loaded = weights.load_smollm2(os.path.join(session_dir, "weights-cache"))
    question = "What is the capital of France?"
    reference = chat.answer(question, engine="hf", compiled=False, max_new_tokens=8, loaded=loaded)
    assert reference.text.startswith("The capital of France is Paris")
    for engine in ("hf", "decoder"):
        pieces = []
        got = chat.answer(question, engine=engine, backend="eager", max_new_tokens=8, loaded=loaded, stream=pieces.append)
        assert got.tokens == reference.tokens, engine
        assert "".join(pieces) == got.text and got.first_token_s <= got.total_s
        assert "trace(s)" in got.start or got.start.startswith("warm start"), got.start
        again = chat.answer(question, engine=engine, backend="eager", max_new_tokens=8, loaded=loaded)
        assert again.tokens == reference.tokens and again.start == "compiled earlier in this process", engine
        assert again.start in again.summary()
    assert reference.start == "eager, nothing compiled"
    assert loaded[0].config._attn_implementation == "sdpa", "the hf engine restores the model's attention"
    assert counters.recompiles == 0


def test_chat_summary_says_what_the_first_token_included():
    from piecewise.hf.chat import describe_start

    assert describe_start({"dynamo_traces": 1, "pieces_compiled": 31}, True) == "1 trace(s), 31 pieces compiled included"
    assert describe_start({"dynamo_traces": 1, "pieces_compiled": 31, "cache_loads": 2}, True) == (
        "1 trace(s), 31 pieces compiled, 2 artifacts loaded from the compile cache included")
    assert describe_start({"bundle_hits": 1, "cache_loads": 3}, True) == (
        "warm start from the compile cache, no trace, 3 artifacts loaded included")
    assert describe_start({}, True) == "compiled earlier in this process"
    assert describe_start({"dynamo_traces": 1}, False) == "eager, nothing compiled"


def test_beam_search_reorders_the_piecewise_cache():
    ids, mask = _prompts([6, 4])
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        expected = _build("llama", "sdpa").generate(ids, attention_mask=mask, **kw)
    got = pw.compile(_build("llama", "piecewise"), _config()).generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-4)


def test_generate_projects_only_the_last_position_and_other_calls_get_every_position():
    ids, mask = _prompts([6, 3])
    expected = _eager("llama", ids, mask, max_new_tokens=4)
    eager = _build("llama", "sdpa")
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4), expected)
    tags = set(counters.by_tag)
    assert f"{compiled.tag}_generate" in tags and f"{compiled.tag}_generate_all_logits" not in tags
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        every = compiled(input_ids=ids, attention_mask=mask).logits  # no logits_to_keep: every position
        last = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        two = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=2).logits
        picked = compiled(input_ids=ids, attention_mask=mask, logits_to_keep=torch.tensor([0, 5])).logits
    real = mask.bool()
    assert every.shape == want.shape and last.shape == (2, 1, want.shape[-1]) and two.shape == (2, 2, want.shape[-1])
    torch.testing.assert_close(every[real], want[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, want[:, -1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(two, want[:, -2:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(picked[:, 1], want[:, 5], rtol=1e-4, atol=1e-4)  # a tensor names positions
    assert picked.shape == (2, 2, want.shape[-1])
    assert counters.by_tag[f"{compiled.tag}_generate_all_logits"].dynamo_traces == 1
    assert counters.by_tag[f"{compiled.tag}_generate"].dynamo_traces == 1 and counters.recompiles == 0


def _tiny(cfg_cls, **extra):
    from transformers import AutoModelForCausalLM

    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=512,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg_cls(**{**common, **extra}), attn_implementation="piecewise").eval()


def test_long_rope_generates_the_eager_tokens_on_one_trace():
    """Phi3's long RoPE creates its long-factor frequencies on the first forward (a plain attribute):
    created inside the first trace, they counted as module state changed after it and the second
    generate() traced again. Prompts below and above the original context (32) pick the short and
    the long factors."""
    from transformers import AutoModelForCausalLM, Phi3Config

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[4.0 + i for i in range(8)],
                original_max_position_embeddings=32)
    model = _tiny(Phi3Config, num_key_value_heads=2, sliding_window=None, rope_parameters=rope)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(50)  # clear greedy margins on random weights
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa").eval()
    ref.load_state_dict(model.state_dict())
    compiled = pw.compile(model, _config())
    for i, (lengths, new) in enumerate([([5, 3], 6), ([9, 4, 7], 4), ([40], 6)]):
        ids, mask = _prompts(lengths, seed=i)
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, output_scores=True,
                               return_dict_in_generate=True)
        margins = [(lambda t: (t[:, 0] - t[:, 1]).min().item())(s.topk(2, dim=-1).values) for s in out.scores]
        assert min(margins) > MIN_GREEDY_MARGIN, "near-tie in the reference; change the seed"
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
        assert torch.equal(got, out.sequences), i
    assert counters.by_tag[f"{compiled.tag}_generate"].dynamo_traces == 1 and counters.recompiles == 0


def test_a_sliding_window_in_the_config_is_refused_at_compile():
    """Mistral and Phi3 carry the window in `sliding_window` without per-layer types: the cache
    attends over every position, so tokens differed once a sequence passed the window."""
    from transformers import MistralConfig, Phi3Config

    for cls in (MistralConfig, Phi3Config):
        with pytest.raises(pw.ConfigError, match="sliding window of 8 positions, below max_model_len=256"):
            pw.compile(_tiny(cls, num_key_value_heads=2, sliding_window=8), _config())
    # a window the cache never exceeds is full attention: served (the cache is capped by the model's
    # max_position_embeddings too), and so are per-layer types that are all full attention
    pw.compile(_tiny(MistralConfig, num_key_value_heads=2, sliding_window=256), _config())
    pw.compile(_tiny(MistralConfig, num_key_value_heads=2, sliding_window=100, max_position_embeddings=64),
               _config(max_model_len=1024))
    from transformers import Qwen2Config

    qwen = _tiny(Qwen2Config, num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert set(qwen.config.layer_types) == {"full_attention"}
    compiled = pw.compile(qwen, _config())
    ids, mask = _prompts([12, 9])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=4)
    with torch.no_grad():
        ref = _tiny(Qwen2Config, num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=2)
        ref.set_attn_implementation("sdpa")
        assert torch.equal(compiled.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("arch", ["stablelm", "diffllama"])
def test_layers_that_miss_the_generation_cache_are_refused(arch):
    """StableLM's decoder layers drop the attention keyword arguments (each step attended only to
    its new token), DiffLlama attends twice a layer: the step must reach the cache once a layer."""
    from transformers import DiffLlamaConfig, StableLmConfig

    model = _tiny(StableLmConfig if arch == "stablelm" else DiffLlamaConfig, num_key_value_heads=2)
    compiled = pw.compile(model, _config())
    ids, mask = _prompts([4, 6])
    with pytest.raises(pw.ConfigError, match=r"has 2 attention layers, but its step reached piecewise's generation KV cache "
                                             r"[04] times"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)


def test_what_the_cached_attention_cannot_honour_is_a_typed_error():
    """Gemma2's logit soft-capping was ignored on the cached path (different tokens); a model whose
    keys do not have the config's KV heads (JetMoE) crashed inside index_copy_. Both are refused
    by name, as the error raised inside the trace, not Dynamo's 'Observed exception'."""
    from transformers import Gemma2Config, JetMoeConfig

    ids, mask = _prompts([5])
    gemma = _tiny(Gemma2Config, num_key_value_heads=2, head_dim=16, layer_types=["full_attention"] * 2,
                  attn_logit_softcapping=0.5)
    with pytest.raises(pw.ConfigError, match="does not support 'softcap'"):
        pw.compile(gemma, _config()).generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    jetmoe = _tiny(JetMoeConfig)
    with pytest.raises(pw.ConfigError, match="keys of 32 heads .* KV cache 16 heads"):
        pw.compile(jetmoe, _config()).generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)


def test_inputs_embeds_and_a_reused_cache_are_typed_errors():
    """A tensor in an unsupported argument raised 'Boolean value of Tensor is ambiguous'; tokens fed
    again on a cache the route already filled (past_key_values from an earlier generate(),
    assisted or prompt-lookup decoding) were written twice and gave other tokens."""
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    ids, mask = _prompts([6])
    with pytest.raises(pw.InputError, match="inputs_embeds"):
        compiled(input_ids=ids, inputs_embeds=torch.randn(1, 6, 64), attention_mask=mask)
    first = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
    more = torch.cat([first.sequences, torch.tensor([[11, 12, 13]])], 1)
    with pytest.raises(pw.InputError, match="already holds 8 positions"):
        compiled.generate(more, attention_mask=torch.ones_like(more), past_key_values=first.past_key_values,
                          do_sample=False, max_new_tokens=3)
    repeating = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # n-grams for prompt lookup to propose
    kw = dict(attention_mask=torch.ones_like(repeating), do_sample=False, max_new_tokens=12, prompt_lookup_num_tokens=3)
    with pytest.raises(pw.InputError, match="prompt_lookup_num_tokens"):
        compiled.generate(repeating, **kw)
    # the forward-assigned path: the first step holds the prompt and the candidates, then
    # transformers crops the rejected ones from its cache, which piecewise's cannot follow
    with _forward_assigned(model, compiled):
        with pytest.raises(pw.InputError, match="crop the KV cache"):
            model.generate(repeating, **kw)


def test_past_key_values_filled_by_an_eager_call_are_refused_on_both_paths():
    """A prefix cache from the eager model: generate() fed only the 4 tokens past its 6 positions,
    which the route wrote at cache positions 0..3 of its own (empty) cache and attended without
    the prefix: other tokens, no error. Refused by name; the model serves the next generate()."""
    from transformers import DynamicCache

    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    ids, mask = _prompts([10])
    with torch.no_grad():
        prefix = _build("llama", "sdpa")(ids[:, :6], use_cache=True).past_key_values
    assert isinstance(prefix, DynamicCache) and prefix.get_seq_length() == 6
    kw = dict(attention_mask=mask, cache=prefix, do_sample=False, max_new_tokens=4)
    with pytest.raises(pw.InputError, match=r"the cache passed in \(cache= / past_key_values=\) already holds 6 "
                                            "positions that piecewise's generation KV cache does not"):
        compiled.generate(ids, **kw)
    with _forward_assigned(model, compiled):
        with pytest.raises(pw.InputError, match="already holds 6 positions"):
            model.generate(ids, **kw)
    expected = _eager("llama", ids, mask, max_new_tokens=4)
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4), expected)


def _decoding_loop(model, ids, steps, **first):
    """Greedy tokens of a hand-written decoding loop: the prompt in one call, then one token a
    call with the cache object the previous call returned."""
    tokens = ids
    with torch.no_grad():
        out = model(ids, **first)
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_a_decoding_loop_that_passes_back_the_returned_cache_equals_eager():
    """A first call with use_cache=True and no cache object returned none, so the loop's next call
    started a new sequence and attended its token alone: other tokens, no error. The route now
    starts a cache object as transformers' forward does. A first call without generation
    arguments runs the model's own forward, which fills transformers' cache object, not
    piecewise's: passing that one back is refused, not continued from an empty cache."""
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    ids, _ = _prompts([7])
    expected = _decoding_loop(_build("llama", "sdpa"), ids, 4, use_cache=True)
    assert torch.equal(_decoding_loop(compiled, ids, 4, use_cache=True), expected)
    assert torch.equal(expected, _eager("llama", ids, torch.ones_like(ids), max_new_tokens=4))  # clear margins
    with pytest.raises(pw.InputError, match="already holds 7 positions .* a call of this compiled model without generation"):
        _decoding_loop(compiled, ids, 1)
    assert counters.recompiles == 0


def test_a_decoding_loop_that_changes_the_batch_on_its_cache_is_refused():
    # rows are cache slots: a loop that dropped a finished row (3 rows to 2) read rows 0..1 where
    # its sequences' keys were in rows 1..2, and gave other tokens; eager fails on the sizes too
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    ids, _ = _prompts([5, 5, 5])
    with torch.no_grad():
        out = compiled(ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for rows in (nxt[1:], torch.cat([nxt, nxt[:1]])):
            with pytest.raises(pw.InputError, match="sequences on a generation cache started with 3"):
                compiled(rows, past_key_values=out.past_key_values, use_cache=True)
        compiled(nxt, past_key_values=out.past_key_values, use_cache=True)  # the same rows go on


def test_static_cache_calls_of_growing_length_keep_one_trace():
    """transformers' generate() records the length of the static cache it built on the model
    (`_previous_max_cache_length`); each longer one counted as module state the trace read, so
    every such call traced again (recompiles 1, 2, 3)."""
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    recorded = []
    for i, (lengths, new) in enumerate([([4, 3], 4), ([8], 4), ([12, 5], 6), ([20, 2, 9], 5)]):
        ids, mask = _prompts(lengths, seed=i)
        got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, cache_implementation="static")
        assert torch.equal(got, _eager("llama", ids, mask, max_new_tokens=new, cache_implementation="static")), i
        recorded.append(compiled.module._previous_max_cache_length)
    assert recorded == sorted(set(recorded)), recorded  # transformers did record a longer length each call
    assert counters.by_tag[f"{compiled.tag}_generate"].dynamo_traces == 1 and counters.recompiles == 0


def test_inputs_generation_cannot_serve_are_typed_errors_naming_the_cause():
    """Each used to fail otherwise: token ids outside the vocabulary raised IndexError (eager
    adaptor) or an untyped kernel bounds error (Inductor); a cap from max_position_embeddings was
    reported as max_model_len with a remedy that changed nothing; dynamic rotary scaling failed
    inside the trace as 'Data-dependent branching'; layer types that are not windows were told to
    lower max_model_len to a window."""
    from transformers import LlamaConfig, Lfm2Config

    compiled = pw.compile(_build("llama", "piecewise"), _config())
    ids, mask = _prompts([5])
    for bad in (512, -1):
        wrong = ids.clone()
        wrong[0, -1] = bad
        with pytest.raises(pw.InputError, match=rf"token id {bad}, outside the vocabulary 0..511"):
            compiled.generate(wrong, attention_mask=mask, do_sample=False, max_new_tokens=2)
        with _forward_assigned(compiled.module, compiled) as model:  # checked at the prompt's step, before its trace
            with pytest.raises(pw.InputError, match=rf"token id {bad}, outside the vocabulary 0..511"):
                model.generate(wrong, attention_mask=mask, do_sample=False, max_new_tokens=2)
    # an empty prompt and float ids failed inside the trace (Dynamo's TorchRuntimeError)
    for spell in ("compiled.generate", "forward_assigned"):
        for wrong, match in ((torch.zeros(1, 0, dtype=torch.long), r"input_ids of shape \(1, 0\) hold no tokens"),
                             (ids.float(), r"input_ids have dtype torch.float32; token ids are integers")):
            with pytest.raises(pw.InputError, match=match):
                if spell == "compiled.generate":
                    compiled.generate(wrong, do_sample=False, max_new_tokens=2)
                else:
                    with _forward_assigned(compiled.module, compiled) as model:
                        model.generate(wrong, do_sample=False, max_new_tokens=2)
    short = pw.compile(_tiny(LlamaConfig, num_key_value_heads=2, max_position_embeddings=32), _config(max_model_len=1024))
    ids, mask = _prompts([30])
    with pytest.raises(pw.InputError, match=r"needs 39 positions \(the last new token is not fed back\), above the model's max_position_embeddings=32 \(it caps "
                                            r"CompilationConfig.max_model_len=1024\)"):
        short.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    dynamic = _tiny(LlamaConfig, num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(pw.ConfigError, match=r"dynamic rotary scaling \(rope_type='dynamic' in model.rotary_emb\)"):
        pw.compile(dynamic, _config())
    with pytest.raises(pw.ConfigError, match=r"types \['conv'\]; .*mode='none', or generate without piecewise$"):
        pw.compile(_tiny(Lfm2Config, num_key_value_heads=2, layer_types=["conv", "full_attention"]), _config())
    assert counters.dynamo_traces == 0


def test_what_eager_computes_differently_from_the_step_is_refused_not_run():
    """Each ran silently with other tokens: is_causal=False (bidirectional attention) was dropped;
    position_ids that restart within a row without mask or cache (transformers attends each packed
    sequence alone) were attended as one row; a row with no real token attended itself where eager
    attends uniformly."""
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    ids, mask = _prompts([6, 6])
    with pytest.raises(pw.InputError, match=r"got \['is_causal'\]"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3, is_causal=False)
    with pytest.raises(pw.InputError, match=r"got \['output_router_logits'\]"):
        compiled(ids, use_cache=True, output_router_logits=True)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)
    with pytest.raises(pw.InputError, match=r"position_ids restart or skip within a row, without attention_mask or a cache"):
        compiled(ids, position_ids=packed, use_cache=False)
    with pytest.raises(pw.InputError, match=r"position_ids restart"):
        compiled.generate(ids, position_ids=packed, use_cache=False, do_sample=False, max_new_tokens=2)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(pw.InputError, match=r"attention_mask row 1 has no real token \(all 6 positions are padding\)"):
        compiled.generate(ids, attention_mask=empty, do_sample=False, max_new_tokens=2)
    with pytest.raises(pw.InputError, match=r"generate\(prefill_chunk_size=4\) feeds the 6-token prompt in chunks"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2, prefill_chunk_size=4)
    # what stays served: flags at transformers' default (is_causal=True, output_router_logits=False),
    # consecutive positions without a mask
    want = _eager("llama", ids, mask, max_new_tokens=3)
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3, is_causal=True), want)
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3,
                                         output_router_logits=False), want)
    with torch.no_grad():
        got = compiled(ids, position_ids=torch.arange(6).expand(2, 6), use_cache=False).logits
        torch.testing.assert_close(got, _build("llama", "sdpa")(ids).logits, rtol=1e-4, atol=1e-4)
    assert counters.recompiles == 0


def test_a_model_cast_after_its_first_generate_is_refused_not_run_on_the_old_cache():
    """A bfloat16 model cast to float32 after one generate() kept its bfloat16 KV cache: keys
    rounded, other tokens, silently."""
    model = _build("llama", "piecewise").to(torch.bfloat16)
    compiled = pw.compile(model, _config())
    ids, mask = _prompts([5, 3])
    first = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    model.to(torch.float32)
    for spelling in ("compiled.generate", "forward_assigned"):
        with pytest.raises(pw.ConfigError, match=r"parameters are now torch.float32 on cpu, but piecewise's generation KV "
                                                 r"cache was made torch.bfloat16 on cpu"):
            if spelling == "compiled.generate":
                compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
            else:
                with _forward_assigned(model, compiled):
                    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
    model.to(torch.bfloat16)  # back as it was: served again
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2), first)


@pytest.mark.parametrize("spelling", ["compiled.generate", "forward_assigned"])
def test_int32_prompts_generate_the_eager_tokens_on_the_one_trace(spelling):
    """Eager takes int32 ids; generate() appends its int64 tokens to them. The step used to be
    traced for the prompt's int32 and then refused its own decode steps (and every later int64
    prompt) with a remedy the caller could not apply."""
    compiled = pw.compile(_build("llama", "piecewise"), _config())
    for i, (lengths, dtype) in enumerate([([5, 3], torch.int32), ([4], torch.int64), ([6, 2, 7], torch.int16)]):
        ids, mask = _prompts(lengths, seed=i)
        expected = _eager("llama", ids, mask, max_new_tokens=4)
        ids = ids.to(dtype)
        if spelling == "compiled.generate":
            got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
        else:
            with _forward_assigned(compiled.module, compiled) as model:
                got = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
        assert torch.equal(got.long(), expected), (i, dtype)
    assert counters.by_tag[f"{compiled.tag}_generate"].dynamo_traces == 1 and counters.recompiles == 0


def test_a_model_without_a_findable_embedding_still_generates(monkeypatch):
    """The vocabulary check asks transformers for the input embedding, which raises
    NotImplementedError for a model it cannot find one in; generate() then goes on unchecked."""
    model = _build("llama", "piecewise")

    def not_found():
        raise NotImplementedError("no input embedding")

    monkeypatch.setattr(model, "get_input_embeddings", not_found)
    ids, mask = _prompts([5, 3])
    got = pw.compile(model, _config()).generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3)
    assert torch.equal(got, _eager("llama", ids, mask, max_new_tokens=3))


def test_the_engine_refuses_token_ids_outside_the_vocabulary():
    from piecewise.serving import LlamaConfig as DecoderConfig
    from piecewise.serving import greedy_decode

    config = DecoderConfig(vocab_size=256)
    with pytest.raises(pw.InputError, match=r"prompt 1 holds token id 256, outside the vocabulary 0..255 "
                                            r"\(LlamaConfig.vocab_size=256\)"):
        greedy_decode(lambda *a: None, [[1, 2], [3, 256]], 2, config=config)
    # a float id ran as its truncation (3.7 as 3), with or without a config
    for cfg in (config, None):
        with pytest.raises(pw.InputError, match=r"prompt 0 holds 3.7 \(float\); token ids are integers"):
            greedy_decode(lambda *a: None, [[3.7, 5], [3, 4]], 2, config=cfg)


def test_a_generation_nested_in_another_on_the_same_model_is_refused():
    """A streamer that generates with the same compiled model: the inner generation overwrote the
    outer one's cache rows and the outer one went on with wrong tokens."""
    from transformers.generation.streamers import BaseStreamer

    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    ids, mask = _prompts([5])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=4)

    class Nested(BaseStreamer):
        def __init__(self, run):
            self.run, self.puts = run, 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:  # the prompt, the first token, then between two decode steps
                self.run()

        def end(self):
            pass

    with pytest.raises(pw.InputError, match=r"while another generate\(\) on it runs"):
        compiled.generate(ids, streamer=Nested(lambda: compiled.generate(ids, **kw)), **kw)
    with _forward_assigned(model, compiled):
        with pytest.raises(pw.InputError, match="a generation resumed after another generation"):
            model.generate(ids, streamer=Nested(lambda: model.generate(ids, **kw)), **kw)
    # the route is free again afterwards, and right
    with torch.no_grad():
        assert torch.equal(compiled.generate(ids, **kw), _eager("llama", ids, mask, max_new_tokens=4))


def test_config_edits_after_the_first_generate_are_followed_or_refused():
    """The trace read the model's config. Lowered after the first generate(), ``num_hidden_layers``
    used to keep serving every layer (stale tokens, no recompile); a sliding window set later was
    served as full attention. Now a changed config traces the steps again (counted, logged), or is
    refused as at compile when the cache cannot serve it; put back, it is served again."""
    ids, mask = _prompts([6, 4])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=4)
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    assert torch.equal(compiled.generate(ids, **kw), _eager("llama", ids, mask, max_new_tokens=4))
    reference = _build("llama", "sdpa")
    for m in (model, reference):
        m.config.num_hidden_layers = 1
    with torch.no_grad():
        expected = reference.generate(ids, **kw)
    with counters.expect(recompiles=1, state_changes=1):
        assert torch.equal(compiled.generate(ids, **kw), expected)
        with _forward_assigned(model, compiled):
            assert torch.equal(model.generate(ids, **kw), expected)
    model.config.sliding_window = 3
    with pytest.raises(pw.ConfigError, match=r"config changed after the first call \(config.sliding_window '<absent>' -> 3\)"
                                             r".*sliding window of 3 positions"):
        compiled.generate(ids, **kw)
    del model.config.sliding_window
    with counters.expect(recompiles=0):
        assert torch.equal(compiled.generate(ids, **kw), expected)


def test_a_layer_attending_twice_after_a_retrace_is_refused_and_a_deleted_layer_is_served():
    """A state change traces the step again inside the same compiled object; its layers are checked
    to reach the cache once each again (the check used to be remembered per compiled object, so a
    hook calling attention a second time was served with other tokens), against the layers the
    step runs now (a layer deleted from the list is still served)."""
    ids, mask = _prompts([6, 4])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=4)
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    assert torch.equal(compiled.generate(ids, **kw), _eager("llama", ids, mask, max_new_tokens=4))

    def twice(module, args, kwargs, out):
        module.forward(*args, **kwargs)  # a second attention call: writes the layer's cache again
        return out

    handle = model.model.layers[1].self_attn.register_forward_hook(twice, with_kwargs=True)
    with pytest.raises(pw.ConfigError, match="2 attention layers, but its step reached piecewise's generation KV cache 3 times"):
        compiled.generate(ids, **kw)
    handle.remove()
    reference = _build("llama", "sdpa")
    for m in (model, reference):
        del m.model.layers[1]
    with torch.no_grad():
        expected = reference.generate(ids, **kw)
    assert torch.equal(compiled.generate(ids, **kw), expected)


def test_a_cache_object_reset_and_reused_across_generate_calls_starts_a_new_sequence():
    """transformers documents reusing a StaticCache across generate() calls with ``cache.reset()``
    between them. The route told generations apart by the cache object only, so a 1-token prompt
    on the reset cache was taken as the next decode step of the last generation (other tokens),
    and a longer one was refused as tokens fed again."""
    from transformers import DynamicCache, StaticCache

    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    for cache in (StaticCache(config=model.config, max_cache_len=64), DynamicCache()):
        for paths, lengths in ((("compiled", "assigned"), [6, 1]), (("assigned", "compiled"), [3, 1])):
            for path, n in zip(paths, lengths):
                ids, mask = _prompts([n, n], seed=n + len(paths))
                cache.reset()
                kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=4, past_key_values=cache)
                if path == "compiled":
                    got = compiled.generate(ids, **kw)
                else:
                    with _forward_assigned(model, compiled):
                        got = model.generate(ids, **kw)
                assert torch.equal(got, _eager("llama", ids, mask, max_new_tokens=4)), (type(cache).__name__, path, n)
        # the class's reset behind one hook (it used to nest one wrapper a reuse, RecursionError after
        # about a thousand), and a deep copy resets itself, not the cache it was copied from
        from piecewise.hf.generate import _CacheReset

        assert isinstance(cache.reset, _CacheReset) and cache.reset.cache() is cache
        assert copy.deepcopy(cache).reset.cache() is not cache
    assert counters.recompiles == 0


def test_a_config_edit_between_compile_and_the_first_generate_is_checked():
    """The config was first compared after the first step's trace: a sliding window set between
    pw.compile and the first generate() was served as full attention."""
    ids, mask = _prompts([6, 4])
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config())
    model.config.sliding_window = 3
    with pytest.raises(pw.ConfigError, match=r"config.sliding_window '<absent>' -> 3.*sliding window of 3 positions"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)


def _tiny_named(config_name, attn="piecewise", **kw):
    import transformers

    cfg = getattr(transformers, config_name)(**{**dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                                      num_attention_heads=4, vocab_size=256, max_position_embeddings=512,
                                                      pad_token_id=0, bos_token_id=1, eos_token_id=None), **kw})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


def test_a_bidirectional_encoder_built_as_a_causal_lm_is_refused():
    """BertLMHeadModel without is_decoder=True attends both ways in eager (transformers warns and
    runs it); the generation step attended causally, with other logits at every step."""
    ids = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    compiled = pw.compile(_tiny_named("BertConfig", is_decoder=False), _config(max_model_len=64))
    with pytest.raises(pw.ConfigError, match="BertSelfAttention attends bidirectionally"):
        compiled.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2)
    decoder = _tiny_named("BertConfig", is_decoder=True)
    eager = _tiny_named("BertConfig", attn="sdpa", is_decoder=True)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3)
    with torch.no_grad():
        assert torch.equal(pw.compile(decoder, _config(max_model_len=64)).generate(ids, **kw), eager.generate(ids, **kw))


def test_a_layer_run_several_times_a_step_is_refused():
    """HRM runs each decoder layer several times a step, each run with its own cache slot
    (layer_idx + a cycle offset); the cache is indexed by layer_idx, so the runs overwrote each
    other's keys (other tokens), while the count of attention calls still matched."""
    ids = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    compiled = pw.compile(_tiny_named("HrmTextConfig", head_dim=16), _config(max_model_len=64))
    with pytest.raises(pw.ConfigError, match="only 2 distinct layer_idx values"):
        compiled.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2)


def test_llama4_attention_temperature_past_the_cache_floor_is_refused_before_compiling():
    """Llama 4 scales its NoPE layers' queries by a temperature that grows from position
    floor_scale, read from the cache object the step does not fill (positions taken as 0)."""
    kw = dict(intermediate_size_mlp=128, num_key_value_heads=2, head_dim=16, num_local_experts=2,
              attention_chunk_size=None, no_rope_layer_interval=2, attn_scale=5.0)
    with counters.expect(dynamo_traces=0), pytest.raises(pw.ConfigError, match="floor_scale=16.*max_model_len"):
        pw.compile(_tiny_named("Llama4TextConfig", floor_scale=16, **kw), _config(max_model_len=64))
    pw.compile(_tiny_named("Llama4TextConfig", floor_scale=64, **kw), _config(max_model_len=64))  # temperature 1 throughout


def test_strided_input_ids_and_guidance_are_served_or_refused_by_name():
    """A hand-written loop whose prompt is a slice of a buffer (strides (12, 1)) then feeds
    contiguous tokens; classifier-free guidance runs a second generation inside each step."""
    ids, mask = _prompts([6, 6])
    model, eager = _build("llama", "piecewise"), _build("llama", "sdpa")
    compiled = pw.compile(model, _config())
    buffer = torch.zeros(2, 12, dtype=torch.long)
    buffer[:, :6] = ids
    with torch.no_grad():
        want = eager(buffer[:, :6]).logits
        got = compiled(input_ids=buffer[:, :6], use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        nxt = torch.cat([ids, got[:, -1:].argmax(-1)], dim=1)
        torch.testing.assert_close(compiled(input_ids=nxt, use_cache=False).logits, eager(nxt).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(pw.InputError, match=r"guidance_scale=1.5.*use_cache=False"):
        compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3, guidance_scale=1.5)
    kw = dict(do_sample=False, max_new_tokens=3, guidance_scale=1.5, use_cache=False)
    with torch.no_grad():
        assert torch.equal(compiled.generate(ids, **kw), eager.generate(ids, **kw))


def test_doge_keeping_fewer_keys_than_the_cache_holds_is_refused_before_compiling():
    """Doge masks all but its keep_window_size strongest keys per query, a mask of its layers'
    own that the step's causal mask replaced (other tokens past the window)."""
    with counters.expect(dynamo_traces=0), pytest.raises(pw.ConfigError, match="keep_window_size=4 strongest keys"):
        pw.compile(_tiny_named("DogeConfig", keep_window_size=4), _config(max_model_len=64))
    pw.compile(_tiny_named("DogeConfig", keep_window_size=64), _config(max_model_len=64))


def test_a_quantized_cache_is_refused_by_name_on_both_paths():
    """A QuantizedCache (fp8, pure torch) makes eager attend fp8-rounded keys and values; the step
    attended its own full-precision cache: other tokens, no error. Refused by name, before a step
    (compiled.generate) or at the first step (the forward-assigned path)."""
    from transformers import QuantizedCache

    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config(max_model_len=64))
    ids, mask = _prompts([6, 4])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=3)
    with pytest.raises(pw.InputError, match="cache_implementation='quantized'"):
        compiled.generate(ids, cache_implementation="quantized", cache_config={"backend": "fp8"}, **kw)
    with pytest.raises(pw.InputError, match="QuantizedCache with layers Fp8QuantizedLayer"):
        compiled.generate(ids, cache=QuantizedCache(backend="fp8", config=model.config), **kw)
    with _forward_assigned(model, compiled):
        with pytest.raises(pw.InputError, match="QuantizedCache with layers Fp8QuantizedLayer"):
            model.generate(ids, cache=QuantizedCache(backend="fp8", config=model.config), **kw)
    # the model still serves a plain generate() with the eager tokens
    assert torch.equal(compiled.generate(ids, **kw), _eager("llama", ids, mask, max_new_tokens=3))


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_cache_reused_without_reset_is_refused_not_continued(kind):
    """The same cache object passed to a second generate() without reset(): a one-token prompt
    was taken for the next decode step of the first generation (its keys attended: other tokens),
    where eager's generate() fails. Refused by name now; after reset() it is a new sequence."""
    from transformers import DynamicCache, StaticCache

    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config(max_model_len=64))
    cache = DynamicCache() if kind == "dynamic" else StaticCache(config=model.config, max_cache_len=64)
    first, second = torch.tensor([[17], [33]]), torch.tensor([[99], [140]])
    kw = dict(cache=cache, do_sample=False, max_new_tokens=4)
    compiled.generate(first, **kw)
    with pytest.raises(pw.InputError, match="already holds 4 positions of an earlier generate"):
        compiled.generate(second, **kw)
    cache.reset()
    ones = torch.ones_like(second)
    assert torch.equal(compiled.generate(second, **kw), _eager("llama", second, ones, max_new_tokens=4))


def test_a_custom_4d_attention_mask_is_refused_and_transformers_own_is_served():
    """A block-diagonal (packed sequences) 4-D mask was read as padding on its last row and
    replaced by a causal mask: logits off by 26, no error. It is refused now; the 4-D masks
    transformers builds for a static cache (left padding) still give the eager tokens."""
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config(max_model_len=64))
    ids = torch.randint(3, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    block = torch.zeros(10, 10, dtype=torch.bool)
    for s in (0, 5):
        block[s:s + 5, s:s + 5] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]] * 2)
    with pytest.raises(pw.InputError, match="4-D attention_mask"):
        compiled(ids, attention_mask=block[None, None].expand(2, 1, 10, 10).contiguous(), position_ids=positions,
                 use_cache=False)
    prefix = torch.ones(10, 10, dtype=torch.bool).tril()
    prefix[:4, :4] = True  # a prefix attended both ways
    with pytest.raises(pw.InputError, match="4-D attention_mask"):
        compiled(ids, attention_mask=prefix[None, None].expand(2, 1, 10, 10).contiguous(), use_cache=False)
    padded, mask = _prompts([6, 3])
    want = _eager("llama", padded, mask, max_new_tokens=4, cache_implementation="static")
    assert torch.equal(compiled.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=4,
                                         cache_implementation="static"), want)


def test_generation_arguments_eager_serves_are_served():
    """Each used to be refused: int32 position_ids fixed the step's dtype (the other dtype was
    refused, and an int32 first call poisoned every later generate()); a model config asking for
    hidden states on every forward failed the trace ('Unsupported context manager'); max_length
    with the model's generation_config.max_new_tokens set was checked as max_length, where
    transformers lets max_new_tokens win."""
    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config(max_model_len=64))
    ids, mask = _prompts([6, 4])
    want = _eager("llama", ids, mask, max_new_tokens=3)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for dtype in (torch.int32, torch.int64, torch.int32):
        got = compiled.generate(ids, attention_mask=mask, position_ids=positions.to(dtype), do_sample=False,
                                max_new_tokens=3)
        assert torch.equal(got, want)
    model.generation_config.max_new_tokens = 3
    try:
        assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_length=1000), want)
    finally:
        model.generation_config.max_new_tokens = None
    hidden = _build("llama", "piecewise")
    hidden.config.output_hidden_states = True
    assert torch.equal(pw.compile(hidden, _config(max_model_len=64)).generate(ids, attention_mask=mask, do_sample=False,
                                                                              max_new_tokens=3), want)


@pytest.mark.parametrize("shapes", ["backed", "unbacked"])
def test_dynamic_shapes_the_generation_steps_cannot_take_are_refused_before_a_trace(shapes):
    """'backed' refused every decode step mid-generation ('pad the call to 2', which generate()
    cannot); 'unbacked' failed the trace in transformers' mask code. Both are ConfigErrors naming
    the default before anything is traced."""
    compiled = pw.compile(_build("llama", "piecewise"), _config(max_model_len=64, dynamic_shapes=shapes))
    ids, mask = _prompts([6])
    with counters.expect(dynamo_traces=0):
        with pytest.raises(pw.ConfigError, match=f"dynamic_shapes='{shapes}'.*backed_size_oblivious"):
            compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)


def test_transformers_auto_compile_does_not_wrap_the_piecewise_model():
    """With a static cache on a GPU, transformers' generate() wraps the forward in torch.compile
    (simulated on the CPU by CompileConfig._compile_all_devices): Dynamo then traced piecewise's
    own route, 35 graphs over four calls, uncounted by piecewise. Both paths now generate with
    transformers' auto-compile off (the model's generation_config.disable_compile, set at compile)."""
    from torch._dynamo.utils import counters as dynamo_counters
    from transformers import CompileConfig

    model = _build("llama", "piecewise")
    compiled = pw.compile(model, _config(max_model_len=64))
    assert model.generation_config.disable_compile is True
    auto = CompileConfig(fullgraph=False)
    auto._compile_all_devices = True
    ids, mask = _prompts([6, 4])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=3, cache_implementation="static")
    want = _eager("llama", ids, mask, max_new_tokens=3, cache_implementation="static")
    assert torch.equal(compiled.generate(ids, **kw), want)
    before = dynamo_counters["frames"]["total"]
    assert torch.equal(compiled.generate(ids, compile_config=auto, **kw), want)
    with _forward_assigned(model, compiled):
        assert torch.equal(model.generate(ids, compile_config=auto, **kw), want)
    assert dynamo_counters["frames"]["total"] == before
