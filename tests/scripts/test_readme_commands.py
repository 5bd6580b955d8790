"""CI runs what the README tells a new user to run (scripts/readme_commands.py, .ci/run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from readme_commands import readme_commands  # noqa: E402


def test_the_readme_opens_with_a_job_command_and_a_test_command():
    commands = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
    job, tests = commands[:2]
    assert job.startswith("pip install torch==2.13.0 -e . && batchgen run ")
    assert tests == "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.index(job) < readme.index(tests) < readme.index("## ")  # first thing read


def test_the_blocks_are_read_in_order_and_whole():
    text = "# t\n\n```bash\nfirst && second\n```\n\nprose\n\n```python\nx = 1\n```\n\n```bash\nthird\n```\n"
    assert readme_commands(text) == ["first && second", "third"]


def test_the_script_prints_the_nth_command_and_refuses_what_is_not_there():
    script = REPO / "scripts" / "readme_commands.py"
    done = subprocess.run([sys.executable, script, "2"], capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout.strip() == readme_commands((REPO / "README.md").read_text())[1]
    missing = subprocess.run([sys.executable, script, "99"], capture_output=True, text=True)
    assert missing.returncode == 2 and "not 99" in missing.stderr


def test_ci_installs_nothing_of_its_own_before_the_readme_commands():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    before = ci[: ci.index("run_command 2")]
    assert "pip install" not in before and "pip3 install" not in before
    assert "python3 -m venv" in before  # a fresh virtual environment, as a new user has
    assert before.index("run_command 1") < ci.index("run_command 2")
    assert "-m slow" in ci[ci.index("run_command 2") :]  # what the README's command leaves out
