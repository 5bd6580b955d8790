"""Tests for scripts/check_hygiene.py: each rule on a tiny throw-away git repository."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from textwrap import dedent

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from hygiene.comments import looks_like_code  # noqa: E402
from hygiene.review import check_change_folders  # noqa: E402
from hygiene.source import Source, check_env_vars, check_pageable_uploads  # noqa: E402

GIT_ENV = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
GOOD_MESSAGE = "feat(kv): change the pool\n\nThe scheduler needs it."

CLEAN = {
    "README.md": "# fake\n",
    "bench_decode.py": "print('benchmarks may live in the root')\n",
    "scripts/check_other.py": "print('scripts/ may hold check_ files')\n",
    "tests/kv/test_pool.py": "def test_size():\n    print('tests may print')\n",
    "src/batchgen/MODULE.md": "root\n",
    "src/batchgen/__init__.py": """\
        from batchgen.api.llm import LLM

        __all__ = ["LLM"]
        """,
    "src/batchgen/config.py": "PAGE_SIZE = 16\n",
    "src/batchgen/api/MODULE.md": "api\n",
    "src/batchgen/api/__init__.py": "",
    "src/batchgen/api/llm.py": """\
        import os

        from batchgen.config import PAGE_SIZE
        from batchgen.engine.core import step

        # The LLM wraps one engine; shapes are (batch, tokens).
        # (B, T)
        # TODO: stream results
        # Note: pages are owned by the pool.
        # if needed:
        # a == b


        class LLM:
            def generate(self):
                home = os.environ.get("HOME")  # x = 1 after code is fine
                return step() * PAGE_SIZE, home, "# y = f(x)"
        """,
    "src/batchgen/engine/MODULE.md": "engine\n",
    "src/batchgen/engine/__init__.py": "",
    "src/batchgen/engine/core.py": """\
        from typing import TYPE_CHECKING

        from .. import config
        from ..kv import pool

        if TYPE_CHECKING:
            from batchgen.api.llm import LLM


        def step(llm: "LLM | None" = None) -> int:
            return pool.SIZE + config.PAGE_SIZE
        """,
    "src/batchgen/kv/MODULE.md": "kv\n",
    "src/batchgen/kv/__init__.py": "",
    "src/batchgen/kv/pool.py": "SIZE = 4\n",
}


def git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    result = subprocess.run(
        ["git", *identity, *args], cwd=repo, env=GIT_ENV, capture_output=True, text=True, check=True
    )
    return result.stdout


def write(repo: Path, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(dedent(text))


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def check(repo: Path, *args: str) -> tuple[int, str]:
    command = [sys.executable, str(SCRIPTS / "check_hygiene.py"), *args]
    result = subprocess.run(command, cwd=repo, env=GIT_ENV, capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "-c", "init.defaultBranch=main", "init", "-q")
    write(tmp_path, CLEAN)
    commit(tmp_path, "chore: start\n\nA clean baseline.")
    return tmp_path


@pytest.fixture
def branch(repo: Path) -> Path:
    git(repo, "checkout", "-q", "-b", "change")
    return repo


# --- the clean repository -------------------------------------------------------------


def test_clean_repo_passes(repo):
    assert check(repo) == (0, "blocking: 0, advisory: 0\n")


def test_clean_change_passes_review(branch):
    write(branch, {"src/batchgen/kv/pool.py": "SIZE = 4\n\n\ndef grow():\n    return SIZE\n"})
    write(branch, {"src/batchgen/kv/MODULE.md": "kv: SIZE, grow()\n"})
    commit(branch, GOOD_MESSAGE)
    assert check(branch, "--base", "main", "--type", "core") == (0, "blocking: 0, advisory: 0\n")


# --- file names and folders -----------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "src/batchgen/kv/test_pool.py",
        "src/batchgen/kv/pool_test.py",
        "src/batchgen/conftest.py",
        "src/batchgen/kv/tests/helpers.py",
    ],
)
def test_test_files_in_package_fail(repo, path):
    write(repo, {path: "X = 1\n"})
    code, out = check(repo)
    assert code == 1
    assert f"{path}: [test-in-package]" in out


@pytest.mark.parametrize(
    "path",
    [
        "debug_run.py",
        "tmp_notes.txt",
        "src/batchgen/check_pages.py",
        "src/batchgen/kv/scratch_a.py",
    ],
)
def test_scratch_files_fail(repo, path):
    write(repo, {path: "X = 1\n"})
    code, out = check(repo)
    assert code == 1
    assert f"{path}: [scratch-file]" in out


ARTIFACTS = [
    "data/x.log", "data/x.csv", "dist/x.whl", "ckpt/x.pt", "ckpt/x.pth", "ckpt/x.ckpt",
    "ckpt/x.bin", "ckpt/x.safetensors", "ckpt/x.gguf", "src/x.pyc", "src/x.pyo", "lib/x.so",
    "lib/x.o", "prof/x.trace", "prof/x.nsys-rep", "prof/x.qdrep", "prof/x.prof",
    "prof/trace.json", "prof/trace_decode.json", "tests/data/tiny.safetensors",
]  # fmt: skip


@pytest.mark.parametrize("path", ARTIFACTS)
def test_artifacts_fail(repo, path):
    write(repo, {path: "data\n"})
    code, out = check(repo)
    assert code == 1
    assert f"{path}: [artifact]" in out


def test_ignored_artifacts_are_skipped_but_force_added_ones_fail(repo):
    write(repo, {".gitignore": "*.log\n", "ignored.log": "x\n", "forced.log": "x\n"})
    git(repo, "add", "-f", "forced.log")
    code, out = check(repo)
    assert code == 1
    assert "forced.log: [artifact]" in out
    assert "ignored.log" not in out


@pytest.mark.parametrize("folder", ["src/batchgen", "src/batchgen/kv"])
def test_missing_module_md_fails(repo, folder):
    (repo / folder / "MODULE.md").unlink()
    code, out = check(repo)
    assert code == 1
    assert f"{folder}/MODULE.md: [module-md]" in out


def test_new_package_folder_needs_module_md(repo):
    write(repo, {"src/batchgen/models/llama.py": "X = 1\n"})
    code, out = check(repo)
    assert code == 1
    assert "src/batchgen/models/MODULE.md: [module-md]" in out


# --- package source -------------------------------------------------------------------


def test_print_in_package_fails(repo):
    source = """\
        import logging

        print("pages", 3)
        logging.getLogger(__name__).info("print(x) in a string is fine")
        """
    write(repo, {"src/batchgen/kv/pool.py": source})
    code, out = check(repo)
    assert code == 1
    assert "src/batchgen/kv/pool.py:3: [print]" in out
    assert out.count("[print]") == 1


def test_commented_code_in_package_fails(repo):
    source = """\
        #!/usr/bin/env python
        # The pool owns every page.
        # x = f(y)
        SIZE = 4  # type: ignore
            # return SIZE
        # import os
        """
    write(repo, {"src/batchgen/kv/pool.py": source})
    code, out = check(repo)
    assert code == 1
    flagged = [line.split(": [")[0] for line in out.splitlines() if "[commented-code]" in line]
    assert flagged == [f"src/batchgen/kv/pool.py:{n}" for n in (3, 5, 6)]


CODE_COMMENTS = [
    "x = f(y)", "return foo", "import os", "from a import b", "self.flush()", "print(x)",
    "pages[i] = j", "k, v = split(qkv)", "if x > 0:", "for p in pages:", "def f(x):",
    "class Foo(Base):", "n += 1", "x: int = 0", "raise ValueError(msg)", "del cache[key]",
    "with torch.no_grad():", "assert n > 0", "await stream.wait()", "while not done():",
]  # fmt: skip
PROSE_COMMENTS = [
    "", "noqa: E501", "type: ignore[attr-defined]", "pragma: no cover", "!/usr/bin/env python",
    "-*- coding: utf-8 -*-", "fmt: off", "TODO", "TODO(lead)", "TODO(lead): fix this",
    "FIXME", "Note: pages are freed here", "The scheduler never touches tensors.",
    "(B, T, H)", "[num_pages, page_size]", "a == b", "not used", "if needed:", "with care:",
    "global state", "e.g. f(x)", "see https://example.com", "----", "returns", "step 1",
    "return", "yield", "Returns: the list of pages", "1. allocate, 2. copy", "page 0 | page 1",
    "Copyright (c) 2025", "SPDX-License-Identifier: Apache-2.0", "len(pages) <= n",
]  # fmt: skip


@pytest.mark.parametrize("comment", CODE_COMMENTS)
def test_code_comments_are_code(comment):
    assert looks_like_code(comment)


@pytest.mark.parametrize("comment", PROSE_COMMENTS)
def test_prose_comments_are_not_code(comment):
    assert not looks_like_code(comment)


@pytest.mark.parametrize(
    "expression",
    [
        'os.environ["BATCHGEN_DEBUG"]',
        'os.environ.get("BATCHGEN_DEBUG")',
        'os.environ.get("BATCHGEN_DEBUG", "0")',
        'os.getenv("BATCHGEN_DEBUG")',
        'environ["BATCHGEN_DEBUG"]',
        'getenv("BATCHGEN_DEBUG")',
        '"BATCHGEN_DEBUG" in os.environ',
    ],
)
def test_batchgen_env_var_read_fails(repo, expression):
    source = f"import os\nfrom os import environ, getenv\n\nflag = {expression}\n"
    write(repo, {"src/batchgen/kv/pool.py": source})
    code, out = check(repo)
    assert code == 1
    assert "src/batchgen/kv/pool.py:4: [env-var]" in out
    assert "BATCHGEN_DEBUG" in out


def test_env_var_allow_list_is_honoured():
    text = 'import os\n\nflag = os.getenv("BATCHGEN_X")\n'
    source = Source("src/batchgen/kv/pool.py", text, ast.parse(text))
    assert len(list(check_env_vars(source))) == 1
    assert list(check_env_vars(source, allowed=frozenset({"BATCHGEN_X"}))) == []


# --- pageable uploads ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "reported"),
    [
        ("torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)", True),
        ("torch.as_tensor(ids).cuda(non_blocking=True)", True),
        ("torch.tensor(ids, pin_memory=False).to(device, non_blocking=True)", True),
        ("torch.from_numpy(array).to(device, non_blocking=True)", True),
        ("torch.tensor(ids, pin_memory=dev.is_cuda).to(device, non_blocking=True)", False),
        ("torch.tensor(ids, pin_memory=True).cuda(non_blocking=True)", False),
        ("torch.tensor(ids).to(device)", False),  # blocking: not this rule's
        ("buf.to(device, non_blocking=True)", False),  # not built here
    ],
)
def test_pageable_non_blocking_uploads(expression, reported):
    text = f"import torch\n\n\ndef f(ids, array, buf, dev, device):\n    return {expression}\n"
    source = Source("src/batchgen/kv/page_copies.py", text, ast.parse(text))
    found = [(f.line, f.rule) for f in check_pageable_uploads(source)]
    assert found == ([(5, "pageable-upload")] if reported else [])


def test_pageable_upload_fails_the_check(repo):
    text = "import torch\n\n\ndef f(ids):\n    return torch.tensor(ids).to('cuda', non_blocking=True)\n"
    write(repo, {"src/batchgen/kv/pool.py": text})
    code, out = check(repo)
    assert code == 1
    assert "src/batchgen/kv/pool.py:5: [pageable-upload]" in out


# --- layering -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "source", "line", "rule"),
    [
        ("src/batchgen/kv/bad.py", "from batchgen.engine import core\n", 1, "layering"),
        ("src/batchgen/kv/bad.py", "import batchgen.api.llm\n", 1, "layering"),
        ("src/batchgen/kv/bad.py", "from ..engine.core import step\n", 1, "layering"),
        ("src/batchgen/kv/bad.py", "from .. import api\n", 1, "layering"),
        ("src/batchgen/kv/bad.py", "def f():\n    from batchgen.api import llm\n", 2, "layering"),
        ("src/batchgen/kernels/x.py", "import batchgen.models.llama\n", 1, "layering"),
        ("src/batchgen/runner/x.py", "from ..distributed import tp\n", 1, "layering"),
        ("src/batchgen/kv/bad.py", "from batchgen import LLM\n", 1, "init-import"),
        ("src/batchgen/kv/bad.py", "from .. import LLM\n", 1, "init-import"),
    ],
)
def test_upward_imports_fail(repo, path, source, line, rule):
    write(repo, {path: source, str(Path(path).parent / "MODULE.md"): "doc\n"})
    code, out = check(repo)
    assert code == 1
    assert f"{path}:{line}: [{rule}]" in out


def test_downward_and_common_imports_pass(repo):
    source = """\
        import torch

        from batchgen import config
        from batchgen.kernels import paged_attention
        from batchgen.sampling_params import SamplingParams

        from . import pool
        from .. import config as config2
        from ..layers.norm import RMSNorm
        """
    write(repo, {"src/batchgen/kv/ok.py": source})
    assert check(repo) == (0, "blocking: 0, advisory: 0\n")


def test_type_checking_only_guards_its_body(repo):
    source = """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from batchgen.api.llm import LLM
        else:
            from batchgen.engine import core
        """
    write(repo, {"src/batchgen/kv/x.py": source})
    code, out = check(repo)
    assert code == 1
    assert "src/batchgen/kv/x.py:6: [layering]" in out
    assert out.count("[layering]") == 1


def test_folder_outside_layer_order_is_advisory(repo):
    write(repo, {"src/batchgen/misc/x.py": "X = 1\n", "src/batchgen/misc/MODULE.md": "misc\n"})
    code, out = check(repo)
    assert code == 0
    assert "src/batchgen/misc: [layering, advisory]" in out


# --- copy-ordering contract (rules and mutations: tests/kv/test_copy_contract.py) ------


def test_copy_contract_is_a_blocking_check_over_the_package(repo):
    source = """\
        import torch


        def offload(src, dst):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)


        def racing(src, dst, side):
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
        """
    write(repo, {"src/batchgen/runner/streams.py": source})
    write(repo, {"src/batchgen/runner/MODULE.md": "runner\n"})
    code, out = check(repo)
    assert code == 1
    assert "src/batchgen/runner/streams.py:12: [copy-2b]" in out
    assert out.count("[copy-") == 1


def test_a_host_tier_without_its_copy_engine_is_reported(repo):
    write(repo, {"src/batchgen/kv/copy_engine.py": "class Copies:\n    pass\n"})
    code, out = check(repo)
    assert code == 1
    assert (
        "src/batchgen/kv/copy_engine.py:1: [copy-1a] kv/copy_engine.py defines no CopyEngine" in out
    )


# --- wiring: components get their dependencies when built -------------------------------

WIRING = """\
    import dataclasses
    from dataclasses import dataclass


    class Tier:
        def __init__(self, pool):
            self.pool = pool  # its own attribute: fine
            self.moves = 0


    @dataclass
    class Step:
        pages: list


    @dataclasses.dataclass(frozen=True)
    class Copy:
        page: int


    class Manager:
        def __init__(self, tier):
            self.tier = tier

        def wire(self, pool, request):
            self.tier.pool = pool
            self.tier.moves += 1  # a counter: fine
            request.status = "running"  # a parameter's plain data: fine
            step = Step([])
            step.pages = [1]  # a dataclass: plain data
            other = Tier(pool)
            other.pool, (self.tier.states, x) = None, (1, 2)
            setattr(other, "pool", pool)
            setattr(self, "tier", other)  # its own attribute: fine
            helper = lambda t: setattr(t, "pool", pool)
            return helper, x


    def build(pool):
        tier = Tier(pool)
        tier.pool = pool
        return Manager(tier)
    """


def test_wiring_after_construction_fails_in_engine_and_kv(repo):
    write(repo, {"src/batchgen/kv/wired.py": WIRING})
    code, out = check(repo)
    assert code == 1
    found = [line.split(": [wiring]")[0] for line in out.splitlines() if "[wiring]" in line]
    assert found == [
        "src/batchgen/kv/wired.py:26",  # self.tier.pool
        "src/batchgen/kv/wired.py:32",  # other.pool
        "src/batchgen/kv/wired.py:32",  # self.tier.states
        "src/batchgen/kv/wired.py:33",  # setattr(other, ...)
        "src/batchgen/kv/wired.py:35",  # setattr(t, ...) in a lambda
        "src/batchgen/kv/wired.py:41",  # tier.pool on a Tier just built
    ]
    assert "assigns self.tier.pool after it is built; pass it to the constructor" in out


def test_wiring_is_checked_under_engine_and_kv_only(repo):
    write(repo, {"src/batchgen/runner/wired.py": WIRING, "src/batchgen/runner/MODULE.md": "r\n"})
    assert check(repo) == (0, "blocking: 0, advisory: 0\n")


# --- reviewing a change ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "rule"),
    [
        ("add the pool\n\nBecause.", "commit-format"),
        ("feature(kv): add the pool\n\nBecause.", "commit-format"),
        ("feat(kv):add the pool\n\nBecause.", "commit-format"),
        ("feat(kv): add the pool", "commit-body"),
        ("feat(kv): add the pool\n\nSigned-off-by: t <t@t>", "commit-body"),
        ("feat(kv): add the pool\n\nBecause.\n\nCo-authored-by: x <x@x>", "co-author"),
    ],
)
def test_bad_commit_messages_fail(branch, message, rule):
    write(branch, {"tests/kv/test_more.py": "def test_more():\n    pass\n"})
    commit(branch, message)
    code, out = check(branch, "--base", "main", "--type", "core")
    assert code == 1
    assert f"[{rule}]" in out


@pytest.mark.parametrize(
    "message",
    [
        "fix: free pages on preemption\n\nThey leaked.",
        "perf(kv/pool): batch copies\n\nFewer launches.\n\nSigned-off-by: t <t@t>",
        "docs(readme): explain resume\n\nNote: users asked for it.",
    ],
)
def test_good_commit_messages_pass(branch, message):
    write(branch, {"tests/kv/test_more.py": "def test_more():\n    pass\n"})
    commit(branch, message)
    assert check(branch, "--base", "main", "--type", "core") == (0, "blocking: 0, advisory: 0\n")


def test_change_outside_type_folders_is_advisory(branch):
    write(branch, {"src/batchgen/engine/core.py": CLEAN["src/batchgen/engine/core.py"] + "\n"})
    commit(branch, GOOD_MESSAGE)
    write(branch, {"README.md": "# changed, not committed\n", "scripts/new_tool.py": "X = 1\n"})
    code, out = check(branch, "--base", "main", "--type", "kernel")
    assert code == 0
    for path in ("src/batchgen/engine/core.py", "README.md", "scripts/new_tool.py"):
        assert f"{path}: [change-folder, advisory]" in out
    assert out.endswith("blocking: 0, advisory: 3\n")


@pytest.mark.parametrize(
    ("change_type", "path", "allowed"),
    [
        ("model", "src/batchgen/models/llama.py", True),
        ("model", "docs/models.md", True),
        ("model", "src/batchgen/kv/pool.py", False),
        ("kernel", "src/batchgen/kernels/decode.py", True),
        ("kernel", "benchmarks/decode.py", True),
        ("kernel", "src/batchgen/models/llama.py", False),
        ("core", "src/batchgen/engine/core.py", True),
        ("core", "README.md", True),
        ("core", "scripts/x.py", False),
        ("fix", "src/batchgen/kv/pool.py", True),
        ("fix", "pyproject.toml", False),
        ("infra", ".ci/test.sh", True),
        ("infra", "CONTRIBUTING.md", True),
        ("infra", "src/batchgen/config.py", False),
        ("docs", "src/batchgen/kv/MODULE.md", True),
        ("docs", "src/batchgen/kv/pool.py", False),
    ],
)
def test_permitted_folders_table(change_type, path, allowed):
    assert (list(check_change_folders({path}, change_type)) == []) == allowed


@pytest.mark.parametrize(
    ("source", "delta"),
    [
        ("SIZE = 4\n\n\ndef grow():\n    pass\n", "+grow"),
        ("SIZE = 4\n\n\nclass Pool:\n    pass\n", "+Pool"),
        ('SIZE = 4\n__all__ = ["SIZE"]\n', "+SIZE"),
    ],
)
def test_public_api_change_without_module_md_is_advisory(branch, source, delta):
    write(branch, {"src/batchgen/kv/pool.py": source})
    commit(branch, GOOD_MESSAGE)
    code, out = check(branch, "--base", "main", "--type", "core")
    assert code == 0
    assert f"src/batchgen/kv/pool.py: [module-md-api, advisory] public API changed ({delta})" in out


def test_removed_module_counts_as_api_change(branch):
    write(branch, {"src/batchgen/engine/core.py": "def step():\n    return 1\n"})
    commit(branch, "chore: give core a public step\n\nSetup.")
    git(branch, "checkout", "-q", "-b", "removal")
    (branch / "src/batchgen/engine/core.py").unlink()
    code, out = check(branch, "--base", "change", "--type", "core")
    assert code == 0
    assert "src/batchgen/engine/core.py: [module-md-api, advisory]" in out
    assert "(-step)" in out


def test_private_names_are_not_api(branch):
    write(branch, {"src/batchgen/kv/pool.py": "SIZE = 4\n\n\ndef _grow():\n    pass\n"})
    commit(branch, GOOD_MESSAGE)
    assert check(branch, "--base", "main", "--type", "core") == (0, "blocking: 0, advisory: 0\n")


def test_review_needs_base_and_type_together(repo):
    code, out = check(repo, "--base", "main")
    assert code == 2
    assert "--base and --type go together" in out


def test_unknown_base_ref_fails(repo):
    code, out = check(repo, "--base", "no-such-ref", "--type", "core")
    assert code == 1
    assert "check_hygiene: git merge-base" in out


# --- tests as evidence ------------------------------------------------------------------

PYPROJECT = """\
    [project]
    name = "fake"
    dependencies = ["torch>=2.6", "fla-core>=0.6", "xgrammar>=0.2.9"]

    [project.optional-dependencies]
    ray = ["ray>=2.10"]
    test = ["ray>=2.10", "pytest>=8", "jsonschema>=4.0"]
    """


@pytest.mark.parametrize(
    ("module", "reported"),
    [
        ("xgrammar", True),  # required by the package
        ("fla.ops.kda", True),  # fla-core's module, required
        ("jsonschema", True),  # installed by the test command
        ("torch.cuda", True),
        ("not_declared", True),  # nothing optional names it
        ("ray", False),  # the optional extra
        ("ray.util", False),
        ("transformers.models.kimi_linear.modeling_kimi_linear", False),  # a version probe
    ],
)
def test_importorskip_only_for_optional_extras(repo, module, reported):
    test = f'import pytest\n\nmod = pytest.importorskip("{module}")\n'
    write(repo, {"pyproject.toml": PYPROJECT, "tests/engine/test_x.py": test})
    code, out = check(repo)
    if reported:
        assert code == 1
        assert f"tests/engine/test_x.py:3: [importorskip] importorskip('{module}')" in out
    else:
        assert (code, out) == (0, "blocking: 0, advisory: 0\n")


def test_importorskip_inside_a_test_is_found_and_skipping_by_hand_is_not_flagged(repo):
    test = """\
        import pytest
        from pytest import importorskip


        def test_x():
            knobs = importorskip("triton").knobs
            assert knobs


        def test_y():
            pytest.skip("needs a GPU")
        """
    write(repo, {"pyproject.toml": PYPROJECT, "tests/kernels/test_k.py": test})
    code, out = check(repo)
    assert code == 1
    assert "tests/kernels/test_k.py:6: [importorskip] importorskip('triton')" in out
    assert out.count("[importorskip]") == 1


CLAIMING = """\
    from batchgen import LLM, SamplingParams


    def test_{name}(model):
        \"\"\"{doc}\"\"\"
        llm = LLM(model{engine})
        return llm.generate([[1, 2]], SamplingParams(max_tokens=4{params}))
    """


@pytest.mark.parametrize(
    ("name", "doc", "engine", "params", "setting"),
    [
        ("default_configuration", "Greedy.", "", ", ignore_eos=True", "ignore_eos=True"),
        ("greedy", "Every default on (EOS, no logprobs).", "", ", logprobs=0", "logprobs=0"),
        ("greedy", "In the engine's defaults.", ", batchgen_debug=True", "", "batchgen_debug"),
        ("greedy", "The default configuration.", ', tier_policy="always"', "", "tier_policy"),
        ("in_defaults", "Greedy.", ", **{'batchgen_debug': 1}", "", "'batchgen_debug': 1"),
    ],
)
def test_a_test_claiming_the_defaults_that_leaves_them_fails(
    repo, name, doc, engine, params, setting
):
    test = CLAIMING.format(name=name, doc=doc, engine=engine, params=params)
    write(repo, {"tests/engine/test_defaults.py": test})
    code, out = check(repo)
    assert code == 1
    flagged = [line for line in out.splitlines() if "[claims-defaults]" in line]
    assert len(flagged) == 1 and setting in flagged[0]
    assert flagged[0].startswith("tests/engine/test_defaults.py:")


@pytest.mark.parametrize(
    ("name", "doc", "engine", "params"),
    [
        ("default_configuration", "Greedy.", "", ", stop=['w7']"),  # defaults kept
        ("default_configuration", "Greedy.", ", batchgen_debug=False", ", logprobs=None"),
        ("greedy", "With logprobs asked, pipelined decode off.", "", ", logprobs=5"),
        ("ignore_eos_fills_the_pool", "Each request to its length.", "", ", ignore_eos=True"),
    ],
)
def test_a_test_keeping_the_defaults_or_not_claiming_them_passes(repo, name, doc, engine, params):
    test = CLAIMING.format(name=name, doc=doc, engine=engine, params=params)
    write(repo, {"tests/engine/test_defaults.py": test})
    assert check(repo) == (0, "blocking: 0, advisory: 0\n")


def test_a_reference_run_off_the_defaults_says_so_on_its_line(repo):
    test = """\
        from batchgen import SamplingParams


        def test_default_configuration_matches_the_logprobs_run(llm):
            plain = SamplingParams(max_tokens=8)
            ref = SamplingParams(max_tokens=8, logprobs=5)  # off-defaults: the reference
            return plain, ref
        """
    write(repo, {"tests/engine/test_defaults.py": test})
    assert check(repo) == (0, "blocking: 0, advisory: 0\n")
    write(repo, {"tests/engine/test_defaults.py": test.replace("# off-defaults: ", "# ")})
    code, out = check(repo)
    assert code == 1 and "tests/engine/test_defaults.py:6: [claims-defaults]" in out


# --- module globals -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "source", "line"),
    [
        ("tests/kv/test_p.py", "from batchgen.kv import pool\n\npool.SIZE = 8\n", 3),
        ("benchmarks/b.py", "import batchgen.kv.pool as p\n\np.SIZE += 1\n", 3),
        ("tests/kv/test_p.py", "from batchgen import config as c\n\nold, c.PAGE_SIZE = 1, 2\n", 3),
        (
            "tests/kv/test_p.py",
            "def test_x(monkeypatch, pool):\n    monkeypatch.setattr(pool, 'SIZE', 2)\n",
            2,
        ),
        ("tests/kv/test_p.py", "def test_x(mp):\n    mp.setattr('batchgen.kv.pool.SIZE', 2)\n", 2),
        ("benchmarks/b.py", "from batchgen.kv import pool\n\nsetattr(pool, 'SIZE', 3)\n", 3),
        (
            "tests/kv/test_p.py",
            "def test_x(monkeypatch, c):\n    monkeypatch.delattr(c, 'PAGE_SIZE')\n",
            2,
        ),
    ],
)
def test_a_test_or_benchmark_setting_a_package_global_fails(repo, path, source, line):
    write(repo, {path: source})
    code, out = check(repo)
    assert code == 1
    flagged = [row for row in out.splitlines() if "[module-global]" in row]
    assert len(flagged) == 1 and flagged[0].startswith(f"{path}:{line}: ")


@pytest.mark.parametrize(
    "source",
    [
        "from batchgen.kv import pool\n\nsize = pool.SIZE * 2\n",  # read, not set
        "def test_x(monkeypatch, pool):\n    monkeypatch.setattr(pool, 'make', len)\n",  # a spy
        "def test_x(monkeypatch, hub):\n    monkeypatch.setattr(hub, 'HF_HUB_OFFLINE', True)\n",
        "class Args:\n    pass\n\n\nArgs.SIZE_HINT = 1\n",  # not a package constant
    ],
)
def test_reading_globals_spying_and_other_libraries_globals_pass(repo, source):
    write(repo, {"tests/kv/test_p.py": source, "benchmarks/b.py": source})
    assert check(repo) == (0, "blocking: 0, advisory: 0\n")


def test_the_package_itself_may_set_its_globals(repo):
    write(repo, {"src/batchgen/kv/other.py": "from batchgen.kv import pool\n\npool.SIZE = 5\n"})
    assert "[module-global]" not in check(repo)[1]
