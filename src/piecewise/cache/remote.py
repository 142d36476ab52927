"""The remote tier of the compile cache: one Redis shared by a fleet (docs/design.md §5.6).

A local miss reads through: the entry's signed envelope and its artifacts come from Redis, are
verified (HMAC-SHA256 of the envelope, sha256 and size of every artifact against the signed
index), written to the local store with its usual atomic writes, and then loaded from there like
any local entry. After a local commit the entry is published: artifacts first, envelope last, so a
reader never sees an envelope whose artifacts were not written. A process that misses both tiers
takes the entry's compile lease (``SET NX PX``, renewed while the process lives) or, when another
process holds it, waits for that process's envelope: a fleet that starts together compiles each
entry once. A killed compiler's lease expires within `LEASE_MS`.

Keys, under ``pw:<REMOTE_FORMAT>:``::

    blob:<sha256>                            an artifact's bytes (content-addressed: equal pieces share one,
                                             whoever wrote them; a reader checks the sha256 its trusted
                                             index names)
    <ns>:entry:<rel>                         the envelope of local entry <rel> (<key>/rank_<r>_<dp>/<tag>)
    <ns>:lease:<rel>                         the compile lease of <rel> (a random token; expires)
    <ns>:bundles:<rank_dir>/<tag>            sorted set of warm-start bundle rels (score: publish time)

``<ns>`` is the writer's namespace (`key_id`): ``key-<16 hex>`` (HMAC-SHA256 of a fixed label
under the signing key: the key's fingerprint, not the key) or ``unsigned`` for a writer without a
key. A writer publishes, and takes leases, only in its own namespace, so a replica started without
the fleet's key, or with another key, never replaces an entry the fleet signed: it compiles for
itself and publishes beside the fleet, and the fleet keeps loading its own entries. An envelope's
body records its writer (namespace, host, pid, time); ``piecewise cache ls --remote URL`` lists
every namespace's entries with it.

Trust: loading an artifact runs its code, so a writable Redis must not be a way in. An envelope is
``b"PWR1 " + <hex HMAC-SHA256 or "-"> + b"\\n" + <canonical JSON>``; the JSON names its own
<rel>, so a valid envelope cannot be replayed under another entry. A reader with a key
(``PIECEWISE_CACHE_KEY``, or ``PIECEWISE_CACHE_KEY_FILE``: a file only its owner can read) reads its
own namespace and loads only envelopes its key signed; with ``PIECEWISE_REMOTE_ALLOW_UNSIGNED=1`` it
also reads the ``unsigned`` namespace (after its own), which is the only way a reader without a key
loads anything. A key the product would not use (under 16 bytes, a key file others can read) is a
`ConfigError` when the tier is set up, not a silent fall back to unsigned entries. A bad signature,
a truncated or altered value, or an artifact whose sha256 differs: one warning, nothing loaded, the
entry compiled locally and published again over it (in the reader's own namespace, which its
fleet verifies).

Faults: every Redis call has bounded timeouts (connect 100 ms, reads 1 s by default: the config's
``remote_connect_timeout_ms`` / ``remote_io_timeout_ms``). A failing server (down, slow, full,
evicting) costs one warning per process; the tier then rests for `REST_S` before it is tried
again, and the model runs from the local tier or a local compile. Nothing here raises into the
model once the tier is set up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigError
from ..fingerprint import canonical_json
from .store import (ARTIFACTS, FACTORS, GRAPH, INDEX, CacheIndexError, atomic_write, encode_index, make_dirs,
                    parse_index, read_index, report_once)

__all__ = ["RemoteCache", "RemoteEntry", "Lease", "claim_or_wait", "remote_cache", "remote_url", "REMOTE_FORMAT", "LEASE_MS",
           "REST_S", "UNSIGNED", "load_key", "key_id", "parse_envelope", "make_envelope"]

log = logging.getLogger("piecewise")

REMOTE_FORMAT = 1
#: compile lease: expires this long after the holder's last renewal (renewed every third of it)
LEASE_MS = 15_000
#: after a failed call the tier is not tried again for this long (seconds)
REST_S = 30.0
#: calls in a row that each take over half their time budget before the tier rests
SLOW_CALLS = 3
#: warm-start bundles of a start key pulled from Redis at most (newest first), and kept listed per tag
BUNDLES_PULLED = 3
BUNDLES_LISTED = 8
#: longest wait for another process's compile of the same entry before compiling here (seconds);
#: PIECEWISE_REMOTE_WAIT_S overrides
WAIT_S = 1800.0
_MAGIC = b"PWR1 "
_MIN_KEY_BYTES = 16


def remote_url(configured: str | None) -> str | None:
    """The remote cache URL: the config's, else ``PIECEWISE_REMOTE_CACHE``, else None."""
    return configured or os.environ.get("PIECEWISE_REMOTE_CACHE") or None


