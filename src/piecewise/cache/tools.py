"""Maintenance of a cache root, behind ``piecewise cache ...`` (docs/design.md §8).

All functions take the root explicitly and return data; the CLI formats it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import filelock

from .._version import build_id
from ..errors import CacheError
from .key import NOT_IN_KEY, diff_factors, diff_items, env_factors
from .store import FACTORS, INDEX, LOCK, QUARANTINE, CacheIndexError, make_dirs, check_permissions, read_index, readable_file, remove_tree

__all__ = ["EntryInfo", "list_entries", "find_entry", "verify", "check_unpacked", "artifact_lines", "explain", "clear", "export_archive", "import_archive"]

MANIFEST = "piecewise_manifest.json"
# <key>/rank_<r>_<dp>/<tag>; a warm-start bundle's key may carry a variant: <start key>-<variant>
_ENTRY_NAME = re.compile(r"[0-9a-f]{8,64}(?:-[0-9a-f]{4,64})?/rank_\d+_\d+/(?!\.)[A-Za-z0-9_.\-]+")


@dataclasses.dataclass
class EntryInfo:
    rel: str  # <key>/rank_<r>_<dp>/<tag>
    path: str
    artifacts: int
    bytes: int
    created: float | None
    valid: bool
    problem: str = ""
    kind: str = "compile"  # "compile" (piece artifacts) or "bundle" (a warm-start bundle)

    @property
    def key(self) -> str:
        return self.rel.split("/")[0]

    @property
    def tag(self) -> str:
        return self.rel.split("/")[-1]


def entry_dirs(root: str) -> Iterator[tuple[str, str]]:
    if not os.path.isdir(root):
        return
    for key in sorted(os.listdir(root)):
        kdir = os.path.join(root, key)
        if not os.path.isdir(kdir) or key.startswith(".") or ".deleting." in key:
            continue
        for rank in sorted(os.listdir(kdir)):
            rdir = os.path.join(kdir, rank)
            if not rank.startswith("rank_") or not os.path.isdir(rdir):
                continue
            for tag in sorted(os.listdir(rdir)):
                tdir = os.path.join(rdir, tag)
                if os.path.isdir(tdir) and ".deleting." not in tag:
                    yield f"{key}/{rank}/{tag}", tdir


def _info(root: str, rel: str, path: str) -> EntryInfo:
    try:
        idx = read_index(os.path.join(path, INDEX))
    except FileNotFoundError:
        return EntryInfo(rel, path, 0, 0, None, False, "no index (incomplete: a compile was interrupted)")
    except (CacheIndexError, OSError) as e:
        return EntryInfo(rel, path, 0, 0, None, False, f"bad index: {e}")
    arts = idx["artifacts"]
    kind = "bundle" if idx["meta"].get("kind") == "bundle" else "compile"
    return EntryInfo(rel, path, len(arts), sum(r["bytes"] for r in arts.values()), idx.get("created"), True, kind=kind)


def list_entries(root: str) -> list[EntryInfo]:
    return [_info(root, rel, path) for rel, path in entry_dirs(root)]


def find_entry(root: str, ref: str) -> EntryInfo:
    """The entry named by `ref`: a path, ``key/rank_r_d/tag``, ``key/tag``, a key, a key prefix or a
    tag (when it names exactly one entry).

    Raises:
        LookupError: none or several entries match.
    """
    if os.path.isdir(ref) and os.path.isfile(os.path.join(ref, FACTORS)):
        path = os.path.abspath(ref)
        return _info(root, os.path.relpath(path, root).replace(os.sep, "/"), path)
    parts = ref.strip("/").split("/")
    matches = []
    for rel, path in entry_dirs(root):
        k, r, t = rel.split("/")
        if len(parts) == 1 and (k.startswith(parts[0]) or t == parts[0]):
            matches.append((rel, path))
        elif len(parts) > 1 and k.startswith(parts[0]) and parts[-1] == t and (len(parts) < 3 or parts[1] == r):
            matches.append((rel, path))
    infos = [_info(root, *m) for m in matches]
    if len(infos) > 1:  # a tag names its compile entry and its bundle: the compile entry is meant
        compiled = [i for i in infos if i.kind == "compile"]
        infos = compiled if len(compiled) == 1 else infos
    if len(infos) != 1:
        names = ", ".join(i.rel for i in infos[:5]) or "none"
        raise CacheError(f"{ref!r} matches {len(infos)} entries under {root} ({names}); give key/rank_r_d/tag")
    return infos[0]


def verify(root: str) -> tuple[list[str], list[str]]:
    """Check every entry: index parses, every artifact exists with its recorded sha256, no
    directory is writable by others. Returns (problems, notes); an empty problem list passes."""
    problems, notes = [], []
    if not os.path.isdir(root):
        return problems, [f"{root} does not exist (an empty cache)"]
    unsafe = check_permissions(root, root)
    if unsafe:
        problems.append(unsafe)
    for rel, path in entry_dirs(root):
        unsafe = check_permissions(root, path)
        if unsafe:
            problems.append(f"{rel}: {unsafe}")
            continue
        try:
            idx = read_index(os.path.join(path, INDEX))
        except FileNotFoundError:
            notes.append(f"{rel}: no index yet (interrupted compile; the next run completes it)")
            continue
        except (CacheIndexError, OSError) as e:
            problems.append(f"{rel}: bad index: {e}")
            continue
        if idx["meta"].get("kind") == "bundle":
            _, rank, tag = rel.split("/")
            target = str(idx["meta"].get("compile_key"))
            if not os.path.isfile(os.path.join(root, target, rank, tag, INDEX)):
                notes.append(f"{rel}: warm-start bundle whose compile entry {target} is gone; unused until the "
                             f"next trace replaces it (clear --key {rel.split('/')[0]} removes it)")
        for name, rec in idx["artifacts"].items():
            f = os.path.join(root, *rec["file"].split("/"))
            try:
                with open(f, "rb") as fh:
                    data = fh.read()
            except OSError as e:
                problems.append(f"{rel}: artifact {name}: {e.strerror or e}")
                continue
            if len(data) != rec["bytes"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
                problems.append(f"{rel}: artifact {name}: checksum mismatch")
            bad, missing = check_unpacked(root, rec)
            problems += [f"{rel}: artifact {name}: readable file {f}: checksum mismatch" for f in bad]
            if missing:
                notes.append(f"{rel}: artifact {name}: {len(missing)} readable file(s) absent ({', '.join(missing[:3])}); "
                             "the artifact itself is what loads (a remote pull brings the binary only)")
        q = os.path.join(path, QUARANTINE)
        if os.path.isdir(q) and os.listdir(q):
            notes.append(f"{rel}: {len(os.listdir(q))} file(s) in quarantine (bad files moved aside)")
    return problems, notes


def check_unpacked(root: str, rec: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The readable files (``artifact_format="unpacked"``) of artifact record `rec` whose bytes
    differ from the manifest's size and sha256, and those that are absent; ([], []) for a binary
    artifact."""
    up = rec.get("unpacked")
    if not up:
        return [], []
    bad, missing = [], []
    for name in up["files"]:
        state, _ = readable_file(root, up, name)
        if state != "ok":
            (missing if state == "absent" else bad).append(name)
    return bad, missing


