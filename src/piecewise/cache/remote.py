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

    entry:<rel>                 the envelope of local entry <rel> (<key>/rank_<r>_<dp>/<tag>)
    blob:<sha256>               an artifact's bytes (content-addressed: equal pieces share one)
    lease:<rel>                 the compile lease of <rel> (a random token; expires)
    bundles:<rank_dir>/<tag>    sorted set of warm-start bundle rels (score: publish time)

Trust: loading an artifact runs its code, so a writable Redis must not be a way in. An envelope is
``b"PWR1 " + <hex HMAC-SHA256 or "-"> + b"\\n" + <canonical JSON>``; the JSON names its own
<rel>, so a valid envelope cannot be replayed under another entry. A reader with a key
(``PIECEWISE_CACHE_KEY``, or ``PIECEWISE_CACHE_KEY_FILE``: a file only its owner can read) loads
only envelopes its key signed; unsigned ones only with ``PIECEWISE_REMOTE_ALLOW_UNSIGNED=1``, which
is also the only way a reader without a key loads anything. A bad signature, a truncated or altered
value, or an artifact whose sha256 differs: one warning, nothing loaded, the entry compiled
locally and published again over it.

Faults: every Redis call has bounded timeouts (connect 100 ms, reads 1 s by default: the config's
``remote_connect_timeout_ms`` / ``remote_io_timeout_ms``). A failing server (down, slow, full,
evicting) costs one warning per process; the tier then rests for `REST_S` before it is tried
again, and the model runs from the local tier or a local compile. Nothing here raises into the
model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..fingerprint import canonical_json
from .store import (ARTIFACTS, FACTORS, GRAPH, INDEX, CacheIndexError, atomic_write, encode_index, make_dirs,
                    parse_index, read_index, report_once)

__all__ = ["RemoteCache", "Lease", "claim_or_wait", "remote_cache", "remote_url", "REMOTE_FORMAT", "LEASE_MS", "REST_S", "load_key",
           "parse_envelope", "make_envelope"]

log = logging.getLogger("piecewise")

REMOTE_FORMAT = 1
#: compile lease: expires this long after the holder's last renewal (renewed every third of it)
LEASE_MS = 15_000
#: after a failed call the tier is not tried again for this long (seconds)
REST_S = 30.0
#: longest wait for another process's compile of the same entry before compiling here (seconds);
#: PIECEWISE_REMOTE_WAIT_S overrides
WAIT_S = 1800.0
_MAGIC = b"PWR1 "
_MIN_KEY_BYTES = 16


def remote_url(configured: str | None) -> str | None:
    """The remote cache URL: the config's, else ``PIECEWISE_REMOTE_CACHE``, else None."""
    return configured or os.environ.get("PIECEWISE_REMOTE_CACHE") or None


