import io
import subprocess
import sys

import pytest

from piecewise.cli import build_parser
from piecewise.demo import run_demo


def test_demo_runs_and_reports_equality(tmp_path):
    buf = io.StringIO()
    code = run_demo(buf, layers=1, modes=[("piecewise", "eager")], minilm=False, chat=False, cache_root=str(tmp_path))
    text = buf.getvalue()
    assert code == 0, text
    assert "| piecewise/eager |" in text and "every output equals eager" in text
    assert "| NO |" not in text


def test_parser_knows_demo():
    args = build_parser().parse_args(["demo", "--layers", "3", "--no-minilm"])
    assert args.layers == 3 and args.no_minilm


CACHE_COMMANDS = [["ls"], ["show", "abc"], ["verify"], ["explain", "a", "b"], ["clear"], ["clear", "--key", "k"],
                  ["export", "out.tgz"], ["import", "in.tgz"]]


def test_every_cache_subcommand_takes_root_before_or_after_its_name():
    parser = build_parser()
    for cmd in CACHE_COMMANDS:
        before = parser.parse_args(["cache", "--root", "/r1", *cmd])
        after = parser.parse_args(["cache", *cmd, "--root", "/r2"])
        neither = parser.parse_args(["cache", *cmd])
        assert (before.root, after.root, neither.root) == ("/r1", "/r2", None), cmd
        assert before.cache_command == after.cache_command == cmd[0]
    # both given: the one nearer the command wins, as with any repeated option
    assert parser.parse_args(["cache", "--root", "/r1", "ls", "--root", "/r2"]).root == "/r2"
    args = parser.parse_args(["cache", "clear", "--root", "/r", "--key", "ab"])
    assert (args.root, args.key) == ("/r", "ab")


def test_root_after_the_subcommand_reaches_the_command(tmp_path, capsys):
    from piecewise.cli import main

    root = str(tmp_path / "empty")
    assert main(["cache", "verify", "--root", root]) == 0
    assert root in capsys.readouterr().out
    assert main(["cache", "ls", "--root", root]) == 0
    assert f"{root}: 0 entries" in capsys.readouterr().out


def _exe():
    import os
    import sys

    return os.path.join(os.path.dirname(sys.executable), "piecewise")


