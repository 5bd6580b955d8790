"""Print one of the README's opening commands, so CI runs exactly what a new user types.

    python3 scripts/readme_commands.py 1    # sets up and runs the main job
    python3 scripts/readme_commands.py 2    # sets up and runs the tests

A command is the body of one of the README's first ```bash blocks, in order.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands(text: str) -> list[str]:
    """The bodies of the README's ```bash blocks, in order, stripped."""
    return [m.group(1).strip() for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        sys.stderr.write("usage: readme_commands.py N  (1-based)\n")
        return 2
    commands = readme_commands(README.read_text(encoding="utf-8"))
    n = int(argv[0])
    if not 1 <= n <= len(commands):
        sys.stderr.write(f"README.md has {len(commands)} bash blocks, not {n}\n")
        return 2
    sys.stdout.write(commands[n - 1] + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
