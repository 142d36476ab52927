"""The on-disk compile cache (docs/design.md §5.1, §5.3, §5.4).

Layout, every path inside relative to the root so a cache can be moved or baked into an image::

    <root>/<key>/rank_<r>_<dp>/<tag>/
        index.json               # written last; JSON data only, with a format version
        cache_key_factors.json   # every raw factor, to explain a miss
        computation_graph.py     # the readable split graph
        artifacts/<piece fingerprint>.<target>.<content hash>.bin
        quarantine/              # bad files moved aside, never read again

Rules: every write is temp file + fsync + atomic rename; writers of one entry are serialised by a
`filelock.FileLock`, readers never lock; each artifact's sha256 is checked before it is loaded; a
bad file is reported once, moved aside and recompiled; an unwritable root or a full disk degrades
to in-memory compilation with one warning; a directory writable by other users (or owned by
another user) is neither read nor written, because loading an artifact executes its code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

import filelock

from ..errors import CacheError
from ..fingerprint import canonical_json, data_digest
from .key import KEY_FORMAT

__all__ = ["INDEX_FORMAT", "resolve_root", "atomic_write", "CacheEntry", "check_permissions", "read_index", "parse_index",
           "CacheIndexError", "current_rank", "shares_across_ranks", "readable_file"]

log = logging.getLogger("piecewise")

INDEX_FORMAT = 1
INDEX, FACTORS, GRAPH, ARTIFACTS, QUARANTINE, LOCK = (
    "index.json", "cache_key_factors.json", "computation_graph.py", "artifacts", "quarantine", ".lock",
)
#: the directory of an artifact's readable files (``artifact_format="unpacked"``): ``<name>.<digest>.unpacked``
UNPACKED_SUFFIX = ".unpacked"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)*")
_DISABLE_VALUES = ("1", "true", "yes", "on")

_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_once(key: str, message: str) -> bool:
    """Warn with `message` once per process per `key`; returns whether it warned."""
    with _reported_lock:
        if key in _reported:
            return False
        _reported.add(key)
    # One report: a Python warning (shown once, filterable); the log keeps a debug copy for servers
    # that route warnings elsewhere.
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.debug(message)
    return True


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to 1/true/yes/on (any case)."""
    return os.environ.get(name, "").strip().lower() in _DISABLE_VALUES


