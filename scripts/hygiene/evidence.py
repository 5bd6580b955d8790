"""Rules on the tests themselves, so that a passing test is evidence:

importorskip      `pytest.importorskip` only for an optional extra of the package. A
                  dependency the package requires (pyproject's [project] dependencies) or
                  that the test command installs (the `test` extra) is imported plainly:
                  a broken install must fail, not skip.
claims-defaults   a test whose name or docstring claims the default configuration sets
                  none of the options that leave it: ignore_eos (EOS endings untested),
                  logprobs and batchgen_debug (each turns pipelined decode off), and
                  tier_policy="always" (the default is "auto"). Rename the test or make
                  it match its name; a
                  reference run the test compares the defaults with says so on its
                  line: `# off-defaults: <why>`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from hygiene.report import Finding

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

TESTS = "tests/"
# Extras of the test command: what they alone install counts as required.
TEST_EXTRAS = frozenset({"test"})
# Modules of a required package that only a newer release of it than the package's minimum
# has, probed by import: each needs a reason in review.
VERSION_PROBES: dict[str, str] = {
    "transformers.models.kimi_linear": "transformers has Kimi Linear from 2026-09 (>4.57)",
}
# Searched in the test's name (underscores read as spaces) and docstring.
DEFAULTS_CLAIM = re.compile(
    r"\bdefault configuration\b|\bevery default\b|\b(the|its|engine's|in) defaults\b"
    r"|\bdefaults on\b",
    re.IGNORECASE,
)
# Keyword arguments (and request-body keys) that leave the default configuration whatever
# value they are given, but None / False (their defaults).
OFF_DEFAULT = ("ignore_eos", "logprobs", "batchgen_debug")
WAIVER = "# off-defaults:"


def optional_modules(pyproject: Path) -> frozenset[str]:
    """Import names of the optional extras the package does not also require (`ray>=2.10`
    -> `ray`). The test extra's own packages (pytest, jsonschema, ...) are not among them:
    the test command installs them, so a test imports them plainly."""
    if not pyproject.is_file():
        return frozenset()
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    extras = project.get("optional-dependencies", {})
    required = {_name(d) for d in project.get("dependencies", [])}
    optional = {
        _name(d) for group, deps in extras.items() if group not in TEST_EXTRAS for d in deps
    }
    return frozenset(optional - required)


def _name(requirement: str) -> str:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return name[1].lower().replace("-", "_").replace(".", "_") if name else requirement


def load_test_sources(root: Path, paths: list[str]) -> list[tuple[str, str, ast.Module]]:
    """(path, text, tree) of every tests/ .py file that parses (one that does not fails
    pytest itself)."""
    out = []
    for path in paths:
        if path.startswith(TESTS) and path.endswith(".py"):
            try:
                text = (root / path).read_text(encoding="utf-8")
                out.append((path, text, ast.parse(text)))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
    return out


def check_importorskip(path: str, tree: ast.AST, optional: frozenset[str]) -> Iterator[Finding]:
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _callee(node.func) == "importorskip"):
            continue
        module = _constant_str(node.args[0]) if node.args else None
        if module is None:
            continue
        top = module.split(".")[0].lower()
        if top in optional or any(_within(module, probe) for probe in VERSION_PROBES):
            continue
        message = (
            f"importorskip({module!r}): {top} is not an optional extra (pyproject.toml); "
            "import it plainly so that a broken install fails"
        )
        yield Finding(path, node.lineno, "importorskip", message)


def check_default_claims(path: str, text: str, tree: ast.AST) -> Iterator[Finding]:
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)):
            continue
        if not node.name.startswith("test"):
            continue
        claim = f"{node.name.replace('_', ' ')} {ast.get_docstring(node) or ''}"
        if not DEFAULTS_CLAIM.search(claim):
            continue
        for line, what in _off_default_settings(node):
            if WAIVER in lines[line - 1]:
                continue
            message = f"{node.name} claims the default configuration but sets {what}"
            yield Finding(path, line, "claims-defaults", message)


def _off_default_settings(func: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in OFF_DEFAULT and not _is_default(kw.value):
                    yield kw.value.lineno, f"{kw.arg}={ast.unparse(kw.value)}"
                elif kw.arg == "tier_policy" and _constant_str(kw.value) == "always":
                    yield kw.value.lineno, 'tier_policy="always"'
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                name = _constant_str(key) if key is not None else None
                if name in OFF_DEFAULT and not _is_default(value):
                    yield value.lineno, f"{name!r}: {ast.unparse(value)}"


def _is_default(value: ast.AST) -> bool:
    return isinstance(value, ast.Constant) and (value.value is None or value.value is False)


def _callee(func: ast.AST) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _constant_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")
