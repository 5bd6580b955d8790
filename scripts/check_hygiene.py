"""Repository hygiene checks, run by CI as `python scripts/check_hygiene.py` from the repo root.

Checks the files git tracks plus untracked files that are not ignored:
  test-in-package  no test modules, conftest.py or tests/ folder inside src/
  scratch-file     no debug_*, check_*, scratch_*, tmp_* in the package or the repo root
  print            no print() calls in the package (use logging)
  commented-code   no commented-out code in the package
  env-var          no BATCHGEN_* environment variables read in the package
  artifact         no logs, traces, CSVs, checkpoints, wheels or compiled files
  layering         no import of a higher layer (see hygiene/layering.py)
  init-import      subpackages do not import names from batchgen/__init__.py
  module-md        every package folder has a MODULE.md
  copy-1a..6a      the KV copy-ordering rules (src/batchgen/kv/copy_rules.py)
  wiring           engine/ and kv/ assign no attribute of another object: a component is
                   handed its dependencies when built (see hygiene/wiring.py)
  importorskip     tests skip only for an optional extra (see hygiene/evidence.py)
  claims-defaults  a test claiming the defaults sets no option that leaves them
  module-global    no test or benchmark sets a module global of the package (see hygiene/knobs.py)
  file-size        no package file over 400 lines (see hygiene/structure.py)
  import-cycle     no two package modules import each other, directly or through others

With `--base REF --type TYPE` it also reviews the change since REF: commit messages
(blocking), files outside the type's folders and public API changes without a MODULE.md
update (advisory). Prints "blocking: N, advisory: M"; exits 1 when N > 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hygiene import (  # noqa: E402
    comments,
    copy_contract,
    evidence,
    knobs,
    layering,
    paths,
    review,
    source,
    structure,
    wiring,
)
from hygiene.git import GitError, listed_files, repo_root  # noqa: E402
from hygiene.report import Finding, summarise  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", metavar="REF", help="review the change since this git ref")
    parser.add_argument("--type", choices=sorted(review.PERMITTED), help="the kind of change")
    args = parser.parse_args(argv)
    if (args.base is None) != (args.type is None):
        parser.error("--base and --type go together")
    return args


def check_files(listed: list[str]) -> list[Finding]:
    return [
        *paths.check_test_files(listed),
        *paths.check_scratch_files(listed),
        *paths.check_artifacts(listed),
        *paths.check_module_docs(listed),
        *layering.check_layer_folders(listed),
    ]


def check_sources(root: Path, listed: list[str]) -> list[Finding]:
    sources, findings = source.load_package_sources(root, listed)
    for src in sources:
        findings += source.check_prints(src)
        findings += source.check_env_vars(src)
        findings += source.check_pageable_uploads(src)
        findings += comments.check_commented_code(src.path, src.text)
    findings += layering.check_layering(sources, listed)
    findings += structure.check_file_sizes(sources)
    findings += structure.check_import_cycles(sources)
    findings += wiring.check_wiring(sources)
    files = [root / src.path for src in sources]  # those that parse; the others are reported
    if files:
        findings += copy_contract.check_copy_contract(root / paths.PACKAGE, files)
    return findings


def check_tests(root: Path, listed: list[str]) -> list[Finding]:
    optional = evidence.optional_modules(root / "pyproject.toml")
    findings: list[Finding] = []
    for path, text, tree in evidence.load_test_sources(root, listed):
        findings += evidence.check_importorskip(path, tree, optional)
        findings += evidence.check_default_claims(path, text, tree)
    findings += knobs.check_module_globals(root, listed)
    return findings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        root = repo_root(Path.cwd())
        listed = listed_files(root)
        findings = check_files(listed) + check_sources(root, listed) + check_tests(root, listed)
        if args.base:
            findings += review.review_change(root, args.base, args.type)
    except GitError as exc:
        print(f"check_hygiene: {exc}", file=sys.stderr)
        return 1
    return summarise(findings)


if __name__ == "__main__":
    sys.exit(main())