def current_rank() -> int:
    """This process's rank in an initialised `torch.distributed` group, else 0 (entries are per rank)."""
    import torch

    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def shares_across_ranks() -> bool:
    """Whether ranks of one `torch.distributed` job share identical pieces through the cache root:
    an initialised group of more than one rank, and ``PIECEWISE_RANK_SHARING`` not set to 0."""
    import torch

    dist = torch.distributed
    if os.environ.get("PIECEWISE_RANK_SHARING", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def resolve_root(cache_dir: str | None) -> str | None:
    """The cache root: None when ``PIECEWISE_DISABLE_CACHE`` is set, else `cache_dir`, else
    ``PIECEWISE_CACHE_DIR``, else the platform's user cache dir (`platformdirs`)."""
    if env_flag("PIECEWISE_DISABLE_CACHE"):
        return None
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    env = os.environ.get("PIECEWISE_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    from platformdirs import user_cache_dir

    return user_cache_dir("piecewise")


def make_dirs(path: str) -> None:
    """Create `path` and missing parents as 0o755, whatever the umask (a group-writable dir would
    be refused at load)."""
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
            os.chmod(d, 0o755)
        except FileExistsError:
            pass


def atomic_write(path: str, data: bytes) -> None:
    """Write `data` to `path` with temp file + fsync + rename (+ fsync of the directory).

    Raises:
        OSError: the write failed (unwritable, disk full); no partial file is left at `path`.
    """
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def check_permissions(root: str, path: str) -> str | None:
    """Why loading from `path` (under `root`) is unsafe, or None when it is safe.

    Unsafe: `root` or a directory between it and `path` (or `path` itself) is writable by group or
    others, or owned by a user other than us or root. Missing components are fine (nothing to load).
    """
    me = os.getuid() if hasattr(os, "getuid") else None
    rel = os.path.relpath(path, root)
    parts = [] if rel == "." else rel.split(os.sep)
    p = root
    for component in [None, *parts]:
        if component is not None:
            p = os.path.join(p, component)
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            return None  # nothing there to load; writing will fail (and say so) if it cannot create it
        except OSError as e:
            return f"cannot stat {p}: {e}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{p} is writable by other users (mode {stat.filemode(st.st_mode)})"
        if me is not None and st.st_uid not in (me, 0):
            return f"{p} is owned by uid {st.st_uid}, not by this user"
    return None


def encode_index(body: Mapping[str, Any]) -> bytes:
    """Index bytes: compact canonical JSON (no insignificant whitespace, so any flipped byte changes
    content) with a sha256 of everything else in ``checksum``."""
    return canonical_json({**body, "checksum": data_digest(body)})


class CacheIndexError(CacheError):
    """An index that is not a valid piecewise index (corrupt, truncated, wrong format)."""


def read_index(path: str) -> dict[str, Any]:
    """Parse and validate an index file as data only (JSON; never eval/pickle).

    Raises:
        FileNotFoundError: no index.
        CacheIndexError: anything else wrong with it.
    """
    with open(path, "rb") as f:
        raw = f.read()
    return parse_index(raw)


def parse_index(raw: bytes) -> dict[str, Any]:
    """Validate index bytes as data only (`read_index` without the file).

    Raises:
        CacheIndexError: not a valid piecewise index.
    """
    try:
        idx = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheIndexError(f"not valid JSON ({e})") from None
    if not isinstance(idx, dict) or idx.get("format") != INDEX_FORMAT or idx.get("key_format") != KEY_FORMAT:
        raise CacheIndexError(f"unknown index format {idx.get('format') if isinstance(idx, dict) else type(idx).__name__}")
    body = {k: v for k, v in idx.items() if k != "checksum"}
    if idx.get("checksum") != data_digest(body):
        raise CacheIndexError("index checksum mismatch")
    arts = idx.get("artifacts")
    if not isinstance(arts, dict) or not isinstance(idx.get("meta"), dict) or not isinstance(idx.get("key"), str):
        raise CacheIndexError("missing fields")
    for name, rec in arts.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("file"), str) and isinstance(rec.get("sha256"), str)
                and isinstance(rec.get("bytes"), int)):
            raise CacheIndexError(f"bad artifact record {name!r}")
        if os.path.isabs(rec["file"]) or ".." in rec["file"].split("/"):
            raise CacheIndexError(f"artifact path {rec['file']!r} escapes the cache root")
        if "unpacked" in rec:
            _check_manifest(name, rec)
    return idx


def _check_manifest(name: str, rec: Mapping[str, Any]) -> None:
    """Raise `CacheIndexError` unless artifact record `rec`'s readable-file manifest is well formed:
    its folder is the one beside the artifact's own file, and each name is a relative path of
    letters, digits, ``_.-`` and ``/`` with a sha256 and a byte count."""
    up = rec["unpacked"]
    if not (isinstance(up, dict) and isinstance(up.get("files"), dict) and rec["file"].endswith(".bin")
            and up.get("dir") == rec["file"][: -len(".bin")] + UNPACKED_SUFFIX):
        raise CacheIndexError(f"bad readable-file manifest of artifact {name!r}")
    for f, want in up["files"].items():
        if not (isinstance(f, str) and _SAFE_NAME.fullmatch(f) and ".." not in f.split("/") and isinstance(want, dict)
                and isinstance(want.get("sha256"), str) and isinstance(want.get("bytes"), int)):
            raise CacheIndexError(f"bad readable file {f!r} in the manifest of artifact {name!r}")


def readable_file(root: str, up: Mapping[str, Any], name: str) -> tuple[str, bytes | None]:
    """One readable file of a manifest (``artifact_format="unpacked"``, as `parse_index` checked
    it): ``("ok", bytes)`` when it is a regular file with the manifest's size and sha256,
    ``("absent", None)`` when there is none, ``("changed", None)`` otherwise (other bytes, or not
    a regular file: a FIFO or device is never opened)."""
    want = up["files"][name]
    path = os.path.join(root, *up["dir"].split("/"), *name.split("/"))
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != want["bytes"]:
            return "changed", None
        with open(path, "rb") as f:
            data = f.read(want["bytes"] + 1)
    except FileNotFoundError:
        return "absent", None
    except OSError:
        return "changed", None
    if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        return "changed", None
    return "ok", data


