"""The examples page's commands, run as a newcomer runs them: each writes only under the folder
it is run from (its `results/`), and the checkout's files are the same afterwards.

The commands are read from `docs/examples/index.md` (its `bash` blocks before "Regenerating
this page's figures", the maintainers' commands that write `docs/_static/`); each runs in a
fresh temporary folder with flags appended that shrink it to seconds (argparse keeps the last
value of a repeated flag, so the page's own flags are all exercised).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "examples" / "index.md"
MAINTAINERS = "## Regenerating this page's figures"
OUTPUT_FLAGS = ("--png", "--plot", "--out", "--save")

# Per script: flags that make a run take seconds (appended after the page's).
SHRINK = {
    "quickstart.py": [],
    "train_digits.py": ["--precisions", "bf16", "--seeds", "1", "--steps", "3"],
    "underflow_demo.py": ["--steps", "3"],
    "train_char_lm.py": ["--precisions", "bf16", "--steps", "2", "--batch-size", "4"],
    "data_parallel.py": ["--steps", "3", "--log-every", "1"],
    "export_inference.py": ["--steps", "3"],
}
SHRINK["train_digits.py"] += ["--width", "8", "--blocks", "1", "--no-progress"]
SHRINK["train_char_lm.py"] += ["--seq-len", "16", "--d-model", "16", "--layers", "1"]
SHRINK["train_char_lm.py"] += ["--heads", "2", "--max-bytes", "20000", "--no-progress"]
SHRINK["underflow_demo.py"] += ["--width", "8", "--blocks", "1", "--no-progress"]


def page_commands(text: str) -> list[list[str]]:
    """The `python examples/...` commands of the page's bash blocks, before the maintainers'."""
    user_part = text.split(MAINTAINERS)[0]
    blocks = re.findall(r"```bash\n(.*?)```", user_part, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("python examples/")]


def _tracked_state() -> str:
    """`git status` of the checkout: modified, deleted and untracked (not ignored) files."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


COMMANDS = page_commands(PAGE.read_text())


def test_the_page_names_every_example_and_writes_under_results():
    scripts = {Path(c[1]).name for c in COMMANDS}
    assert scripts == set(SHRINK), "a new example needs its shrinking flags here"
    for cmd in COMMANDS:
        for flag, value in zip(cmd, cmd[1:], strict=False):
            if flag in OUTPUT_FLAGS:
                assert value.startswith("results/"), (cmd, "writes outside results/")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[" ".join(c[1:]) for c in COMMANDS])
def test_page_command_runs_and_leaves_the_checkout_unchanged(cmd, tmp_path):
    if not (ROOT / ".git").exists():
        pytest.fail("run from a git checkout: the test compares `git status` before and after")
    before = _tracked_state()
    script = ROOT / cmd[1]
    argv = [sys.executable, str(script), *cmd[2:], *SHRINK[script.name]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    env.pop("XLA_FLAGS", None)  # the example sets up its own devices, as for a user
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _tracked_state() == before
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    outside = [p for p in written if p.relative_to(tmp_path).parts[0] != "results"]
    assert not outside, outside
    for flag, value in zip(cmd, cmd[1:], strict=False):
        if flag in OUTPUT_FLAGS:
            assert (tmp_path / value).is_file(), (value, "not written")
