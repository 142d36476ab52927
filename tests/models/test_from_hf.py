"""The reference decoder built from transformers checkpoints (`LlamaForCausalLM.from_hf`) and served
by the continuous-batching loop: logits equal HF eager, greedy tokens equal HF ``generate`` for
each prompt alone, whatever the batch mix; bad inputs fail with typed errors before any compile."""

from __future__ import annotations

import math

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, ConfigError, InputError, counters
from piecewise.serving.decode import greedy_decode, make_prompts
from piecewise.serving.llama import LlamaForCausalLM

import transformers  # noqa: E402  (pinned in requirements: a missing install fails, never skips)

DIMS = {"input_ids": 0, "positions": 0, "seq_ids": 0}
VOCAB = 256
_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=256)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

# name -> (config class name, overrides): the Llama-family variants from_hf maps.
VARIANTS = {
    "llama-gqa": ("LlamaConfig", {}),
    "llama-tied-mqa": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama-biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama3-rope": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE)),
    "linear-rope-head32": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
                                               head_dim=32)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=4096)),
}


def tiny_hf(name: str, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny transformers decoder (2 layers, hidden 64, SDPA, eval) with every parameter drawn at
    random (biases and norm weights included, which transformers initialises to constants), scaled
    like the reference decoder's init so greedy choices win by clear margins; `extra` overrides
    config fields."""
    cls_name, overrides = VARIANTS[name]
    config = getattr(transformers, cls_name)(**{**_TINY, **overrides, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # tied weights are listed once
            if pname.endswith("norm.weight"):
                std, mean = 0.1, 1.0
            elif pname.endswith(".bias"):
                std, mean = 0.1, 0.0
            elif pname.endswith("embed_tokens.weight"):
                std, mean = 1.0, 0.0
            elif pname == "lm_head.weight":
                std, mean = 2.0 / math.sqrt(p.shape[1]), 0.0
            else:
                std, mean = 1.0 / math.sqrt(p.shape[1]), 0.0
                if pname.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= 2.0
            p.copy_(torch.randn(p.shape, generator=gen) * std + mean)
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for one prompt alone (it stops after an EOS token, keeping it)."""
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_hf_eager(name):
    hf = tiny_hf(name)
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=4, max_seq_len=64)
    c = model.config
    cls_name, overrides = VARIANTS[name]
    assert c.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert (model.lm_head.weight is model.embed_tokens.weight) == c.tie_word_embeddings
    assert c.qkv_bias == (name in ("llama-biases", "qwen2")) and c.o_bias == (name == "llama-biases")
    assert c.qk_norm == (name == "qwen3") and c.num_kv_heads == overrides.get("num_key_value_heads", 2)
    assert c.rope_type == overrides.get("rope_parameters", {}).get("rope_type", "default")
    # Three sequences of different lengths in one flattened call, in slots 3, 0, 1.
    prompts = make_prompts(3, VOCAB, seed=1, min_len=5, max_len=40)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    seq_ids = torch.cat([torch.full((len(p),), s) for p, s in zip(prompts, (3, 0, 1))])
    with torch.no_grad():
        got = model(ids, positions, seq_ids)
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert want.std() > 0.5  # logits of a real spread: the comparison means something
    # The HF model is untouched, and the copy does not share its storage.
    assert all(p.data_ptr() != q.data_ptr() for p in model.parameters() for q in hf.parameters())


class StepLog:
    """Wraps a decode forward and records, per call, how many prefill and decode segments it fed."""

    def __init__(self, forward) -> None:
        self.forward, self.steps = forward, []

    def __call__(self, input_ids, positions, seq_ids):
        starts = [0] + [i for i in range(1, len(seq_ids)) if seq_ids[i] != seq_ids[i - 1]] + [len(seq_ids)]
        segments = [(positions[a].item(), b - a) for a, b in zip(starts, starts[1:])]
        self.steps.append((sum(n > 1 or p == 0 for p, n in segments), sum(n == 1 and p > 0 for p, n in segments)))
        return self.forward(input_ids, positions, seq_ids)

    def mixed(self) -> bool:
        """Some step fed a prefill and a decode together."""
        return any(prefills and decodes for prefills, decodes in self.steps)


