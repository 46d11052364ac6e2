"""Prompt templates in Python source, found with ``ast`` (never by regexes over the code).

Each of these becomes one template sample, its placeholders judged by the value they are given:

- f-strings: ``f"Today is {datetime.now().isoformat()}. ..."`` (each ``{...}`` by its expression);
- ``str.format`` on a literal or on a name bound to one: ``"Today is {today}".format(today=...)``
  (each field by the argument bound to it, positional, keyword or ``**mapping``, or by its name);
- ``%`` formatting: ``"Today is %s. ..." % time.ctime()``, ``"%(ts)s" % {"ts": ...}``;
- concatenation: ``"Today is " + datetime.now().isoformat() + ". ..."``;
- string constants holding template placeholders (``"Today is {{ now() }}. ..."`` for Jinja).

A bare name is followed to the values its scope assigns it (``now = time.time()`` makes ``{now}``
volatile whatever its name; a parameter or loop variable is not followed). Templates that are
logged, printed, raised, asserted or bound to a path, file name, URL or key are not prompts and are
skipped; so are docstrings. Literal text in code is the same on every request, so only placeholders
are checked, never literal values.

Knows nothing about tokenizers or findings.
"""

from __future__ import annotations

import ast
import re
import string

from hotprefix.lint.python_module import PyModule, name_of
from hotprefix.lint.samples import Field, LintUsageError, Sample, SourceFile
from hotprefix.text.volatile import Placeholder, find_placeholders

PYTHON_SUFFIXES = (".py", ".pyi")

_SINK_CALLS = frozenset({"print", "debug", "info", "warning", "warn", "error", "exception",
                         "critical", "fatal", "log", "write", "writelines", "open", "Path",
                         "getLogger", "compile", "mkdir", "makedirs", "exists", "unlink"})
_SINK_TARGET = re.compile(r"(?i)(?:^|_)(?:path|file|filename|dir|dirname|url|uri|endpoint|key|"
                          r"log|logger)(?:$|_)|(?:Path|File|Dir|Url|Key)$")
_PERCENT = re.compile(r"%(?:\((?P<key>[^)]*)\))?[#0 +\-]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?"
                      r"(?P<conv>[diouxXeEfFgGcrsab%])")


class _Template:
    """A template under construction: its text, placeholders and text -> file anchors."""

    def __init__(self) -> None:
        self.text = ""
        self.placeholders: list[Placeholder] = []
        self.anchors: list[tuple[int, int]] = []

    def literal(self, s: str, file_at: int | None = None) -> None:
        if file_at is not None:
            self.anchors.append((len(self.text), file_at))
        self.text += s

    def placeholder(self, text: str, expr: str, cause: str | None, file_at: int | None = None,
                    file_end: int | None = None) -> None:
        start = len(self.text)
        self.literal(text, file_at)
        self.placeholders.append(Placeholder(start, len(self.text), text, expr, cause))
        if file_end is not None:
            self.anchors.append((len(self.text), file_end))


