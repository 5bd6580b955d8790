"""Commented-out code: a whole-line comment whose text parses as a code-like statement.

Prose rarely parses as Python, and when it does it is usually a bare name (`# TODO`), an
annotation-shaped note (`# Note: x`) or an expression such as a shape (`# (B, T, H)`) or
an invariant (`# a == b`). Those are let through; assignments, imports, calls, returns
with a value, and compound statements with a real condition are flagged.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator

from hygiene.report import Finding

SKIPPED_PREFIXES = (
    "noqa", "type:", "pragma", "!", "fmt:", "ruff:", "pylint:", "isort:", "-*-",
    "todo", "fixme", "xxx", "note", "hack",
)  # fmt: skip
ALWAYS_CODE = (
    ast.Assign, ast.AugAssign, ast.Import, ast.ImportFrom, ast.Delete, ast.Assert,
    ast.For, ast.AsyncFor, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
)  # fmt: skip
SENTENCE_DOT = re.compile(r"[A-Za-z]\.\s")
CODE_EXPRESSIONS = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom)


def check_commented_code(path: str, text: str) -> Iterator[Finding]:
    for line, comment in whole_line_comments(text):
        if looks_like_code(comment):
            yield Finding(path, line, "commented-code", f"commented-out code: # {comment}")


def whole_line_comments(text: str) -> Iterator[tuple[int, str]]:
    """(line, text after the '#') for each comment that is alone on its line."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    try:
        for tok in tokens:
            if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
                yield tok.start[0], tok.string.lstrip("#").strip()
    except (tokenize.TokenError, SyntaxError):
        return


def looks_like_code(comment: str) -> bool:
    if not comment or comment.lower().startswith(SKIPPED_PREFIXES):
        return False
    if SENTENCE_DOT.search(comment):  # "e.g. f(x)" parses as e.g.f(x)
        return False
    tree = _parse(comment)
    return tree is not None and any(_is_code(stmt) for stmt in tree.body)


def _parse(comment: str) -> ast.Module | None:
    """Parse the comment as statements; a header such as `if x:` is completed with `pass`."""
    candidates = [comment, comment + " pass"] if comment.endswith(":") else [comment]
    for candidate in candidates:
        try:
            return ast.parse(candidate)
        except (SyntaxError, ValueError):
            continue
    return None


def _is_code(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ALWAYS_CODE):
        return True
    if isinstance(stmt, ast.AnnAssign):  # `x: int = 0` is code; `Note: blah` is prose
        return stmt.value is not None
    if isinstance(stmt, ast.Return):
        return stmt.value is not None
    if isinstance(stmt, ast.Raise):
        return stmt.exc is not None
    if isinstance(stmt, (ast.If, ast.While)):  # `# if needed:` is prose
        return not _is_bare(stmt.test)
    if isinstance(stmt, (ast.With, ast.AsyncWith)):  # `# with care:` is prose
        return any(not _is_bare(item.context_expr) for item in stmt.items)
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, CODE_EXPRESSIONS) and not _is_bare_yield(stmt.value)
    return False


def _is_bare(node: ast.expr) -> bool:
    return isinstance(node, (ast.Name, ast.Constant))


def _is_bare_yield(node: ast.expr) -> bool:
    return isinstance(node, ast.Yield) and node.value is None