def _requests(seed: int = 2):
    """Seven requests: lengths 3..30, arriving at steps 0, 0, 1, 3, 4, 4, 9, each its own budget."""
    prompts = make_prompts(7, VOCAB, seed=seed, min_len=3, max_len=30)
    return prompts, [0, 0, 1, 3, 4, 4, 9], [6, 3, 8, 5, 7, 2, 6]


def _with_eos_hit(hf, prompts, budgets):
    """Make a token that request 0 generates at its third step an EOS token of `hf`'s generation
    config, so at least one request stops early on EOS (others may too)."""
    free = hf_greedy(hf, prompts[0], budgets[0])
    hf.generation_config.eos_token_id = [free[2]]
    return free[2]


@pytest.mark.parametrize("name", ["llama-gqa", "llama-tied-mqa", "qwen2", "llama3-rope"])
def test_engine_greedy_equals_hf_generate_per_prompt(name, greedy_margin):
    hf = tiny_hf(name, seed=1)
    prompts, arrivals, budgets = _requests()
    eos = _with_eos_hit(hf, prompts, budgets)
    want = [hf_greedy(hf, p, n) for p, n in zip(prompts, budgets)]
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=3, max_seq_len=48)
    assert model.eos_token_ids == (eos,)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=128), dynamic_arg_dims=DIMS)
    forward = greedy_margin(cm)
    log = StepLog(forward)
    run = greedy_decode(log, prompts, budgets, arrival_steps=arrivals, eos_token_ids=model.eos_token_ids,
                        config=model.config, reset=model.reset_kv_cache)
    assert run.tokens == want
    assert want[0][-1] == eos and run.stop_reasons[0] == "eos"
    assert "length" in run.stop_reasons
    # The mix the loop served: 7 requests through 3 slots (some queued), prefills beside decodes.
    assert log.mixed() and len(set(run.step_sizes)) >= 5
    forward.assert_far_from_ties()
    # Same requests again, other arrivals: no new trace, no recompile.
    with counters.expect(recompiles=0, dynamo_traces=0):
        again = greedy_decode(cm, prompts, budgets, arrival_steps=[0] * 7, eos_token_ids=model.eos_token_ids,
                              config=model.config, reset=model.reset_kv_cache)
    assert again.tokens == want


def test_engine_chunked_prefill_under_token_budget_equals_hf(greedy_margin):
    hf = tiny_hf("llama-biases", seed=3)
    prompts, arrivals, budgets = _requests(seed=4)
    want = [hf_greedy(hf, p, n) for p, n in zip(prompts, budgets)]
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=4, max_seq_len=48)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=8), dynamic_arg_dims=DIMS)
    forward = greedy_margin(cm)
    run = greedy_decode(forward, prompts, budgets, arrival_steps=arrivals, eos_token_ids=model.eos_token_ids,
                        config=model.config, max_num_tokens=8, reset=model.reset_kv_cache)
    assert run.tokens == want
    assert max(run.step_sizes) == 8 and max(map(len, prompts)) > 8  # long prompts went in chunks
    assert counters.recompiles == 0
    forward.assert_far_from_ties()


def test_engine_with_inductor_equals_hf(greedy_margin):
    hf = tiny_hf("llama-tied-mqa", seed=5)
    prompts, arrivals, budgets = _requests(seed=6)
    eos = _with_eos_hit(hf, prompts, budgets)
    want = [hf_greedy(hf, p, n) for p, n in zip(prompts, budgets)]
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=3, max_seq_len=48)
    cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_tokens=64), dynamic_arg_dims=DIMS)
    forward = greedy_margin(cm)
    with counters.expect(recompiles=0, dynamo_traces=1):
        run = greedy_decode(forward, prompts, budgets, arrival_steps=arrivals, eos_token_ids=(eos,),
                            config=model.config, reset=model.reset_kv_cache)
    assert run.tokens == want and "eos" in run.stop_reasons
    forward.assert_far_from_ties()


# -- bad input: typed errors before anything is compiled --------------------------------------

def _no_compile_work():
    return counters.expect(dynamo_traces=0, compiler_invocations=0, graphs_seen=0)


