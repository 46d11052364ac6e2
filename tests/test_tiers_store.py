"""The storage half of the KV tiers (``hotprefix.cache.tiers``): blobs, the host, disk and Redis
backends, and the stack that verifies every load. No model; the Redis tests run against a real
Valkey server (``tests/valkey_support.py``)."""

from __future__ import annotations

import hashlib
import os
import random
import stat
import threading
import time
from pathlib import Path

import pytest
import redis

from hotprefix.cache.tiers import (BLOB_VERSION, TIER_KINDS, BadSignature, CorruptEntry, TierEntry,
                                   TierStack, decode_blob, encode_blob, make_tier)
from hotprefix.cache.tiers.blob import storage_key
from hotprefix.cache.tiers.redis_tier import KEY_PREFIX
from valkey_support import valkey_server

LAYOUT = "float32/l2/kv2/d8/b4"
PAYLOAD_LEN = 4096
BLOCK = 4


def chain(n: int, seed: int = 0, root: bytes = b"namespace") -> tuple[list[TierEntry], list[bytes]]:
    """``n`` chained entries with random token ids and random payloads."""
    rng = random.Random(seed)
    entries, payloads, parent = [], [], hashlib.sha256(root).digest()
    for _ in range(n):
        toks = tuple(rng.randrange(50_000) for _ in range(BLOCK))
        key = hashlib.sha256(parent + repr(toks).encode()).digest()
        entries.append(TierEntry(key, parent, toks))
        payloads.append(rng.randbytes(PAYLOAD_LEN))
        parent = key
    return entries, payloads


def wait_until_retry_time(stack: TierStack) -> None:
    """Wait (on the condition, not a guessed delay) until every degraded tier may be tried again."""
    deadline = time.monotonic() + 60  # only a hang guard
    while not all(h.available() for h in stack._health):
        assert time.monotonic() < deadline, "a degraded tier's retry time never came"
        time.sleep(0.01)


def store_all(stack: TierStack, entries, payloads, **kw) -> None:
    for e, p in zip(entries, payloads):
        assert stack.store(e, p, **kw)
    assert stack.flush(10)


def blob_of(e: TierEntry, payload: bytes, layout: str = LAYOUT, secret: bytes | None = None) -> bytes:
    return encode_blob(e.key, e.parent, e.token_ids, layout, payload, secret=secret)


@pytest.fixture(scope="module")
def valkey():
    with valkey_server() as (url, server):
        yield url, server


@pytest.fixture
def redis_url(valkey):
    url, server = valkey
    server.start()  # a test may have stopped it
    redis.Redis.from_url(url).flushdb()
    return url


def tier_url(kind: str, tmp_path: Path, redis_url: str | None) -> str:
    return {"host": "host:64MiB", "disk": f"disk:{tmp_path / 'kv'}", "redis": redis_url}[kind]


# ---------------------------------------------------------------------- blobs
def test_blob_round_trip_and_every_check():
    entries, payloads = chain(2)
    e, p = entries[1], payloads[1]
    want = dict(key=e.key, parent=e.parent, token_ids=e.token_ids, layout=LAYOUT, payload_len=PAYLOAD_LEN)
    blob = blob_of(e, p)
    assert blob[:4] == b"HPKV" and BLOB_VERSION == 2
    assert decode_blob(blob, **want) == p
    assert decode_blob(memoryview(blob), **want) == p
    for field, value in [("key", b"x" * 32), ("parent", None), ("token_ids", (1, 2, 3, 4)),
                         ("layout", "bfloat16/l2/kv2/d8/b4"), ("payload_len", PAYLOAD_LEN - 1)]:
        with pytest.raises(CorruptEntry, match="mismatch|payload length"):
            decode_blob(blob, **{**want, field: value})
    for bad in (blob[:-1], blob[:7], b"", blob + b"\0", b"XXXX" + blob[4:],
                blob[:4] + b"\x09" + blob[5:]):  # another format version
        with pytest.raises(CorruptEntry):
            decode_blob(bad, **want)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_blob(bytes(flipped), **want)
    signed = blob_of(e, p, secret=b"one")
    assert decode_blob(signed, **want, secret=b"one") == p
    with pytest.raises(BadSignature):
        decode_blob(signed, **want, secret=b"two")
    with pytest.raises(BadSignature):
        decode_blob(blob, **want, secret=b"one")  # unsigned while a secret is required
    with pytest.raises(BadSignature):
        decode_blob(signed, **want)  # signed, no secret here
    assert len(storage_key(LAYOUT, e.key)) == 64
    assert storage_key(LAYOUT, e.key) != storage_key("bfloat16/l2/kv2/d8/b4", e.key)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", ["host", "disk", "redis"])
