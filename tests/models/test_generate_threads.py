"""Compiled generate() owns the module's ``forward`` for its call: generations on one module from
several threads (through one compiled model or several of it) run one after the other with the
eager tokens, a generation nested in another on the same thread runs inside it, and the module is
left exactly as it was, also when generate() raises."""

import contextlib
import sys
import threading

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.hf import attention as hf

from conftest import greedy_reference as _eager
from conftest import left_padded_prompts as _prompts

hf.register_hf_attention()


def _build(attn, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(50)
    return model


def _cfg(**kw):
    kw.setdefault("backend", "eager")
    kw.setdefault("max_model_len", 128)
    return CompilationConfig(max_num_tokens=256, **kw)


@contextlib.contextmanager
def _fast_thread_switches():
    """Switch threads every 10 us, so a race on the module shows within a few rounds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _in_threads(jobs, rounds):
    """Run each ``(name, fn)`` of `jobs` `rounds` times, all jobs at once in threads of their own;
    returns the outputs by name and every exception raised."""
    outs, errors = {name: [] for name, _ in jobs}, []

    def run(name, fn):
        try:
            for _ in range(rounds):
                outs[name].append(fn())
        except BaseException as e:  # judged by the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a generation hung"
    return outs, errors


@pytest.mark.parametrize("mode", ["default", "none"])
def test_two_compiled_models_of_one_module_generate_from_two_threads_with_the_eager_tokens(mode):
    """Each compiled generate() set ``module.forward`` to itself and put it back: two of them on one
    module from two threads deleted each other's assignment (untyped AttributeError 'no attribute
    forward'), ran steps of the other one's route (InputErrors naming a wrong cause) and left
    ``forward`` assigned on the module."""
    eager = _build("sdpa")
    model = _build("piecewise" if mode == "default" else "sdpa")
    extra = {} if mode == "default" else {"mode": "none"}
    first = pw.compile(model, _cfg(tag="a", max_model_len=64, **extra))
    second = pw.compile(model, _cfg(tag="b", **extra))
    ids, mask = _prompts([5, 9, 3])
    ids2, mask2 = _prompts([7, 2], seed=7)
    want, want2 = _eager(eager, ids, mask, max_new_tokens=8), _eager(eager, ids2, mask2, max_new_tokens=10)
    assert torch.equal(first.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8), want)
    with _fast_thread_switches():
        for _ in range(4):
            outs, errors = _in_threads([
                ("a", lambda: first.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)),
                ("b", lambda: second.generate(ids2, attention_mask=mask2, do_sample=False, max_new_tokens=10)),
            ], rounds=2)
            assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
            assert len(outs["a"]) == len(outs["b"]) == 2
            assert all(torch.equal(o, want) for o in outs["a"]) and all(torch.equal(o, want2) for o in outs["b"])
            assert "forward" not in model.__dict__
    if mode == "default":
        assert counters.by_tag[f"{first.tag}_generate"].dynamo_traces == 1
        assert counters.by_tag[f"{second.tag}_generate"].dynamo_traces == 1 and counters.recompiles == 0


def test_one_compiled_model_generating_from_two_threads_serves_both_one_after_the_other():
    """Its KV cache holds one generation: the second thread waits for the first one's generate()
    (the first is held inside its streamer until the second has had ample time to start) instead
    of being refused or overwriting the first one's cache rows."""
    from transformers.generation.streamers import BaseStreamer

    eager, model = _build("sdpa"), _build("piecewise")
    compiled = pw.compile(model, _cfg())
    ids, mask = _prompts([5, 9, 3])
    ids2, mask2 = _prompts([7, 2], seed=7)
    want, want2 = _eager(eager, ids, mask, max_new_tokens=6), _eager(eager, ids2, mask2, max_new_tokens=6)
    compiled.generate(ids2, attention_mask=mask2, do_sample=False, max_new_tokens=2)  # traced before the threads
    inside, second_done = threading.Event(), threading.Event()
    overlapped = []

    class Hold(BaseStreamer):
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:  # between two decode steps of the first generation
                inside.set()
                overlapped.append(second_done.wait(1.5))  # the second generation must not finish meanwhile

        def end(self):
            pass

    def second():
        inside.wait(60)
        try:
            return compiled.generate(ids2, attention_mask=mask2, do_sample=False, max_new_tokens=6)
        finally:
            second_done.set()

    outs, errors = _in_threads([
        ("first", lambda: compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, streamer=Hold())),
        ("second", second),
    ], rounds=1)
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert overlapped == [False], "the second generate() waited for the first"
    assert torch.equal(outs["first"][0], want) and torch.equal(outs["second"][0], want2)
    assert "forward" not in model.__dict__


