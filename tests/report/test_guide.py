"""The ```python blocks of docs/guides/debugging_precision.md run as written, in order."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "debugging_precision.md"


def test_guide_code_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name} block {i}", "exec"), {"__name__": "guide"})
    out = capsys.readouterr().out
    assert "in float32: mid" in out and "float16 under/sub/over" in out