class CacheEntry:
    """One ``<key>/rank_<r>_<dp>/<tag>`` directory, as one backend uses it.

    `open` reads the index (if any) and decides whether the entry may be read and written;
    `load_artifact` / `save_artifact` move payload bytes; `commit` writes factors, graph dump and
    the merged index, in that order. Every failure degrades (miss, or in-memory only); nothing here
    raises into the model.
    """

    def __init__(self, root: str, key: str, tag: str, rank: int = 0, dp_rank: int = 0, remote: Any = None) -> None:
        self.root = root
        #: the remote tier (`piecewise.cache.remote.RemoteCache`) a local miss reads through and a
        #: commit publishes to; None: local only
        self.remote = remote
        self.key = key
        self.tag = tag
        self.rel = "/".join((key, f"rank_{rank}_{dp_rank}", tag))
        self.path = os.path.join(root, *self.rel.split("/"))
        self.readable = True
        self.writable = True
        self.index: dict[str, Any] | None = None
        self.saved: dict[str, dict[str, Any]] = {}
        self._sibling_files: dict[str, str] = {}  # artifact name -> the sibling rank's file it was copied from

    # -- reading ------------------------------------------------------------------------------
    def open(self, meta: Mapping[str, Any] | None) -> bool:
        """Check permissions and read the index; True when a matching index exists (a hit). With
        `meta` None any meta matches (the caller reads ``index["meta"]`` itself)."""
        unsafe = check_permissions(self.root, self.path)
        if unsafe:
            self.readable = self.writable = False
            report_once(f"unsafe:{unsafe}", f"piecewise cache: not loading or writing {self.path}: {unsafe}; "
                        "compiling in memory. Fix the permissions (chmod go-w) or choose another cache_dir")
            return False
        try:
            try:
                idx = read_index(os.path.join(self.path, INDEX))
            except (FileNotFoundError, NotADirectoryError):
                if self.remote is None or not self.remote.pull(self.root, self.rel):
                    raise
                idx = read_index(os.path.join(self.path, INDEX))  # read through: written locally, then read as local
        except (FileNotFoundError, NotADirectoryError):
            return False
        except CacheIndexError as e:
            self._bad(INDEX, f"index is unusable ({e})")
            return False
        except OSError as e:
            report_once(f"read:{self.path}", f"piecewise cache: cannot read {self.path} ({e}); compiling")
            return False
        if idx["key"] != self.key or (meta is not None and idx.get("meta") != json.loads(canonical_json(dict(meta)))):
            log.info("[%s] cache entry %s was built for another graph (piece count or signature differ); recompiling",
                     self.tag, self.rel)
            return False
        self.index = idx
        return True

    def load_artifact(self, name: str) -> bytes | None:
        """The verified bytes of artifact `name`, or None (missing, or bad: reported and moved aside)."""
        if not self.readable or self.index is None:
            return None
        rec = self.index["artifacts"].get(name)
        if rec is None:
            return None
        return self._read_verified(rec)

    def _read_verified(self, rec: Mapping[str, Any]) -> bytes | None:
        """The bytes of the artifact file `rec` names if they match its size and sha256, or None
        (missing, or bad: reported and moved aside)."""
        path = os.path.join(self.root, *rec["file"].split("/"))
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                self._bad(rec["file"], "artifact is not a private regular file")
                return None
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            log.warning("[%s] cache artifact %s is missing; rebuilding it", self.tag, rec["file"])
            return None
        except OSError as e:
            report_once(f"read:{path}", f"piecewise cache: cannot read {path} ({e}); recompiling that piece")
            return None
        if len(data) != rec["bytes"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
            what = (f"size {len(data)} bytes, index says {rec['bytes']}" if len(data) != rec["bytes"]
                    else "sha256 differs from the index")
            self._bad(rec["file"], f"artifact is corrupt ({what})")
            return None
        return data

    def sibling_indexes(self) -> list[str]:
        """Index paths of the other ranks' entries of this key and tag under this root."""
        import glob

        pattern = os.path.join(glob.escape(self.root), glob.escape(self.key), "rank_*", glob.escape(self.tag), INDEX)
        return [p for p in sorted(glob.glob(pattern)) if os.path.dirname(p) != self.path]

    def sibling_artifact(self, name: str) -> bytes | None:
        """Artifact `name` as another rank of this job compiled it under the same key, verified and
        copied into this entry (recorded at `commit`); None when no rank has it. Sound because the
        key holds the traced graph's hash and the name the piece's fingerprint and target: the same
        code, whichever rank compiled it (a rank-dependent graph has another key)."""
        if not self.readable:
            return None
        for path in self.sibling_indexes():
            try:
                idx = read_index(path)
            except (OSError, CacheIndexError):
                continue
            rec = idx["artifacts"].get(name) if idx["key"] == self.key else None
            data = self._read_verified(rec) if rec is not None else None
            if data is not None:
                self.save_artifact(name, data, self._readable_of(rec))
                self._sibling_files[name] = rec["file"]
                return data
        return None

    def _readable_of(self, rec: Mapping[str, Any]) -> dict[str, bytes] | None:
        """The readable files (``artifact_format="unpacked"``) of another entry's artifact record,
        each checked against its manifest; None when it has none or one does not check out (the
        copy then holds the binary only, as `piecewise cache verify` notes)."""
        up = rec.get("unpacked")
        if not up:
            return None
        out = {}
        for name in up["files"]:
            state, data = readable_file(self.root, up, name)
            if state != "ok":
                return None
            out[name] = data
        return out

    def reject_artifact(self, name: str, why: str) -> None:
        """An artifact that verified but failed to load: report it and move it aside."""
        rec = (self.index or {}).get("artifacts", {}).get(name)
        if rec is not None:
            self._bad(rec["file"], why)
        if name in self._sibling_files:  # loaded from another rank's entry: set that file aside too
            self._bad(self._sibling_files.pop(name), why)
        bad_copy = self.saved.pop(name, None)  # this entry's copy of it is not recorded either
        if bad_copy is not None:
            self._bad(bad_copy["file"], why)

    def _bad(self, rel_file: str, why: str) -> None:
        """Report a bad file once and move it into the entry's quarantine dir."""
        from ..counters import counters

        counters.bump("cache_errors", tag=self.tag)
        # index records name files relative to the root (this entry's or a sibling rank's); the
        # entry's own files (index, factors) are passed by bare name
        src = os.path.join(self.root, *rel_file.split("/")) if "/" in rel_file else os.path.join(self.path, rel_file)
        report_once(f"bad:{src}", f"piecewise cache: {why}: {src}; moved aside and recompiling")
        if not self.writable:
            return
        try:
            qdir = os.path.join(self.path, QUARANTINE)
            make_dirs(qdir)
            stamp = f"{int(time.time())}.{os.getpid()}"
            os.replace(src, os.path.join(qdir, f"{os.path.basename(src)}.{stamp}"))
            readable = src[: -len(".bin")] + UNPACKED_SUFFIX if src.endswith(".bin") else None
            if readable is not None and os.path.isdir(readable):  # its readable files go with it
                os.replace(readable, os.path.join(qdir, f"{os.path.basename(readable)}.{stamp}"))
        except OSError:
            pass  # another process moved it first, or read-only: the index rewrite drops it anyway

    # -- writing ------------------------------------------------------------------------------
    def _disable_writes(self, e: OSError) -> None:
        self.writable = False
        report_once(f"write:{self.root}", f"piecewise cache: cannot write under {self.root} ({e.strerror or e}); "
                    "compiling in memory without saving")

    def _lock(self) -> filelock.FileLock:
        return filelock.FileLock(os.path.join(self.path, LOCK), mode=0o644)

    def rank_compile_lock(self) -> filelock.FileLock | None:
        """A held lock that serialises the compiles of this key and tag across the ranks of one job
        (``<root>/<key>/.<tag>.compile.lock``), so the first rank compiles and the others load its
        artifacts (`sibling_artifact`). The OS drops it when its holder dies. None when the root
        cannot be written."""
        try:
            make_dirs(os.path.join(self.root, self.key))
            lock = filelock.FileLock(os.path.join(self.root, self.key, f".{self.tag}.compile.lock"), mode=0o644)
            lock.acquire()
            return lock
        except OSError as e:
            self._disable_writes(e)
            return None

    def save_artifact(self, name: str, payload: bytes, unpacked: Mapping[str, bytes] | None = None) -> bool:
        """Write `payload` as artifact `name` (recorded in the index at `commit`); returns whether
        it was written. `unpacked` (``artifact_format="unpacked"``): readable files written beside
        it in ``<artifact>.unpacked/`` (relative names of letters, digits, ``_.-`` and ``/``), each
        file's size and sha256 recorded in the artifact's index record (its manifest)."""
        if not self.writable:
            return False
        digest = hashlib.sha256(payload).hexdigest()
        # The file name carries the content hash: two processes compiling the same piece may produce
        # different bytes (compilers are not bit-reproducible), and neither may overwrite the file
        # the other's index points to. Equal bytes mean equal names, so a lost rename race between
        # equal contents is a success.
        rel = f"{self.rel}/{ARTIFACTS}/{name}.{digest[:16]}.bin"
        record: dict[str, Any] = {"file": rel, "sha256": digest, "bytes": len(payload)}
        try:
            make_dirs(os.path.join(self.path, ARTIFACTS))
            atomic_write(os.path.join(self.root, *rel.split("/")), payload)
            if unpacked:
                record["unpacked"] = self._write_unpacked(rel[: -len(".bin")] + UNPACKED_SUFFIX, unpacked)
        except OSError as e:
            self._disable_writes(e)
            return False
        self.saved[name] = record
        return True

    def _write_unpacked(self, rel_dir: str, files: Mapping[str, bytes]) -> dict[str, Any]:
        """Write `files` under `rel_dir` (relative to the root); their manifest for the index."""
        manifest: dict[str, dict[str, Any]] = {}
        for name, data in sorted(files.items()):
            if not _SAFE_NAME.fullmatch(name) or ".." in name.split("/"):
                log.warning("[%s] readable file %r of artifact %s not written: names must be relative, of letters, digits, "
                            "'_.-' and '/' (the adaptor's unpack)", self.tag, name, rel_dir)
                continue
            path = os.path.join(self.root, *rel_dir.split("/"), *name.split("/"))
            make_dirs(os.path.dirname(path))
            atomic_write(path, data)
            manifest[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        return {"dir": rel_dir, "files": manifest}

    def commit(self, meta: Mapping[str, Any], factors: Mapping[str, Any], graph_code: str) -> None:
        """Write the factors, the graph dump and then the index (merged with what other writers
        recorded meanwhile) under the entry lock."""
        if not self.writable:
            return
        try:
            make_dirs(self.path)
            with self._lock():
                atomic_write(os.path.join(self.path, FACTORS), json.dumps(factors, indent=1, sort_keys=True, default=str).encode())
                atomic_write(os.path.join(self.path, GRAPH), graph_code.encode())
                merged: dict[str, Any] = {}
                try:
                    old = read_index(os.path.join(self.path, INDEX))
                    if old["key"] == self.key and old["meta"] == json.loads(canonical_json(dict(meta))):
                        merged.update(old["artifacts"])
                except (OSError, CacheIndexError):
                    pass
                if self.index is not None:
                    merged.update(self.index["artifacts"])
                merged.update(self.saved)
                # drop records whose files are gone (moved aside, deleted)
                merged = {k: v for k, v in merged.items() if os.path.isfile(os.path.join(self.root, *v["file"].split("/")))}
                idx = {"format": INDEX_FORMAT, "key_format": KEY_FORMAT, "key": self.key, "tag": self.tag,
                       "meta": dict(meta), "created": time.time(), "artifacts": dict(sorted(merged.items()))}
                atomic_write(os.path.join(self.path, INDEX), encode_index(json.loads(canonical_json(idx))))
        except OSError as e:
            self._disable_writes(e)
            return
        except filelock.Timeout as e:  # pragma: no cover - FileLock has no timeout by default
            log.warning("[%s] cache lock timed out (%s); entry index not updated", self.tag, e)
            return
        if self.remote is not None:
            self.remote.publish(self.root, self.rel)


def remove_tree(path: str) -> None:
    """Remove a directory: rename it aside first (atomic), then delete, so a reader never sees a
    half-deleted entry."""
    trash = f"{path}.deleting.{os.getpid()}.{secrets.token_hex(3)}"
    try:
        os.replace(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)
