"""The ``piecewise`` command line: ``piecewise demo``."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(layers=args.layers, minilm=not args.no_minilm)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="piecewise", description="piecewise compilation tools")
    p.add_argument("-v", "--verbose", action="store_true", help="log compile phases (logger 'piecewise')")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compile reference and transformers models on the CPU and compare with eager")
    d.add_argument("--layers", type=int, default=2, help="decoder layers of the demo models (default 2)")
    d.add_argument("--no-minilm", action="store_true", help="skip the pretrained MiniLM sentence-embedding part")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
