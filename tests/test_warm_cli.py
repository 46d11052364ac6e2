"""``hotprefix warm FILE`` against a live server: the system prompt is prefilled, the first user hits."""

from __future__ import annotations

import json

import httpx
import pytest

from hotprefix.config.sections import EngineConfig
from hotprefix.tools.warm import main as warm_main
from server_support import LONG_SYSTEM, LiveServer


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with LiveServer(EngineConfig.from_options(model=tiny_model_dir, num_blocks=256)) as s:
        yield s


def test_warm_file_then_first_user_hits(srv, tmp_path, capsys):
    f = tmp_path / "system.txt"
    f.write_text("WARM-CLI " + LONG_SYSTEM)
    assert warm_main([str(f), "--url", srv.url]) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(printed) == 1 and printed[0]["written_blocks"] > 10
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": srv.model, "max_tokens": 2,
        "messages": [{"role": "system", "content": "WARM-CLI " + LONG_SYSTEM},
                     {"role": "user", "content": "hello"}]})
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (printed[0]["written_blocks"] - 1) * 16


def test_warm_jsonl_and_usage_errors(srv, tmp_path, capsys):
    f = tmp_path / "convs.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "system", "content": "one " * 50}]}) + "\n"
                 + json.dumps({"prompt": "two " * 50}) + "\n")
    assert warm_main([str(f), "--url", srv.url]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert warm_main([str(bad), "--url", srv.url]) == 2
    assert "invalid JSON" in capsys.readouterr().err
    assert warm_main([str(tmp_path / "missing.txt"), "--url", srv.url]) == 2
    assert warm_main([str(f), "--url", "http://127.0.0.1:9"]) == 1
    capsys.readouterr()
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    deep = tmp_path / "deep.json"
    deep.write_text('{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    for argv, needle in [([str(empty)], "no prompts in"), ([str(deep)], "nested too deeply"),
                         ([str(f), "--url", "http://[::1"], "--url"),
                         ([str(f), "--timeout", "-1"], "positive number of seconds")]:
        assert warm_main(argv + ([] if "--url" in argv else ["--url", srv.url])) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("status,ctype,body,needle", [
    (200, "text/plain", b"OK", "not a warm answer (200): OK"),
    (200, "application/json", b"[1, 2]", "not a warm answer (200): [1, 2]"),
    (400, "application/json", b'{"error": "bad request"}', "server refused (400): bad request"),
    (502, "application/json", b"<html>bad gateway</html>", "server refused (502): <html>bad gateway"),
])
def test_warm_reports_an_answer_it_cannot_read(tmp_path, capsys, status, ctype, body, needle):
    """A proxy or another program answering on the port: warm says what came back, exit 1."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        f = tmp_path / "sys.txt"
        f.write_text("You are a helpful assistant.")
        assert warm_main([str(f), "--url", f"http://127.0.0.1:{server.server_port}"]) == 1
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    finally:
        server.shutdown()


def test_warm_reads_files_with_the_linters_readers(tmp_path):
    """Every form warm accepts, read by ``hotprefix.lint.sources`` (no server needed)."""
    from hotprefix.lint import LintUsageError
    from hotprefix.tools.warm import read_prompts

    def put(name: str, value) -> str:
        p = tmp_path / name
        p.write_text(value if isinstance(value, str) else json.dumps(value))
        return str(p)

    sys_msg = [{"role": "system", "content": "S"}]
    assert read_prompts(put("s.txt", "You are Orbit.\n")) == ([], [[{"role": "system",
                                                                    "content": "You are Orbit.\n"}]])
    assert read_prompts(put("a.json", ["one", "two"])) == (["one", "two"], [])
    assert read_prompts(put("b.json", {"prompts": ["one", "two"]})) == (["one", "two"], [])
    assert read_prompts(put("c.json", [sys_msg, sys_msg])) == ([], [sys_msg, sys_msg])
    assert read_prompts(put("d.json", {"messages": [sys_msg]})) == ([], [sys_msg])
    assert read_prompts(put("e.json", sys_msg)) == ([], [sys_msg])
    assert read_prompts(put("f.json", {"system": "S"})) == ([], [sys_msg])
    # a chat request as the server reads it: top-level system first, parts joined, developer=system
    req = {"system": "A", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "B"}, {"type": "text", "text": "C"}]},
        {"role": "user", "content": "hi", "name": "ann"}]}
    assert read_prompts(put("g.jsonl", json.dumps(req) + "\n\n" + json.dumps("p") + "\n")) == (
        ["p"], [[{"role": "system", "content": "A"}, {"role": "system", "content": "BC"},
                 {"role": "user", "content": "hi", "name": "ann"}]])
    for name, value, needle in [("h.py", "P = f'{x}'\n", "source code"),
                                ("i.json", {"input": "x"}, "not a request"),
                                ("j.json", "{", "invalid JSON")]:
        with pytest.raises(LintUsageError, match=needle):
            read_prompts(put(name, value))