#: the namespace of writers without a signing key
UNSIGNED = "unsigned"
_MAKE_KEY = 'python -c "import secrets; print(secrets.token_hex(32))"'


def load_key() -> bytes | None:
    """The signing key: ``PIECEWISE_CACHE_KEY`` (text, at least 16 bytes) or the contents of
    ``PIECEWISE_CACHE_KEY_FILE`` (a regular file owned by this user that no one else can read or
    write, at least 16 bytes); None when neither is set.

    Raises:
        ConfigError: a key is set that would not be used (too short; a key file that is not
            private, not a regular file, or unreadable). Silently going unsigned would split the
            fleet (docs/design.md §5.6); the message names the remedy.
    """
    text = os.environ.get("PIECEWISE_CACHE_KEY")
    path = os.environ.get("PIECEWISE_CACHE_KEY_FILE")
    if text:
        key, source = text.encode(), "PIECEWISE_CACHE_KEY"
    elif path:
        source = f"PIECEWISE_CACHE_KEY_FILE={path}"
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
                raise ConfigError(f"piecewise remote cache: the key file {path} (PIECEWISE_CACHE_KEY_FILE) must be a "
                                  "regular file of this user that no one else can read or write; chmod 600 it")
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(f"piecewise remote cache: cannot read the key file {path} (PIECEWISE_CACHE_KEY_FILE): "
                              f"{e.strerror or e}") from None
    else:
        return None
    if len(key) < _MIN_KEY_BYTES:
        raise ConfigError(f"piecewise remote cache: the signing key ({source}) has {len(key)} bytes; it needs at least "
                          f"{_MIN_KEY_BYTES} (32 random bytes recommended). Make one with {_MAKE_KEY} and give the "
                          "same key to every replica of the fleet")
    return key


def key_id(key: bytes | None) -> str:
    """The namespace a writer with `key` publishes under: ``"unsigned"`` without a key, else
    ``"key-"`` and the first 16 hex digits of HMAC-SHA256(key, "piecewise cache key id") (a
    fingerprint that names the key without revealing it).

    Example: ``key_id(None) == "unsigned"``; ``key_id(b"0123456789abcdef")`` is ``"key-"`` + 16 hex.
    """
    if key is None:
        return UNSIGNED
    return "key-" + hmac.new(key, b"piecewise cache key id", hashlib.sha256).hexdigest()[:16]


def _allow_unsigned() -> bool:
    return os.environ.get("PIECEWISE_REMOTE_ALLOW_UNSIGNED", "").strip().lower() in ("1", "true", "yes", "on")


def make_envelope(body: dict[str, Any], key: bytes | None) -> bytes:
    """Serialise `body` (with its ``rel``) as an envelope, signed when `key` is given."""
    data = canonical_json(body)
    sig = hmac.new(key, data, hashlib.sha256).hexdigest().encode() if key else b"-"
    return _MAGIC + sig + b"\n" + data