def test_from_hf_refuses_other_architectures_naming_them():
    from piecewise.hf import attention as pw_hf

    bert = pw_hf.tiny_bert(attn_implementation="sdpa")
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4), attn_implementation="sdpa")
    with _no_compile_work():
        for model, arch in ((bert, "BertModel.*'bert'"), (gpt2, "GPT2LMHeadModel.*'gpt2'")):
            with pytest.raises(ConfigError, match=f"{arch}.*supported model types: llama, mistral, qwen2, qwen3"):
                LlamaForCausalLM.from_hf(model)
        bare = tiny_hf("llama-gqa").model  # the decoder without its LM head
        with pytest.raises(ConfigError, match="no language-model head"):
            LlamaForCausalLM.from_hf(bare)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                   original_max_position_embeddings=64)), "rope_type='yarn'.*supported: default, linear, llama3"),
        (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)), "rope_type='dynamic'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
)
def test_from_hf_refuses_what_the_reference_decoder_does_not_compute(overrides, match):
    config = transformers.LlamaConfig(**{**_TINY, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with _no_compile_work(), pytest.raises(ConfigError, match=match):
        LlamaForCausalLM.from_hf(hf)


def test_from_hf_refuses_a_sliding_window_shorter_than_the_cache():
    config = transformers.MistralConfig(**{**_TINY, "sliding_window": 32})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="sliding window of 32.*max_seq_len <= 32"):
        LlamaForCausalLM.from_hf(hf, max_seq_len=64)
    assert LlamaForCausalLM.from_hf(hf, max_seq_len=32).config.max_seq_len == 32


def test_engine_refuses_a_request_longer_than_the_cache_before_compiling():
    model = LlamaForCausalLM.from_hf(tiny_hf("llama-gqa"), max_num_seqs=2, max_seq_len=32)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=64), dynamic_arg_dims=DIMS)
    prompts = [[1, 2, 3], [5] * 30]
    with _no_compile_work():
        with pytest.raises(InputError, match=r"request 1 needs 33 positions .* max_seq_len=32 \(LlamaConfig.max_seq_len"):
            greedy_decode(cm, prompts, 4, config=model.config)
        with pytest.raises(InputError, match=r"max_num_seqs=3 exceeds the model's 2 sequence slots \(LlamaConfig.max_num_seqs\)"):
            greedy_decode(cm, prompts[:1], 4, config=model.config, max_num_seqs=3)
        with pytest.raises(InputError, match="max_new_tokens has 1 entries for 2 prompts"):
            greedy_decode(cm, prompts, [4], config=model.config)
    # Exactly at the limit is fine: 30 + 3 - 1 = 32 positions.
    assert [len(t) for t in greedy_decode(cm, prompts, 3, config=model.config).tokens] == [3, 3]


def test_config_refuses_unknown_rope_type_and_bad_variant_fields():
    from piecewise.serving.llama import LlamaConfig

    with pytest.raises(ConfigError, match="LlamaConfig.rope_type='yarn' is not supported"):
        LlamaConfig(rope_type="yarn")
    with pytest.raises(ConfigError, match="LlamaConfig.qkv_bias=1 must be True or False"):
        LlamaConfig(qkv_bias=1)
    with pytest.raises(ConfigError, match="rope_high_freq_factor"):
        LlamaConfig(rope_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)


# -- what the transformers model computes with, where its config could say otherwise -----------

def test_a_mistral_window_applies_whatever_layer_types_says():
    # Mistral's mask windows every layer once sliding_window is set; layer_types is not read
    config = transformers.MistralConfig(**{**_TINY, "sliding_window": 16, "layer_types": ["full_attention"] * 2})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with _no_compile_work(), pytest.raises(ConfigError, match="sliding window of 16.*max_seq_len <= 16"):
        LlamaForCausalLM.from_hf(hf, max_seq_len=64)
    # Qwen2 windows only the layers layer_types names
    config = transformers.Qwen2Config(**{**_TINY, "use_sliding_window": True, "sliding_window": 16,
                                         "layer_types": ["full_attention"] * 2})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert LlamaForCausalLM.from_hf(hf, max_seq_len=64).config.max_seq_len == 64


def test_eos_ids_are_the_generation_configs_even_when_it_has_none():
    hf = tiny_hf("llama-gqa")
    assert hf.config.eos_token_id is not None
    hf.generation_config.eos_token_id = None  # generate() then never stops early
    assert LlamaForCausalLM.from_hf(hf).eos_token_ids == ()
    hf.generation_config.eos_token_id = [7, 9]
    assert LlamaForCausalLM.from_hf(hf).eos_token_ids == (7, 9)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1.3), ("no_repeat_ngram_size", 2),
                                          ("suppress_tokens", [5]), ("min_new_tokens", 3), ("bad_words_ids", [[4]]),
                                          ("num_beams", 3), ("encoder_repetition_penalty", 3.0),
                                          ("encoder_no_repeat_ngram_size", 1)])
