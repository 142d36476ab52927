"""The documentation: the site builds with ``mkdocs build --strict`` (no broken link, every config
field, environment variable, counter, error and public name documented: scripts/mkdocs_hooks.py),
every fenced ``python`` example in README.md and docs/ runs, and the README stays short and current.

Examples run in a subprocess per page, blocks in page order in one namespace (a guide's later block
may use what an earlier one defined), in a temp directory with a temp ``PIECEWISE_CACHE_DIR``. A
block preceded by the line ``<!-- gpu -->`` needs CUDA: it runs only in the GPU tier (marker
``gpu``). Blocks that are not meant to run use another fence language (``bash``, ``text``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "scripts"))

import bench_tables  # noqa: E402

PAGES = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
GPU_MARK = "<!-- gpu -->"


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def python_blocks(page: pathlib.Path) -> list[tuple[int, str, bool]]:
    """``(line, code, needs_gpu)`` of every fenced ``python`` block of `page`, in order."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        out.append((text.count("\n", 0, m.start()) + 2, m.group(2), before == GPU_MARK))
    return out


def _pages_with(gpu: bool) -> list[str]:
    return [_rel(p) for p in PAGES if any(g == gpu for _, _, g in python_blocks(p))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_blocks(page: pathlib.Path, blocks: list[tuple[int, str]], tmp_path: pathlib.Path, timeout: int = 600) -> str:
    """Run `blocks` of `page` as a reader would: pasted one after another into one script, run by
    a fresh interpreter in an empty temp dir, with the compile cache in a temp dir. Returns stdout;
    fails the test with the output, naming the block, on an error."""
    work = tmp_path / "work"
    work.mkdir()
    script, starts = [], []  # starts: (first script line, page line) of each block
    for line, code in blocks:
        script.append(f"# --- {_rel(page)}:{line} ---")
        starts.append((len(script) + 1, line))
        script.extend(code.rstrip("\n").split("\n"))
    path = work / "example.py"
    path.write_text("\n".join(script) + "\n")
    env = dict(os.environ, PIECEWISE_CACHE_DIR=str(tmp_path / "cache"), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(path)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        failed = [int(n) for n in re.findall(r'File "[^"]*example\.py", line (\d+)', proc.stderr)]
        where = ""
        if failed:
            first, start = max((s, l) for s, l in starts if s <= failed[-1])
            where = f" (the block at {_rel(page)}:{start}, its line {failed[-1] - first + 1})"
        pytest.fail(f"{_rel(page)}: an example failed{where}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


@pytest.mark.parametrize("page", _pages_with(gpu=False))
def test_python_examples_of_page_run_on_the_cpu(page, tmp_path):
    path = ROOT / page
    blocks = [(line, code) for line, code, gpu in python_blocks(path) if not gpu]
    run_blocks(path, blocks, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("page", _pages_with(gpu=True))
def test_gpu_python_examples_of_page_run(page, tmp_path):
    path = ROOT / page
    run_blocks(path, [(line, code) for line, code, _ in python_blocks(path)], tmp_path)


#: runs the docstring examples (``>>>``) of every public name in a fresh process; prints the count
DOCTESTS = """
import doctest, sys
import piecewise, piecewise.graphs
objects = [getattr(piecewise, name) for name in piecewise.__all__] + [piecewise.graphs.batch_hint]
finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
seen, examples = set(), 0
for obj in objects:
    for test in finder.find(obj, getattr(obj, "__name__", repr(obj))):
        if test.examples and test.name not in seen:
            seen.add(test.name)
            examples += len(test.examples)
            runner.run(test)
print(examples, "examples")
sys.exit(1 if runner.failures else 0)
"""


def test_docstring_examples_of_public_names_run(tmp_path):
    env = dict(os.environ, PIECEWISE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", DOCTESTS], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert int(proc.stdout.split()[-2]) >= 10, proc.stdout


def test_site_builds_strict_with_every_generated_table(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "<!-- generated:" not in "".join(p.read_text() for p in site.rglob("*.html"))
    import dataclasses

    from piecewise import CompilationConfig, __all__ as public
    from piecewise.counters import FIELDS

    config_page = (site / "reference" / "config" / "index.html").read_text()
    for f in dataclasses.fields(CompilationConfig):
        assert f">{f.name}<" in config_page, f.name
    counters_page = (site / "reference" / "counters" / "index.html").read_text()
    for name in FIELDS:
        assert f">{name}<" in counters_page, name
    api_page = (site / "reference" / "api" / "index.html").read_text()
    for name in public:
        assert name in api_page, name
    bench_page = (site / "benchmarks" / "index.html").read_text()
    assert "No suite results" not in bench_page and "piecewise / full graph" in bench_page


def test_readme_starts_with_the_two_setup_commands_and_stays_short():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it at most 250 (move detail into docs/)"
    first = FENCE.search(text)
    assert first is not None and first.group(1) in ("bash", "sh")
    commands = [line.split("#")[0].strip() for line in first.group(2).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert text.index(first.group(0)) < text.index("\n## "), "the setup commands come before the first section"
    # the first Python example runs as written: the README's page test runs it first, in a fresh process
    blocks = python_blocks(README)
    assert blocks and not blocks[0][2], "the README's first Python example runs on the CPU"


def test_readme_headline_table_is_the_latest_benchmark_results():
    text = README.read_text()
    assert bench_tables.BEGIN in text and bench_tables.END in text
    assert bench_tables.readme_with_headline(text) == text, (
        "README.md's headline table differs from benchmarks/results: run python scripts/bench_tables.py --write-readme")


def test_docs_carry_no_dates_or_development_log():
    dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bthis round\b|\bat \d\d:\d\d\b|the issue's target", re.I)
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not dated.search(line), f"{_rel(page)}:{n}: {line.strip()}"


def test_design_sections_cited_in_code_exist():
    """Module docstrings and tests cite ``docs/design.md §N``: every cited section has a row in the
    section table of docs/design.md whose link resolves; a ``docs/design/<page>.md`` citation names
    an existing page."""
    table = (DOCS / "design.md").read_text()
    rows = dict(re.findall(r"^\| (\d+(?:\.\d+)?) \| [^|]+ \| \[[^\]]+\]\(([^)#]+)(?:#[^)]*)?\) \|$", table, re.M))
    cited: set[tuple[str, str]] = set()
    pages: set[tuple[str, str]] = set()
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        text = path.read_text()
        for m in re.finditer(r"docs/design\.md([^)\"\n]*)", text):
            cited |= {(s, str(path.relative_to(ROOT))) for s in re.findall(r"§(\d+(?:\.\d+)?)", m.group(1))}
        pages |= {(p, str(path.relative_to(ROOT))) for p in re.findall(r"docs/(design/[\w-]+\.md)", text)}
    assert cited
    for section, where in sorted(cited):
        assert section in rows, f"{where} cites docs/design.md §{section}, which docs/design.md does not list"
        assert (DOCS / rows[section]).is_file(), rows[section]
    for page, where in sorted(pages):
        assert (DOCS / page).is_file(), f"{where} cites docs/{page}, which does not exist"


def test_benchmark_tables_come_from_the_latest_results():
    latest = bench_tables._latest(bench_tables.SUITE)
    assert latest is not None
    dates = [json.loads(p.read_text())["machine"]["date"] for p in (ROOT / "benchmarks" / "results").glob("bench-*.json")]
    assert latest[1]["machine"]["date"] == max(dates)
    for name, table in bench_tables.TABLES.items():
        text = table()
        assert text.startswith("|") or "\n|" in text, name
        assert not text.startswith("No "), name
