"""``hotprefix lint`` on placeholders in every common template language, judged by what they evaluate
to: Python f-strings and ``str.format`` (``{...}``), Jinja/Handlebars (``{{ ... }}``), JavaScript
template literals (``${...}``) and ``%``-style (``%(name)s``) in template files, and the templates
that Python and JavaScript/TypeScript source builds prompts with (the article's own first example,
``f"Today is {datetime.now().isoformat()}."``).

A volatile placeholder before the stable part is one finding with its file position, its token
and its cost; a placeholder of plain data (``{documents}``) is none, and starts the per-request tail.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hotprefix.lint import Finding, Report, lint_files
from hotprefix.text.tokenizer import Tokenizer
from hotprefix.text.volatile import expression_cause, find_placeholders, find_volatile

B = 16
BODY = ("You are Orbit, the travel assistant of Skyline Airways. You help customers change flights, "
        "add baggage and understand fare rules. Saver fares are non-refundable; Flex fares are "
        "refundable up to 24 hours before departure. Be concise and friendly.")


@pytest.fixture(scope="module")
def tok(default_tokenizer: Tokenizer) -> Tokenizer:
    return default_tokenizer


def only(report: Report) -> Finding:
    assert len(report.findings) == 1, [f.message for f in report.findings]
    return report.findings[0]


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def check_cost(f: Finding, tok: Tokenizer, text: str, placeholder: str) -> None:
    """The finding's token is the one where ``placeholder`` starts in ``text``; its cost is every
    token from the start of that token's block to the end of the prompt."""
    ids = tok.encode(text)
    before = tok.decode(ids[:f.token], skip_special_tokens=True)
    assert placeholder[:1] not in before[-2:] and text.startswith(before)
    assert len(before) <= text.index(placeholder) < len(tok.decode(ids[:f.token + 1],
                                                                   skip_special_tokens=True))
    assert f.block == f.token // B
    assert (f.tokens_lost, f.blocks_lost) == (len(ids) - f.block * B, len(ids) // B - f.block)


# ------------------------------------------------------------------------------- template files
@pytest.mark.parametrize("placeholder,cause", [
    # Python f-string / str.format fields: calls, nested attributes, spacing, specs
    ("{datetime.now().isoformat()}", "time"),
    ("{ datetime.datetime.now().isoformat() }", "time"),
    ("{time.time():.0f}", "time"),
    ("{now:%Y-%m-%d %H:%M}", "time"),
    ("{date.today().strftime('%A')}", "time"),
    ("{uuid4()}", "uuid"),
    ("{uuid.uuid4().hex}", "uuid"),
    ("{random.randint(1, 1000)}", "random"),
    ("{secrets.token_hex(8)}", "random"),
    ("{next(turn_counter)}", "counter"),
    ("{request_id}", "id"),
    # Jinja / Handlebars / Go templates
    ("{{ now() }}", "time"),
    ("{{- datetime.now().isoformat() -}}", "time"),
    ("{{ .Now }}", "time"),
    ("{{ request.id }}", "id"),
    ("{{ random() }}", "random"),
    ("{{ uuid }}", "uuid"),
    # JavaScript template literals (also ${name} in string.Template and shells)
    ("${Date.now()}", "time"),
    ("${new Date().toISOString()}", "time"),
    ("${ crypto.randomUUID() }", "uuid"),
    ("${Math.floor(Math.random() * 1e6)}", "random"),
    ("${counter++}", "counter"),
    ("${TIMESTAMP}", "time"),
    # %-style with a mapping key
    ("%(ts)s", "time"),
    ("%(request_id)s", "id"),
    ("%(now)-20s", "time"),
    ("%(seq)d", "counter"),
])
def test_volatile_placeholder_before_the_stable_part(tok: Tokenizer, tmp_path: Path,
                                                     placeholder: str, cause: str) -> None:
    text = f"Today is {placeholder}.\n{BODY}\nQuestion: {{{{ question }}}}\n"
    f = only(lint_files([write(tmp_path, "t.txt", text)], tok, B))
    assert (f.kind, f.text, f.line, f.column, f.field) == (
        "template_placeholder", placeholder, 1, 10, "template")
    assert f.details == {"evaluates_to": cause}
    check_cost(f, tok, text, placeholder)
    assert f.token == 2 and f.blocks_lost >= 3


@pytest.mark.parametrize("placeholder", [
    "{documents}", "{ documents }", "{context!s}", "{len(history)}", "{user.name.title()}",
    "{{ user_question }}", "{{ document }}", "{{ doc | truncate(100) }}", "{{- history -}}",
    "${question}", "${ userMessage }", "${docs.map(d => d.text).join('\\n')}",
    "%(question)s", "%(documents)s",
])
def test_plain_data_placeholder_is_no_finding_and_starts_the_tail(tok: Tokenizer, tmp_path: Path,
                                                                  placeholder: str) -> None:
    # data first: nothing volatile before it; a volatile placeholder after it is in the tail
    text = f"{BODY}\nDocuments:\n{placeholder}\nToday is {{{{ now() }}}}. Answer briefly.\n"
    report = lint_files([write(tmp_path, "t.j2", text)], tok, B)
    assert report.findings == [], [f.message for f in report.findings]
    assert [p.cause for p in find_placeholders(placeholder)] == [None]


def test_the_articles_first_example_as_a_template(tok: Tokenizer, tmp_path: Path) -> None:
    text = f"Today is {{datetime.now().isoformat()}}.\n{BODY}\n"
    path = write(tmp_path, "system.txt", text)
    f = only(lint_files([path], tok, B))
    assert (f.kind, f.text, f.token) == ("template_placeholder", "{datetime.now().isoformat()}", 2)
    assert f.message == (f'template_placeholder "{{datetime.now().isoformat()}}" in template at token 2 '
                         f"(block 0): costs {f.tokens_lost} tokens of reuse per request")


def test_literal_braces_are_not_placeholders() -> None:
    for text in ('Return JSON like {"id": 1, "name": "x"}.', "Schema: {id: number, name: string}",
                 "{{! a comment about now }}", "{{#each documents}}", "a set {1, 2, 3}", "100%"):
        assert find_volatile(text) == [], text


@pytest.mark.parametrize("expr,cause", [
    ("datetime.now().isoformat()", "time"), ("datetime.utcnow()", "time"), ("time.time_ns()", "time"),
    ("time.monotonic()", "time"), ("Date.now()", "time"), ("new Date()", "time"),
    ("performance.now()", "time"), ("arrow.utcnow()", "time"), ("pendulum.today()", "time"),
    ("uuid.uuid1()", "uuid"), ("uuidv4()", "uuid"), ("ulid()", "uuid"), ("nanoid()", "uuid"),
    ("np.random.rand()", "random"), ("os.urandom(8)", "random"), ("random.getrandbits(64)", "random"),
    ("itertools.count()", "counter"), ("next(it)", "counter"), ("self.turn", "counter"),
    ("n += 1", "counter"), ("ctx.trace_id", "id"), ("requestId", "id"),
    ("documents", None), ("user_question", None), ("format_docs(docs)", None),
    ("strftime_format", "time"), ("guidance", None), ("next_steps", None),
    ("'now'.upper()", None),  # words inside string literals do not count
])
def test_expression_cause(expr: str, cause: str | None) -> None:
    assert expression_cause(expr) == cause


# ------------------------------------------------------------------------------- Python source
PY = '''\
"""Prompts for Orbit. {now} in a docstring is no template."""
import logging
import time
import uuid
from datetime import date, datetime

log = logging.getLogger(__name__)

SYSTEM = f"Today is {datetime.now().isoformat()}. You are Orbit, the travel assistant of Skyline Airways."
RAG = f"You are Orbit. Answer only from these documents.\\n{documents}\\nQuestion: {question}"
TEMPLATE = "Today is {today}. You are Orbit, the travel assistant of Skyline Airways."


def build(question, docs, stamp_source):
    stamp = time.time()
    log.info(f"[{time.time()}] building a prompt for {question}")
    out_path = f"/tmp/{uuid.uuid4()}.json"
    return [
        {"role": "system", "content": TEMPLATE.format(today=date.today())},
        {"role": "system", "content": "Session {}: you are Orbit, a travel assistant.".format(uuid.uuid4())},
        {"role": "system", "content": "Docs: {documents}. You are Orbit.".format(documents=docs)},
        {"role": "system", "content": "Docs: {documents}. You are Orbit.".format(documents=datetime.now())},
        {"role": "system", "content": "Started %s. You are Orbit, a travel assistant." % time.ctime()},
        {"role": "system", "content": "Request %(ts)s: you are Orbit, a travel assistant." % {"ts": stamp}},
        {"role": "system", "content": "Asked: %s. You are Orbit, a travel assistant." % question},
        {"role": "system", "content": "Now " + datetime.now().strftime("%H:%M") + ". You are Orbit."},
        {"role": "system", "content": "You are Orbit. " + question},
    ]


def system_prompt():
    if False:
        raise ValueError(f"{time.time()} bad state for Orbit")
    return f"Turn {next(counter)} of the chat. You are Orbit, the travel assistant."


JINJA = "Today is {{ now() }}. You are Orbit, the travel assistant of Skyline Airways."
'''


def test_python_source_templates(tok: Tokenizer, tmp_path: Path) -> None:
    path = write(tmp_path, "prompts.py", PY)
    report = lint_files([path], tok, B)
    got = [(f.line, f.column, f.field, f.text, f.details["evaluates_to"]) for f in report.findings]
    lines = PY.splitlines()

    def col(line: int, text: str) -> int:
        return lines[line - 1].index(text) + 1

    assert got == [
        (9, col(9, "{datetime"), "SYSTEM (f-string)", "{datetime.now().isoformat()}", "time"),
        # the field is written in TEMPLATE (line 11), bound at the call (line 19)
        (11, col(11, "{today}"), "content (str.format)", "{today}", "time"),
        (20, col(20, "{}"), "content (str.format)", "{}", "uuid"),
        (22, col(22, "{documents}"), "content (str.format)", "{documents}", "time"),  # by its value
        (23, col(23, "%s"), "content (%-format)", "%s", "time"),
        (24, col(24, "%(ts)s"), "content (%-format)", "%(ts)s", "time"),  # stamp = time.time()
        (26, col(26, "datetime.now()"), "content (concatenation)",
         'datetime.now().strftime("%H:%M")', "time"),
        (34, col(34, "{next"), "system_prompt() (f-string)", "{next(counter)}", "counter"),
        (37, col(37, "{{ now() }}"), "JINJA (string)", "{{ now() }}", "time"),
    ]
    # RAG, {documents}=docs, %s=question and "..." + question are plain data; the log line, the
    # file path, the exception and the docstring are not prompts
    assert report.summary["prompts"] == 13
    assert report.summary["samples"] == []  # templates in code are not a request sample
    first = report.findings[0]
    text = first.text.join(["Today is ", ". You are Orbit, the travel assistant of Skyline Airways."])
    check_cost(first, tok, text, first.text)
    assert first.message.startswith('template_placeholder "{datetime.now().isoformat()}" in SYSTEM '
                                    "(f-string) at token 2 (block 0)")


@pytest.mark.parametrize("code,found", [
    ('PROMPT = f"Today is {datetime.now()}. You are Orbit, a travel assistant."', "{datetime.now()}"),
    ('PROMPT = f"Today is { datetime.now() !s:>30}. You are Orbit."', "{ datetime.now() !s:>30}"),
    ('PROMPT = (f"Session {uuid4()} "\n          "You are Orbit, a travel assistant.")', "{uuid4()}"),
    ('now = datetime.now()\nPROMPT = f"Date {now:%d %B}. You are Orbit."', "{now:%d %B}"),
    ('started = config.start_label\nPROMPT = f"Up since {started}. You are Orbit."', None),
    ('when = time.time()\nPROMPT = f"Build {when}. You are Orbit."', "{when}"),  # followed
    ('def f():\n    when = time.time()\n    return f"Build {when}. You are Orbit."', "{when}"),
    # a parameter or loop variable shadows the module's name: not followed
    ('when = time.time()\ndef f(when):\n    return f"Build {when}. You are Orbit."', None),
    ('when = time.time()\nP = [f"Build {when}. You are Orbit." for when in builds]', None),
    ('PROMPT = "Today is {}. You are Orbit.".format(datetime.now().date())', "{}"),
    ('PROMPT = "Today is {0}. You are Orbit.".format(date.today())', "{0}"),
    ('PROMPT = "Today is {d}. You are Orbit.".format(**{"d": date.today()})', "{d}"),
    ('d = date.today()\nPROMPT = "Today is {d}. You are Orbit.".format(**locals())', "{d}"),
    ('PROMPT = "Today is {d}. You are Orbit.".format(d=dt.datetime.today())', "{d}"),
    ('PROMPT = "Today is {today}. You are Orbit.".format(today=get_day())', "{today}"),  # by name
    ('PROMPT = "Ask: {q}. You are Orbit.".format(q=question)', None),
    ('PROMPT = "Seed %d. You are Orbit." % random.randint(0, 9)', "%d"),
    ('PROMPT = "Seed %d of %s. You are Orbit." % (n, random.random())', None),  # n first: the tail
    ('PROMPT = "At %(t)s. You are Orbit." % dict(t=time.strftime("%H"))', "%(t)s"),
    ('PROMPT = "Id " + str(uuid.uuid4()) + ". You are Orbit."', "str(uuid.uuid4())"),
    ('PROMPT = "Hello " + name + ". You are Orbit."', None),
    ('path = f"/data/{uuid4()}/prompt.txt"', None),
    ('print(f"{datetime.now()} started the Orbit server")', None),
    ('logger.warning("%s: slow request for Orbit", time.time())', None),
    ('assert ok, f"{time.time()} the Orbit check failed"', None),
])
def test_python_source_class(tok: Tokenizer, tmp_path: Path, code: str, found: str | None) -> None:
    report = lint_files([write(tmp_path, "p.py", code + "\n")], tok, B)
    assert [f.text for f in report.findings] == ([found] if found else []), [
        f.message for f in report.findings]
    for f in report.findings:
        line = code.splitlines()[f.line - 1]
        assert line[f.column - 1:].startswith(found[:4])


def test_python_syntax_error_message(tok: Tokenizer, tmp_path: Path) -> None:
    from hotprefix.lint import LintUsageError
    path = write(tmp_path, "broken.py", "x = 1\nPROMPT = f'Today is {now'\n")
    with pytest.raises(LintUsageError, match=r"broken.py:2:\d+: invalid Python"):
        lint_files([path], tok, B)


# ------------------------------------------------------------------------------- JavaScript source
JS = """\
// `Today is ${Date.now()}` in a comment is no template
const note = "a ${quoted} string";
const system = `Today is ${new Date().toISOString()}. You are Orbit, the travel assistant.`;
const rag = `You are Orbit. Answer from the documents.\\n${documents}\\nQuestion: ${question}`;
console.log(`[${Date.now()}] request done`);
const msgs = [{ role: "system", content: `Session ${crypto.randomUUID()}: you are Orbit.` }];
function tail(q) { return `You are Orbit. ${q} (asked at ${Date.now()})`; }
"""


def test_javascript_template_literals(tok: Tokenizer, tmp_path: Path) -> None:
    path = write(tmp_path, "prompts.ts", JS)
    report = lint_files([path], tok, B)
    lines = JS.splitlines()
    got = [(f.line, f.column, f.field, f.text, f.details["evaluates_to"]) for f in report.findings]
    assert got == [
        (3, lines[2].index("${new") + 1, "system (template literal)", "${new Date().toISOString()}",
         "time"),
        (6, lines[5].index("${crypto") + 1, "content (template literal)", "${crypto.randomUUID()}",
         "uuid"),
    ]
    assert report.summary["prompts"] == 4  # system, rag, msgs, tail; not the log line
    f = report.findings[0]
    body = lines[2][lines[2].index("`") + 1:lines[2].rindex("`")]
    check_cost(f, tok, body, f.text)


# ------------------------------------------------------------------------------- the runtime
def test_importing_the_engine_does_not_import_the_linter() -> None:
    code = ("import sys, hotprefix.engine.engine, hotprefix.text.diagnose; "
            "assert 'hotprefix.lint' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('hotprefix.lint')); assert 'hotprefix.text.volatile' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_reading_request_files_does_not_load_the_tokenizer_library() -> None:
    code = textwrap.dedent("""\
        import sys
        from hotprefix.lint.sources import load_samples
        assert 'hotprefix.text.tokenizer' not in sys.modules and 'transformers' not in sys.modules
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("text", [
    "{{ " + " " * 20_000 + "x", "{abc" + " " * 20_000 + "x", "{abc" + " \t" * 10_000 + "=",
    "${" + "a" * 20_000, "{f(" + "(" * 20_000, "{{ x " * 20_000, "{a} " * 20_000,
])
def test_placeholder_scan_finishes_on_unclosed_or_huge_input(text: str) -> None:
    # unclosed placeholders followed by long runs once backtracked for minutes (cubic in the run);
    # none of these holds a volatile value. How long the scan takes, and how it grows with the
    # input, is measured by benchmarks/bench_lint_scan.py, not asserted here.
    assert find_volatile(text) == []
