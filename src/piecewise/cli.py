"""The ``piecewise`` command line: ``demo``, ``generate "prompt"``, ``bench`` and ``cache ls | show | verify | explain | clear | push | pull |
export | import``. Exit status 0 on success, 1 when ``verify`` finds a problem, ``push`` / ``pull``
do not move every entry (or the remote does not answer) or the demo's outputs differ from eager, 2
on usage errors."""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import CacheError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(layers=args.layers, minilm=not args.no_minilm, chat=not args.no_chat)


def _generate(args: argparse.Namespace) -> int:
    from .models.chat import answer, print_stream

    result = answer(args.prompt, engine=args.engine, max_new_tokens=args.max_new_tokens, backend=args.backend,
                    compiled=not args.no_compile, stream=print_stream)
    print()
    print(result.summary(), file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, run_bench
    from .bench.suite import to_markdown

    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    cfg = BenchConfig(layers=ints(args.layers), steady_layers=args.steady_layers, batches=ints(args.batches),
                      steps=args.steps, sizes=args.sizes, out_dir=args.out)
    print(to_markdown(run_bench(cfg)))
    return 0


def _root(args: argparse.Namespace) -> str:
    from .cache.store import resolve_root

    root = args.root or resolve_root(None)
    if root is None:
        raise SystemExit("the compile cache is disabled (PIECEWISE_DISABLE_CACHE); pass --root DIR")
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
    """``cache push | pull | ls --remote URL``: copy every local entry to Redis, every Redis entry
    into the local root, or list Redis's entries with what this process's key makes of each."""
    from .cache import remote as R
    from .cache import tools

    url = R.remote_url(args.remote)
    if not url:
        raise SystemExit(f"cache {cmd} needs --remote redis://host:port/db (or PIECEWISE_REMOTE_CACHE)")
    tier = R.RemoteCache(url, connect_timeout_ms=1000, io_timeout_ms=10_000)
    if not tier.available():
        print(f"error: the remote cache {url} does not answer")
        return 1
    if cmd == "ls":
        rels = list(tier.entries())
        print(f"{url}: {len(rels)} entr{'y' if len(rels) == 1 else 'ies'}")
        for rel in rels:
            print(f"  {rel}  {tier.status(rel)}")
        return 0
    root = _root(args)
    if cmd == "push":
        rels = [rel for rel, _ in tools.entry_dirs(root)]
        n = sum(tier.publish(root, rel) for rel in rels)
        print(f"pushed {n} of {len(rels)} entr{'y' if len(rels) == 1 else 'ies'} from {root} to {url}"
              f"{'' if R.load_key() else ' unsigned (no PIECEWISE_CACHE_KEY)'}")
        return 0 if n == len(rels) else 1
    rels = list(tier.entries())
    n = sum(tier.pull(root, rel) for rel in rels)
    print(f"pulled {n} of {len(rels)} entr{'y' if len(rels) == 1 else 'ies'} from {url} into {root}")
    return 0 if n == len(rels) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="piecewise", description="piecewise compilation tools")
    p.add_argument("-v", "--verbose", action="store_true", help="log compile phases (logger 'piecewise')")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compile reference and transformers models on the CPU and compare with eager")
    d.add_argument("--layers", type=int, default=2, help="decoder layers of the demo models (default 2)")
    d.add_argument("--no-minilm", action="store_true", help="skip the pretrained MiniLM sentence-embedding part")
    d.add_argument("--no-chat", action="store_true", help="skip the SmolLM2 chat part (real weights, the longest part)")
    d.set_defaults(func=_demo)

    g = sub.add_parser("generate", help="answer a chat prompt with SmolLM2-135M-Instruct, compiled, streaming tokens")
    g.add_argument("prompt", help="the user's message (the model's chat template is applied)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens (default 64)")
    g.add_argument("--engine", choices=("hf", "decoder"), default="hf",
                   help="hf: transformers generate() compiled; decoder: the reference decoder's batching loop")
    g.add_argument("--backend", choices=("inductor", "eager"), default="inductor", help="compiler adaptor (default inductor)")
    g.add_argument("--no-compile", action="store_true", help="run eagerly, without piecewise (the reference)")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="benchmark eager, torch.compile and piecewise side by side (minutes)")
    b.add_argument("--layers", default="2,8,32", help="layer counts for cold/warm start (default 2,8,32)")
    b.add_argument("--steady-layers", type=int, default=8, help="layers for the steady-state runs")
    b.add_argument("--batches", default="1,8,64")
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--sizes", type=int, default=64, help="distinct sizes run to count recompiles")
    b.add_argument("--out", default=None, help="directory for JSON and Markdown results")
    b.set_defaults(func=_bench)

    root_help = "cache root (default: PIECEWISE_CACHE_DIR or the user cache dir)"
    c = sub.add_parser("cache", help="inspect and maintain the compile cache")
    c.add_argument("--root", help=root_help)
    # `--root` is accepted after the subcommand name too (`cache ls --root R`). SUPPRESS keeps a
    # subcommand that was not given --root from overwriting the value given before its name.
    root_after = argparse.ArgumentParser(add_help=False)
    root_after.add_argument("--root", default=argparse.SUPPRESS, help=root_help)
    cs = c.add_subparsers(dest="cache_command", required=True)

    def cache_cmd(name: str, help: str) -> argparse.ArgumentParser:
        return cs.add_parser(name, help=help, parents=[root_after])

    remote_help = "Redis URL of the remote tier (default: PIECEWISE_REMOTE_CACHE)"
    ls = cache_cmd("ls", "list entries (of the remote tier with --remote)")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (CacheError, ValueError, OSError) as e:
        print(f"piecewise: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
