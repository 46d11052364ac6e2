"""Tests for `hotprefix lint` (src/hotprefix/lint/) and its detectors (src/hotprefix/text/volatile.py).

Fixtures live in tests/data/lint/: ``clean_*`` must produce no finding, ``trap_*`` exactly the
findings asserted here (kind, line, column, token position, cost), ``bad*``/``not_a_request`` exit 2.
Token positions are for the default model's tokenizer (SmolLM2-135M-Instruct), loaded once; the
CLI tests use its tokenizer.json copy, which loads in a tenth of a second and gives the same ids.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from hotprefix import lint
from hotprefix.lint import check_drift, lint_files, main
from hotprefix.model.loader import default_model_path
from hotprefix.text.tokenizer import Tokenizer
from hotprefix.text.volatile import find_volatile, is_volatile_name

DATA = Path(__file__).parent / "data" / "lint"
CLEAN = [DATA / "clean_system.txt", DATA / "clean_rag.j2", DATA / "clean_chat.jsonl"]
B = 16


def d(name: str) -> str:
    return str(DATA / name)


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def json_tok_path(gguf_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    gguf_tok.save_json(str(path))
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def only(report: lint.Report, kind: str | None = None) -> lint.Finding:
    found = [f for f in report.findings if kind is None or f.kind == kind]
    assert len(found) == 1, [f.message for f in report.findings]
    return found[0]


# ------------------------------------------------------------------------------- detectors
@pytest.mark.parametrize("text,kind,volatile", [
    ("Current time: 2026-11-29T13:47:43Z.", "timestamp", "2026-11-29T13:47:43Z"),
    ("at 2026-11-29 13:47:43.123+01:00 we", "timestamp", "2026-11-29 13:47:43.123+01:00"),
    ("Date: Sat, 29 Nov 2026 13:47:43 +0000", "timestamp", "Sat, 29 Nov 2026 13:47:43 +0000"),
    ("Generated November 29, 2026 at 1:47 PM", "timestamp", "November 29, 2026 at 1:47 PM"),
    ("uptime since 13:47:43 today", "timestamp", "13:47:43"),
    ("ts=1764424063 ok", "timestamp", "1764424063"),
    ("ts=1764424063123 ok", "timestamp", "1764424063123"),
    ("Today's date: 2026-11-29.", "date", "2026-11-29"),
    ("as of 29/11/2026,", "date", "29/11/2026"),
    ("It is Monday, November 30th, 2026.", "date", "Monday, November 30th, 2026"),
    ("Today is Saturday.", "date", "Saturday"),
    ("id 7c9e6679-7425-40de-944b-e07fc1f90ae7", "uuid", "7c9e6679-7425-40de-944b-e07fc1f90ae7"),
    ("commit 9fceb02d0ae598e95dc970b74767f19372d61af8", "hex_id",
     "9fceb02d0ae598e95dc970b74767f19372d61af8"),
    ("trace-id: 4bf92f3577b34da6a3ce929d0e0e4736", "hex_id", "4bf92f3577b34da6a3ce929d0e0e4736"),
    ("Request 0x7f3a9c2b11d4e8aa.", "hex_id", "0x7f3a9c2b11d4e8aa"),
    ("日付: 2026年11月29日 13時47分 です", "timestamp", "2026年11月29日 13時47分"),
    ("今天是2026年11月29日。", "date", "2026年11月29日"),
    ("오늘은 2026년 11월 29일 13시 47분입니다", "timestamp", "2026년 11월 29일 13시 47분"),
    ("handling req_8f3a2b1c9d now", "request_id", "req_8f3a2b1c9d"),
    ("Request ID: AB-20491", "request_id", "AB-20491"),
    ("session_id=s93kd02", "request_id", "s93kd02"),
    ("random seed: 8812 for sampling", "random_number", "8812"),
    ("nonce=51231", "random_number", "51231"),
    ("reference 83749201", "random_number", "83749201"),
    ("This is Request #123.", "counter", "Request #123"),
    ("turn 5 of the chat", "counter", "turn 5"),
    ("your 4th attempt", "counter", "4th attempt"),
    ("request_count: 17", "counter", "request_count: 17"),
    ("Today is {{ now }}.", "template_placeholder", "{{ now }}"),
    ("id={request_id}", "template_placeholder", "{request_id}"),
    ("at {{ strftime_now('%d %b %Y') }}", "template_placeholder", "{{ strftime_now('%d %b %Y') }}"),
    ("seed ${randomSeed}", "template_placeholder", "${randomSeed}"),
])
def test_detector_finds_exactly(text: str, kind: str, volatile: str) -> None:
    matches = find_volatile(text)
    assert [(m.kind, m.text) for m in matches] == [(kind, volatile)]
    assert text[matches[0].start:matches[0].end] == volatile


@pytest.mark.parametrize("text", [
    "Cite the Contracts (Rights of Third Parties) Act 1999 and the 2024 guidance.",
    "Step 1: read. Step 2: answer. Use version 3.2 of the style guide.",
    "Keep answers under 300 words; the fee is 1,204.50 EUR; call extension 4410.",
    "Use gpt-4o-2024-08-06 for drafts and write times as HH:MM.",
    "Document:\n{{ document }}\nQuestion: {question}",
    'Return JSON like {"id": 1, "name": "x"} and never a list.',
    "The ratio is 16:9 and the score 3:1.",
    "Mask the flags with 0xFF and 0x10.",
    "2026年版のガイドに従ってください。",
])
def test_detector_ignores_stable_text(text: str) -> None:
    assert find_volatile(text) == []


@pytest.mark.parametrize("name,volatile", [
    ("now", True), ("current_time", True), ("requestId", True), ("trace_id", True),
    ("uuid", True), ("random_seed", True), ("turn", True), ("document", False),
    ("question", False), ("user_name", False), ("valid", False), ("history", False),
])
def test_volatile_names(name: str, volatile: bool) -> None:
    assert is_volatile_name(name) is volatile


# ------------------------------------------------------------------------------- traps: exact findings
def test_today_is_now_at_the_top(gguf_tok: Tokenizer) -> None:
    report = lint_files([d("trap_now.j2")], gguf_tok, B)
    f = only(report)
    n = len(gguf_tok.encode((DATA / "trap_now.j2").read_text()))
    assert (f.kind, f.line, f.column, f.field, f.text) == (
        "template_placeholder", 1, 10, "template", "{{ now }}")
    assert (f.token, f.block, f.tokens_lost, f.blocks_lost) == (2, 0, n, n // B)
    assert n == 95


def test_uuid_request_id_in_first_line(gguf_tok: Tokenizer) -> None:
    f = only(lint_files([d("trap_uuid.txt")], gguf_tok, B))
    assert (f.kind, f.line, f.column, f.text) == ("uuid", 1, 13, "3f2b8c1e-9a4d-4e7b-b5c2-7d1e0f6a9b34")
    assert (f.token, f.block, f.tokens_lost, f.blocks_lost) == (4, 0, 102, 6)


def test_counter(gguf_tok: Tokenizer) -> None:
    f = only(lint_files([d("trap_counter.txt")], gguf_tok, B))
    assert (f.kind, f.line, f.column, f.text) == ("counter", 2, 9, "attempt 3")
    assert (f.token, f.block, f.tokens_lost, f.blocks_lost) == (14, 0, 63, 3)


def test_iso_timestamp_in_system_prompt_of_a_json_request(gguf_tok: Tokenizer) -> None:
    path = DATA / "trap_system_timestamp.json"
    f = only(lint_files([str(path)], gguf_tok, B))
    line6 = path.read_text().splitlines()[5]
    assert line6.index("2026-11-29T13:47:43Z") + 1 == 78  # column counts raw file characters
    assert (f.kind, f.line, f.column, f.field) == ("timestamp", 6, 78, "messages[0].content")
    assert (f.text, f.token, f.block) == ("2026-11-29T13:47:43Z", 16, 1)
    request = json.loads(path.read_text())
    ids = gguf_tok.encode_chat(request["messages"])
    assert (f.tokens_lost, f.blocks_lost) == (len(ids) - 16, len(ids) // B - 1) == (61, 3)
    # the token really is where the timestamp starts
    assert "2026" not in gguf_tok.decode(ids[:16], skip_special_tokens=False)
    assert gguf_tok.decode(ids[:17], skip_special_tokens=False).endswith("time: 2")


def test_jsonl_system_prompts_with_different_timestamps(gguf_tok: Tokenizer) -> None:
    report = lint_files([d("trap_timestamps.jsonl")], gguf_tok, B)
    stamps = [f for f in report.findings if f.kind == "timestamp"]
    assert [(f.line, f.column, f.token, f.block, f.field) for f in stamps] == [
        (1, 108, 17, 1, "messages[0].content"), (2, 108, 17, 1, "messages[0].content"),
        (3, 108, 17, 1, "messages[0].content")]
    assert [f.text for f in stamps] == ["2026-11-29T13:47:43Z", "2026-11-29T13:48:02Z",
                                        "2026-11-29T13:51:17Z"]
    v = only(report, "system_prompt_varies")
    # the first differing character is the '8' of 13:48 on line 2
    assert (v.line, v.column, v.field, v.token, v.block) == (2, 123, "messages[0].content", 32, 2)
    assert v.details["num_variants"] == 3 and v.details["num_requests"] == 3
    assert v.details["reference_line"] == 1
    assert "13:47:43Z" in v.details["reference_excerpt"] and "13:48:02Z" in v.details["variant_excerpt"]
    assert v.details["shared_prefix_tokens"] == 31
    assert report.summary["samples"] == [{"file": d("trap_timestamps.jsonl"), "requests": 3,
                                          "shared_prefix_tokens": 31, "shared_prefix_blocks": 1}]


def test_clean_fixtures_have_no_findings(gguf_tok: Tokenizer) -> None:
    report = lint_files([str(p) for p in CLEAN], gguf_tok, B)
    assert report.findings == []
    assert report.summary["clean"] is True and report.summary["prompts"] == 6
    # four chat requests share the system prompt: the prefix through "<|im_start|>user\n"
    sample = report.summary["samples"][0]
    assert (sample["requests"], sample["shared_prefix_tokens"], sample["shared_prefix_blocks"]) == (
        4, 55, 3)


def test_volatile_text_in_the_final_user_message_is_fine(gguf_tok: Tokenizer) -> None:
    # clean_chat.jsonl's user messages hold a timestamp, a UUID, a date and an invoice number
    samples = lint.load_samples(d("clean_chat.jsonl"))
    last = [s.messages[-1]["content"] for s in samples]
    assert {m.kind for text in last for m in find_volatile(text)} >= {"timestamp", "uuid", "date"}
    assert lint_files([d("clean_chat.jsonl")], gguf_tok, B).findings == []


def test_volatile_placeholder_after_the_per_request_tail_is_fine(gguf_tok: Tokenizer,
                                                                 tmp_path: Path) -> None:
    text = (DATA / "clean_rag.j2").read_text()
    assert "{{ retrieval_time }}" in text  # after {{ document }}: not reported (see clean test)
    moved = "Manual revision fetched at {{ retrieval_time }}.\n" + text.replace(
        "(retrieved {{ retrieval_time }})\n", "")
    p = tmp_path / "rag_moved.j2"
    p.write_text(moved)
    f = only(lint_files([str(p)], gguf_tok, B))
    assert (f.kind, f.line, f.column, f.text) == ("template_placeholder", 1, 28, "{{ retrieval_time }}")
    assert f.token > 0 and f.block == 0


def test_moving_the_timestamp_later_lowers_its_cost(gguf_tok: Tokenizer, tmp_path: Path) -> None:
    body = (DATA / "clean_system.txt").read_text()
    early, late = tmp_path / "early.txt", tmp_path / "late.txt"
    early.write_text("Now: 2026-11-29T13:47:43Z\n" + body)
    late.write_text(body + "Now: 2026-11-29T13:47:43Z\nQuestion:")
    fe = only(lint_files([str(early)], gguf_tok, B))
    fl = only(lint_files([str(late)], gguf_tok, B))
    assert fe.token == 3 and fe.block == 0  # Now : ␠ 2
    assert fl.block == fl.token // B and fl.block >= 14
    assert fe.tokens_lost == len(gguf_tok.encode(early.read_text())) > 5 * fl.tokens_lost
    assert fl.tokens_lost == len(gguf_tok.encode(late.read_text())) - fl.block * B


def test_block_size_changes_block_and_cost(gguf_tok: Tokenizer) -> None:
    f = only(lint_files([d("trap_system_timestamp.json")], gguf_tok, 4))
    assert (f.token, f.block, f.tokens_lost, f.blocks_lost) == (16, 4, 61, 19 - 4)


def test_no_cost_where_no_full_block_starts(gguf_tok: Tokenizer) -> None:
    """A block size larger than the prompt: its volatile text is still found, but no full block
    (the only thing the cache keeps) is lost, and the message says so instead of a cost."""
    f = only(lint_files([d("trap_system_timestamp.json")], gguf_tok, 4096))
    assert (f.block, f.tokens_lost, f.blocks_lost) == (0, 0, 0)
    assert "no full block of 4096 tokens starts there" in f.message


def test_json_positions_walk_escapes(gguf_tok: Tokenizer, tmp_path: Path) -> None:
    p = tmp_path / "esc.json"
    # \u00e9 (6 raw chars, 1 char), a surrogate pair (12 raw, 1 char), \" and \n (2 raw, 1 char)
    p.write_text('[{"system": "Caf\\u00e9 \\ud83d\\ude00 \\"x\\"\\nStarted 2026-11-29T13:47:43Z. '
                 'Be helpful and brief."},\n {"prompt": "Summarise: ok"}]')
    report = lint_files([str(p)], gguf_tok, B)
    f = only(report)
    raw = p.read_text().splitlines()[0]
    assert (f.kind, f.field, f.line, f.column) == ("timestamp", "system", 1, raw.index("2026") + 1)


def test_content_parts_and_top_level_system(gguf_tok: Tokenizer, tmp_path: Path) -> None:
    p = tmp_path / "parts.jsonl"
    req = {"system": "Be terse.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Context below."},
                                     {"type": "text", "text": "session_id=s93kd02 then the rules"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"}]}
    p.write_text(json.dumps(req) + "\n")
    f = only(lint_files([str(p)], gguf_tok, B))
    assert (f.kind, f.field, f.text) == ("request_id", "messages[0].content[1].text", "s93kd02")
    assert f.column == json.dumps(req).index("s93kd02") + 1


def test_different_apps_in_one_log_are_not_a_varying_system_prompt(gguf_tok: Tokenizer,
                                                                     tmp_path: Path) -> None:
    p = tmp_path / "two_apps.jsonl"
    a = {"messages": [{"role": "system", "content": "You translate English into French, nothing else."},
                      {"role": "user", "content": "Good morning"}]}
    b = {"messages": [{"role": "system", "content": "Summarise legal contracts as bullet points."},
                      {"role": "user", "content": "Clause 4.2 ..."}]}
    p.write_text("\n".join(json.dumps(x) for x in (a, b, a)) + "\n")
    report = lint_files([str(p)], gguf_tok, B)
    assert report.findings == []
    assert report.summary["samples"][0]["requests"] == 3


def test_date_injected_by_the_chat_template_itself(gguf_tok: Tokenizer, tmp_path: Path) -> None:
    # Llama-3.1-style templates write "Today Date: ..." into every system prompt
    template = gguf_tok.chat_template.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content']",
        "{{'<|im_start|>' + message['role'] + '\nToday Date: 26 Jul 2024\n' + message['content']")
    assert template != gguf_tok.chat_template
    other = _modified_copy(gguf_tok, tmp_path / "dated", chat_template=template)
    report = lint_files([d("clean_chat.jsonl")], other, B)
    dated = [f for f in report.findings if f.kind == "date"]
    assert [(f.line, f.column, f.field, f.text, f.token) for f in dated] == [
        (i, None, "chat_template", "26 Jul 2024", 7) for i in range(1, 5)]
    assert report.summary["warnings"] == []


# ------------------------------------------------------------------------------- CLI
def test_cli_exit_codes_and_human_output(capsys: pytest.CaptureFixture[str], json_tok_path: str) -> None:
    rc, out, _ = run(capsys, "--tokenizer", json_tok_path, *map(str, CLEAN))
    assert rc == 0 and out.splitlines()[-1].startswith("clean: 6 prompts from 3 files")
    rc, out, _ = run(capsys, "--tokenizer", json_tok_path, d("trap_now.j2"), d("clean_rag.j2"))
    assert rc == 1
    assert out.splitlines()[0] == (
        f'{d("trap_now.j2")}:1:10: template_placeholder "{{{{ now }}}}" in template at token 2 '
        "(block 0): costs 95 tokens of reuse per request")
    assert out.splitlines()[-1].startswith("1 finding (1 template_placeholder) in 2 prompts from 2 files")


def test_cli_default_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, d("trap_system_timestamp.json"))
    assert rc == 1
    assert out.startswith(f'{d("trap_system_timestamp.json")}:6:78: timestamp "2026-11-29T13:47:43Z" '
                          "in system prompt (messages[0].content) at token 16 (block 1): costs 61 tokens")


def test_cli_json_output(capsys: pytest.CaptureFixture[str], json_tok_path: str) -> None:
    rc, out, _ = run(capsys, "--json", "--tokenizer", json_tok_path, d("trap_timestamps.jsonl"),
                     d("trap_uuid.txt"), d("clean_system.txt"))
    assert rc == 1
    doc = json.loads(out)
    assert set(doc) == {"findings", "summary"}
    kinds = [(f["kind"], f["file"], f["line"]) for f in doc["findings"]]
    assert kinds == [("timestamp", d("trap_timestamps.jsonl"), 1),
                     ("timestamp", d("trap_timestamps.jsonl"), 2),  # column 108
                     ("system_prompt_varies", d("trap_timestamps.jsonl"), 2),  # column 123
                     ("timestamp", d("trap_timestamps.jsonl"), 3),
                     ("uuid", d("trap_uuid.txt"), 1)]
    for f in doc["findings"]:
        assert {"kind", "file", "line", "column", "field", "text", "token", "block", "tokens_lost",
                "blocks_lost", "message"} <= set(f)
        assert f["block"] == f["token"] // 16 and f["tokens_lost"] > 0
    s = doc["summary"]
    assert s["by_kind"] == {"system_prompt_varies": 1, "timestamp": 3, "uuid": 1}
    assert (s["files"], s["prompts"], s["findings"], s["clean"], s["block_size"]) == (3, 5, 5, False, 16)
    assert s["max_tokens_lost"] == 102
    rc, out, _ = run(capsys, "--json", "--tokenizer", json_tok_path, d("clean_rag.j2"))
    assert rc == 0 and json.loads(out)["findings"] == []


@pytest.mark.parametrize("argv,needle", [
    (["tests/data/lint/no_such_file.txt"], "no such file"),
    (["tests/data/lint"], "tests/data/lint: a directory; name the files"),
    (["tests/data/lint/bad.json"], "bad.json:2:1: invalid JSON"),
    (["tests/data/lint/bad_line.jsonl"], "bad_line.jsonl:2:10: invalid JSON"),
    (["tests/data/lint/not_a_request.json"], "not a request"),
    (["--block-size", "0", "tests/data/lint/clean_rag.j2"], "--block-size: expected a positive integer"),
    (["--frobnicate", "tests/data/lint/clean_rag.j2"], "unrecognized arguments: --frobnicate"),
    ([], "the following arguments are required: FILE"),
    (["--tokenizers", "/nonexistent/a", "/nonexistent/b", "tests/data/lint/clean_rag.j2"],
     "tokenizer source not found"),
    (["--tokenizers", "a", "tests/data/lint/clean_rag.j2"], "required: FILE"),
    (["--tokenizer", "/nonexistent/tok.json", "tests/data/lint/clean_rag.j2"], "tokenizer source not found"),
    (["--tokenizer", "x", "--tokenizers", "a", "b", "tests/data/lint/clean_rag.j2"], "not allowed with"),
    (["DEEP"], "nested too deeply to read"),
])
def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], json_tok_path: str,
                                 argv: list[str], needle: str) -> None:
    if argv == ["DEEP"]:  # JSON too deeply nested for the parsers: a usage error, not a crash
        deep = Path(tempfile.mkdtemp()) / "deep.json"
        deep.write_text('{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}")
        argv = [str(deep)]
    if argv and argv[0].endswith((".json", ".jsonl")):
        argv = ["--tokenizer", json_tok_path] + argv
    cwd = os.getcwd()
    os.chdir(Path(__file__).parent.parent)
    try:
        rc, out, err = run(capsys, *argv)
    finally:
        os.chdir(cwd)
    assert rc == 2
    assert out == ""
    assert err.startswith("hotprefix lint: error:") and needle in err
    assert "Traceback" not in err


def test_cli_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "--tokenizers A B" in out and "--block-size N" in out


# ------------------------------------------------------------------------------- tokenizer drift
def _modified_copy(tok: Tokenizer, tmp: Path, *, drop_merge: list[str] | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "tokenizer.json"
    tok.save_json(str(path))
    if drop_merge is not None:
        spec = json.loads(path.read_text())
        spec["model"]["merges"].remove(drop_merge)
        path.write_text(json.dumps(spec))
    if chat_template is not None:
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = chat_template
        cfg_path.write_text(json.dumps(cfg))
    return Tokenizer.load(str(path))


def test_drift_from_a_removed_merge(gguf_tok: Tokenizer, tmp_path: Path) -> None:
    other = _modified_copy(gguf_tok, tmp_path / "nomerge", drop_merge=["Y", "ou"])
    report = check_drift([d("clean_system.txt"), d("clean_chat.jsonl")], gguf_tok, other, B)
    fp = only(report, "tokenizer_fingerprint")
    assert fp.file is None and gguf_tok.fingerprint in fp.text and other.fingerprint in fp.text
    drift = [f for f in report.findings if f.kind == "tokenizer_drift"]
    # "You are Lexi" starts the template; in chat it follows "<|im_start|>system\n"
    assert [(f.file, f.line, f.token, f.block) for f in drift] == [
        (d("clean_system.txt"), 1, 0, 0)] + [(d("clean_chat.jsonl"), i, 3, 0) for i in range(1, 5)]
    n = len(gguf_tok.encode((DATA / "clean_system.txt").read_text()))
    assert (drift[0].tokens_lost, drift[0].blocks_lost) == (n, n // B)
    texts = report.summary["drift"]["texts"]
    assert [t["blocks_match"] for t in texts] == [False] * 5
    assert texts[0]["first_diff"] == 0 and texts[0]["matching_blocks"] == 0
    assert report.summary["drift"]["fingerprints_match"] is False


def test_drift_from_a_changed_chat_template_only_hits_chat_requests(gguf_tok: Tokenizer,
                                                                      tmp_path: Path) -> None:
    template = gguf_tok.chat_template.replace("'<|im_start|>' + message['role'] + '\n'",
                                              "'<|im_start|>' + message['role'] + ':\n'")
    assert template != gguf_tok.chat_template
    other = _modified_copy(gguf_tok, tmp_path / "tmpl", chat_template=template)
    report = check_drift([d("clean_system.txt"), d("trap_system_timestamp.json")], gguf_tok, other, B)
    texts = report.summary["drift"]["texts"]
    assert texts[0]["first_diff"] is None and texts[0]["blocks_match"] is True
    f = only(report, "tokenizer_drift")
    assert (f.file, f.token, f.block, f.field) == (d("trap_system_timestamp.json"), 2, 0,
                                                   "rendered chat prompt")
    assert texts[1]["first_diff"] == 2


def test_gguf_vs_its_json_copy_same_ids_different_fingerprint(gguf_tok: Tokenizer,
                                                              json_tok_path: str) -> None:
    copy = Tokenizer.load(json_tok_path)
    report = check_drift([str(p) for p in CLEAN], gguf_tok, copy, B)
    assert [f.kind for f in report.findings] == (
        [] if copy.fingerprint == gguf_tok.fingerprint else ["tokenizer_fingerprint"])
    assert all(t["first_diff"] is None and t["blocks_match"] for t in report.summary["drift"]["texts"])
    assert len(report.summary["drift"]["texts"]) == 6


def test_cli_drift_same_tokenizer_twice_is_clean(capsys: pytest.CaptureFixture[str],
                                                 json_tok_path: str) -> None:
    rc, out, _ = run(capsys, "--json", "--tokenizers", json_tok_path, json_tok_path,
                     *map(str, CLEAN), d("trap_now.j2"))
    doc = json.loads(out)
    assert rc == 0 and doc["findings"] == []
    assert doc["summary"]["drift"]["fingerprints_match"] is True
    assert len(doc["summary"]["drift"]["texts"]) == 7


def test_cli_drift_against_modified_copy(capsys: pytest.CaptureFixture[str], gguf_tok: Tokenizer,
                                         json_tok_path: str, tmp_path: Path) -> None:
    _modified_copy(gguf_tok, tmp_path / "m", drop_merge=["Y", "ou"])
    rc, out, _ = run(capsys, "--tokenizers", json_tok_path, str(tmp_path / "m" / "tokenizer.json"),
                     d("trap_counter.txt"))
    lines = out.splitlines()
    assert rc == 1
    assert lines[0].startswith("<tokenizers>: tokenizer_fingerprint: fingerprints differ")
    assert lines[1].startswith(f"{d('trap_counter.txt')}:1: tokenizer_drift in template: "
                               "first differing token 0 (block 0)")
    assert "0 of 3 full blocks still match" in lines[1]
    assert lines[-1].startswith("2 findings (1 tokenizer_drift, 1 tokenizer_fingerprint)")
