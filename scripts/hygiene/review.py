"""Checks on a change against a base ref, the way a reviewer reads it (--base REF --type TYPE).

Blocking: commit messages. Advisory: files outside the change type's folders, and a
public API change in a package folder whose MODULE.md was not touched.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from hygiene.git import Commit, changed_files, commits_since, file_at, merge_base
from hygiene.paths import in_package
from hygiene.report import Finding

# Entries ending in "/" are folders, entries starting with "*" match file names anywhere,
# anything else is one exact file. CONTRIBUTING.md carries the same table.
_FOLDERS = {
    "model": "src/batchgen/models/ src/batchgen/layers/ tests/ *.md",
    "kernel": "src/batchgen/kernels/ src/batchgen/layers/ tests/ benchmarks/",
    "core": "src/batchgen/ tests/ benchmarks/ README.md",
    "fix": "src/ tests/",
    "infra": ".ci/ scripts/ pyproject.toml .gitignore benchmarks/ tests/ README.md CONTRIBUTING.md",
    "docs": "*.md",
}
PERMITTED = {change_type: tuple(entries.split()) for change_type, entries in _FOLDERS.items()}
COMMIT_TYPES = "feat fix docs style refactor perf test build ci chore revert".split()
SUBJECT = re.compile(rf"^(?:{'|'.join(COMMIT_TYPES)})(?:\([\w./-]+\))?: \S")
TRAILER = re.compile(r"^(?:[A-Za-z]+(?:-[A-Za-z]+)+|Fixes|Closes|Refs): ")
CO_AUTHOR = re.compile(r"^\s*co-authored-by:", re.IGNORECASE | re.MULTILINE)


def review_change(root: Path, ref: str, change_type: str) -> Iterator[Finding]:
    base = merge_base(root, ref)
    changed = changed_files(root, base)
    yield from check_change_folders(changed, change_type)
    for commit in commits_since(root, ref):
        yield from check_commit(commit)
    yield from check_module_docs_touched(root, base, changed)


def check_change_folders(changed: set[str], change_type: str) -> Iterator[Finding]:
    allowed = PERMITTED[change_type]
    for path in sorted(changed):
        if not _permitted(path, allowed):
            message = f"a '{change_type}' change may touch only {', '.join(allowed)}"
            yield Finding(path, 0, "change-folder", message, blocking=False)


def check_commit(commit: Commit) -> Iterator[Finding]:
    where = f"commit {commit.sha[:10]}"
    subject, _, rest = commit.message.strip().partition("\n")
    if not SUBJECT.match(subject):
        message = f"subject '{subject}' is not 'type(scope): subject' ({', '.join(COMMIT_TYPES)})"
        yield Finding(where, 0, "commit-format", message)
    if not _body_without_trailers(rest):
        yield Finding(where, 0, "commit-body", "commit has no body saying why")
    if CO_AUTHOR.search(commit.message):
        yield Finding(where, 0, "co-author", "Co-authored-by trailers are not accepted")


def _body_without_trailers(rest: str) -> str:
    paragraphs = [p.strip() for p in rest.strip().split("\n\n") if p.strip()]
    if paragraphs and all(TRAILER.match(line) for line in paragraphs[-1].splitlines()):
        paragraphs.pop()
    return "\n\n".join(paragraphs)


def check_module_docs_touched(root: Path, base: str, changed: set[str]) -> Iterator[Finding]:
    """A public name added to or removed from a package module needs its MODULE.md touched."""
    for path in sorted(changed):
        if not (in_package(path) and path.endswith(".py")):
            continue
        folder = PurePosixPath(path).parent
        if f"{folder}/MODULE.md" in changed:
            continue
        current = root / path
        before = public_names(file_at(root, base, path))
        after = public_names(current.read_text(encoding="utf-8") if current.is_file() else None)
        if before is not None and after is not None and before != after:
            added, removed = sorted(after - before), sorted(before - after)
            delta = [f"+{n}" for n in added] + [f"-{n}" for n in removed]
            message = f"public API changed ({' '.join(delta)}); update {folder}/MODULE.md"
            yield Finding(path, 0, "module-md-api", message, blocking=False)


def public_names(text: str | None) -> set[str] | None:
    """Top-level public defs and classes plus __all__; empty for a missing file, None if unparsable."""
    if text is None:
        return set()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith("_"):
                names.add(node.name)
        elif _assigns_all(node) and isinstance(node.value, (ast.List, ast.Tuple)):
            names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return names


def _assigns_all(node: ast.stmt) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    return isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "__all__"


def _permitted(path: str, allowed: tuple[str, ...]) -> bool:
    name = PurePosixPath(path).name
    for entry in allowed:
        if entry.startswith("*"):
            if fnmatch.fnmatchcase(name, entry):
                return True
        elif entry.endswith("/"):
            if path.startswith(entry):
                return True
        elif path == entry:
            return True
    return False