def test_a_generation_config_that_processes_greedy_logits_is_refused(field, value):
    hf = tiny_hf("llama-gqa")
    assert LlamaForCausalLM.from_hf(hf).config.num_layers == 2  # the defaults pass
    setattr(hf.generation_config, field, value)
    with _no_compile_work(), pytest.raises(ConfigError, match=f"generation_config sets {field}=.*pw.compile\\(model\\).generate"):
        LlamaForCausalLM.from_hf(hf)


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_stale_non_finite_cache_rows_never_reach_a_request(stale):
    # a slot's rows past a request's position hold what an earlier occupant left (here: NaN or inf,
    # as an fp16 key that overflowed leaves); decode batches gather them, masked
    hf = tiny_hf("llama-gqa", seed=3)
    prompts = make_prompts(5, VOCAB, seed=5, min_len=2, max_len=20)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=3, max_seq_len=32)
    for layer in model.layers:
        layer.self_attn.k_cache.fill_(stale)
        layer.self_attn.v_cache.fill_(stale)
    log = StepLog(model)
    run = greedy_decode(log, prompts, 6, arrival_steps=[0, 0, 1, 2, 2], config=model.config)  # no reset
    assert run.tokens == want
    assert any(decodes > 1 for _, decodes in log.steps)  # decode batches took the gathered path


def test_a_model_built_under_inference_mode_decodes_outside_it():
    # the KV cache is written in place by every step: built as an inference tensor, no step
    # outside inference mode could write it (reset included)
    hf = tiny_hf("llama-gqa", seed=3)
    prompts = make_prompts(3, VOCAB, seed=5, min_len=2, max_len=12)
    want = [hf_greedy(hf, p, 4) for p in prompts]
    with torch.inference_mode():
        model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    assert not model.layers[0].self_attn.k_cache.is_inference()
    with torch.no_grad():
        run = greedy_decode(model, prompts, 4, config=model.config, reset=model.reset_kv_cache)
    assert run.tokens == want


def test_a_model_cast_after_it_was_built_rotates_and_normalises_as_transformers_does():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from piecewise.serving.llama import RMSNorm, _rope_scaling, apply_rotary, rotary_cos_sin, rotary_inv_freq

    hf = tiny_hf("llama3-rope").to(torch.bfloat16)  # .to() rounds the rotary frequency buffer too
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=64)
    c = model.config
    assert c.dtype == torch.bfloat16 and c.rope_inv_freq_dtype == torch.bfloat16
    ours = rotary_inv_freq(c.head_dim, c.rope_theta, **_rope_scaling(c))
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq.float())
    assert LlamaForCausalLM.from_hf(tiny_hf("llama3-rope"), max_seq_len=64).config.rope_inv_freq_dtype is None
    # the same bfloat16 roundings as transformers' modules, to the bit
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16) * 3
    norm = RMSNorm(64, c.rms_norm_eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(hf.model.norm.weight)
        assert torch.equal(norm(x), hf.model.norm(x))
    q = torch.randn(7, 4, c.head_dim, generator=gen).to(torch.bfloat16)
    positions = torch.arange(30, 37)
    cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta, **_rope_scaling(c))
    hf_cos, hf_sin = hf.model.rotary_emb(q, positions[None])
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(apply_rotary(q, cos, sin), want[0].transpose(0, 1))


def test_a_config_edited_after_the_model_was_built_is_not_followed_silently():
    hf = tiny_hf("llama-gqa")
    hf.config.rms_norm_eps = 0.5  # the built norms keep their epsilon, as transformers computes
    assert LlamaForCausalLM.from_hf(hf).config.rms_norm_eps == hf.model.norm.variance_epsilon != 0.5
    hf.config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}
    with _no_compile_work(), pytest.raises(ConfigError, match="rotary_emb rotates by 8 frequencies that differ"):
        LlamaForCausalLM.from_hf(hf)