def test_help_does_not_import_torch():
    import subprocess
    import sys

    probe = ("import sys, contextlib, io\nfrom piecewise.cli import main\n"
             "for argv in (['--help'], ['cache', '--help'], ['cache', 'ls', '--help']):\n"
             "    with contextlib.redirect_stdout(io.StringIO()):\n"
             "        try:\n            main(argv)\n        except SystemExit as e:\n            assert e.code == 0, (argv, e.code)\n"
             "print(sorted(m for m in ('torch', 'piecewise.compilers', 'piecewise.api', 'piecewise.backend') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
    # the installed console script too (its wall time is what a user feels)
    p = subprocess.run([_exe(), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "cache" in p.stdout


def test_cli_usage_error_exits_2():
    import subprocess

    p = subprocess.run([_exe(), "cache", "nosuch"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice" in p.stderr


# -- every failure is one line on stderr and exit status 2 ----------------------------------------

def _run_main(argv, capsys):
    """main(argv) as the console script runs it: (exit status, stdout, stderr); argparse's
    refusals exit through SystemExit."""
    from piecewise.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_refusal(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def no_weights(monkeypatch):
    """Loading SmolLM2 fails the test: whatever is refused must be refused before it."""
    from piecewise.hf import gguf as weights

    def load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(weights, "load_smollm2", load)


@pytest.mark.parametrize("flags, words", [
    (["--max-new-tokens", "0"], ["--max-new-tokens", "0 must be at least 1"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens", "-3 must be at least 1"]),
    (["--max-new-tokens", "many"], ["--max-new-tokens", "'many' is not a whole number"]),
    (["--max-model-len", "0"], ["--max-model-len", "at least 1"]),
    (["--max-model-len", "9000"], ["max_model_len=9000", "1..8192"]),
    (["--engine", "vllm"], ["invalid choice: 'vllm'"]),
    (["--backend", "tvm"], ["invalid choice: 'tvm'"]),
])
def test_generate_refuses_a_bad_flag_in_one_line_before_loading_anything(flags, words, no_weights, capsys):
    code, out, err = _run_main(["generate", *flags, "hello"], capsys)
    _one_line_refusal(code, err, *words)


def test_a_refused_generate_flag_imports_neither_torch_nor_transformers():
    """The refusal comes before the seconds of imports and weight loading, not after them."""
    probe = ("import sys\nfrom piecewise.cli import main\n"
             "try:\n    main(['generate', '--max-new-tokens', '0', 'hi'])\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "2 []", p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "--max-new-tokens" in p.stderr


class _Tokenizer:
    """A stand-in for SmolLM2's tokenizer: a chat turn of `n` token ids."""

    def __init__(self, n):
        self.n = n

    def apply_chat_template(self, messages, **kw):
        assert isinstance(messages[0]["content"], str)
        return {"input_ids": list(range(1, self.n + 1))}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_a_prompt_longer_than_the_cache_names_the_command_line_flags(monkeypatch, capsys):
    from piecewise.hf import chat, gguf as weights

    monkeypatch.setattr(weights, "load_smollm2", lambda *a, **k: (object(), _Tokenizer(600)))
    served = []
    monkeypatch.setattr(chat, "_hf", lambda model, tok, ids, new, backend, compiled, stream, max_model_len:
                        served.append((len(ids), new, max_model_len)) or ([7, 8], 0.1, 0.2))
    code, out, err = _run_main(["generate", "--max-new-tokens", "8", "a long question"], capsys)
    _one_line_refusal(code, err, "the prompt is 600 tokens", "--max-new-tokens 8", "607 positions",
                      "--max-model-len 512", "raise --max-model-len to 607")
    assert "CompilationConfig" not in err and served == []
    # the flag it names serves the prompt
    code, out, err = _run_main(["generate", "--max-new-tokens", "8", "--max-model-len", "607", "a long question"], capsys)
    assert code == 0 and served == [(600, 8, 607)], err
    # a prompt that fits leaves room for fewer tokens: the message says how many
    monkeypatch.setattr(weights, "load_smollm2", lambda *a, **k: (object(), _Tokenizer(500)))
    code, out, err = _run_main(["generate", "--max-new-tokens", "64", "q"], capsys)
    _one_line_refusal(code, err, "room for at most 13 new tokens", "lower --max-new-tokens")


def test_the_library_answer_refuses_bad_arguments_before_loading(no_weights):
    from piecewise.errors import ConfigError, InputError
    from piecewise.hf import chat

    for kw, match in [({"max_new_tokens": 0}, "max_new_tokens=0"), ({"max_new_tokens": True}, "max_new_tokens=True"),
                      ({"max_model_len": 10_000}, "max_model_len=10000"), ({"engine": "x"}, "engine='x'"),
                      ({"backend": "x"}, "backend='x'")]:
        with pytest.raises(ConfigError, match=match):
            chat.answer("hi", **kw)
    with pytest.raises(InputError, match="not valid UTF-8"):
        chat.answer("caf\udce9")
    with pytest.raises(InputError, match="must be text"):
        chat.answer(b"hi")
    # the limit in the library's own words
    err = chat.PromptTooLongError(600, 8, 512)
    assert "max_model_len 512" in str(err) and "max_new_tokens 8" in str(err) and err.needed == 607


def test_a_prompt_that_is_not_utf8_is_decoded_with_replacement(monkeypatch, capsys):
    from piecewise.hf import chat

    seen = []
    monkeypatch.setattr(chat, "answer", lambda prompt, **kw: seen.append(prompt) or chat.ChatResult("hf", "ok", [1], 0, 0, 0))
    # what Python makes of the argv bytes b"caf\xe9 \xff?" (surrogateescape)
    arg = b"caf\xe9 \xff?".decode("utf-8", "surrogateescape")
    code, out, err = _run_main(["generate", "--backend", "eager", arg], capsys)
    assert code == 0 and seen == ["caf\ufffd \ufffd?"], err
    assert "not valid UTF-8" in err and "Traceback" not in err
    seen[0].encode("utf-8")  # text a tokenizer takes


def test_without_transformers_the_cli_names_the_extra_to_install():
    """`transformers` made unimportable in a fresh interpreter (None in sys.modules is how Python
    spells an absent module): generate and demo refuse in one line, exit status 2."""
    probe = ("import sys\nsys.modules['transformers'] = None\nfrom piecewise.cli import main\n"
             "codes = [main(['generate', '--backend', 'eager', 'hi']), main(['demo', '--no-chat', '--no-minilm'])]\n"
             "print(codes)\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "[2, 2]", p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in p.stderr, p.stderr
    assert all("'transformers'" in ln and "pip install 'piecewise[hf]'" in ln for ln in lines), lines


def test_cache_commands_refuse_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PIECEWISE_DISABLE_CACHE", "1")
    code, out, err = _run_main(["cache", "ls"], capsys)
    _one_line_refusal(code, err, "PIECEWISE_DISABLE_CACHE", "--root")
    monkeypatch.delenv("PIECEWISE_DISABLE_CACHE")
    monkeypatch.delenv("PIECEWISE_REMOTE_CACHE", raising=False)
    code, out, err = _run_main(["cache", "push", "--root", str(tmp_path)], capsys)
    _one_line_refusal(code, err, "--remote redis://")
    code, out, err = _run_main(["cache", "show", "nosuchentry", "--root", str(tmp_path)], capsys)
    _one_line_refusal(code, err, "'nosuchentry' matches 0 entries")
    code, out, err = _run_main(["cache", "nosuch"], capsys)
    _one_line_refusal(code, err, "invalid choice", "--help")


def test_an_unexpected_exception_is_not_swallowed(monkeypatch):
    """The one-line handler is for the user's input; a bug still shows its traceback."""
    from piecewise import cli

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "_cache", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["cache", "ls"])
