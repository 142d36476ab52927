import io

from piecewise.cli import build_parser
from piecewise.demo import run_demo


def test_demo_runs_and_reports_equality(tmp_path):
    buf = io.StringIO()
    code = run_demo(buf, layers=1, modes=[("piecewise", "eager")], minilm=False, cache_root=str(tmp_path))
    text = buf.getvalue()
    assert code == 0, text
    assert "| piecewise/eager |" in text and "every output equals eager" in text
    assert "| NO |" not in text


def test_parser_knows_demo():
    args = build_parser().parse_args(["demo", "--layers", "3", "--no-minilm"])
    assert args.layers == 3 and args.no_minilm