def test_the_decode_loop_takes_the_models_own_slots_when_given_no_config():
    hf = tiny_hf("qwen2", seed=4)
    prompts = make_prompts(5, VOCAB, seed=6, min_len=2, max_len=12)
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    run = greedy_decode(model, prompts, 4, arrival_steps=[0] * 5)  # 5 requests queue for 2 slots
    assert run.tokens == [hf_greedy(hf, p, 4) for p in prompts]
    with pytest.raises(InputError, match="max_num_seqs=3 exceeds the model's 2 sequence slots"):
        greedy_decode(model, prompts, 4, max_num_seqs=3)
    # so does the model compiled (its .config is the CompilationConfig; the model is .module)
    compiled = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=64),
                          dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
    assert greedy_decode(compiled, prompts, 4, arrival_steps=[0] * 5, reset=model.reset_kv_cache).tokens == run.tokens
    with pytest.raises(InputError, match="max_num_seqs=3 exceeds the model's 2 sequence slots"):
        greedy_decode(compiled, prompts, 4, max_num_seqs=3)
    with pytest.raises(InputError, match="outside the vocabulary"):
        greedy_decode(compiled, [[VOCAB]], 4)


def test_the_decode_loop_builds_its_inputs_on_the_models_device_by_default():
    """A model on another device than the CPU (here "meta", standing in for CUDA) gets its step
    inputs there, found through a compiled model as its slots are; the default was the CPU, and a
    CUDA model failed at its first trace."""

    class OnMeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), dict(max_num_seqs=2, max_seq_len=16))()
            self.register_buffer("k_cache", torch.empty(2, 16, device="meta"))
            self.seen = set()

        def forward(self, input_ids, positions, seq_ids):
            self.seen |= {t.device.type for t in (input_ids, positions, seq_ids)}
            return torch.nn.functional.one_hot(torch.zeros(input_ids.shape[0], dtype=torch.long), 5).float()

    model = OnMeta()
    greedy_decode(model, [[1, 2], [3]], 2)  # (its tokens mean nothing: the logits are the CPU's)
    assert model.seen == {"meta"}
    model.seen.clear()
    greedy_decode(model, [[1]], 2, device="cpu")  # an explicit device still wins
    assert model.seen == {"cpu"}


def test_the_decode_loop_finds_the_models_slots_and_budget_through_a_compiled_backbone():
    """A compiled backbone holds the decoder as ``.module.decoder``: its slots, positions and
    vocabulary bound the loop as the model's do (it defaulted to 8 slots and failed mid-run with a
    raw IndexError), and the CompilationConfig's max_num_tokens is the loop's step budget (a
    larger step was refused after the trace and earlier steps)."""
    hf = tiny_hf("qwen2", seed=4)
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=48)
    compiled = pw.compile(model.backbone(), CompilationConfig(backend="eager", max_num_tokens=16), dynamic_arg_dims=DIMS)
    with _no_compile_work():
        with pytest.raises(InputError, match=r"request 0 needs 49 positions .* \(LlamaConfig.max_seq_len"):
            greedy_decode(compiled, [[1] * 40], 10, compute_logits=model.compute_logits)
        with pytest.raises(InputError, match="max_num_seqs=3 exceeds the model's 2 sequence slots"):
            greedy_decode(compiled, [[1, 2]], 4, max_num_seqs=3, compute_logits=model.compute_logits)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 4]]  # 3 requests queue for 2 slots; a 30-token prefill
    run = greedy_decode(compiled, prompts, 4, arrival_steps=[0, 3, 3], compute_logits=model.compute_logits)
    assert max(run.step_sizes) <= 16
    assert run.tokens == [hf_greedy(hf, p, 4) for p in prompts]


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(max_num_seqs=-1), dict(arrival_steps=[0, float("nan")]),
                                 dict(arrival_steps=[0, 1.5]), dict(max_new_tokens=4.0), dict(max_new_tokens=[4, 0])])
def test_loop_arguments_that_could_never_progress_are_refused(bad):
    """``max_num_seqs=0`` and a NaN arrival step used to loop forever on empty steps."""
    model = LlamaForCausalLM.from_hf(tiny_hf("llama-gqa"), max_num_seqs=2, max_seq_len=32)
    kw = {"max_new_tokens": 4, **bad}
    with pytest.raises(InputError, match=f"{next(iter(bad))}="):
        greedy_decode(model, [[1, 2], [3]], **kw)


