"""The ``piecewise`` command line: ``demo``, ``generate "prompt"``, ``bench`` and ``cache ls | show | verify | explain | clear | push | pull |
export | import``. Exit status 0 on success, 1 when ``verify`` finds a problem, ``push`` / ``pull``
do not move every entry (or the remote does not answer) or the demo's outputs differ from eager, 2
on usage errors and on input the command refuses (one line on stderr, no traceback)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

from .errors import PiecewiseError
from .threads import apply_serving_threads

__all__ = ["main"]

#: optional dependencies by top-level module, and the extra that installs each
_EXTRAS = {"transformers": "hf", "gguf": "hf", "accelerate": "hf", "tokenizers": "hf", "safetensors": "hf",
           "redis": "redis"}


class UsageError(Exception):
    """A command line the command cannot run (one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``piecewise generate: error: ... (piecewise generate --help)``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``2,8,32``)."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated whole numbers, e.g. 2,8,32")
    return tuple(_positive_int(p) for p in parts)


def _text_arg(text: str) -> str:
    """A command-line argument as valid text: bytes that were not UTF-8 (kept by Python as lone
    surrogates, ``surrogateescape``) become U+FFFD, with a note on stderr."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        fixed = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        print(f"piecewise: note: the prompt is not valid UTF-8; its undecodable bytes read as U+FFFD: {fixed!r}",
              file=sys.stderr)
        return fixed


def _require(module: str) -> None:
    """Import optional dependency `module` now (before any slow work), or refuse in one line."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise _missing(e, module) from None


def _missing(e: ImportError, module: str | None = None) -> UsageError:
    top = module or (e.name or "").split(".")[0]
    extra = _EXTRAS.get(top, "hf")
    return UsageError(f"this command needs {top!r}, which cannot be imported ({type(e).__name__}: {e}); "
                      f"install it with: pip install 'piecewise[{extra}]'")


def _demo(args: argparse.Namespace) -> int:
    _require("transformers")  # the demo's transformers models; before minutes of other work
    from .demo import run_demo

    return run_demo(layers=args.layers, minilm=not args.no_minilm, chat=not args.no_chat)