def parse_envelope(raw: bytes, rel: str, key: bytes | None, allow_unsigned: bool) -> tuple[dict[str, Any] | None, str, bool]:
    """(body, '', signed) or (None, why it is refused, False). Checks the format, the signature
    under the reader's policy (module doc) and that the body names `rel`; `signed` says the body
    was accepted on a valid signature under `key` rather than as an allowed unsigned entry."""
    if not raw.startswith(_MAGIC) or b"\n" not in raw:
        return None, "not a piecewise envelope (truncated or foreign value)", False
    head, data = raw[len(_MAGIC):].split(b"\n", 1)
    signed = False
    if head == b"-":
        if not allow_unsigned:
            return None, "unsigned (set PIECEWISE_REMOTE_ALLOW_UNSIGNED=1 to load unsigned entries)", False
    elif key is not None:
        good = hmac.new(key, data, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(good, head):
            return None, "signature does not match this key (altered, truncated, or written by a writer without it)", False
        signed = True
    elif not allow_unsigned:
        return None, "signed, but this process has no key to verify it (set PIECEWISE_CACHE_KEY)", False
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not valid JSON ({e})", False
    if not isinstance(body, dict) or body.get("rel") != rel or not isinstance(body.get("index"), dict):
        return None, "names another entry", False
    return body, "", signed


def _key_level(e: BaseException) -> bool:
    """A server error reply about one key (WRONGTYPE, a bad script argument), as opposed to the
    server failing (connection, timeout, out of memory, read-only replica)."""
    try:
        import redis
    except ImportError:
        return False
    full = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
    # inside a script, a full server answers a generic error that names OOM
    return (isinstance(e, redis.exceptions.ResponseError) and not isinstance(e, full)
            and "OOM" not in str(e) and "maxmemory" not in str(e))


def valid_rel(rel: str) -> bool:
    """Whether `rel` has the shape of a local entry path, ``<key>/rank_<r>_<d>/<tag>``, with no
    part that could leave the cache root (entry names come from Redis key names)."""
    import re

    parts = rel.split("/")
    return (len(parts) == 3 and re.fullmatch(r"[0-9a-f][0-9a-f-]*", parts[0]) is not None
            and re.fullmatch(r"rank_\d+_\d+", parts[1]) is not None
            and bool(parts[2]) and not parts[2].startswith(".") and "\\" not in parts[2] and "\x00" not in parts[2])


@dataclasses.dataclass
class RemoteEntry:
    """One published entry as `RemoteCache.listing` finds it (for operators).

    Attributes:
        namespace: the writer's namespace (`key_id`): ``key-<16 hex>`` or ``unsigned``.
        rel: the entry, ``<key>/rank_<r>_<dp>/<tag>``.
        kind: ``"compile"`` or ``"bundle"`` (a warm-start bundle); ``"?"`` for an unreadable envelope.
        artifacts: artifacts its index names.
        bytes: the envelope's bytes plus its artifacts' (as the index records them).
        host, pid, time: the writer as the envelope records it (None when not recorded: an entry
            of an older version; for an envelope this process cannot verify, what it claims).
        state: what this process makes of it: ``"loads here (signed by this key)"``, ``"loads here
            (unsigned, allowed)"``, ``"not loaded here (...)"`` or ``"refused: <why>"``.
    """

    namespace: str
    rel: str
    kind: str
    artifacts: int
    bytes: int
    host: str | None
    pid: int | None
    time: float | None
    state: str


class RemoteCache:
    """One Redis server as the remote tier (module doc). Methods never raise: a Redis failure is
    reported once, rests the tier for `REST_S`, and reads as a miss.

    Args:
        url: the Redis URL.
        connect_timeout_ms, io_timeout_ms: the budget of one call (see `_call`).
        key: the signing key (at least 16 bytes; None: unsigned); by default `load_key` (the
            environment's), read once here.

    Raises:
        ConfigError: the key is set but unusable (`load_key`; a `key` under 16 bytes).

    Example::

        tier = RemoteCache("redis://cache:6379/0")   # PIECEWISE_CACHE_KEY signs and verifies
        tier.namespace                              # 'key-1f0c...' (or 'unsigned')
    """

    def __init__(self, url: str, connect_timeout_ms: int = 100, io_timeout_ms: int = 1000,
                 key: bytes | None | object = ...) -> None:
        self.url = url
        self.connect_timeout_ms = connect_timeout_ms
        self.io_timeout_ms = io_timeout_ms
        #: the signing key (None: this process writes unsigned entries)
        self.key: bytes | None = load_key() if key is ... else key  # type: ignore[assignment]
        if self.key is not None and len(self.key) < _MIN_KEY_BYTES:
            raise ConfigError(f"piecewise remote cache: the signing key has {len(self.key)} bytes; it needs at least "
                              f"{_MIN_KEY_BYTES}. Make one with {_MAKE_KEY}")
        #: this writer's namespace (`key_id`)
        self.namespace = key_id(self.key)
        #: shared keys (blobs)
        self.prefix = f"pw:{REMOTE_FORMAT}:"
        #: this writer's entries, leases and bundle lists
        self.ns_prefix = f"{self.prefix}{self.namespace}:"
        self._client: Any = None
        self._resting_until = 0.0
        self._slow = 0
        self._lock = threading.Lock()
        self._rejected: set[tuple[str, str]] = set()

    # -- plumbing -----------------------------------------------------------------------------
    def read_namespaces(self) -> list[str]:
        """The namespaces this process loads from, in order: its own when it has a key, then
        ``unsigned`` when ``PIECEWISE_REMOTE_ALLOW_UNSIGNED`` is set (none for a keyless process
        that does not allow unsigned entries)."""
        out = [self.namespace] if self.key is not None else []
        if _allow_unsigned():
            out.append(UNSIGNED)
        return out

    def _redis(self) -> Any:
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(
                self.url, socket_connect_timeout=self.connect_timeout_ms / 1000, socket_timeout=self.io_timeout_ms / 1000,
                retry_on_timeout=False, health_check_interval=0)
        return self._client

    def _call(self, what: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """Run `fn(client)` within ``io_timeout_ms`` in total (redis-py's socket timeout bounds each
        read, not a reply trickled byte by byte, so the call runs in a daemon thread and is
        abandoned, its connections closed, at the deadline). A failure or an overrun is reported
        once, rests the tier for `REST_S` and returns `default`; so do `SLOW_CALLS` calls in a row
        that each take over half the budget. A reply the server sends as an error about one key
        (WRONGTYPE, say) is reported once and returns `default` without resting the tier."""
        if time.monotonic() < self._resting_until:
            return default
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(self._redis())
            except BaseException as e:  # handed to the caller's thread below
                box["error"] = e

        budget = self.io_timeout_ms / 1000 + self.connect_timeout_ms / 1000
        t0 = time.monotonic()
        worker = threading.Thread(target=run, name="piecewise-remote-call", daemon=True)
        worker.start()
        worker.join(budget)
        took = time.monotonic() - t0
        if worker.is_alive():
            self._drop_connections()
            return self._fail(what, TimeoutError(f"no complete reply within {budget * 1000:.0f} ms"), default)
        e = box.get("error")
        if e is None:
            self._slow = self._slow + 1 if took > budget / 2 else 0
            if self._slow >= SLOW_CALLS:
                self._slow = 0
                return self._fail(what, TimeoutError(f"{SLOW_CALLS} calls in a row took over half of "
                                                     f"{budget * 1000:.0f} ms"), box.get("value"))
            return box.get("value")
        if _key_level(e):
            report_once(f"remote-key:{self.url}:{what}", f"piecewise remote cache {self.url} refused to {what} "
                        f"({type(e).__name__}: {e}); treating that key as missing")
            return default
        return self._fail(what, e, default)

    def _fail(self, what: str, e: BaseException, default: Any) -> Any:
        from ..counters import counters

        counters.bump("remote_errors")
        self._resting_until = time.monotonic() + REST_S
        report_once(f"remote:{self.url}:{type(e).__name__}",
                    f"piecewise remote cache {self.url} failed to {what} ({type(e).__name__}: {e}); using the "
                    f"local cache and compiling locally, retrying the remote in {REST_S:.0f} s")
        return default

    def _drop_connections(self) -> None:
        """Close every pooled connection (unblocks an abandoned call); the next call reconnects."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.connection_pool.disconnect()
            except Exception as e:  # closing a broken socket may itself fail; nothing more to do
                log.debug("remote cache: closing connections failed (%s)", e)

    def resting(self) -> bool:
        """Whether a recent failure rests the tier (calls return their default without trying)."""
        return time.monotonic() < self._resting_until

    def available(self) -> bool:
        """Whether the server answers a PING now."""
        return bool(self._call("answer a ping", lambda r: r.ping(), False))

    # -- reading ------------------------------------------------------------------------------
    def pull(self, root: str, rel: str) -> bool:
        """Copy entry `rel` from Redis into the local store under `root` if Redis has a valid one;
        True when a local index was written. Artifacts missing from Redis (evicted) are left out of
        the local index, so those pieces compile here."""
        if not valid_rel(rel):
            self._reject(rel, "its name is not an entry path (<key>/rank_<r>_<d>/<tag>)")
            return False
        for ns in self.read_namespaces():
            raw = self._call("read an entry", lambda r, ns=ns: r.get(f"{self.prefix}{ns}:entry:{rel}"))
            if not isinstance(raw, bytes):
                continue
            # a signed namespace holds only its key's signatures; unsigned ones only where allowed
            body, why, signed = parse_envelope(raw, rel, self.key, ns == UNSIGNED)
            if body is None:
                self._reject(rel, why)
                continue
            return self._write_local(root, rel, body, signed)
        return False

    def _write_local(self, root: str, rel: str, body: dict[str, Any], signed: bool) -> bool:
        """Check a trusted envelope's index, fetch and verify its artifacts and write the entry
        under `root` (the second half of `pull`)."""
        idx = body["index"]
        try:  # the same checks as a local index (format, checksum, paths inside the root)
            _check_index(idx, rel)
        except CacheIndexError as e:
            self._reject(rel, f"its index is unusable ({e})")
            return False
        arts = idx["artifacts"]
        names = list(arts)
        blobs = self._call("read artifacts", lambda r: r.mget([self.prefix + "blob:" + arts[n]["sha256"] for n in names]))
        if blobs is None:
            return False
        kept: dict[str, Any] = {}
        entry_dir = os.path.join(root, *rel.split("/"))
        try:
            for name, data in zip(names, blobs):
                rec = arts[name]
                if data is None:
                    log.info("remote cache: artifact %s of %s was evicted; that piece compiles here", name, rel)
                    continue
                if len(data) != rec["bytes"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
                    self._reject(rel, f"artifact {name} does not match its signed sha256")
                    # a content-addressed value that does not hash to its name is wrong for everyone
                    self._call("drop a damaged artifact", lambda r: r.delete(self.prefix + "blob:" + rec["sha256"]))
                    continue
                if not signed:
                    # accepted only because unsigned entries are allowed: never signed by this
                    # process's publish later (that would launder it for strict readers)
                    rec = {**rec, "unsigned": True}
                path = os.path.join(root, *rec["file"].split("/"))
                if not os.path.isfile(path):
                    make_dirs(os.path.dirname(path))
                    atomic_write(path, data)
                kept[name] = rec
            make_dirs(entry_dir)
            for fname in (FACTORS, GRAPH):
                text = body.get("files", {}).get(fname)
                if isinstance(text, str):
                    atomic_write(os.path.join(entry_dir, fname), text.encode())
            local = {k: v for k, v in idx.items() if k != "checksum"}
            local["artifacts"] = kept
            atomic_write(os.path.join(entry_dir, INDEX), encode_index(local))
        except OSError as e:
            report_once(f"pull:{root}", f"piecewise remote cache: cannot write {entry_dir} ({e}); compiling locally")
            return False
        from ..counters import counters

        counters.bump("remote_pulls")
        log.info("remote cache: pulled %s (%d of %d artifacts) from %s", rel, len(kept), len(arts), self.url)
        return True

    def bundle_rels(self, rank_dir: str, tag: str, prefix: str = "") -> list[str]:
        """Published warm-start bundle rels of `tag` whose key starts with `prefix`, from the
        namespaces this process reads (its own first), newest first within each."""
        out: list[str] = []
        for ns in self.read_namespaces():
            rels = self._call("list bundles", lambda r, ns=ns: r.zrevrange(f"{self.prefix}{ns}:bundles:{rank_dir}/{tag}", 0, -1),
                              []) or []
            for x in rels:
                x = x.decode(errors="replace") if isinstance(x, bytes) else str(x)
                if x.startswith(prefix) and valid_rel(x) and x not in out:
                    out.append(x)
        return out

    def _scan(self, pattern: str) -> list[tuple[str, str, bytes]]:
        """(namespace, rel, Redis key) of every entry key matching `pattern` (SCAN), sorted."""
        keys = self._call("list entries", lambda r: list(r.scan_iter(match=pattern, count=500)), []) or []
        out = []
        for k in keys:
            name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
            ns, sep, rest = name[len(self.prefix):].partition(":")
            rel = rest[len("entry:"):]
            if sep and rest.startswith("entry:") and (ns == UNSIGNED or ns.startswith("key-")) and valid_rel(rel):
                out.append((ns, rel, k if isinstance(k, bytes) else k.encode()))
            else:
                log.warning("remote cache: ignoring Redis key %r: not an entry path", k)
        return sorted(out)

    def entries(self) -> Iterator[str]:
        """Every published entry rel this process would load from (its read namespaces; SCAN:
        for operators, not the serving path)."""
        seen: set[str] = set()
        for ns in self.read_namespaces():
            for _, rel, _ in self._scan(f"{self.prefix}{ns}:entry:*"):
                if rel not in seen:
                    seen.add(rel)
                    yield rel

    def listing(self) -> list[RemoteEntry]:
        """Every published entry of every namespace, with its writer and what this process makes
        of it (`RemoteEntry`), sorted by namespace and rel; for ``piecewise cache ls --remote``."""
        found = self._scan(f"{self.prefix}*:entry:*")
        raws = self._call("read entries", lambda r: r.mget([k for _, _, k in found]), None) if found else []
        out = []
        for (ns, rel, _), raw in zip(found, raws or []):
            if not isinstance(raw, bytes):
                continue  # gone since the scan
            out.append(self._describe(ns, rel, raw))
        return out

    def _describe(self, ns: str, rel: str, raw: bytes) -> RemoteEntry:
        if ns == UNSIGNED:
            state = ("loads here (unsigned, allowed by PIECEWISE_REMOTE_ALLOW_UNSIGNED)" if _allow_unsigned()
                     else "not loaded here (unsigned; PIECEWISE_REMOTE_ALLOW_UNSIGNED=1 loads it)")
            body, why, _ = parse_envelope(raw, rel, None, True)
        elif ns != self.namespace:
            state = "not loaded here (signed by another key)"
            body, why, _ = parse_envelope(raw, rel, None, True)  # read, not verified: shown as claimed
        else:
            body, why, _ = parse_envelope(raw, rel, self.key, False)
            state = "loads here (signed by this key)"
        if body is None:
            return RemoteEntry(ns, rel, "?", 0, len(raw), None, None, None, f"refused: {why}")
        idx = body["index"]
        arts = idx.get("artifacts") if isinstance(idx.get("artifacts"), dict) else {}
        size = len(raw) + sum(r.get("bytes", 0) for r in arts.values() if isinstance(r, dict) and isinstance(r.get("bytes"), int))
        meta = idx.get("meta") if isinstance(idx.get("meta"), dict) else {}
        w = body.get("writer") if isinstance(body.get("writer"), dict) else {}
        return RemoteEntry(ns, rel, "bundle" if meta.get("kind") == "bundle" else "compile", len(arts), size,
                           w.get("host") if isinstance(w.get("host"), str) else None,
                           w.get("pid") if isinstance(w.get("pid"), int) else None,
                           w.get("time") if isinstance(w.get("time"), (int, float)) else None, state)

    def _reject(self, rel: str, why: str) -> None:
        from ..counters import counters

        if (rel, why) not in self._rejected:  # a value looked at twice (before and after a lease) counts once
            self._rejected.add((rel, why))
            counters.bump("remote_rejects")
        report_once(f"remote-reject:{rel}", f"piecewise remote cache: not loading {rel} from {self.url}: {why}; "
                    "compiling it locally and publishing it again")

    # -- writing ------------------------------------------------------------------------------
    def publish(self, root: str, rel: str) -> bool:
        """Publish local entry `rel`: artifacts Redis lacks first, then the envelope (and, for a
        warm-start bundle, its place in the tag's bundle list). True when the envelope was written."""
        entry_dir = os.path.join(root, *rel.split("/"))
        try:
            idx = read_index(os.path.join(entry_dir, INDEX))
            files = {}
            for fname in (FACTORS, GRAPH):
                try:
                    with open(os.path.join(entry_dir, fname), encoding="utf-8") as f:
                        files[fname] = f.read()
                except FileNotFoundError:
                    pass
        except (OSError, CacheIndexError, UnicodeDecodeError) as e:
            log.info("remote cache: %s not published (%s: %s)", rel, type(e).__name__, e)
            return False
        arts = idx["artifacts"]
        key = self.key
        if key is not None and any(rec.get("unsigned") for rec in arts.values()):
            log.info("remote cache: %s holds artifacts pulled from unsigned entries; not publishing it under "
                     "this process's key", rel)
            return False
        keys = [self.prefix + "blob:" + rec["sha256"] for rec in arts.values()]

        def exists(r: Any) -> list[bool]:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)  # one EXISTS per key: a multi-key EXISTS returns only a count
            return [bool(x) for x in pipe.execute()]

        have = self._call("check artifacts", exists, None) if keys else []
        if have is None or len(have) != len(keys):
            return False
        for (name, rec), present in zip(arts.items(), have):
            if present:
                continue
            try:
                with open(os.path.join(root, *rec["file"].split("/")), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if hashlib.sha256(data).hexdigest() != rec["sha256"]:
                continue  # the local file changed under us; the index is rewritten by its next commit
            if not self._call("write an artifact", lambda r: r.set(self.prefix + "blob:" + rec["sha256"], data), False):
                return False
        writer = {"namespace": self.namespace, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        envelope = make_envelope({"rel": rel, "index": idx, "files": files, "writer": writer}, key)
        # only into this writer's namespace: an entry another key signed is never replaced here
        if not self._call("write an entry", lambda r: r.set(self.ns_prefix + "entry:" + rel, envelope), False):
            return False
        if idx.get("meta", {}).get("kind") == "bundle":
            parts = rel.split("/")
            listing = self.ns_prefix + f"bundles:{parts[1]}/{parts[2]}"

            def list_bundle(r: Any) -> None:
                pipe = r.pipeline(transaction=False)
                pipe.zadd(listing, {rel: time.time()})
                pipe.zremrangebyrank(listing, 0, -BUNDLES_LISTED - 1)  # keep the newest
                pipe.execute()

            self._call("list a bundle", list_bundle)
        from ..counters import counters

        counters.bump("remote_publishes")
        log.info("remote cache: published %s (%d artifacts) to %s as %s", rel, len(arts), self.url, self.namespace)
        return True

    # -- compile leases -----------------------------------------------------------------------
    def lease(self, rel: str) -> "Lease | None":
        """Take the compile lease of `rel` (None: another process holds it, or Redis failed)."""
        token = secrets.token_hex(16)
        got = self._call("take a compile lease", lambda r: r.eval(_ACQUIRE, 1, self.ns_prefix + "lease:" + rel, token, LEASE_MS),
                         None)
        return Lease(self, rel, token) if got else None

    def holder_alive(self, rel: str) -> bool:
        """Whether some process holds the compile lease of `rel` now (a string with an expiry: a
        key without one, or of another type, is no lease and is replaced by the next `lease`)."""
        ttl = self._call("read a compile lease", lambda r: r.pttl(self.ns_prefix + "lease:" + rel), -2)
        return isinstance(ttl, int) and ttl > 0


_ACQUIRE = """
local t = redis.call('type', KEYS[1])['ok']
if t ~= 'none' and (t ~= 'string' or redis.call('pttl', KEYS[1]) < 0) then redis.call('del', KEYS[1]) end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 else return 0 end
"""
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class Lease:
    """A held compile lease: renewed by a daemon thread every third of `LEASE_MS` until `release`
    (or until the process dies, after which it expires)."""

    def __init__(self, remote: RemoteCache, rel: str, token: str) -> None:
        self.remote, self.rel, self.token = remote, rel, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="piecewise-remote-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        key = self.remote.ns_prefix + "lease:" + self.rel
        while not self._stop.wait(LEASE_MS / 3000):
            self.remote._call("renew a compile lease", lambda r: r.eval(_RENEW, 1, key, self.token, LEASE_MS))

    def release(self) -> None:
        self._stop.set()
        key = self.remote.ns_prefix + "lease:" + self.rel
        self.remote._call("release a compile lease", lambda r: r.eval(_RELEASE, 1, key, self.token))


def claim_or_wait(remote: RemoteCache, root: str, rel: str, reopen: Callable[[], bool]) -> Lease | None:
    """Before compiling entry `rel`: take its compile lease, or wait for the process holding it to
    publish the entry.

    Returns the held `Lease` (compile, commit, then `Lease.release`), or None: `reopen()` (the
    caller's read-through open of the entry) found it published, or the tier failed or the wait
    ran past ``PIECEWISE_REMOTE_WAIT_S`` (default `WAIT_S`; then this process compiles without a
    lease, with a warning). A holder that dies stops renewing its lease, which expires within
    `LEASE_MS`; the first waiter to see it gone takes it over. Every lease taken is followed by one
    more `reopen()`: the entry may have been published between the caller's miss and the lease."""
    if remote.namespace not in remote.read_namespaces():
        return None  # keyless and unsigned entries not allowed: nothing another process publishes loads here
    lease = remote.lease(rel)
    if lease is not None:
        # the caller's miss came before this lease: a holder may have published the entry and let go
        # in between (it publishes, then releases), so look once more before compiling it again
        if reopen():
            lease.release()
            return None
        return lease
    if remote.resting():
        return None
    from ..counters import counters

    counters.bump("remote_waits")
    log.info("remote cache: another process is compiling %s; waiting for it to publish", rel)
    try:
        wait_s = float(os.environ.get("PIECEWISE_REMOTE_WAIT_S", WAIT_S))
    except ValueError:
        wait_s = WAIT_S
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if reopen():
            return None
        if remote.resting():
            return None
        if not remote.holder_alive(rel):
            lease = remote.lease(rel)
            if lease is not None:
                if reopen():  # published just before its holder let go
                    lease.release()
                    return None
                log.info("remote cache: the compile lease of %s was given up without a publication; compiling here",
                         rel)
                return lease
            if not remote.holder_alive(rel):  # nobody holds it and it cannot be taken: no leases here
                report_once(f"remote-lease:{remote.url}", f"piecewise remote cache {remote.url}: the compile lease of "
                            f"{rel} can be neither taken nor seen held; compiling without it")
                return None
    report_once(f"remote-wait:{rel}", f"piecewise remote cache: waited {wait_s:.0f} s for another process to publish "
                f"{rel}; compiling it here too")
    return None


def _check_index(idx: dict[str, Any], rel: str) -> None:
    """Validate a pulled index as `read_index` validates a local one, and require every artifact
    file to lie in the entry's own ``artifacts/`` dir."""
    checked = parse_index(canonical_json(idx))
    if checked["key"] != rel.split("/")[0]:
        raise CacheIndexError(f"index key {checked['key']!r} is not the entry's")
    for name, rec in checked["artifacts"].items():
        rest = rec["file"][len(f"{rel}/{ARTIFACTS}/"):]
        if not rec["file"].startswith(f"{rel}/{ARTIFACTS}/") or not rest or "/" in rest:
            raise CacheIndexError(f"artifact {name!r} lies outside the entry ({rec['file']!r})")


_tiers: dict[tuple[str, int, int, str], RemoteCache] = {}
_tiers_lock = threading.Lock()


def remote_cache(url: str | None, connect_timeout_ms: int = 100, io_timeout_ms: int = 1000) -> RemoteCache | None:
    """The process's `RemoteCache` for `url` (one client per URL, timeouts and signing key); None
    without a URL.

    Raises:
        ConfigError: a signing key is set that would not be used (`load_key`).
    """
    if not url:
        return None
    key = load_key()
    if key is None and not _allow_unsigned():
        report_once(f"remote-nokey:{url}", f"piecewise remote cache {url}: no signing key (PIECEWISE_CACHE_KEY): this "
                    "process loads nothing from it and publishes its entries unsigned, beside the fleet's signed ones; "
                    "give it the fleet's key, or set PIECEWISE_REMOTE_ALLOW_UNSIGNED=1 on every replica of a fleet "
                    "without one")
    with _tiers_lock:
        k = (url, connect_timeout_ms, io_timeout_ms, key_id(key))
        if k not in _tiers:
            _tiers[k] = RemoteCache(url, connect_timeout_ms, io_timeout_ms, key=key)
        return _tiers[k]