def test_integer_like_max_new_tokens_are_taken():
    import numpy as np

    hf = tiny_hf("llama-gqa")
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    want = [hf_greedy(hf, [1, 2], 3), hf_greedy(hf, [3], 2)]
    assert greedy_decode(model, [[1, 2], [3]], [np.int64(3), torch.tensor(2)]).tokens == want
    assert greedy_decode(model, [[1, 2]], np.int64(3)).tokens == want[:1]
    # so is the per-step token budget (a step of 1 token: the 2-token prompt goes in two chunks)
    assert greedy_decode(model, [[1, 2], [3]], [3, 2], max_num_tokens=np.int64(1)).tokens == want
    assert greedy_decode(model, [[1, 2], [3]], [3, 2], max_num_tokens=torch.tensor(1)).tokens == want


def test_two_loops_on_one_models_cache_at_once_are_refused():
    """Two loops on one model would hand out the same KV-cache slots (silently other tokens): the
    second is refused while the first runs, and the model is free again afterwards."""
    hf = tiny_hf("llama-gqa")
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    compiled = pw.compile(model.backbone(), CompilationConfig(backend="eager", max_num_tokens=32), dynamic_arg_dims=DIMS)
    errors = []

    def forward(*args):
        if not errors:  # a second loop on the same model, from inside the first's step
            with pytest.raises(InputError, match="while another greedy_decode on it runs"):
                greedy_decode(compiled, [[9]], 2, compute_logits=model.compute_logits)
            errors.append(1)
        return compiled(*args)

    forward.decoder = model  # what the loop finds the cache's owner by
    got = greedy_decode(forward, [[1, 2]], 3, compute_logits=model.compute_logits).tokens
    assert errors and got == [hf_greedy(hf, [1, 2], 3)]
    assert greedy_decode(compiled, [[1, 2]], 3, compute_logits=model.compute_logits).tokens == got


def test_an_activation_swapped_behind_the_config_is_refused():
    """transformers binds each MLP's activation at construction: a config whose hidden_act was
    edited to 'silu' afterwards still runs GELU (from_hf used to read the config and decode other
    tokens)."""
    config = transformers.LlamaConfig(**{**_TINY, "hidden_act": "gelu"})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    hf.config.hidden_act = "silu"
    with _no_compile_work(), pytest.raises(ConfigError, match="MLPs apply GELUActivation, not SiLU"):
        LlamaForCausalLM.from_hf(hf)


@pytest.mark.parametrize("fields, match", [(dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
                                           (dict(dola_layers="low"), "dola_generation"),
                                           (dict(force_words_ids=[[5]]), "constrained_beam_search"),
                                           (dict(stop_strings=["a"]), "stop_strings"),
                                           (dict(max_time=1.0), "max_time")])
def test_a_generation_config_that_is_not_plain_greedy_search_is_refused(fields, match):
    """Fields that make greedy generate() search otherwise, or stop on text or time, were accepted
    and decoded as plain greedy search. A generation config asking to sample is fine: the engine's
    contract is generate(do_sample=False)."""
    hf = tiny_hf("llama-gqa")
    hf.generation_config.do_sample, hf.generation_config.temperature = True, 0.7
    assert LlamaForCausalLM.from_hf(hf).config.num_layers == 2
    for k, v in fields.items():
        setattr(hf.generation_config, k, v)
    with _no_compile_work(), pytest.raises(ConfigError, match=match):
        LlamaForCausalLM.from_hf(hf)


@pytest.mark.parametrize("max_seq_len", [None, "64", 0, True])
def test_a_bad_max_seq_len_is_a_typed_error_for_windowed_models_too(max_seq_len):
    config = transformers.MistralConfig(**{**_TINY, "sliding_window": 4096})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match=f"max_seq_len={max_seq_len!r} must be a positive integer"):
        LlamaForCausalLM.from_hf(hf, max_seq_len=max_seq_len)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "qwen3", "mistral"])
def test_only_the_layers_transformers_runs_are_copied(name):
    """transformers' forward runs ``self.layers[:config.num_hidden_layers]``: with the config
    lowered after the model was built, it skips the last layers, which from_hf used to copy and
    run (other tokens, silently)."""
    hf = tiny_hf(name, seed=2, num_hidden_layers=3)
    prompts = make_prompts(3, VOCAB, seed=7, min_len=2, max_len=12)
    all_three = [hf_greedy(hf, p, 6) for p in prompts]
    hf.config.num_hidden_layers = 2
    want = [hf_greedy(hf, p, 6) for p in prompts]
    assert want != all_three  # the third layer changes the tokens: the comparison means something
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    assert model.config.num_layers == len(model.layers) == 2
    assert greedy_decode(model, prompts, 6, eos_token_ids=model.eos_token_ids).tokens == want
    hf.config.num_hidden_layers = 0
    with _no_compile_work(), pytest.raises(ConfigError, match="runs no decoder layers"):
        LlamaForCausalLM.from_hf(hf)


