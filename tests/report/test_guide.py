"""The ```python blocks of docs/guides/debugging_precision.md run as written, in order, in
one namespace (a block uses what the blocks before it define)."""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "debugging_precision.md"


def test_guide_code_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 4
    namespace = {"__name__": "guide"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name} block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "in float32: mid" in out and "float16 under/sub/over" in out
    assert "\nmpjax: loss scaling " in out and "cond/branch" not in out
    assert "fp8 GEMMs (Dense_0, mid, head), 0 run as fp8 on cpu" in out
    assert "fp8_meta/Dense_0 g float8_e5m2" in out
