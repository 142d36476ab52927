import io

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