def _steer(module, args, output):
    return output + 3.0


def _steer_embeddings(module, args, output):
    return output + 3.0 if isinstance(module, torch.nn.Embedding) else None


def _steer_input(module, args, kwargs):
    return (args[0] + 1.0,), kwargs


@pytest.mark.parametrize("kind", ["forward_hook", "pre_hook_with_kwargs", "instance_forward", "global_hook"])
def test_a_hook_transformers_would_run_is_refused(kind):
    """from_hf copies weights only: a forward hook, pre-hook or instance-level forward on any of the
    transformers model's modules (activation steering, say) changed HF's tokens and was silently
    dropped. Refused, naming the module and the remedy; hooks transformers installs itself pass."""
    from torch.nn.modules import module as nn_module

    hf = tiny_hf("llama-gqa", seed=1)
    prompt = [5, 17, 42, 99, 3]
    plain = hf_greedy(hf, prompt, 6)
    with torch.no_grad():  # transformers' own output-capturing hooks, left installed
        hf(torch.tensor([prompt]), output_hidden_states=True)
    hf.enable_input_require_grads()
    assert any(m._forward_hooks for m in hf.modules())
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=1, max_seq_len=32)
    assert greedy_decode(model, [prompt], 6, eos_token_ids=model.eos_token_ids).tokens == [plain]
    if kind == "forward_hook":
        handle, where = hf.model.layers[0].register_forward_hook(_steer), "LlamaForCausalLM.model.layers.0 has a forward hook"
    elif kind == "pre_hook_with_kwargs":
        handle = hf.model.norm.register_forward_pre_hook(_steer_input, with_kwargs=True)
        where = "LlamaForCausalLM.model.norm has a forward pre-hook"
    elif kind == "instance_forward":
        mlp = hf.model.layers[1].mlp
        mlp.forward = lambda x: type(mlp).forward(mlp, x) * 2.0
        handle, where = None, "LlamaForCausalLM.model.layers.1.mlp has its own forward attribute"
    else:
        handle, where = nn_module.register_module_forward_hook(_steer_embeddings), "a global forward hook"
    try:
        assert hf_greedy(hf, prompt, 6) != plain  # the hook changes transformers' tokens
        with _no_compile_work(), pytest.raises(
                ConfigError, match=f"{where}.*Remove the hook.*into the weights.*pw.compile\\(model\\).generate"):
            LlamaForCausalLM.from_hf(hf)
    finally:
        if handle is not None:
            handle.remove()
        else:
            del mlp.forward
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=1, max_seq_len=32)
    assert greedy_decode(model, [prompt], 6, eos_token_ids=model.eos_token_ids).tokens == [plain]


def test_the_decode_loop_takes_transformers_eos_forms_and_refuses_malformed_arguments():
    """transformers' ``generation_config.eos_token_id`` is often one int (or None): both raised a
    raw TypeError, as did prompts given flat (one prompt, not a list of them); a step budget
    above the compiled forward's own max_num_tokens failed mid-run."""
    hf = tiny_hf("llama-gqa", seed=1)
    prompt = [5, 17, 42, 99, 3]
    hf.generation_config.eos_token_id = None
    free = hf_greedy(hf, prompt, 6)
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    assert greedy_decode(model, [prompt], 6, eos_token_ids=hf.generation_config.eos_token_id).tokens == [free]
    hf.generation_config.eos_token_id = free[2]  # one int, as most checkpoints give it
    want = hf_greedy(hf, prompt, 6)
    assert want == free[:3]
    run = greedy_decode(model, [prompt], 6, eos_token_ids=hf.generation_config.eos_token_id)
    assert run.tokens == [want] and run.stop_reasons == ["eos"]
    with pytest.raises(InputError, match=r"eos_token_ids=2.5 \(float\) must be None, a token id or an iterable"):
        greedy_decode(model, [prompt], 6, eos_token_ids=2.5)
    with pytest.raises(InputError, match=r"prompts\[0\]=5 is a token id, not a prompt.*\[\[1, 2, 3\]\]"):
        greedy_decode(model, prompt, 6)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=8, cache_dir=None), dynamic_arg_dims=DIMS)
    long_prompt = list(range(1, 13))
    with _no_compile_work(), pytest.raises(
            InputError, match=r"max_num_tokens=16 exceeds the compiled forward's CompilationConfig.max_num_tokens=8"):
        greedy_decode(cm, [long_prompt], 4, max_num_tokens=16)
    run = greedy_decode(cm, [long_prompt], 4, max_num_tokens=8, eos_token_ids=hf.generation_config.eos_token_id)
    assert run.tokens == [hf_greedy(hf, long_prompt, 4)]