def load_key() -> bytes | None:
    """The signing key: ``PIECEWISE_CACHE_KEY`` (text, at least 16 bytes) or the contents of
    ``PIECEWISE_CACHE_KEY_FILE`` (a regular file owned by this user that no one else can read or
    write). None, with one warning, when the key is too short or the file is not private."""
    text = os.environ.get("PIECEWISE_CACHE_KEY")
    path = os.environ.get("PIECEWISE_CACHE_KEY_FILE")
    if text:
        key = text.encode()
    elif path:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
                report_once(f"keyfile:{path}", f"piecewise remote cache: key file {path} must be a regular file of "
                            "this user readable by no one else (chmod 600); not signing or verifying with it")
                return None
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            report_once(f"keyfile:{path}", f"piecewise remote cache: cannot read key file {path} ({e})")
            return None
    else:
        return None
    if len(key) < _MIN_KEY_BYTES:
        report_once("key:short", f"piecewise remote cache: the signing key has {len(key)} bytes; give at least "
                    f"{_MIN_KEY_BYTES} (e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
        return None
    return key


def _allow_unsigned() -> bool:
    return os.environ.get("PIECEWISE_REMOTE_ALLOW_UNSIGNED", "").strip().lower() in ("1", "true", "yes", "on")


def make_envelope(body: dict[str, Any], key: bytes | None) -> bytes:
    """Serialise `body` (with its ``rel``) as an envelope, signed when `key` is given."""
    data = canonical_json(body)
    sig = hmac.new(key, data, hashlib.sha256).hexdigest().encode() if key else b"-"
    return _MAGIC + sig + b"\n" + data


def parse_envelope(raw: bytes, rel: str, key: bytes | None, allow_unsigned: bool) -> tuple[dict[str, Any] | None, str]:
    """The envelope's body, or (None, why it is refused). Checks the format, the signature under
    the reader's policy (module doc) and that the body names `rel`."""
    if not raw.startswith(_MAGIC) or b"\n" not in raw:
        return None, "not a piecewise envelope (truncated or foreign value)"
    head, data = raw[len(_MAGIC):].split(b"\n", 1)
    if head == b"-":
        if not allow_unsigned:
            return None, "unsigned (set PIECEWISE_REMOTE_ALLOW_UNSIGNED=1 to load unsigned entries)"
    elif key is not None:
        good = hmac.new(key, data, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(good, head):
            return None, "signature does not match this key (altered, truncated, or written by a writer without it)"
    elif not allow_unsigned:
        return None, "signed, but this process has no key to verify it (set PIECEWISE_CACHE_KEY)"
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not valid JSON ({e})"
    if not isinstance(body, dict) or body.get("rel") != rel or not isinstance(body.get("index"), dict):
        return None, "names another entry"
    return body, ""


class RemoteCache:
    """One Redis server as the remote tier (module doc). Methods never raise: a Redis failure is
    reported once, rests the tier for `REST_S`, and reads as a miss."""

    def __init__(self, url: str, connect_timeout_ms: int = 100, io_timeout_ms: int = 1000) -> None:
        self.url = url
        self.connect_timeout_ms = connect_timeout_ms
        self.io_timeout_ms = io_timeout_ms
        self.prefix = f"pw:{REMOTE_FORMAT}:"
        self._client: Any = None
        self._resting_until = 0.0
        self._lock = threading.Lock()

    # -- plumbing -----------------------------------------------------------------------------
    @property
    def key(self) -> bytes | None:
        return load_key()

    def _redis(self) -> Any:
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(
                self.url, socket_connect_timeout=self.connect_timeout_ms / 1000, socket_timeout=self.io_timeout_ms / 1000,
                retry_on_timeout=False, health_check_interval=0)
        return self._client

    def _call(self, what: str, fn: Callable[[Any], Any], default: Any = None) -> Any:
        """Run `fn(client)`; on any Redis or socket failure report once, rest, return `default`."""
        if time.monotonic() < self._resting_until:
            return default
        try:
            return fn(self._redis())
        except Exception as e:  # redis.RedisError, OSError, a bad URL: all read as "remote unavailable"
            from ..counters import counters

            counters.bump("remote_errors")
            self._resting_until = time.monotonic() + REST_S
            report_once(f"remote:{self.url}:{type(e).__name__}",
                        f"piecewise remote cache {self.url} failed to {what} ({type(e).__name__}: {e}); using the "
                        f"local cache and compiling locally, retrying the remote in {REST_S:.0f} s")
            return default

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
        raw = self._call("read an entry", lambda r: r.get(self.prefix + "entry:" + rel))
        if raw is None:
            return False
        body, why = parse_envelope(raw, rel, self.key, _allow_unsigned())
        if body is None:
            self._reject(rel, why)
            return False
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
                    continue
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
        """Published warm-start bundle rels of `tag`, newest first, whose key starts with `prefix`."""
        rels = self._call("list bundles", lambda r: r.zrevrange(self.prefix + f"bundles:{rank_dir}/{tag}", 0, -1), []) or []
        out = [x.decode() if isinstance(x, bytes) else str(x) for x in rels]
        return [x for x in out if x.startswith(prefix)]

    def entries(self) -> Iterator[str]:
        """Every published entry rel (SCAN: for operators, not the serving path)."""
        keys = self._call("list entries", lambda r: list(r.scan_iter(match=self.prefix + "entry:*", count=500)), []) or []
        n = len(self.prefix + "entry:")
        for k in sorted(keys):
            yield (k.decode() if isinstance(k, bytes) else k)[n:]

    def status(self, rel: str) -> str:
        """What a reader here would make of entry `rel`: ``signed``, ``unsigned``, ``signed (no
        key here to verify it)``, ``refused: <why>``, or ``gone``."""
        raw = self._call("read an entry", lambda r: r.get(self.prefix + "entry:" + rel))
        if raw is None:
            return "gone"
        if raw.startswith(_MAGIC) and raw[len(_MAGIC):].split(b"\n", 1)[0] == b"-":
            return "unsigned"
        key = self.key
        if key is None and raw.startswith(_MAGIC):
            return "signed (no key here to verify it)"
        body, why = parse_envelope(raw, rel, key, False)
        return "signed" if body is not None else f"refused: {why}"

    def _reject(self, rel: str, why: str) -> None:
        from ..counters import counters

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
        keys = [self.prefix + "blob:" + rec["sha256"] for rec in arts.values()]
        have = self._call("check artifacts", lambda r: [bool(x) for x in r.pipeline().exists(*keys).execute()] if keys
                          else [], None) if keys else []
        if have is None:
            return False
        for (name, rec), present in zip(arts.items(), have if len(have) == len(keys) else [False] * len(keys)):
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
        envelope = make_envelope({"rel": rel, "index": idx, "files": files}, self.key)
        if not self._call("write an entry", lambda r: r.set(self.prefix + "entry:" + rel, envelope), False):
            return False
        if idx.get("meta", {}).get("kind") == "bundle":
            parts = rel.split("/")
            self._call("list a bundle", lambda r: r.zadd(self.prefix + f"bundles:{parts[1]}/{parts[2]}", {rel: time.time()}))
        from ..counters import counters

        counters.bump("remote_publishes")
        log.info("remote cache: published %s (%d artifacts) to %s", rel, len(arts), self.url)
        return True

    # -- compile leases -----------------------------------------------------------------------
    def lease(self, rel: str) -> "Lease | None":
        """Take the compile lease of `rel` (None: another process holds it, or Redis failed)."""
        token = secrets.token_hex(16)
        got = self._call("take a compile lease", lambda r: r.set(self.prefix + "lease:" + rel, token, nx=True, px=LEASE_MS),
                         None)
        return Lease(self, rel, token) if got else None

    def holder_alive(self, rel: str) -> bool:
        """Whether some process holds the compile lease of `rel` now."""
        return bool(self._call("read a compile lease", lambda r: r.exists(self.prefix + "lease:" + rel), 0))


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
        key = self.remote.prefix + "lease:" + self.rel
        while not self._stop.wait(LEASE_MS / 3000):
            self.remote._call("renew a compile lease", lambda r: r.eval(_RENEW, 1, key, self.token, LEASE_MS))

    def release(self) -> None:
        self._stop.set()
        key = self.remote.prefix + "lease:" + self.rel
        self.remote._call("release a compile lease", lambda r: r.eval(_RELEASE, 1, key, self.token))


def claim_or_wait(remote: RemoteCache, root: str, rel: str, reopen: Callable[[], bool]) -> Lease | None:
    """Before compiling entry `rel`: take its compile lease, or wait for the process holding it to
    publish the entry.

    Returns the held `Lease` (compile, commit, then `Lease.release`), or None: `reopen()` (the
    caller's read-through open of the entry) found it published, or the tier failed or the wait
    ran past ``PIECEWISE_REMOTE_WAIT_S`` (default `WAIT_S`; then this process compiles without a
    lease, with a warning). A holder that dies stops renewing its lease, which expires within
    `LEASE_MS`; the first waiter to see it gone takes it over."""
    lease = remote.lease(rel)
    if lease is not None or remote.resting():
        return lease
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


_tiers: dict[tuple[str, int, int], RemoteCache] = {}
_tiers_lock = threading.Lock()


def remote_cache(url: str | None, connect_timeout_ms: int = 100, io_timeout_ms: int = 1000) -> RemoteCache | None:
    """The process's `RemoteCache` for `url` (one client per URL and timeouts); None without a URL."""
    if not url:
        return None
    with _tiers_lock:
        k = (url, connect_timeout_ms, io_timeout_ms)
        if k not in _tiers:
            _tiers[k] = RemoteCache(url, connect_timeout_ms, io_timeout_ms)
        return _tiers[k]
