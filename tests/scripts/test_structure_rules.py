"""The hygiene rules on the package as a whole (scripts/hygiene/structure.py): no file over
400 lines, no import cycle between package modules; and the repository keeps both."""

from __future__ import annotations

import sys
from pathlib import Path
from textwrap import dedent

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_hygiene  # noqa: E402
from hygiene import structure  # noqa: E402
from hygiene.git import listed_files  # noqa: E402
from hygiene.source import load_package_sources  # noqa: E402

BASE = {
    "src/batchgen/__init__.py": "",
    "src/batchgen/config.py": "PAGE_SIZE = 16\n",
    "src/batchgen/api/__init__.py": "",
    "src/batchgen/engine/__init__.py": "",
    "src/batchgen/kv/__init__.py": "",
}


def write(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """Write BASE plus `files` under tmp_path; their paths, sorted."""
    tree = {**BASE, **files}
    for path, text in tree.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(dedent(text))
    return sorted(tree)


def findings(tmp_path: Path, files: dict[str, str], rule: str) -> list:
    """What check_hygiene's source checks report under `rule` for BASE plus `files`."""
    listed = write(tmp_path, files)
    return [f for f in check_hygiene.check_sources(tmp_path, listed) if f.rule == rule]


def sources(tmp_path: Path, files: dict[str, str]) -> list:
    """The parsed package sources of BASE plus `files`."""
    loaded, unparsed = load_package_sources(tmp_path, write(tmp_path, files))
    assert unparsed == []
    return loaded


def lines(n: int) -> str:
    return "".join(f"X{i} = {i}\n" for i in range(n))


# --- file size ------------------------------------------------------------------------


def test_a_package_file_over_the_limit_fails_and_one_at_it_passes(tmp_path):
    over = findings(tmp_path, {"src/batchgen/kv/big.py": lines(401)}, "file-size")
    assert [(f.where, f.blocking) for f in over] == [("src/batchgen/kv/big.py", True)]
    assert "401 lines" in over[0].message
    assert findings(tmp_path, {"src/batchgen/kv/big.py": lines(400)}, "file-size") == []


def test_the_allow_list_holds_only_files_still_over_the_limit(tmp_path):
    listed = "src/batchgen/kv/big.py"
    allowed = frozenset({listed})
    assert list(structure.check_file_sizes(sources(tmp_path, {listed: lines(401)}), allowed)) == []
    shrunk = list(structure.check_file_sizes(sources(tmp_path, {listed: lines(10)}), allowed))
    assert [(f.where, f.blocking) for f in shrunk] == [(listed, False)]
    assert "OVER_LIMIT_FOR_NOW" in shrunk[0].message


# --- import cycles --------------------------------------------------------------------


@pytest.mark.parametrize(
    "back",
    [
        "from batchgen.engine import a\n",  # at the top
        "from . import a\n",  # relative
        "import batchgen.engine.a\n",
        "def f():\n    from batchgen.engine.a import A\n",  # inside a function
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from batchgen.engine.a import A\n",
    ],
)
def test_two_modules_importing_each_other_fail(tmp_path, back):
    files = {"src/batchgen/engine/a.py": "from batchgen.engine.b import B\n\nA = B\n"}
    files["src/batchgen/engine/b.py"] = "B = 1\n" + back
    (cycle,) = findings(tmp_path, files, "import-cycle")
    assert cycle.where == "src/batchgen/engine/a.py" and cycle.blocking
    assert cycle.message.endswith("batchgen.engine.a -> batchgen.engine.b -> batchgen.engine.a")


def test_a_cycle_through_three_modules_names_them_all(tmp_path):
    files = {
        "src/batchgen/kv/a.py": "from batchgen.kv.b import B\n",
        "src/batchgen/kv/b.py": "from batchgen.kv import c\n\nB = 1\n",
        "src/batchgen/kv/c.py": "def f():\n    from batchgen.kv import a\n",
        "src/batchgen/kv/d.py": "from batchgen.kv import a\n",  # imports the cycle, not in it
    }
    (cycle,) = findings(tmp_path, files, "import-cycle")
    assert cycle.message == (
        "import cycle: batchgen.kv.a -> batchgen.kv.b -> batchgen.kv.c -> batchgen.kv.a"
    )


def test_the_cycle_allow_list_holds_only_cycles_still_there(tmp_path):
    allowed = frozenset({("batchgen.kv.a", "batchgen.kv.b")})
    a, b = "src/batchgen/kv/a.py", "src/batchgen/kv/b.py"
    cyclic = sources(tmp_path, {a: "from . import b\n", b: "from . import a\n"})
    assert list(structure.check_import_cycles(cyclic, allowed)) == []
    broken = sources(tmp_path, {a: "from . import b\n", b: "X = 1\n"})
    gone = list(structure.check_import_cycles(broken, allowed))
    assert [(f.where, f.blocking) for f in gone] == [(a, False)]
    assert "CYCLES_FOR_NOW" in gone[0].message


def test_imports_without_a_cycle_pass(tmp_path):
    files = {
        "src/batchgen/engine/a.py": "from batchgen.engine import b\nfrom batchgen.kv import c\n",
        "src/batchgen/engine/b.py": "from batchgen import config\nfrom batchgen.kv.c import C\n",
        "src/batchgen/kv/c.py": "import torch\n\nC = 1\n",
        # layering lets annotations name a higher layer: not counted as a cycle
        "src/batchgen/kv/d.py": "from typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from batchgen.api.e import E\n",
        "src/batchgen/api/e.py": "from batchgen.kv import d\n\nE = d\n",
    }
    assert findings(tmp_path, files, "import-cycle") == []


# --- the repository itself ------------------------------------------------------------


def test_the_package_keeps_both_rules():
    sources, unparsed = load_package_sources(ROOT, listed_files(ROOT))
    assert unparsed == [] and len(sources) > 50
    problems = [*structure.check_file_sizes(sources), *structure.check_import_cycles(sources)]
    assert [str(f) for f in problems if f.blocking] == []