def test_the_module_used_eagerly_on_another_thread_during_a_compiled_generate_runs_its_own_forward():
    """What a compiled generate() sets as ``module.forward`` ran the compiled model on every thread:
    an eager ``model.generate()`` elsewhere meanwhile ran its prompt through the compiled route
    (waiting for it) and its next steps eagerly on a cache the route had never filled."""
    from transformers.generation.streamers import BaseStreamer

    eager, model = _build("sdpa"), _build("piecewise")
    compiled = pw.compile(model, _cfg())
    ids, mask = _prompts([5, 9, 3])
    ids2, mask2 = _prompts([7, 2], seed=7)
    want, want2 = _eager(eager, ids, mask, max_new_tokens=6), _eager(eager, ids2, mask2, max_new_tokens=5)
    with torch.no_grad():
        logits2 = eager(ids2, attention_mask=mask2).logits
    compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)  # traced before the threads
    inside, other_done = threading.Event(), threading.Event()
    overlapped = []

    class Hold(BaseStreamer):
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                inside.set()
                overlapped.append(other_done.wait(60))  # the eager work runs meanwhile, not after

        def end(self):
            pass

    def eager_use():
        inside.wait(60)
        try:
            with torch.no_grad():
                return model.generate(ids2, attention_mask=mask2, do_sample=False, max_new_tokens=5), \
                    model(ids2, attention_mask=mask2).logits
        finally:
            other_done.set()

    outs, errors = _in_threads([
        ("compiled", lambda: compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                                               streamer=Hold())),
        ("eager", eager_use),
    ], rounds=1)
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    assert overlapped == [True], "the eager calls ran while the compiled generate() was held"
    assert torch.equal(outs["compiled"][0], want)
    tokens, logits = outs["eager"][0]
    assert torch.equal(tokens, want2)
    torch.testing.assert_close(logits, logits2, rtol=1e-4, atol=1e-4)
    assert "forward" not in model.__dict__


def test_a_generation_nested_through_another_compiled_model_of_the_module_runs_inside_it():
    """A streamer of one compiled model's generate() that generates with another compiled model of
    the same module (its own KV cache) on the same thread: both get the eager tokens, and the
    outer one's forward is back in place for its remaining steps."""
    from transformers.generation.streamers import BaseStreamer

    eager, model = _build("sdpa"), _build("piecewise")
    outer, inner = pw.compile(model, _cfg(tag="outer")), pw.compile(model, _cfg(tag="inner"))
    ids, mask = _prompts([5, 9, 3])
    ids2, mask2 = _prompts([4, 6], seed=3)
    want, want2 = _eager(eager, ids, mask, max_new_tokens=6), _eager(eager, ids2, mask2, max_new_tokens=5)
    nested = []

    class Nest(BaseStreamer):
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts in (3, 5):
                nested.append(inner.generate(ids2, attention_mask=mask2, do_sample=False, max_new_tokens=5))

        def end(self):
            pass

    got = outer.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, streamer=Nest())
    assert torch.equal(got, want) and len(nested) == 2 and all(torch.equal(n, want2) for n in nested)
    assert "forward" not in model.__dict__


def test_generate_leaves_the_module_as_it_was_when_it_returns_or_raises():
    """A forward the user set on the instance before generate() is set again after it, and none is
    left when there was none, whether generate() returns or raises (an InputError of the step, or
    the user's own exception from a stopping criterion mid-generation)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    eager, model = _build("sdpa"), _build("piecewise")
    compiled = pw.compile(model, _cfg())
    ids, mask = _prompts([5, 3])
    want = _eager(eager, ids, mask, max_new_tokens=4)

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > ids.shape[1] + 1:
                raise KeyError("the user's own error")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    bad = ids.clone()
    bad[0, -1] = 512
    for own in (None, compiled, lambda *a, **k: "the user's"):
        if own is not None:
            model.forward = own
        try:
            got = compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
            assert torch.equal(got, want)
            assert model.__dict__.get("forward", None) is own
            with pytest.raises(pw.InputError, match=r"token id 512, outside the vocabulary"):
                compiled.generate(bad, attention_mask=mask, do_sample=False, max_new_tokens=4)
            assert model.__dict__.get("forward", None) is own
            with pytest.raises(KeyError, match="the user's own error"):
                compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                                  stopping_criteria=StoppingCriteriaList([Boom()]))
            assert model.__dict__.get("forward", None) is own
            # the interrupted generation left the route free and right
            assert torch.equal(compiled.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4), want)
        finally:
            model.__dict__.pop("forward", None)
    assert "forward" not in model.__dict__


def test_the_generation_lock_is_one_reentrant_lock_per_module():
    model, other = _build("piecewise"), _build("piecewise", seed=1)
    lock = pw.CompiledModel.generation_lock(model)
    assert pw.CompiledModel.generation_lock(model) is lock
    assert pw.CompiledModel.generation_lock(other) is not lock
    with lock:
        with pw.CompiledModel.generation_lock(model):  # re-entrant on one thread
            taken = []
            t = threading.Thread(target=lambda: taken.append(lock.acquire(timeout=0.05)))
            t.start()
            t.join()
            assert taken == [False], "another thread waits while this one holds it"
