"""mkdocs hooks (``hooks:`` in mkdocs.yml): pages that the code itself knows are generated here.

A page holds a marker line ``<!-- generated: NAME -->``; `on_page_markdown` replaces it with the
table `GENERATORS[NAME]` builds from the code as it is: every `CompilationConfig` field (type,
default, whether it enters the cache key, its guide), the environment variables piecewise reads,
the counters, the errors, the command line (from its argparse parser) and the benchmark tables
(``scripts/bench_tables.py``, from ``benchmarks/results/*.json``).

Drift is a build warning, so ``mkdocs build --strict`` (``make docs``, ``make test``) fails on it:
a config field, environment variable, counter or error class the docs do not describe, or a
public name (``piecewise.__all__``) missing from the API reference.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_tables  # noqa: E402

log = logging.getLogger("mkdocs.hooks.piecewise")

MARKER = re.compile(r"^<!-- generated: ([a-z0-9-]+) -->$", re.M)

#: CompilationConfig field -> the guide that explains it (page path under docs/, anchor optional)
FIELD_GUIDES = {
    "mode": "guides/compile-your-model.md#modes",
    "backend": "guides/compile-your-model.md#compiler-adaptors",
    "splitting_ops": "guides/compile-your-model.md#splitting-ops",
    "compile_sizes": "guides/compile-your-model.md#compile-sizes-and-ranges",
    "compile_ranges": "guides/compile-your-model.md#compile-sizes-and-ranges",
    "cudagraph_mode": "guides/cuda-graphs.md#modes",
    "cudagraph_capture_sizes": "guides/cuda-graphs.md#capture-sizes-and-padding",
    "cudagraph_num_warmups": "guides/cuda-graphs.md#capture-sizes-and-padding",
    "dynamic_shapes": "guides/compile-your-model.md#dynamic-shape-modes",
    "split_strategy": "guides/compile-your-model.md#split-strategies",
    "artifact_format": "guides/cache.md#readable-artifacts",
    "max_num_tokens": "guides/compile-your-model.md#dynamic-dims",
    "cache_dir": "guides/cache.md#where-it-lives",
    "tag": "guides/cache.md#where-it-lives",
    "inductor_options": "guides/compile-your-model.md#compiler-adaptors",
    "passes": "guides/passes.md",
    "noop_elimination": "guides/passes.md",
    "reinplace_custom_ops": "guides/passes.md",
    "cpu_packed_linear": "guides/cpu.md#packed-linears",
    "debug": "guides/troubleshooting.md#guardfailureerror",
    "max_size_classes": "guides/compile-your-model.md#code-that-branches-on-a-size",
    "max_num_seqs": "guides/generate.md#the-kv-cache",
    "max_model_len": "guides/generate.md#the-kv-cache",
    "remote_cache": "guides/fleet.md",
    "remote_connect_timeout_ms": "guides/fleet.md#faults",
    "remote_io_timeout_ms": "guides/fleet.md#faults",
}

#: environment variables piecewise reads (every ``PIECEWISE_*`` name in src/ must be here; one listed
#: here that src/ does not name is left out of the table)
ENVIRONMENT = {
    "PIECEWISE_CACHE_DIR": ("the compile cache root when `CompilationConfig.cache_dir` is not set "
                            "(default: the user cache dir, `~/.cache/piecewise` on Linux)", "guides/cache.md#where-it-lives"),
    "PIECEWISE_DISABLE_CACHE": ("`1`: read and write no compile cache, no warm-start bundles and no weights cache",
                                "guides/cache.md#where-it-lives"),
    "PIECEWISE_DISABLE_BUNDLE": ("`1`: no warm-start bundles (pieces still load from the cache; the model is traced)",
                                 "guides/cache.md#warm-start-without-tracing"),
    "PIECEWISE_BUNDLES_PER_TAG": ("how many warm-start bundles a tag keeps (default 8, at least 1)",
                                  "guides/cache.md#warm-start-without-tracing"),
    "PIECEWISE_KEY_SALT": ("any value enters the cache key: a change invalidates every entry", "guides/cache.md#the-key"),
    "PIECEWISE_CONFIG": ("a JSON object of `CompilationConfig` fields for `torch.compile(backend=\"piecewise\")` "
                         "(`CompilationConfig.from_env`)", "guides/torch-compile.md"),
    "PIECEWISE_MODE": ("`CompilationConfig.mode` under `torch.compile(backend=\"piecewise\")`", "guides/torch-compile.md"),
    "PIECEWISE_BACKEND": ("`CompilationConfig.backend` under `torch.compile(backend=\"piecewise\")`",
                          "guides/torch-compile.md"),
    "PIECEWISE_MAX_NUM_TOKENS": ("`CompilationConfig.max_num_tokens` under `torch.compile(backend=\"piecewise\")`",
                                 "guides/torch-compile.md"),
    "PIECEWISE_REMOTE_CACHE": ("Redis URL of the remote cache tier when `CompilationConfig.remote_cache` is not set",
                               "guides/fleet.md"),
    "PIECEWISE_CACHE_KEY": ("the key (at least 16 bytes) that signs and verifies remote entries (HMAC-SHA256)",
                            "guides/fleet.md#trust"),
    "PIECEWISE_CACHE_KEY_FILE": ("a file holding that key, owned by this user and readable by no one else",
                                 "guides/fleet.md#trust"),
    "PIECEWISE_REMOTE_ALLOW_UNSIGNED": ("`1`: load remote entries no key of this process signed", "guides/fleet.md#trust"),
    "PIECEWISE_REMOTE_WAIT_S": ("seconds a process waits for another's compile lease before compiling itself "
                                "(default 1800)", "guides/fleet.md#compile-once-per-fleet"),
    "PIECEWISE_RANK_SHARING": ("`0`: ranks of one job do not share compiled pieces through the local root",
                               "guides/tensor-parallel.md#the-compile-cache-across-ranks"),
    "PIECEWISE_NUM_THREADS": ("intra-op threads of a process that applies piecewise's thread policy (`piecewise "
                              "generate`, `piecewise.threads.apply_serving_threads()`): a whole number, or `auto` or "
                              "empty (default: one per usable core other processes leave free)",
                              "guides/cpu.md#threads"),
    "PIECEWISE_LLAMA_ATTENTION": ("the reference decoder's attention: `auto` (Triton on CUDA when installed, else "
                                  "SDPA), `sdpa` or `triton`", "guides/engine.md#attention-kernels"),
}

#: counters whose source line carries no comment to describe them
COUNTER_NOTES = {
    "splitting_pieces": "pieces that hold splitting ops (run eagerly, or inside graphs under full capture)",
    "cache_hits": "compile-cache entries found (local or pulled from the remote tier)",
    "cache_misses": "compile-cache lookups that found no entry (the pieces were compiled)",
    "artifacts_saved": "compiled pieces written to the compile cache",
    "bundles_saved": "warm-start bundles written after a cold trace",
    "capturable_pieces": "pieces planned for graph capture",
    "graphs_captured": "graphs captured (a piece or a full forward at one size)",
    "graph_replays": "graph replays",
}


def _link(page: str, target: str) -> str:
    """A relative link from `page` (a path under docs/) to `target` (ditto, anchor allowed)."""
    path, _, anchor = target.partition("#")
    rel = os.path.relpath(path, os.path.dirname(page) or ".")
    return rel + (f"#{anchor}" if anchor else "")


def _field_notes() -> dict[str, str]:
    """The first sentence of each field's entry under ``Fields:`` in `CompilationConfig`'s docstring."""
    from piecewise.config import CompilationConfig

    doc = CompilationConfig.__doc__ or ""
    body = doc.split("Fields:", 1)[1].split("Raises:", 1)[0]
    notes: dict[str, str] = {}
    entry = re.compile(r"^ {8}([a-z_]+(?: / [a-z_]+)*): (.*)$")
    current: list[str] = []
    text: list[str] = []
    for line in body.splitlines() + ["        end: "]:
        m = entry.match(line)
        if m:
            for name in current:
                notes[name] = " ".join(text)
            current, text = m.group(1).split(" / "), [m.group(2).strip()]
        elif current:
            text.append(line.strip())
    out = {}
    for name, t in notes.items():
        t = re.sub(r"\s+", " ", t)
        first = re.split(r"(?<=\.)\s", t, maxsplit=1)[0]
        out[name] = first.replace("|", "\\|")
    return out


def config_fields(page: str) -> str:
    from piecewise.config import CODE_FIELDS, PASS_FIELDS, CompilationConfig

    notes = _field_notes()
    rows = []
    for f in dataclasses.fields(CompilationConfig):
        if not f.init:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if f.name in PASS_FIELDS:
            key = "yes (through the compiler hash)"
        else:
            key = "yes" if f.name in CODE_FIELDS else "no"
        guide = FIELD_GUIDES.get(f.name)
        if guide is None:
            log.warning("CompilationConfig.%s has no guide: add it to FIELD_GUIDES in scripts/mkdocs_hooks.py", f.name)
            where = "-"
        else:
            title = guide.split("#")[0].rsplit("/", 1)[-1].removesuffix(".md").replace("-", " ")
            where = f"[{title}]({_link(page, guide)})"
        if f.name not in notes:
            log.warning("CompilationConfig.%s is not described under Fields: in its docstring", f.name)
        typ = str(f.type).replace("|", "\\|")  # plain text: a pipe escaped inside a code span would show its backslash
        rows.append([f"`{f.name}`", typ, f"`{default!r}`", key, notes.get(f.name, ""), where])
    return bench_tables.table(["field", "type", "default", "in the cache key", "what it does", "guide"], rows, "llllll")


def _env_in_source() -> set[str]:
    names: set[str] = set()
    for dirpath, _, files in os.walk(os.path.join(SRC, "piecewise")):
        for fn in files:
            if fn.endswith(".py"):
                with open(os.path.join(dirpath, fn)) as f:
                    names |= set(re.findall(r"\bPIECEWISE_[A-Z0-9_]+\b", f.read()))
    return names - {"PIECEWISE_TEST_SESSION_DIR"}


def environment(page: str) -> str:
    from piecewise.cache.key import ENV_ALLOWLIST

    found = _env_in_source()
    for name in sorted(found - set(ENVIRONMENT)):
        log.warning("environment variable %s is read in src/ but not documented: add it to ENVIRONMENT in "
                    "scripts/mkdocs_hooks.py", name)
    rows = [[f"`{name}`", what, "yes" if name in ENV_ALLOWLIST else "no", f"[guide]({_link(page, guide)})"]
            for name, (what, guide) in sorted(ENVIRONMENT.items()) if name in found]
    out = bench_tables.table(["variable", "what it does", "in the cache key", "guide"], rows, "llll")
    others = [n for n in ENV_ALLOWLIST if not n.startswith("PIECEWISE_")]
    out += ("\nThese variables of torch enter the cache key as well (`piecewise.cache.ENV_ALLOWLIST`), so a "
            "change compiles again and a miss names them: " + ", ".join(f"`{n}`" for n in others) + ".\n")
    return out


def counters(page: str) -> str:
    path = os.path.join(SRC, "piecewise", "counters.py")
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("class _Tally"))
    rows = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        m = re.match(r"^\s+([a-z_]+): int = 0\s*(?:#\s*(.*))?$", line)
        if not m:
            continue
        name, note = m.group(1), m.group(2) or COUNTER_NOTES.get(m.group(1))
        if not note:
            log.warning("counter %s has no description: comment its line in counters.py or add it to COUNTER_NOTES", name)
        rows.append([f"`{name}`", note or ""])
    from piecewise.counters import FIELDS

    if [r[0].strip("`") for r in rows] != list(FIELDS):
        log.warning("the counters read from counters.py differ from piecewise.counters.FIELDS")
    return bench_tables.table(["counter", "counts"], rows, "ll")


def errors(page: str) -> str:
    import piecewise.errors as E

    with open(os.path.join(ROOT, "docs", "guides", "troubleshooting.md")) as f:
        trouble = f.read()
    rows = []
    for name in E.__all__:
        cls = getattr(E, name)
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        first = re.split(r"(?<=\.)\s", " ".join((cls.__doc__ or "").split()), maxsplit=1)[0]
        if f"## {name}" not in trouble:
            log.warning("errors.%s has no section '## %s' in docs/guides/troubleshooting.md", name, name)
        rows.append([f"`{name}`", bases, first, f"[causes and remedies]({_link(page, 'guides/troubleshooting.md#' + name.lower())})"])
    return bench_tables.table(["error", "is a", "meaning", "troubleshooting"], rows, "llll")


def cli(page: str) -> str:
    import argparse

    from piecewise.cli import build_parser

    def walk(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
        out = [(name, parser)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    out += walk(p, f"{name} {sub}")
        return out

    os.environ["COLUMNS"] = "100"
    parts = []
    for name, parser in walk(build_parser(), "piecewise"):
        parser.prog = name
        level = "#" * min(2 + name.count(" "), 4)
        parts.append(f"{level} `{name}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


#: what a layer entry of tests/test_layers.py holds, where its name alone does not say
LAYER_NOTES = {
    "_torch": "torch internals: private names and patches, one module per torch subsystem",
    "targets": "`CompileRange`, `CompileTarget`",
    "fingerprint": "the one code digest, the one data digest and the one describer of Python values for keys",
    "passes": "the pass manager and the built-in passes",
    "config": "`CompilationConfig`",
    "split": "cutting the FX graph",
    "cache": "`key`, `store`, `remote`, `tools`: storage only; nothing about models or compilers",
    "compilers": "`base`, `eager`, `inductor`, `isa_record`: the one patch of Inductor state; `partition`: the "
                 "Inductor-partition strategy's scoped hooks",
    "piece": "per-piece dispatch over sizes and ranges",
    "graphs": "`platform`, `wrapper`, `dispatch`, `install`, `capture_sizes`, `planner`, `subbatch`",
    "compiled": "`CompiledForward`, `CompiledPlan`, `StitchedForward`",
    "backend": "the Dynamo backend",
    "trace": "the Dynamo trace and its saved form",
    "warmstart": "bundles (`CompiledArtifact`) and the lookup over them: the warm start sits above the store and the "
                 "backend, not inside the cache",
    "api": "`pw.compile`, guard-free dispatch",
    "serving": "the serving engine: `llama` (the reference decoder), `decode` (the continuous-batching loop), "
               "`triton_attention`, `tensor_parallel`",
    "hf": "the transformers integration: `attention`, `generate` (`CompiledModel.generate`), `gguf` (weights), `chat`",
    "testing": "fixtures for tests and benchmarks: `toy` (toy models), `graph_platform` (the fake graph platform), "
               "`redis_server`",
    "models": "deprecated shims of the old module paths, for one release",
    "": "the package root (lazy re-exports)",
}


def layers(page: str) -> str:
    """The layer list, from the `LAYERS` table of tests/test_layers.py (which the import test enforces)."""
    import ast

    with open(os.path.join(ROOT, "tests", "test_layers.py")) as f:
        tree = ast.parse(f.read())
    table = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                 if isinstance(node, (ast.Assign, ast.AnnAssign))
                 and any(getattr(t, "id", None) == "LAYERS" for t in (node.targets if isinstance(node, ast.Assign) else [node.target])))
    out = []
    for i, names in enumerate(table, 1):
        items = []
        for name in names:
            shown = "the package root" if name == "" else f"`{name}`"
            if name and os.path.isdir(os.path.join(SRC, "piecewise", name)):
                shown = f"`{name}/`"
            note = LAYER_NOTES.get(name)
            items.append(f"{shown} ({note})" if note and name else shown)
        out.append(f"{i}. " + ", ".join(items))
    return "\n".join(out) + "\n"


def public_api_check(markdown: str) -> None:
    import piecewise

    for name in piecewise.__all__:
        if not re.search(rf"^::: piecewise\.(?:[a-z_.]+\.)?{re.escape(name)}$", markdown, re.M):
            log.warning("piecewise.%s is public (piecewise.__all__) but has no '::: ...%s' entry in docs/reference/api.md",
                        name, name)


def _bench(name: str) -> Callable[[str], str]:
    return lambda page: bench_tables.TABLES[name]()


GENERATORS: dict[str, Callable[[str], str]] = {
    "config-fields": config_fields,
    "environment": environment,
    "counters": counters,
    "errors": errors,
    "cli": cli,
    "layers": layers,
    **{f"bench-{name}": _bench(name) for name in bench_tables.TABLES},
}


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs' signature)
    path = page.file.src_uri
    if path == "reference/api.md":
        public_api_check(markdown)

    def replace(m: re.Match) -> str:
        gen = GENERATORS.get(m.group(1))
        if gen is None:
            log.warning("%s: unknown generated block %r (known: %s)", path, m.group(1), ", ".join(GENERATORS))
            return ""
        return gen(path)

    return MARKER.sub(replace, markdown)
