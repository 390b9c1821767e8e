"""The README's ```python blocks run as written.

Convention (for anyone adding a block):
- Blocks run in README order, in one namespace, after `PREAMBLE` below (imports and tiny stand-ins
  for the placeholders the README uses: `model`, `params`, `x`, `y`, `loss_fn`, `MyModel`, ...).
- `<!-- readme-test: setup ... -->` right before a block runs the hidden code in it first (define
  the block's own placeholders there; it does not show on the rendered page).
- `<!-- readme-test: skip REASON -->` right before a block skips it; only for what cannot run
  here (several hosts, a GPU).
A failure names the block by its README line number.
"""

from __future__ import annotations

import re
import sys
import traceback
import types
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

PREAMBLE = """
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax

rng_np = np.random.default_rng(0)
rng = jax.random.key(0)
x = jnp.asarray(rng_np.standard_normal((8, 4)), jnp.float32)
y = jnp.asarray(rng_np.standard_normal((8, 2)), jnp.float32)
params = {"w": jnp.asarray(rng_np.standard_normal((4, 2)), jnp.float32), "b": jnp.zeros(2)}


def model(p, x):
    return x @ p["w"] + p["b"]


def mse_loss(params, x, y):
    return ((model(params, x) - y) ** 2).mean()


loss_fn = mse_loss


class MyModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))
"""

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(skip|setup)\b(.*?)-->", re.S)


def readme_blocks(text: str) -> list[dict]:
    """The ```python blocks of `text` with their line numbers and any directive before them."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang == "python":
            before = "\n".join(lines[:start]).rstrip()
            directive = None
            d = list(_DIRECTIVE.finditer(before))
            if d and d[-1].end() == len(before):
                directive = (d[-1].group(1), d[-1].group(2).strip("\n "))
            blocks.append(
                {"line": start + 1, "code": "\n".join(lines[start + 1 : j]), "directive": directive}
            )
        i = j + 1
    return blocks


def test_readme_blocks_are_found_and_parsed():
    text = "a\n<!-- readme-test: skip needs 2 hosts -->\n```python\nA\n```\n```bash\nB\n```\n"
    text += "<!-- readme-test: setup\nq = 1\n-->\n```python\nC\n```\n```python\nD\n```\n"
    blocks = readme_blocks(text)
    assert [b["line"] for b in blocks] == [3, 12, 15]
    assert blocks[0]["directive"] == ("skip", "needs 2 hosts")
    assert blocks[1]["directive"] == ("setup", "q = 1")
    assert [b["code"] for b in blocks] == ["A", "C", "D"]
    assert blocks[2]["directive"] is None


def run_blocks(text: str, preamble: str = PREAMBLE) -> list[int]:
    """Runs the blocks; returns the lines run. Raises AssertionError naming the failing block."""
    module = types.ModuleType("readme_blocks")  # dataclasses (flax.struct) look their module up
    sys.modules[module.__name__] = module
    try:
        return _run_in(module.__dict__, text, preamble)
    finally:
        del sys.modules[module.__name__]


def _run_in(namespace: dict, text: str, preamble: str) -> list[int]:
    exec(compile(preamble, "<readme preamble>", "exec"), namespace)
    ran = []
    for block in readme_blocks(text):
        kind, arg = block["directive"] or (None, None)
        if kind == "skip":
            assert arg, f"README.md:{block['line']}: a skipped block must say why"
            continue
        where = f"README.md:{block['line']}"
        try:
            if kind == "setup":
                exec(compile(arg, f"{where} (setup)", "exec"), namespace)
            exec(compile(block["code"], where, "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - reported with the block's line
            tb = "".join(traceback.format_exception(e)[-6:])
            raise AssertionError(f"the python block at {where} fails:\n{tb}") from e
        ran.append(block["line"])
    return ran


def test_a_failing_block_is_named_by_its_line():
    text = "```python\nz = 1\n```\n\n```python\nz = undefined_name\n```\n"
    try:
        run_blocks(text, preamble="")
    except AssertionError as e:
        assert "README.md:5" in str(e) and "undefined_name" in str(e)
    else:
        raise AssertionError("a failing block was not reported")


@pytest.mark.slow
def test_readme_python_blocks_run():
    text = README.read_text()
    ran = run_blocks(text)
    assert ran, "no python block ran"
    for section in ("## BatchNorm models", "## NNX"):
        start = text.index(section)
        end = text.find("\n## ", start + 1)
        lines = range(text[:start].count("\n") + 1, text[:end].count("\n") + 1)
        inside = [b["line"] for b in readme_blocks(text) if b["line"] in lines]
        assert inside and set(inside) <= set(ran), f"{section}: blocks {inside}, ran {ran}"