def test_round_trip_each_backend(kind, tmp_path, request):
    url = tier_url(kind, tmp_path, request.getfixturevalue("redis_url") if kind == "redis" else None)
    entries, payloads = chain(6, seed=sum(kind.encode()))
    with TierStack([url], LAYOUT) as stack:
        assert stack.names == [kind]
        assert stack.fetch_run(entries, PAYLOAD_LEN) == []
        store_all(stack, entries, payloads)
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.payload for b in got] == payloads
        assert {b.tier for b in got} == {kind}
        s = stack.stats()[kind]
        assert s["hit_blocks"] == 6 and s["bytes_read"] > 6 * PAYLOAD_LEN
        assert s["bytes_written"] > 6 * PAYLOAD_LEN and s["misses"] == 1  # the first, empty fetch: asked up to the first miss
        assert s["status"] == "ok" and s["errors"] == s["corrupt"] == s["dropped_writes"] == 0
        assert s["loads"] == 2 and s["load_seconds"] > 0
        if kind != "redis":
            assert s["entries"] == 6 and s["bytes"] > 6 * PAYLOAD_LEN
        # a run that starts later in the chain, and one that stops at the first unknown block
        assert [b.payload for b in stack.fetch_run(entries[3:], PAYLOAD_LEN)] == payloads[3:]
        other, _ = chain(2, seed=999)
        assert len(stack.fetch_run(entries[:2] + other, PAYLOAD_LEN)) == 2
        assert stack.healthy()


def test_stacked_tiers_serve_from_the_fastest_and_fill_up(tmp_path, redis_url):
    entries, payloads = chain(5)
    urls = ["host:64MiB", f"disk:{tmp_path / 'kv'}", redis_url]
    with TierStack(urls, LAYOUT) as stack:
        assert stack.names == ["host", "disk", "redis"]
        store_all(stack, entries, payloads)
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.tier for b in got] == ["host"] * 5 and [b.payload for b in got] == payloads
        assert stack.stats()["disk"]["loads"] == 0  # nothing left to ask
    # a new process: empty host, same disk, same redis
    with TierStack(urls, LAYOUT) as stack:
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.tier for b in got] == ["disk"] * 5 and [b.payload for b in got] == payloads
        assert stack.stats()["host"]["misses"] == 5
        stack.flush()  # read-through fill: the host now has them
        assert [b.tier for b in stack.fetch_run(entries, PAYLOAD_LEN)] == ["host"] * 5
    # another machine: its own host and disk, the shared redis; blocks 0-1 already on its disk
    urls2 = ["host:64MiB", f"disk:{tmp_path / 'kv2'}", redis_url]
    with TierStack(urls2[1:2], LAYOUT) as disk_only:
        store_all(disk_only, entries[:2], payloads[:2])
    with TierStack(urls2, LAYOUT) as stack:
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.tier for b in got] == ["disk"] * 2 + ["redis"] * 3
        assert [b.payload for b in got] == payloads
        stack.flush()
        assert stack.stats()["disk"]["entries"] == 5


def test_two_tiers_of_one_kind_get_numbered(tmp_path):
    with TierStack([f"disk:{tmp_path / 'a'}", f"disk:{tmp_path / 'b'}", "host:1MiB"], LAYOUT) as stack:
        assert stack.names == ["disk", "disk2", "host"]
        assert set(stack.stats()) == {"disk", "disk2", "host"}


