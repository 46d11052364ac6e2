"""A parsed Python module as the template reader needs it: each node's parent and file position,
the names each scope binds, and what an expression evaluates to when that varies per request
(following bare names to what their scope assigns them).

Knows nothing about templates, tokenizers or findings.
"""

from __future__ import annotations

import ast
import re
from typing import Iterator

from hotprefix.lint.samples import SourceFile
from hotprefix.text.volatile import expression_cause

_SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp,
           ast.SetComp, ast.DictComp, ast.GeneratorExp)
_QUOTE = re.compile(r"[rRbBuUfF]{0,2}(\"\"\"|'''|\"|')")


def name_of(node: ast.AST) -> str | None:
    """The name a target or callee ends in (``x``, ``obj.attr``, ``d["key"]``), if any."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return None


class PyModule:
    """One parsed module: parents, positions, scopes and the values its names are bound to."""

    def __init__(self, src: SourceFile, tree: ast.Module):
        self.src, self.tree = src, tree
        self.parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        # (scope, name) -> the values assigned to it there (None: bound otherwise, not followed)
        self.bindings: dict[tuple[ast.AST, str], list[ast.expr | None]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                parent = self.parents.get(node)
                value = None
                if isinstance(parent, ast.Assign) and node in parent.targets or isinstance(
                        parent, (ast.AnnAssign, ast.NamedExpr)) and parent.target is node:
                    value = parent.value  # type: ignore[union-attr]
                self.bindings.setdefault((self.scopes(node)[0], node.id), []).append(value)
            elif isinstance(node, ast.arg):
                self.bindings.setdefault((self.scopes(node)[0], node.arg), []).append(None)

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """``node``'s parents, innermost first."""
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scopes(self, node: ast.AST | None) -> list[ast.AST]:
        """The scopes ``node`` sees names in, innermost first, the module last."""
        found = [p for p in self.ancestors(node) if isinstance(p, _SCOPES)] if node else []
        return found if found and found[-1] is self.tree else found + [self.tree]

    def values_of(self, name: str, at: ast.AST | None) -> list[ast.expr]:
        """What the innermost scope binding ``name`` (as seen from ``at``) assigns it."""
        for scope in self.scopes(at):
            if (scope, name) in self.bindings:
                return [v for v in self.bindings[scope, name] if v is not None]
        return []

    # ------------------------------------------------------------------ positions
    def offset(self, line: int, col: int) -> int:
        """File offset (characters) of an ast position (1-based line, UTF-8 byte column)."""
        start = self.src.line_starts[line - 1]
        end = self.src.raw.find("\n", start)
        text = self.src.raw[start:end if end >= 0 else len(self.src.raw)]
        return start + len(text.encode()[:col].decode(errors="ignore"))

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def body_start(self, node: ast.AST) -> int:
        """File offset of the first character inside a string literal's quotes."""
        at = self.start(node)
        m = _QUOTE.match(self.src.raw, at)
        return m.end() if m else at

    def source(self, node: ast.AST) -> str:
        return self.src.raw[self.start(node):self.end(node)]

    # ------------------------------------------------------------------ values
    def cause(self, node: ast.AST | None, name: str = "", depth: int = 0,
              at: ast.AST | None = None) -> str | None:
        """What ``node`` evaluates to when that varies per request (see ``expression_cause``),
        following bare names to what their scope assigns them; ``name`` is the placeholder's own,
        ``at`` where a node without a position (``**locals()``) is read."""
        cause = expression_cause(name) if name else None
        if node is None or cause:
            return cause
        positioned = hasattr(node, "lineno")
        cause = expression_cause(self.source(node) if positioned else name_of(node) or "")
        if cause is None and isinstance(node, ast.Name) and depth < 3:
            for value in self.values_of(node.id, node if positioned else at):
                cause = cause or self.cause(value, depth=depth + 1)
        return cause

    def string_of(self, node: ast.AST) -> ast.Constant | None:
        """The string literal ``node`` is, or the one a bare name is bound to."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node
        if isinstance(node, ast.Name):
            for value in reversed(self.values_of(node.id, node)):
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value
        return None

    def lookup(self, mapping: ast.AST, key: str) -> ast.AST | None:
        """The value ``mapping`` (a dict display, ``dict(...)``, ``locals()``) gives ``key``."""
        if isinstance(mapping, ast.Dict):
            for k, v in zip(mapping.keys, mapping.values):
                if isinstance(k, ast.Constant) and k.value == key:
                    return v
        if isinstance(mapping, ast.Call) and isinstance(mapping.func, ast.Name):
            if mapping.func.id == "dict":
                return next((kw.value for kw in mapping.keywords if kw.arg == key), None)
            if mapping.func.id in ("locals", "globals", "vars"):
                return ast.Name(id=key)
        return None
