"""A model named by its Hugging Face id ("org/name"), resolved to a local snapshot
directory: from the local Hugging Face cache first, downloaded only where it is missing
and the network allows."""

from __future__ import annotations

import os
from pathlib import Path

# what a download fetches: configs, safetensors weights, tokenizer files (no pickles)
_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def looks_like_repo_id(model: str) -> bool:
    """ "name" or "org/name": no other separators, not a relative or home path, no .gguf."""
    parts = model.split("/")
    return (
        len(parts) <= 2
        and all(parts)
        and not model.startswith((".", "~"))
        and "\\" not in model
        and not model.endswith(".gguf")
    )


def snapshot_path(
    repo_id: str, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """The directory of repo_id's snapshot at `revision` (a branch, tag or commit hash;
    None: "main") in the Hugging Face cache `cache_dir` (None: HF_HUB_CACHE, read at call
    time, else huggingface_hub's default). The cache is asked first, with no network
    access at all; only a snapshot it does not hold is downloaded into it (configs,
    safetensors, tokenizer files), which fails where the network is off or
    HF_HUB_OFFLINE is set. Raises FileNotFoundError naming the id, the revision and the
    cache when neither works."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = str(cache_dir) if cache_dir else os.environ.get("HF_HUB_CACHE") or None
    where = dict(revision=revision, cache_dir=cache)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **where))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_PATTERNS, **where))
    except Exception as e:  # offline, unknown repo or revision, gated, HTTP or disk errors alike
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"model {repo_id!r}{at} is not a local path, not in the Hugging Face cache "
            f"({cache or 'the default cache'}) and could not be downloaded: {e}"
        ) from e