def test_registry_and_bad_urls():
    assert set(TIER_KINDS) == {"host", "disk", "redis", "rediss"}
    for bad in ["nfs:/x", "host:lots", "disk:", "/plain/path", "host:0"]:
        with pytest.raises(ValueError):
            make_tier(bad)
    with pytest.raises(ValueError) as err:
        make_tier("ftp://user:hunter2@example/0")
    assert "hunter2" not in str(err.value)


# ---------------------------------------------------------------------- verification
def _raw(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def _rkey(e: TierEntry, layout: str = LAYOUT) -> str:
    return KEY_PREFIX + storage_key(layout, e.key)


def _flip(blob: bytes) -> bytes:
    b = bytearray(blob)
    b[len(b) // 2] ^= 0x40
    return bytes(b)


BAD_BLOBS = {
    "flipped byte": ("corrupt", lambda es, ps, i: _flip(blob_of(es[i], ps[i]))),
    "truncated": ("corrupt", lambda es, ps, i: blob_of(es[i], ps[i])[:-100]),
    "wrong layout": ("corrupt", lambda es, ps, i: blob_of(es[i], ps[i], layout="bfloat16/l2/kv2/d8/b4")),
    "wrong key": ("corrupt", lambda es, ps, i: encode_blob(es[i - 1].key, es[i].parent, es[i].token_ids,
                                                            LAYOUT, ps[i])),
    "wrong parent": ("corrupt", lambda es, ps, i: encode_blob(es[i].key, es[0].key, es[i].token_ids,
                                                               LAYOUT, ps[i])),
    "wrong token ids": ("corrupt", lambda es, ps, i: encode_blob(es[i].key, es[i].parent, (7, 7, 7, 7),
                                                                  LAYOUT, ps[i])),
    "wrong payload size": ("corrupt", lambda es, ps, i: blob_of(es[i], ps[i][:-8])),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOBS))
def test_a_bad_entry_truncates_the_run_and_is_deleted(case, redis_url):
    counter, make_bad = BAD_BLOBS[case]
    entries, payloads = chain(5)
    with TierStack([redis_url], LAYOUT) as stack:
        store_all(stack, entries, payloads)
        _raw(redis_url).set(_rkey(entries[2]), make_bad(entries, payloads, 2))
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.payload for b in got] == payloads[:2]
        s = stack.stats()["redis"]
        assert s[counter] == 1 and s["hit_blocks"] == 2 and s["bad_signature"] == 0
        assert not _raw(redis_url).exists(_rkey(entries[2]))  # deleted
        assert _raw(redis_url).exists(_rkey(entries[3]))  # the rest stays
        assert stack.healthy()  # a bad entry is not a failing tier


def test_missing_middle_block_ends_the_run(redis_url, tmp_path):
    entries, payloads = chain(5)
    with TierStack(["host:1MiB", redis_url], LAYOUT) as stack:
        store_all(stack, entries, payloads)
        stack.delete(entries[2].key)
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.payload for b in got] == payloads[:2]
        s = stack.stats()
        assert s["host"]["misses"] == 1 and s["redis"]["misses"] == 1  # asked up to the gap only
        assert s["host"]["corrupt"] == s["redis"]["corrupt"] == 0


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_corruption_in_local_tiers(kind, tmp_path):
    entries, payloads = chain(4)
    with TierStack([tier_url(kind, tmp_path, None)], LAYOUT) as stack:
        store_all(stack, entries, payloads)
        tier = stack._tiers[0]
        skey = storage_key(LAYOUT, entries[1].key)
        if kind == "disk":
            path = tmp_path / "kv" / skey[:2] / f"{skey}.blk"
            path.write_bytes(_flip(path.read_bytes()))
        else:
            tier._blobs[skey] = _flip(tier._blobs[skey])
        assert [b.payload for b in stack.fetch_run(entries, PAYLOAD_LEN)] == payloads[:1]
        assert stack.stats()[kind]["corrupt"] == 1
        assert tier.get_many([skey]) == [None]
        if kind == "disk":
            assert not path.exists()


