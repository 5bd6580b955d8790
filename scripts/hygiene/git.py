"""The few git queries the checks need, each returning repo-relative POSIX paths."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


class GitError(RuntimeError):
    """A git command failed (not a repository, unknown ref, ...)."""


@dataclass(frozen=True)
class Commit:
    sha: str
    message: str


def git(root: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _paths(output: str) -> list[str]:
    return [p for p in output.split("\0") if p]


def repo_root(start: Path) -> Path:
    return Path(git(start, "rev-parse", "--show-toplevel").strip())


def listed_files(root: Path) -> list[str]:
    """Tracked files plus untracked files that .gitignore does not exclude, if they exist."""
    out = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return sorted(p for p in set(_paths(out)) if (root / p).is_file())


def merge_base(root: Path, ref: str) -> str:
    return git(root, "merge-base", ref, "HEAD").strip()


def changed_files(root: Path, base: str) -> set[str]:
    """Files changed since `base`: commits up to HEAD, the index, the work tree, new files."""
    changed = _paths(git(root, "diff", "-z", "--name-only", "--no-renames", base))
    untracked = _paths(git(root, "ls-files", "-z", "--others", "--exclude-standard"))
    return set(changed) | set(untracked)


def file_at(root: Path, rev: str, path: str) -> str | None:
    """The text of `path` at `rev`, or None where it did not exist."""
    try:
        return git(root, "show", f"{rev}:{path}")
    except GitError:
        return None


def commits_since(root: Path, ref: str) -> list[Commit]:
    out = git(root, "log", "--no-merges", "--format=%H%x1f%B%x1e", f"{ref}..HEAD")
    records = [r.strip("\n") for r in out.split("\x1e") if r.strip()]
    return [Commit(*record.split("\x1f", 1)) for record in records]