class _Reader(PyModule):
    """One module's templates."""

    def __init__(self, src: SourceFile, tree: ast.Module):
        super().__init__(src, tree)
        self.consumed: set[ast.AST] = set()

    # ------------------------------------------------------------------ templates
    def fstring(self, node: ast.JoinedStr, t: _Template) -> None:
        t.literal("", self.body_start(node))
        raw = self.src.raw
        for part in node.values:
            if isinstance(part, ast.Constant):
                t.literal(str(part.value))
            elif isinstance(part, ast.FormattedValue):
                expr_at, expr_end = self.start(part.value), self.end(part.value)
                open_at = raw.rfind("{", 0, expr_at)
                close_at, depth = expr_end, 1
                while close_at < len(raw) and depth:
                    depth += {"{": 1, "}": -1}.get(raw[close_at], 0)
                    close_at += 1
                text = raw[open_at:close_at]
                if not (text.startswith("{") and text.endswith("}")):
                    text, open_at, close_at = "{" + self.source(part.value) + "}", expr_at, expr_end
                t.placeholder(text, self.source(part.value), self.cause(part.value), open_at, close_at)
        self.consumed.add(node)

    def format_call(self, call: ast.Call, lit: ast.Constant, t: _Template) -> bool:
        try:
            parsed = list(string.Formatter().parse(lit.value))
        except ValueError:
            return False
        args = [a for a in call.args]
        keywords = {kw.arg: kw.value for kw in call.keywords if kw.arg}
        mappings = [kw.value for kw in call.keywords if kw.arg is None]
        raw, cursor, auto = self.src.raw, self.body_start(lit), 0
        t.literal("", cursor)
        for literal, name, spec, conv in parsed:
            t.literal(literal)
            if name is None:
                continue
            head = re.match(r"[^.\[]*", name).group()  # type: ignore[union-attr]
            value: ast.AST | None = None
            if head == "" or head.isdigit():
                i = auto if head == "" else int(head)
                auto += head == ""
                if i < len(args) and not isinstance(args[i], ast.Starred):
                    value = args[i]
            else:
                value = keywords.get(head) or next(
                    (v for v in (self.lookup(m, head) for m in mappings) if v is not None), None)
            text = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            at = raw.find(text, cursor, self.end(lit))
            cursor = at + len(text) if at >= 0 else cursor
            t.placeholder(text, name, self.cause(value, head, at=call), at if at >= 0 else None,
                          cursor if at >= 0 else None)
        self.consumed.add(lit)
        return True

    def percent(self, op: ast.BinOp, lit: ast.Constant, t: _Template) -> bool:
        convs = [m for m in _PERCENT.finditer(lit.value) if m.group("conv") != "%"]
        if not convs:
            return False
        right = op.right
        positional = right.elts if isinstance(right, ast.Tuple) else [right]
        raw, cursor, last, index = self.src.raw, self.body_start(lit), 0, 0
        t.literal("", cursor)
        for m in convs:
            t.literal(lit.value[last:m.start()])
            last = m.end()
            key = m.group("key")
            if key is not None:
                value, name = self.lookup(right, key), key
            else:
                value, name = positional[index] if index < len(positional) else None, ""
                index += 1
            at = raw.find(m.group(0), cursor, self.end(lit))
            cursor = at + len(m.group(0)) if at >= 0 else cursor
            t.placeholder(m.group(0), key or (self.source(value) if value is not None else ""),
                          self.cause(value, name, at=op), at if at >= 0 else None,
                          cursor if at >= 0 else None)
        t.literal(lit.value[last:])
        self.consumed.add(lit)
        return True

    def concatenation(self, op: ast.BinOp, t: _Template) -> bool:
        operands: list[ast.expr] = []

        def flatten(n: ast.expr) -> None:
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
                flatten(n.left)
                flatten(n.right)
            else:
                operands.append(n)

        flatten(op)
        is_str = [isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant)
                                                     and isinstance(n.value, str)) for n in operands]
        if not any(is_str) or all(is_str):
            return False
        for n in operands:
            if isinstance(n, ast.JoinedStr):
                self.fstring(n, t)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                t.literal(n.value, self.body_start(n))
                self.consumed.add(n)
            else:
                src = self.source(n)
                t.placeholder(src, src, self.cause(n), self.start(n), self.end(n))
        return True

    # ------------------------------------------------------------------ context
    def is_sink(self, node: ast.AST) -> bool:
        """Whether ``node`` is logged, printed, raised, asserted or bound to a path/URL/key."""
        child, parent = node, self.parents.get(node)
        while parent is not None:
            if isinstance(parent, (ast.Raise, ast.Assert)):
                return True
            if isinstance(parent, ast.Expr) and child is node:
                return True  # a docstring or a bare string statement
            if isinstance(parent, ast.Call) and child is not parent.func:
                name = name_of(parent.func) or ""
                if name in _SINK_CALLS or name.endswith(("Error", "Exception", "Warning")):
                    return True
            if isinstance(parent, (ast.Assign, ast.AnnAssign)):
                targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
                return any(_SINK_TARGET.search(name_of(t) or "") for t in targets)
            if isinstance(parent, ast.keyword) and parent.arg and _SINK_TARGET.search(parent.arg):
                return True
            if isinstance(parent, ast.stmt):
                return False
            child, parent = parent, self.parents.get(parent)
        return False

    def label(self, node: ast.AST, syntax: str) -> str:
        """``NAME (syntax)`` for the nearest name the template is bound to, else the syntax."""
        child, parent = node, self.parents.get(node)
        while parent is not None:
            name = None
            if isinstance(parent, ast.keyword):
                name = parent.arg
            elif isinstance(parent, ast.Dict) and child in parent.values:
                k = parent.keys[parent.values.index(child)]  # type: ignore[arg-type]
                name = str(k.value) if isinstance(k, ast.Constant) else None
            elif isinstance(parent, (ast.Assign, ast.AnnAssign)):
                targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
                name = name_of(targets[0])
            elif isinstance(parent, ast.Return):
                fn = next((p for p in self.ancestors(parent)
                           if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
                name = f"{fn.name}()" if fn else None
            elif isinstance(parent, ast.Call) and child is not parent.func:
                name = (name_of(parent.func) or "") + "()" if name_of(parent.func) else None
            if name:
                return f"{name} ({syntax})"
            if isinstance(parent, ast.stmt):
                break
            child, parent = parent, self.parents.get(parent)
        return syntax

    # ------------------------------------------------------------------ driver
    def samples(self) -> list[Sample]:
        found: list[tuple[ast.AST, ast.AST, str, _Template]] = []  # (node, position node, syntax, t)
        for node in ast.walk(self.tree):
            t = _Template()
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and not (
                    isinstance(self.parents.get(node), ast.BinOp)
                    and isinstance(self.parents[node].op, ast.Add)):  # type: ignore[attr-defined]
                if self.concatenation(node, t):
                    found.append((node, node, "concatenation", t))
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                lit = self.string_of(node.left)
                if lit is not None and self.percent(node, lit, t):
                    found.append((node, lit, "%-format", t))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "format"):
                lit = self.string_of(node.func.value)
                if lit is not None and self.format_call(node, lit, t):
                    found.append((node, lit, "str.format", t))
        for node in ast.walk(self.tree):
            if node in self.consumed or any(isinstance(p, (ast.JoinedStr, ast.FormattedValue))
                                            for p in self.ancestors(node)):
                continue
            t = _Template()
            if isinstance(node, ast.JoinedStr):
                self.fstring(node, t)
                found.append((node, node, "f-string", t))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                placeholders = find_placeholders(node.value)
                if placeholders:
                    t.literal(node.value, self.body_start(node))
                    t.placeholders = placeholders
                    found.append((node, node, "string", t))
        samples = []
        for node, at, syntax, t in found:
            if self.is_sink(node) or not t.placeholders or not t.text.strip():
                continue
            f = Field(self.label(node, syntax), None, t.text, self.src, self.start(at), False,
                      t.anchors, t.placeholders)
            samples.append(Sample(self.src, at.lineno, "template", [f]))  # type: ignore[attr-defined]
        samples.sort(key=lambda s: (s.line, s.fields[0].raw_start or 0))
        return samples


def python_samples(src: SourceFile) -> list[Sample]:
    """The prompt templates of one Python file, one sample each, in file order.

    Raises:
        LintUsageError: the file is not valid Python.
    """
    try:
        tree = ast.parse(src.raw, filename=src.path)
    except SyntaxError as e:
        raise LintUsageError(f"{src.path}:{e.lineno}:{e.offset}: invalid Python: {e.msg}") from e
    return _Reader(src, tree).samples()