def test_another_layout_never_even_matches(redis_url):
    entries, payloads = chain(3)
    with TierStack([redis_url], LAYOUT) as a, TierStack([redis_url], "bfloat16/l2/kv2/d8/b4") as b:
        store_all(a, entries, payloads)
        assert b.fetch_run(entries, PAYLOAD_LEN) == []
        s = b.stats()["redis"]
        assert s["misses"] == 1 and s["corrupt"] == 0


def test_secrets(redis_url):
    entries, payloads = chain(4)
    with TierStack([redis_url], LAYOUT, secret=b"fleet") as signer, \
         TierStack([redis_url], LAYOUT, secret=b"fleet") as peer:
        store_all(signer, entries, payloads)
        assert [b.payload for b in peer.fetch_run(entries, PAYLOAD_LEN)] == payloads
        # an entry signed by another secret, then one written unsigned, in the middle of the run
        for bad in (blob_of(entries[2], payloads[2], secret=b"intruder"), blob_of(entries[2], payloads[2])):
            _raw(redis_url).set(_rkey(entries[2]), bad)
            assert [b.payload for b in peer.fetch_run(entries, PAYLOAD_LEN)] == payloads[:2]
            assert not _raw(redis_url).exists(_rkey(entries[2]))
        assert peer.stats()["redis"]["bad_signature"] == 2 and peer.stats()["redis"]["corrupt"] == 0
    with TierStack([redis_url], LAYOUT, secret=b"fleet") as signer, TierStack([redis_url], LAYOUT) as plain:
        store_all(signer, entries, payloads)
        assert plain.fetch_run(entries, PAYLOAD_LEN) == []  # signed entries, no secret here
        assert plain.stats()["redis"]["bad_signature"] == 1


def test_two_replicas_share_one_valkey(redis_url):
    entries, payloads = chain(8, seed=5)
    with TierStack([redis_url], LAYOUT) as a, TierStack([redis_url], LAYOUT) as b:
        store_all(a, entries[:5], payloads[:5])
        store_all(b, entries[5:], payloads[5:])
        for stack in (a, b):
            assert [x.payload for x in stack.fetch_run(entries, PAYLOAD_LEN)] == payloads


def test_pin_extends_the_redis_ttl(redis_url):
    entries, payloads = chain(2)
    with TierStack([redis_url], LAYOUT, ttl_s=100) as stack:
        stack.store(entries[0], payloads[0])
        stack.store(entries[1], payloads[1], ttl_s=5000)
        stack.flush()
        r = _raw(redis_url)
        assert 90 <= r.ttl(_rkey(entries[0])) <= 100
        assert 4900 <= r.ttl(_rkey(entries[1])) <= 5000


# ---------------------------------------------------------------------- disk
def test_disk_survives_a_restart_with_private_files(tmp_path):
    entries, payloads = chain(6)
    url = f"disk:{tmp_path / 'kv'}"
    with TierStack([url], LAYOUT) as stack:
        store_all(stack, entries, payloads, priority=3)
    root = tmp_path / "kv"
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 6 and not [p for p in files if p.name.endswith(".tmp")]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in [root, *[p.parent for p in files]])
    (files[0].parent / ".leftover.tmp").write_bytes(b"x")  # a crash's temp file is never an entry
    os.chmod(root, 0o755)  # an operator's chmod, or a folder made by hand: made private again
    with TierStack([url], LAYOUT) as stack:
        assert stack.stats()["disk"]["entries"] == 6
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert [b.payload for b in stack.fetch_run(entries, PAYLOAD_LEN)] == payloads
        assert stack._tiers[0]._order.priority(storage_key(LAYOUT, entries[0].key)) == 3