def artifact_lines(root: str, info: EntryInfo) -> list[str]:
    """One line per artifact of an entry (name, bytes), each followed by its readable files
    (``artifact_format="unpacked"``: path under the root, bytes, and ``CHANGED`` / ``ABSENT``
    where the manifest disagrees), for ``piecewise cache show``."""
    try:
        idx = read_index(os.path.join(info.path, INDEX))
    except (CacheIndexError, OSError):
        return []
    out = []
    for name, rec in idx["artifacts"].items():
        out.append(f"  {name}  {rec['bytes']} bytes  {rec['file']}")
        up = rec.get("unpacked")
        if up:
            bad, missing = check_unpacked(root, rec)
            for f, want in up["files"].items():
                state = "  CHANGED" if f in bad else "  ABSENT" if f in missing else ""
                out.append(f"      {up['dir']}/{f}  {want['bytes']} bytes{state}")
    return out


def _factors(root: str, ref: str) -> tuple[str, dict[str, Any]]:
    if os.path.isfile(ref):
        with open(ref) as f:
            return ref, json.load(f)
    info = find_entry(root, ref)
    with open(os.path.join(info.path, FACTORS)) as f:
        return info.rel, json.load(f)


def explain(root: str, a: str, b: str) -> tuple[str, str, list[str]]:
    """Which key factors differ between two entries (or factor files: a run's
    ``cache_key_factors.json``). Returns (name a, name b, ``"factor: value a -> value b"`` lines;
    a factor present on one side only reads ``"factor (only in first): value"``). A traced
    source file shows the first 12 hex digits of its sha256 and its path where recorded."""
    na, fa = _factors(root, a)
    nb, fb = _factors(root, b)
    out = []
    for path, where in diff_items(fa, fb):
        name = ".".join(str(p) for p in path)
        va, vb = _describe_factor(fa, path), _describe_factor(fb, path)
        if where == "both":
            out.append(f"{name}: {va} -> {vb}")
        else:
            out.append(f"{name} (only in {where}): {va if where == 'first' else vb}")
    return na, nb, out


