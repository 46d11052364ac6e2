"""The state directory under faults: torn, garbled and old-format ledgers, a file or an unusable
path given as the directory, and writes that fail while serving (a full disk). The server starts
or refuses with a message naming the path; requests keep succeeding; /health says degraded."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time

import httpx
import pytest

from hotprefix.cache.ledger import ContentLedger, format_record, parse_record
from hotprefix.cache.state_dir import StateDir
from hotprefix.config.sections import ConfigError, ServerConfig
from hotprefix.engine.engine import LLMEngine
from server_support import LiveServer, tiny_config

KEY = bytes(range(16))


def records(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def test_torn_and_garbled_records_are_skipped_by_name_and_line(tmp_path, caplog):
    sd = StateDir(str(tmp_path))
    led = ContentLedger(sd)
    led.record(b"c1" * 16, "ns1", "tenant:a")
    led.record(b"c2" * 16, "ns1", None)
    assert led.flush()
    path = sd.file("ledger.txt")
    good = records(path)
    assert len(good) == 2 and all(parse_record(r) for r in good)
    with open(path, "a") as f:
        f.write(good[0][:10] + "ZZ" + good[0][12:] + "\n")  # garbled: the checksum fails
        f.write("a1b2c3 old-format line\n")                  # the unsalted format of older versions
        f.write(good[1][:25])                                # torn: a crash mid-write
    caplog.set_level(logging.WARNING)
    again = ContentLedger(StateDir(str(tmp_path)))
    assert again.skipped_records == 3
    assert f"{path}:3" in caplog.text and f"{path}:4" in caplog.text and f"{path}:5" in caplog.text
    assert again.lookup(b"c1" * 16, "tenant:a") == {"ns1"}
    assert again.lookup(b"c2" * 16, None) == {"ns1"}
    assert records(path) == good  # rewritten without the damaged records
    # appending after the repair gives whole records (the old bug glued a record to a torn line)
    again.record(b"c3" * 16, "ns1", "tenant:a")
    assert again.flush()
    assert all(parse_record(r) for r in records(path)) and len(records(path)) == 3


def test_a_short_write_never_glues_two_records(tmp_path, monkeypatch):
    import hotprefix.cache.ledger as ledger_mod

    led = ContentLedger(StateDir(str(tmp_path)))
    real = ledger_mod.append_whole

    def half(path, data):  # the disk fills halfway through the write
        real(path, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ledger_mod, "append_whole", half)
    led.record(b"c1" * 16, "ns1", "tenant:a")
    assert not led.flush() and led.last_error and "No space left" in led.last_error
    monkeypatch.setattr(ledger_mod, "append_whole", real)
    led._next_try = 0.0
    assert led.flush() and led.last_error is None
    fresh = ContentLedger(StateDir(str(tmp_path)))
    assert fresh.skipped_records == 1 and fresh.lookup(b"c1" * 16, "tenant:a") == {"ns1"}


def test_the_ledger_is_keyed_by_tenant_and_by_the_server_secret(tmp_path):
    a = ContentLedger(StateDir(str(tmp_path / "one")))
    b = ContentLedger(StateDir(str(tmp_path / "two")))
    for led in (a, b):
        led.record(b"same" * 8, "ns", "tenant:a")
        led.record(b"same" * 8, "ns", "tenant:b")
        led.flush()
    ra, rb = records(a.path), records(b.path)
    assert len(set(ra)) == 2  # two tenants, two unrelated records for the same content
    assert not set(ra) & set(rb)  # another secret, other records: no offline confirmation
    assert a.lookup(b"same" * 8, "tenant:c") == set()
    assert a.held_by_other_scope(b"same" * 8, "ns", "tenant:c")  # the operator-only aggregate


def test_reset_clears_the_ledger_on_disk(tmp_path):
    led = ContentLedger(StateDir(str(tmp_path)))
    led.record(b"x" * 32, "ns", "tenant:a")
    led.flush()
    led.clear()
    assert records(led.path) == [] and led.lookup(b"x" * 32, "tenant:a") == set()
    assert ContentLedger(StateDir(str(tmp_path))).lookup(b"x" * 32, "tenant:a") == set()


def test_old_state_files_are_made_private(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    (d / "ledger.txt").write_text("a1b2 ns - \n")
    os.chmod(d / "ledger.txt", 0o644)
    ContentLedger(StateDir(str(d)))
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(d / "ledger.txt").st_mode & 0o777 == 0o600
    assert os.stat(d / "secret.key").st_mode & 0o777 == 0o600
    assert "a1b2" not in (d / "ledger.txt").read_text()  # the unkeyed old record is gone


@pytest.mark.parametrize("kind", ["file", "under_a_file", "unwritable"])
def test_an_unusable_state_dir_is_a_clear_error_at_start(tmp_path, tiny_model_dir, kind):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    path = {"file": str(f), "under_a_file": str(f / "sub"), "unwritable": "/proc/hotprefix-state"}[kind]
    with pytest.raises(ConfigError) as e:
        LLMEngine(tiny_config(tiny_model_dir, state_dir=path))
    assert path in str(e.value)


@pytest.mark.parametrize("name", ["ledger.txt", "secret.key"])
@pytest.mark.parametrize("kind", ["directory", "pipe", "symlink"])
def test_a_state_file_that_is_not_a_file_is_a_clear_error_at_start(tmp_path, name, kind):
    """A state file made a directory, a pipe (whose read would block the start forever) or a
    symlink: the start stops with a message naming it, within the call."""
    import threading

    d = tmp_path / "state"
    ContentLedger(StateDir(str(d)))  # a state dir as a first start leaves it
    p = d / name
    if p.exists():
        p.unlink()
    {"directory": p.mkdir, "pipe": lambda: os.mkfifo(p),
     "symlink": lambda: p.symlink_to(tmp_path / "elsewhere")}[kind]()
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            ContentLedger(StateDir(str(d)))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome.append(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(20)
    assert outcome, "the start blocked"
    assert isinstance(outcome[0], ConfigError) and name in str(outcome[0]), outcome


def test_a_ledger_made_a_pipe_while_serving_fails_writes_without_blocking(tmp_path):
    """Appending to a pipe with no reader would block the engine thread: it fails at once, is
    counted, and is retried later."""
    d = tmp_path / "state"
    ledger = ContentLedger(StateDir(str(d)))
    os.mkfifo(d / "ledger.txt")
    ledger.record(KEY, "ns", None)
    assert ledger.flush() is False  # returns (a blocking open would never return: no reader)
    assert ledger.write_failures == 1


def test_a_full_disk_never_fails_a_request(tmp_path, tiny_model_dir, monkeypatch):
    import hotprefix.cache.ledger as ledger_mod

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    cfg = tiny_config(tiny_model_dir, state_dir=str(tmp_path / "state"))
    with LiveServer(cfg, ServerConfig()) as s:
        monkeypatch.setattr(ledger_mod, "append_whole", full)
        for i in range(3):
            body = {"model": s.model, "prompt": list(range(100 + i, 160 + i)), "max_tokens": 2}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        health = httpx.get(s.url + "/health", timeout=30).json()
        assert health["status"] == "degraded" and "No space left" in health["state"]["error"]
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
        assert "hotprefix_state_degraded 1.0" in metrics
        assert "hotprefix_state_write_failures_total 0.0" not in metrics
        monkeypatch.undo()  # the disk has room again: the next flush writes what was kept
        # writes are retried about once a second: serve requests until the retry has come and
        # gone (waiting on the health it restores, not on a guessed delay)
        deadline = time.monotonic() + 60  # only a hang guard
        for n in itertools.count():
            body = {"model": s.model, "prompt": list(range(300 + n, 360 + n)), "max_tokens": 2}
            assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
            if httpx.get(s.url + "/health", timeout=30).json() == {"status": "ok"}:
                break
            assert time.monotonic() < deadline, "state writes never recovered"
    kept = records(str(tmp_path / "state" / "ledger.txt"))
    assert len(kept) >= 4 * 3 and all(parse_record(r) for r in kept)