def test_disk_reads_are_copies_and_only_regular_files_are_entries(tmp_path):
    """A disk read copies its file: a file truncated in place after the read leaves the payload
    as read (a mapped read would kill the process with SIGBUS on the next touch). An entry that
    is not a regular file (a pipe, which would block the reader forever; a symlink; a directory) reads as
    corrupt: counted, deleted, computed instead, within the call."""
    entries, payloads = chain(5)
    url = f"disk:{tmp_path / 'kv'}"
    with TierStack([url], LAYOUT) as stack:
        store_all(stack, entries, payloads)
    with TierStack(["host:64MiB", url], LAYOUT) as stack:
        disk = stack._tiers[1]
        path = [disk._path(storage_key(LAYOUT, e.key), 0) for e in entries]
        got = stack.fetch_run(entries, PAYLOAD_LEN)
        assert [b.tier for b in got] == ["disk"] * 5
        with open(path[0], "r+b") as f:
            f.truncate(0)
        assert [bytes(b.payload) for b in got] == payloads
        stack.flush()  # the read-through fill of the host tier holds bytes of its own
        assert all(type(b) is bytes for b in stack._tiers[0]._blobs.values())
    with TierStack([url], LAYOUT) as stack:
        path[1].unlink()
        os.mkfifo(path[1])
        path[2].unlink()
        path[2].symlink_to(path[4])
        path[3].unlink()
        path[3].mkdir()
        answers: dict[int, list] = {}

        def fetch_each() -> None:
            for i in range(4):
                answers[i] = stack.fetch_run(entries[i:i + 1], PAYLOAD_LEN)

        t = threading.Thread(target=fetch_each, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a read blocked on a pipe"
        assert answers == {0: [], 1: [], 2: [], 3: []}
        s = stack.stats()["disk"]
        assert s["corrupt"] == 4 and s["status"] == "ok", s
        assert not any(os.path.lexists(p) for p in path[:3])  # the directory stays: not a file
        assert path[3].is_dir()
        assert [b.payload for b in stack.fetch_run(entries[4:], PAYLOAD_LEN)] == payloads[4:]


def test_disk_budget_evicts_least_recent_and_lowest_priority_first(tmp_path):
    entries, payloads = chain(8)
    blob_len = len(blob_of(entries[0], payloads[0]))
    url = f"disk:{tmp_path / 'kv'}"
    with TierStack([url], LAYOUT, max_bytes=4 * blob_len) as stack:
        store_all(stack, entries[:1], payloads[:1], priority=5)  # kept over everything else
        store_all(stack, entries[1:4], payloads[1:4])
        stack.fetch_run(entries[1:2], PAYLOAD_LEN)  # block 1 read: more recent than 2 and 3
        store_all(stack, entries[4:6], payloads[4:6])
        s = stack.stats()["disk"]
        assert s["entries"] == 4 and s["bytes"] <= 4 * blob_len and s["evictions"] == 2
        held = [stack.fetch_run([e], PAYLOAD_LEN) != [] for e in entries[:6]]
        assert held == [True, True, False, False, True, True]
        # a low-priority block never pushes out higher ones: it is refused
        store_all(stack, entries[6:7], payloads[6:7], priority=-1)
        assert stack.fetch_run(entries[6:7], PAYLOAD_LEN) == []
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.blk"))
    assert on_disk <= 4 * blob_len
    with TierStack([url], LAYOUT, max_bytes=2 * blob_len) as stack:  # a smaller budget at restart
        s = stack.stats()["disk"]
        assert s["entries"] == 2 and s["bytes"] <= 2 * blob_len
        assert stack.fetch_run(entries[:1], PAYLOAD_LEN) != []  # priority 5 kept


def test_host_tier_is_lru_by_bytes():
    entries, payloads = chain(6)
    blob_len = len(blob_of(entries[0], payloads[0]))
    with TierStack([f"host:{3 * blob_len}"], LAYOUT) as stack:
        store_all(stack, entries[:3], payloads[:3])
        stack.fetch_run(entries[:1], PAYLOAD_LEN)
        store_all(stack, entries[3:4], payloads[3:4])
        s = stack.stats()["host"]
        assert s["entries"] == 3 and s["bytes"] <= 3 * blob_len
        assert [stack.fetch_run([e], PAYLOAD_LEN) != [] for e in entries[:4]] == [True, False, True, True]


def test_unwritable_disk_degrades_and_recovers(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "kv"
        blocker.write_bytes(b"not a directory")  # root ignores permissions; a file blocks mkdir
    else:
        (tmp_path / "ro").mkdir(mode=0o500)
        blocker = tmp_path / "ro"
    url = f"disk:{tmp_path / 'kv'}" if os.geteuid() == 0 else f"disk:{tmp_path / 'ro' / 'kv'}"
    entries, payloads = chain(2)
    with TierStack([url], LAYOUT, retry_after_s=0.2) as stack:
        assert stack.store(entries[0], payloads[0])
        stack.flush()
        assert stack.fetch_run(entries, PAYLOAD_LEN) == []
        s = stack.stats()["disk"]
        assert s["errors"] >= 1 and s["dropped_writes"] == 1 and s["status"] == "degraded"
        assert s["last_error"] and not stack.healthy()
        if blocker.is_file():
            blocker.unlink()
        else:
            blocker.chmod(0o700)
        wait_until_retry_time(stack)
        store_all(stack, entries, payloads)
        assert [b.payload for b in stack.fetch_run(entries, PAYLOAD_LEN)] == payloads
        assert stack.healthy()


# ---------------------------------------------------------------------- the writer
def test_a_full_writer_queue_drops_and_counts_without_blocking(tmp_path):
    entries, payloads = chain(20)
    with TierStack([f"disk:{tmp_path / 'kv'}", "host:64MiB"], LAYOUT, queue_blocks=4) as stack:
        lock = stack._tiers[0]._lock
        accepted: list[bool] = []
        stored = threading.Event()

        def store() -> None:
            accepted.extend(stack.store(e, p) for e, p in zip(entries, payloads))
            stored.set()
        with lock:  # the writer is stuck inside the disk tier until this block ends
            threading.Thread(target=store, daemon=True).start()
            # every store returns while the writer is still stuck: a store that waited for room in
            # the queue would wait forever here (the deadline only turns that hang into a failure)
            assert stored.wait(60), "a store blocked on the full queue"
            assert lock.locked()
        assert accepted == [True] * 4 + [False] * 16
        assert stack.flush(10)
        s = stack.stats()
        assert s["disk"]["dropped_writes"] == s["host"]["dropped_writes"] == 16
        assert s["disk"]["entries"] == s["host"]["entries"] == 4


def test_fetches_and_writes_from_many_threads(tmp_path, redis_url):
    entries, payloads = chain(12, seed=3)
    errors: list[BaseException] = []
    with TierStack(["host:64MiB", f"disk:{tmp_path / 'kv'}", redis_url], LAYOUT) as stack:
        def reader():
            try:
                for _ in range(30):
                    got = stack.fetch_run(entries, PAYLOAD_LEN)
                    assert [b.payload for b in got] == payloads[:len(got)]
            except BaseException as e:  # reported below
                errors.append(e)
        threads = [threading.Thread(target=reader) for _ in range(3)]
        for th in threads:
            th.start()
        store_all(stack, entries, payloads)
        for th in threads:
            th.join()
        assert not errors
        assert len(stack.fetch_run(entries, PAYLOAD_LEN)) == 12


def test_deadline(redis_url):
    entries, payloads = chain(3)
    with TierStack([redis_url], LAYOUT) as stack:
        store_all(stack, entries, payloads)
        assert stack.fetch_run(entries, PAYLOAD_LEN, deadline_s=0.0) == []
        assert stack.stats()["redis"]["timeouts"] == 1 and stack.healthy()
        assert len(stack.fetch_run(entries, PAYLOAD_LEN, deadline_s=5.0)) == 3


# ---------------------------------------------------------------------- a failing server
def test_valkey_stopped_mid_run_degrades_then_recovers(valkey, redis_url):
    _, server = valkey
    entries, payloads = chain(4)
    with TierStack(["host:1MiB", redis_url], LAYOUT, timeout_s=0.5, retry_after_s=0.5) as stack:
        store_all(stack, entries[:2], payloads[:2])
        server.stop()
        other, other_payloads = chain(3, seed=11)
        assert stack.fetch_run(other, PAYLOAD_LEN) == []
        s = stack.stats()["redis"]
        assert s["errors"] == 1 and s["status"] == "degraded" and "Connection" in s["last_error"]
        assert not stack.healthy() and stack.stats()["host"]["status"] == "ok"
        # the host tier still serves, and a write is accepted (dropped for redis) without raising
        assert [b.tier for b in stack.fetch_run(entries[:2], PAYLOAD_LEN)] == ["host", "host"]
        assert stack.store(other[0], other_payloads[0])
        stack.flush()
        s = stack.stats()["redis"]
        assert s["dropped_writes"] == 1 and s["errors"] == 1  # skipped while degraded, not retried
        server.start()  # back, empty
        wait_until_retry_time(stack)
        store_all(stack, other, other_payloads)
        assert stack.healthy()
        assert stack.stats()["redis"]["bytes_written"] > 0
        with TierStack([redis_url], LAYOUT) as fresh:
            assert [b.payload for b in fresh.fetch_run(other, PAYLOAD_LEN)] == other_payloads


def test_no_password_in_stats_or_errors():
    password = "pa55-w0rd-s3cret"
    with valkey_server(password=password) as (url, server):
        with_pw = url.replace("redis://", f"redis://:{password}@")
        entries, payloads = chain(2)
        with TierStack([with_pw], LAYOUT, timeout_s=0.5) as stack:
            store_all(stack, entries, payloads)
            assert len(stack.fetch_run(entries, PAYLOAD_LEN)) == 2
            server.stop()
            stack.fetch_run(entries, PAYLOAD_LEN)
            text = repr(stack.stats()) + repr(stack)
            assert stack.stats()["redis"]["last_error"]
            assert "***" in stack.stats()["redis"]["url"] and password not in text
        with TierStack([url.replace("redis://", "redis://:wrong-pass-word@")], LAYOUT) as stack:
            server.start()
            stack.fetch_run(entries, PAYLOAD_LEN)  # authentication fails: an error, no password
            s = stack.stats()["redis"]
            assert s["errors"] == 1 and "wrong-pass-word" not in repr(s)
        # TLS against a plain server: a handshake error whose text names no password
        tls = url.replace("redis://", f"rediss://admin:{password}@")
        with TierStack([tls], LAYOUT, timeout_s=0.5) as stack:
            stack.fetch_run(entries, PAYLOAD_LEN)
            s = stack.stats()["redis"]
            assert s["errors"] + s["timeouts"] == 1 and s["url"].startswith("rediss://admin:***@")
            assert password not in repr(s) + repr(stack)


def test_disk_directory_removed_while_running(tmp_path):
    import shutil
    entries, payloads = chain(3)
    with TierStack([f"disk:{tmp_path / 'kv'}"], LAYOUT) as stack:
        store_all(stack, entries, payloads)
        shutil.rmtree(tmp_path / "kv")
        assert stack.fetch_run(entries, PAYLOAD_LEN) == []  # gone: a miss, not an error
        store_all(stack, entries, payloads)
        assert [b.payload for b in stack.fetch_run(entries, PAYLOAD_LEN)] == payloads
        s = stack.stats()["disk"]
        assert s["errors"] == 0 and s["entries"] == 3 and stack.healthy()
        assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700


def test_a_tier_error_quoting_binary_is_kept_printable_and_short():
    """A server's error may quote the binary entry it refused (Valkey over maxmemory): the tier's
    last_error (in stats and the log) stays one short printable line."""
    from hotprefix.cache.tiers.health import MAX_ERROR_CHARS, TierHealth

    h = TierHealth("redis", retry_after_s=5.0)
    h.failed("OOM command not allowed: SET hp:k \x00\x01\xff\n" + "\x7f" * 1000)
    err = h.snapshot()["last_error"]
    assert err.isprintable() and len(err) == MAX_ERROR_CHARS and err.startswith("OOM command")
    assert h.snapshot()["errors"] == 1