def _lookup(factors: dict[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = factors
    for part in path:
        if not isinstance(cur, dict) or part not in cur:
            return "<absent>"
        cur = cur[part]
    return cur


def _describe_factor(factors: dict[str, Any], path: tuple[str, ...]) -> str:
    value = _lookup(factors, path)
    if len(path) == 2 and path[0] == "sources" and isinstance(value, str):
        where = _lookup(factors, ("sources", NOT_IN_KEY, path[1]))
        return f"sha256 {value[:12]}" + (f" ({where})" if isinstance(where, str) and where != "<absent>" else " (path not recorded)")
    if len(path) == 1 and path[0] == "sources" and isinstance(value, dict):  # all traced files at once
        return _short({k: v[:12] if isinstance(v, str) else v for k, v in value.items() if k != NOT_IN_KEY})
    return _short(value)


def _short(v: Any, limit: int = 120) -> str:
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def clear(root: str, key: str | None = None) -> int:
    """Remove every entry (or those of one key prefix); returns how many. Safe while another
    process compiles: each entry is removed under its writer lock, renamed aside first."""
    n = 0
    for rel, path in list(entry_dirs(root)):
        if key and not rel.startswith(key):
            continue
        try:
            with filelock.FileLock(os.path.join(path, LOCK), timeout=60):
                remove_tree(path)
        except (filelock.Timeout, OSError):
            remove_tree(path)
        n += 1
    for k in os.listdir(root) if os.path.isdir(root) else []:
        kdir = os.path.join(root, k)
        if (not key or k.startswith(key)) and os.path.isdir(kdir) and not k.startswith("."):
            for dirpath, _, _ in os.walk(kdir, topdown=False):
                try:
                    os.rmdir(dirpath)  # only succeeds for directories emptied above
                except OSError:
                    pass
    if not key and os.path.isdir(os.path.join(root, "isa")):  # Inductor's recorded CPU ISA probe
        remove_tree(os.path.join(root, "isa"))
    return n


def _skip(name: str) -> bool:
    base = os.path.basename(name)
    return base == LOCK or ".tmp." in base or f"/{QUARANTINE}/" in f"/{name}/" or ".deleting." in name


def export_archive(root: str, out: str, key: str | None = None) -> int:
    """Write the valid entries (or one key prefix's) to a tar.gz with a manifest of their factors;
    returns the number of entries."""
    entries = [e for e in list_entries(root) if e.valid and (not key or e.rel.startswith(key))]
    manifest = {"format": 1, "created": time.time(), "entries": []}
    tmp = f"{out}.tmp.{secrets.token_hex(3)}"
    with tarfile.open(tmp, "w:gz") as tar:
        for e in entries:
            with open(os.path.join(e.path, FACTORS)) as f:
                manifest["entries"].append({"entry": e.rel, "factors": json.load(f)})
            for dirpath, _, filenames in os.walk(e.path):
                for fn in sorted(filenames):
                    full = os.path.join(dirpath, fn)
                    arc = os.path.relpath(full, root).replace(os.sep, "/")
                    if not _skip(arc):
                        tar.add(full, arcname=arc, recursive=False)
        data = json.dumps(manifest, indent=1, sort_keys=True, default=str).encode()
        ti = tarfile.TarInfo(MANIFEST)
        ti.size, ti.mtime, ti.mode = len(data), int(time.time()), 0o644
        tar.addfile(ti, io.BytesIO(data))
    os.replace(tmp, out)
    return len(entries)


def current_factors_sample(entry_factors: dict[str, Any], compiler_hash: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The factors of this process that do not depend on the model: torch and piecewise versions,
    the allow-listed environment, and the hash the entry's compiler adaptor has here
    (`compiler_hash(name)`, given by the caller: this layer knows no adaptors; None: not compared).
    Entries built with custom Inductor options keep their recorded compiler hash (the options are
    stored as text and cannot be rebuilt here), so only the other factors are compared for them."""
    import torch

    comp = entry_factors.get("compiler", {})
    name = comp.get("name", "inductor")
    if compiler_hash is None or entry_factors.get("config", {}).get("inductor_options"):
        here_hash = comp.get("hash")
    else:
        here_hash = compiler_hash(name)
    return {"torch": torch.__version__, "piecewise": build_id(), "env": env_factors(),
            "compiler": {"name": name, "hash": here_hash}}


#: what reading a truncated or corrupt archive raises (tarfile, gzip, zlib; gzip.BadGzipFile, an OSError, apart)
_ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, UnicodeDecodeError, ValueError)


def _read_archive(archive: str) -> tuple[list[tarfile.TarInfo], dict[str, Any]]:
    """Read all of `archive` once, writing nothing: its members (each checked to be a plain
    relative file, its data read to the end so a truncated or corrupt stream fails here) and its
    manifest, checked.

    Raises:
        CacheError: no such file, not a gzip'd tar, truncated or corrupt, a member that is not a
            plain relative file, no manifest, a manifest of another format, or an entry name
            that is not ``key/rank_r_d/tag``.
    """
    if not os.path.exists(archive):
        raise CacheError(f"{archive}: no such file")
    if not os.path.isfile(archive):
        raise CacheError(f"{archive} is not a file; give the .tar.gz that 'piecewise cache export' wrote")
    what = f"{archive} is not an archive made by 'piecewise cache export'"
    damaged = f"{archive} is truncated or damaged"
    try:
        tar = tarfile.open(archive, "r:gz")
    except (tarfile.ReadError, tarfile.CompressionError, gzip.BadGzipFile, EOFError, zlib.error) as e:
        if isinstance(e, EOFError) or isinstance(e.__cause__ or e.__context__, (EOFError, zlib.error)):
            raise CacheError(f"{damaged} ({e}); nothing imported. Copy it again or export it again") from None
        raise CacheError(f"{what} (not a gzip'd tar: {e})") from None
    except OSError as e:
        raise CacheError(f"cannot read {archive}: {e.strerror or e}") from None
    manifest_bytes = None
    members = []
    try:
        with tar:
            for m in tar:
                if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/"):
                    raise CacheError(f"archive member {m.name!r} of {archive} is not a plain relative file; refusing to "
                                     "import")
                src = tar.extractfile(m)
                got, chunks = 0, []
                while src is not None:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    got += len(chunk)
                    if m.name == MANIFEST:
                        chunks.append(chunk)
                if got != m.size:
                    raise EOFError(f"member {m.name!r} ends after {got} of {m.size} bytes")
                if m.name == MANIFEST:
                    manifest_bytes = b"".join(chunks)
                members.append(m)
            # the tar ends before the gzip stream does: read that to its end too, so a cut or
            # altered trailer (length, CRC) is found here as well
            while tar.fileobj.read(1 << 20):
                pass
    except CacheError:
        raise
    except OSError as e:
        if not isinstance(e, gzip.BadGzipFile):
            raise CacheError(f"cannot read {archive}: {e.strerror or e}") from None
        raise CacheError(f"{damaged} ({e}); nothing imported. Copy it again or export it again") from None
    except _ARCHIVE_ERRORS as e:  # the stream ends early or is corrupt
        raise CacheError(f"{damaged} ({type(e).__name__}: {e}); nothing imported. Copy it again or export it "
                         "again") from None
    if manifest_bytes is None:
        raise CacheError(f"{archive} has no {MANIFEST}; export it with 'piecewise cache export'")
    try:
        manifest = json.loads(manifest_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"{what} ({MANIFEST} is not valid JSON: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != 1 or not isinstance(manifest.get("entries"), list):
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CacheError(f"{what} ({MANIFEST} has format {got!r}; this version imports format 1)")
    for e in manifest["entries"]:
        name = e.get("entry") if isinstance(e, dict) else None
        if not isinstance(name, str) or not _ENTRY_NAME.fullmatch(name):
            raise CacheError(f"manifest entry {name!r} of {archive} is not key/rank_r_d/tag; refusing to import")
        if not isinstance(e.get("factors", {}), dict):
            raise CacheError(f"manifest entry {name!r} of {archive} has no factors record; refusing to import")
    return members, manifest


def import_archive(root: str, archive: str, compiler_hash: Callable[[str], str] | None = None) -> tuple[int, list[str]]:
    """Unpack an exported archive into `root`. Members must be regular files under the root (no
    absolute paths, no '..', no links). The whole archive is read and checked before anything is
    written, and entries are unpacked into a staging dir first, so a refused archive leaves `root`
    as it was. Returns (entries imported, warnings naming each factor in which an entry differs
    from this process; `compiler_hash(name)` gives an adaptor's hash here, see
    `current_factors_sample`).

    Raises:
        CacheError: the archive is missing, not one `export_archive` wrote (not a gzip'd tar, no
            manifest, another manifest format), truncated or corrupt, or a member or manifest
            entry would land outside `root`.
        OSError: `root` cannot be written (disk full, permissions).
    """
    members, manifest = _read_archive(archive)
    entries = manifest["entries"]
    real_root = os.path.realpath(root)
    for e in entries:
        dst = os.path.join(root, *e["entry"].split("/"))
        if not os.path.realpath(dst).startswith(real_root + os.sep):
            raise CacheError(f"manifest entry {e['entry']!r} resolves outside {root}; refusing to import")
    warns: list[str] = []
    for e in entries:
        f = e.get("factors", {})
        here = current_factors_sample(f, compiler_hash)
        for name in diff_factors({k: f.get(k) for k in here}, here):
            warns.append(f"{e['entry']}: factor {name} differs from this process; it will not hit here")
    created_root = not os.path.isdir(root)
    make_dirs(root)
    staging = os.path.join(root, f".import.{os.getpid()}.{secrets.token_hex(3)}")
    os.mkdir(staging, 0o755)
    n = 0
    try:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for m in tar:
                    if m.name == MANIFEST or not m.isfile():
                        continue
                    src = tar.extractfile(m)
                    dest = os.path.join(staging, *m.name.split("/"))
                    make_dirs(os.path.dirname(dest))
                    with open(dest, "wb") as out:
                        out.write(src.read() if src is not None else b"")
                    os.chmod(dest, 0o644)
        except (tarfile.TarError, EOFError, zlib.error) as e:  # changed since it was read
            raise CacheError(f"{archive} changed while it was imported ({type(e).__name__}: {e}); nothing imported") from None
        for e in entries:
            src = os.path.join(staging, *e["entry"].split("/"))
            dst = os.path.join(root, *e["entry"].split("/"))
            if not os.path.isdir(src):
                continue
            make_dirs(os.path.dirname(dst))
            if os.path.isdir(dst):
                remove_tree(dst)
            os.replace(src, dst)
            n += 1
    except BaseException:
        if n == 0 and created_root:  # refused before any entry landed: leave no trace
            shutil.rmtree(staging, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(root)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return n, warns