def _compiled(hf):
    return torch.compile(hf)


def _no_op_generation_fields(hf):
    free = hf_greedy(hf, [5, 17, 42, 99, 3], 6)
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = free[1]  # were it read, min_new_tokens would hold it back
    hf.generation_config.suppress_tokens = []  # masks nothing
    hf.generation_config.begin_suppress_tokens = []
    hf.generation_config.min_new_tokens = 5  # built only with an EOS token
    return hf


@pytest.mark.parametrize(("extra", "setup"), [
    (dict(hidden_act="swish"), None),
    ({}, _compiled),
    (dict(rms_norm_eps=0.0), None),
    ({}, _no_op_generation_fields),
], ids=["swish", "torch-compiled", "eps-0", "no-op-generation-fields"])
def test_what_transformers_computes_as_plain_llama_is_accepted(extra, setup):
    """Each was refused though transformers' greedy generate() computes plain Llama: hidden_act
    'swish' (nn.SiLU), a
    torch.compile'd model, rms_norm_eps=0, and generation-config fields whose processors do nothing
    (suppress_tokens=[], min_new_tokens without an EOS token)."""
    hf = tiny_hf("llama-gqa", seed=1, **extra)
    if setup is not None:
        hf = setup(hf)
    prompts = make_prompts(3, VOCAB, seed=8, min_len=12, max_len=20)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=2, max_seq_len=32)
    assert greedy_decode(model, prompts, 6, eos_token_ids=model.eos_token_ids).tokens == want
    if "rms_norm_eps" in extra:
        assert model.config.rms_norm_eps == 0.0


def test_a_stray_window_on_a_llama_config_changes_what_transformers_generates():
    """Llama's attention ignores config.sliding_window (a forward's logits are the same), but
    generate()'s cache keeps only the last sliding_window - 1 keys of each layer layer_types names
    sliding (every layer when it is unset): accepting such a config whole, as asked, would decode
    other tokens than generate(). Refused with why and the fix; within the window, or with
    layer_types all full attention, the tokens are generate()'s."""
    plain = tiny_hf("llama-gqa", seed=1)
    stray = tiny_hf("llama-gqa", seed=1, sliding_window=8)
    prompts = make_prompts(3, VOCAB, seed=8, min_len=12, max_len=20)
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert torch.equal(stray(x).logits, plain(x).logits)
    full = [hf_greedy(plain, p, 6) for p in prompts]
    assert [hf_greedy(stray, p, 6) for p in prompts] != full  # generate() decodes windowed
    with _no_compile_work(), pytest.raises(ConfigError, match=r"its attention ignores but transformers' generate\(\) "
                                                              r"does not.*max_seq_len <= 8 .*sliding_window = None"):
        LlamaForCausalLM.from_hf(stray, max_seq_len=32)
    short = make_prompts(3, VOCAB, seed=8, min_len=2, max_len=3)  # at most 3 + 6 - 1 = 8 positions
    model = LlamaForCausalLM.from_hf(stray, max_num_seqs=2, max_seq_len=8)
    assert greedy_decode(model, short, 6, eos_token_ids=model.eos_token_ids).tokens == [hf_greedy(stray, p, 6)
                                                                                         for p in short]
    full_types = tiny_hf("llama-gqa", seed=1, sliding_window=8, layer_types=["full_attention"] * 2)
    assert [hf_greedy(full_types, p, 6) for p in prompts] == full
    model = LlamaForCausalLM.from_hf(full_types, max_num_seqs=2, max_seq_len=32)
    assert greedy_decode(model, prompts, 6, eos_token_ids=model.eos_token_ids).tokens == full
    stray.config.sliding_window = None  # the fix the message names
    model = LlamaForCausalLM.from_hf(stray, max_num_seqs=2, max_seq_len=32)
    assert [hf_greedy(stray, p, 6) for p in prompts] == full
    assert greedy_decode(model, prompts, 6, eos_token_ids=model.eos_token_ids).tokens == full