def _generate(args: argparse.Namespace) -> int:
    from .hf.chat import PromptTooLongError, answer, check_arguments, print_stream

    prompt = _text_arg(args.prompt)
    kw = dict(engine=args.engine, max_new_tokens=args.max_new_tokens, backend=args.backend, max_model_len=args.max_model_len)
    check_arguments(prompt, **kw)  # everything the flags say, before the weights load (seconds)
    _require("transformers")
    apply_serving_threads()  # an inference process: piecewise's CPU thread policy (piecewise.threads)
    try:
        result = answer(prompt, compiled=not args.no_compile, stream=print_stream, **kw)
    except PromptTooLongError as e:
        raise UsageError(e.describe("--max-new-tokens", "--max-model-len")) from None
    print()
    print(result.summary(), file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, run_bench
    from .bench.suite import to_markdown

    cfg = BenchConfig(layers=args.layers, steady_layers=args.steady_layers, batches=args.batches,
                      steps=args.steps, sizes=args.sizes, out_dir=args.out)
    print(to_markdown(run_bench(cfg)))
    return 0


def _root(args: argparse.Namespace) -> str:
    from .cache.store import resolve_root

    root = args.root or resolve_root(None)
    if root is None:
        raise UsageError("the compile cache is disabled (PIECEWISE_DISABLE_CACHE); pass --root DIR")
    return root


def _cache(args: argparse.Namespace) -> int:
    import datetime
    import json

    from .cache import tools

    cmd = args.cache_command
    if cmd in ("push", "pull") or (cmd == "ls" and getattr(args, "remote", None)):
        return _remote(args, cmd)
    root = _root(args)
    if cmd == "ls":
        entries = tools.list_entries(root)
        print(f"{root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
        for e in entries:
            when = datetime.datetime.fromtimestamp(e.created).isoformat(timespec="seconds") if e.created else "-"
            state = "ok" if e.valid else e.problem
            kind = "  warm-start bundle" if e.kind == "bundle" else ""
            print(f"  {e.rel}  {e.artifacts} artifacts  {e.bytes / 1e6:.2f} MB  {when}  {state}{kind}")
        return 0
    if cmd == "show":
        e = tools.find_entry(root, args.entry)
        print(f"entry {e.rel}\npath  {e.path}\nartifacts {e.artifacts} ({e.bytes} bytes), {'valid' if e.valid else e.problem}")
        for line in tools.artifact_lines(root, e):
            print(line)
        with open(f"{e.path}/cache_key_factors.json") as f:
            print("factors:", json.dumps(json.load(f), indent=1, sort_keys=True))
        return 0
    if cmd == "verify":
        problems, notes = tools.verify(root)
        for n in notes:
            print("note:", n)
        for p in problems:
            print("PROBLEM:", p)
        print(f"{root}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if cmd == "explain":
        a, b, diff = tools.explain(root, args.a, args.b)
        if not diff:
            print(f"{a} and {b} have the same key factors")
        else:
            print(f"{a} and {b} differ in:")
            for d in diff:
                print(f"  {d}")
        return 0
    if cmd == "clear":
        n = tools.clear(root, args.key)
        print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {root}")
        return 0
    if cmd == "export":
        n = tools.export_archive(root, args.archive, args.key)
        print(f"exported {n} entr{'y' if n == 1 else 'ies'} to {args.archive}")
        return 0
    if cmd == "import":
        n, warns = tools.import_archive(root, args.archive, compiler_hash=_compiler_hash)
        for w in warns:
            print("warning:", w)
        print(f"imported {n} entr{'y' if n == 1 else 'ies'} into {root}")
        return 0
    raise AssertionError(cmd)


def _remote(args: argparse.Namespace, cmd: str) -> int:
    """``cache push | pull | ls --remote URL``: copy every local entry to Redis (into this
    process's namespace), every Redis entry this process loads into the local root, or list every
    namespace's entries with their writers and what this process's key makes of each."""
    import datetime

    from .cache import remote as R
    from .cache import tools

    url = R.remote_url(args.remote)
    if not url:
        raise UsageError(f"cache {cmd} needs --remote redis://host:port/db (or PIECEWISE_REMOTE_CACHE)")
    _require("redis")
    tier = R.RemoteCache(url, connect_timeout_ms=1000, io_timeout_ms=10_000)  # ConfigError: an unusable key
    if not tier.available():
        print(f"piecewise: error: the remote cache {url} does not answer", file=sys.stderr)
        return 1
    if cmd == "ls":
        entries = tier.listing()
        spaces = sorted({e.namespace for e in entries})
        print(f"{url}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in {len(spaces)} writer namespace"
              f"{'' if len(spaces) == 1 else 's'}; this process writes {tier.namespace}"
              f"{'' if tier.key else ' (no PIECEWISE_CACHE_KEY)'}")
        for e in entries:
            when = datetime.datetime.fromtimestamp(e.time).isoformat(timespec="seconds") if e.time else "-"
            who = f"{e.host or '?'} pid {e.pid}" if e.pid is not None else (e.host or "writer not recorded")
            kind = "  warm-start bundle" if e.kind == "bundle" else ""
            print(f"  {e.namespace}  {e.rel}  {e.artifacts} artifacts  {e.bytes / 1e6:.2f} MB  {when}  {who}  "
                  f"{e.state}{kind}")
        return 0
    root = _root(args)
    if cmd == "push":
        rels = [rel for rel, _ in tools.entry_dirs(root)]
        n = sum(tier.publish(root, rel) for rel in rels)
        print(f"pushed {n} of {len(rels)} entr{'y' if len(rels) == 1 else 'ies'} from {root} to {url} as {tier.namespace}"
              f"{'' if tier.key else ' (unsigned: no PIECEWISE_CACHE_KEY)'}")
        return 0 if n == len(rels) else 1
    rels = list(tier.entries())
    n = sum(tier.pull(root, rel) for rel in rels)
    print(f"pulled {n} of {len(rels)} entr{'y' if len(rels) == 1 else 'ies'} from {url} into {root}")
    return 0 if n == len(rels) else 1


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="piecewise", description="piecewise compilation tools")
    p.add_argument("-v", "--verbose", action="store_true", help="log compile phases (logger 'piecewise')")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compile reference and transformers models on the CPU and compare with eager")
    d.add_argument("--layers", type=_positive_int, default=2, help="decoder layers of the demo models (default 2)")
    d.add_argument("--no-minilm", action="store_true", help="skip the pretrained MiniLM sentence-embedding part")
    d.add_argument("--no-chat", action="store_true", help="skip the SmolLM2 chat part (real weights, the longest part)")
    d.set_defaults(func=_demo)

    g = sub.add_parser("generate", help="answer a chat prompt with SmolLM2-135M-Instruct, compiled, streaming tokens")
    g.add_argument("prompt", help="the user's message (the model's chat template is applied)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="at most this many tokens (default 64)")
    g.add_argument("--max-model-len", type=_positive_int, default=512,
                   help="positions of the KV cache: prompt plus answer (default 512, at most 8192)")
    g.add_argument("--engine", choices=("hf", "decoder"), default="hf",
                   help="hf: transformers generate() compiled; decoder: the reference decoder's batching loop")
    g.add_argument("--backend", choices=("inductor", "eager"), default="inductor", help="compiler adaptor (default inductor)")
    g.add_argument("--no-compile", action="store_true", help="run eagerly, without piecewise (the reference)")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="benchmark eager, torch.compile and piecewise side by side (minutes)")
    b.add_argument("--layers", type=_positive_ints, default=(2, 8, 32), help="layer counts for cold/warm start (default 2,8,32)")
    b.add_argument("--steady-layers", type=_positive_int, default=8, help="layers for the steady-state runs")
    b.add_argument("--batches", type=_positive_ints, default=(1, 8, 64))
    b.add_argument("--steps", type=_positive_int, default=200)
    b.add_argument("--sizes", type=_positive_int, default=64, help="distinct sizes run to count recompiles")
    b.add_argument("--out", default=None, help="directory for JSON and Markdown results")
    b.set_defaults(func=_bench)

    root_help = "cache root (default: PIECEWISE_CACHE_DIR or the user cache dir)"
    c = sub.add_parser("cache", help="inspect and maintain the compile cache")
    c.add_argument("--root", help=root_help)
    # `--root` is accepted after the subcommand name too (`cache ls --root R`). SUPPRESS keeps a
    # subcommand that was not given --root from overwriting the value given before its name.
    root_after = _Parser(add_help=False)
    root_after.add_argument("--root", default=argparse.SUPPRESS, help=root_help)
    cs = c.add_subparsers(dest="cache_command", required=True)

    def cache_cmd(name: str, help: str) -> argparse.ArgumentParser:
        return cs.add_parser(name, help=help, parents=[root_after])

    remote_help = "Redis URL of the remote tier (default: PIECEWISE_REMOTE_CACHE)"
    ls = cache_cmd("ls", "list entries (with --remote: every writer's entries in Redis: namespace, host, pid, time, size)")
    ls.add_argument("--remote", help=remote_help)
    cache_cmd("push", "publish every local entry to the remote tier").add_argument("--remote", help=remote_help)
    cache_cmd("pull", "copy every remote entry this process trusts into the local root").add_argument(
        "--remote", help=remote_help)
    sh = cache_cmd("show", "one entry's artifacts and key factors")
    sh.add_argument("entry", help="key, key prefix, key/tag, key/rank_r_d/tag or a path")
    cache_cmd("verify", "check every index and artifact checksum; exit 1 on a problem")
    ex = cache_cmd("explain", "which key factor differs between two entries (or cache_key_factors.json files)")
    ex.add_argument("a")
    ex.add_argument("b")
    cl = cache_cmd("clear", "remove entries (safe while another process compiles)")
    cl.add_argument("--key", help="only entries whose key starts with this")
    xp = cache_cmd("export", "write entries to one .tar.gz with a manifest of their factors")
    xp.add_argument("archive")
    xp.add_argument("--key", help="only entries whose key starts with this")
    im = cache_cmd("import", "unpack an exported archive; warns about factors that differ here")
    im.add_argument("archive")
    c.set_defaults(func=_cache)
    return p


def _compiler_hash(name: str) -> str:
    """The hash compiler adaptor `name` has in this process (what an imported entry is compared with)."""
    from .compilers import get_adaptor
    from .config import CompilationConfig
    from .errors import PiecewiseError

    try:
        return get_adaptor(name, CompilationConfig(backend=name)).compute_hash()
    except PiecewiseError:
        return f"<adaptor {name!r} not registered in this process>"


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Warnings as ``piecewise: warning: <message>`` (one line, no source line) while a command runs."""
    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *a, **k: f"piecewise: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = previous


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default ``sys.argv[1:]``); returns the exit status.

    Errors of the user's input (a refused argument, file, archive, key or configuration, a missing
    optional dependency) print one line on stderr and return 2; an unexpected exception still
    shows its traceback (a bug to report).
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    try:
        with _one_line_warnings():
            return args.func(args)
    except ImportError as e:
        top = (e.name or "").split(".")[0]
        if top not in _EXTRAS:
            raise
        return _fail(_missing(e))
    except (UsageError, PiecewiseError, ValueError, OSError) as e:
        return _fail(e)
    except KeyboardInterrupt:
        print("piecewise: interrupted", file=sys.stderr)
        return 130


def _fail(e: BaseException) -> int:
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"piecewise: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
