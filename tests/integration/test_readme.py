"""Every code block of the README and of `docs/` runs as written.

Convention (for anyone adding a block):
- Each page (README.md, each docs/**/*.md) runs in a fresh, empty namespace: its ```python blocks
  run in page order, so the first one is a complete program (imports included) and later blocks
  may use what earlier blocks on the same page defined. There is no hidden setup.
- A ```python block that cannot run here (several hosts, a GPU) is marked right before it with
  `<!-- docs-test: skip REASON -->`; the reason is required.
- Blocks in other languages are not run; only the languages in `NOT_RUN` are allowed (a shell
  command is ```bash, program output ```text), and MyST directives (```{toctree}) are not code.
A failure names the block by its file and line.
"""

from __future__ import annotations

import re
import sys
import traceback
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
NOT_RUN = {"bash", "console", "text", "toml"}

_FENCE = re.compile(r"^```(\S*)(?:\s.*)?$")
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(\w+)(.*?)-->", re.S)


def doc_pages() -> list[Path]:
    """README.md and every Markdown page of the docs (not build outputs)."""
    pages = sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0][0] == "_")
    return [README, *pages]


def code_blocks(text: str) -> list[dict]:
    """The fenced blocks of `text`: language, first line, code and the directive before it."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        before = "\n".join(lines[:start]).rstrip()
        directive = None
        d = list(_DIRECTIVE.finditer(before))
        if d and d[-1].end() == len(before):
            directive = (d[-1].group(1), d[-1].group(2).strip("\n "))
        code = "\n".join(lines[start + 1 : j])
        blocks.append({"line": start + 1, "lang": lang, "code": code, "directive": directive})
        i = j + 1
    return blocks


def check_blocks(blocks: list[dict], where: str) -> None:
    """Raises AssertionError for a block whose language or directive breaks the convention."""
    for b in blocks:
        at = f"{where}:{b['line']}"
        lang, directive = b["lang"], b["directive"]
        if lang.startswith("{"):
            continue  # a MyST directive, not code
        assert lang == "python" or lang in NOT_RUN, (
            f"{at}: a ```{lang or '(no language)'} block; use python, or one of {sorted(NOT_RUN)}"
        )
        if directive is None:
            continue
        kind, reason = directive
        assert kind == "skip", f"{at}: unknown directive docs-test: {kind} (only skip)"
        assert lang == "python", f"{at}: docs-test: skip before a ```{lang} block, which never runs"
        assert reason, f"{at}: a skipped block must say why"


def test_blocks_are_found_and_parsed():
    text = "a\n<!-- docs-test: skip needs 2 hosts -->\n```python\nA\n```\n```bash\nB\n```\n"
    text += "```{include} x.md\nC\n```\n```python\nD\n```\n"
    blocks = code_blocks(text)
    assert [b["line"] for b in blocks] == [3, 6, 9, 12]
    assert [b["lang"] for b in blocks] == ["python", "bash", "{include}", "python"]
    assert blocks[0]["directive"] == ("skip", "needs 2 hosts")
    assert [b["code"] for b in blocks] == ["A", "B", "C", "D"]
    assert blocks[3]["directive"] is None
    check_blocks(blocks, "t.md")


@pytest.mark.parametrize(
    "text, message",
    [
        ("```py\nx\n```\n", "a ```py block"),
        ("```\nx\n```\n", "(no language)"),
        ("<!-- docs-test: skip -->\n```python\nx\n```\n", "must say why"),
        ("<!-- docs-test: skip shell -->\n```bash\nx\n```\n", "never runs"),
        ("<!-- docs-test: setup\nx = 1\n-->\n```python\nx\n```\n", "unknown directive"),
    ],
)
def test_a_block_breaking_the_convention_is_refused(text, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_blocks(code_blocks(text), "t.md")


def run_blocks(text: str, where: str = "README.md") -> list[int]:
    """Runs the page's python blocks in one fresh namespace; returns the lines run.

    Raises AssertionError naming the failing block by `where` and line.
    """
    blocks = code_blocks(text)
    check_blocks(blocks, where)
    module = types.ModuleType("doc_blocks")  # dataclasses (flax.struct) look their module up
    sys.modules[module.__name__] = module
    try:
        return _run_in(module.__dict__, blocks, where)
    finally:
        del sys.modules[module.__name__]


def _run_in(namespace: dict, blocks: list[dict], where: str) -> list[int]:
    ran = []
    for block in blocks:
        if block["lang"] != "python" or block["directive"]:
            continue
        at = f"{where}:{block['line']}"
        try:
            exec(compile(block["code"], at, "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - reported with the block's line
            tb = "".join(traceback.format_exception(e)[-6:])
            raise AssertionError(f"the python block at {at} fails:\n{tb}") from e
        ran.append(block["line"])
    return ran


def test_a_failing_block_is_named_by_its_line():
    text = "```python\nz = 1\n```\n\n```python\nz = undefined_name\n```\n"
    with pytest.raises(AssertionError, match=r"page\.md:5(.|\n)*undefined_name"):
        run_blocks(text, "page.md")


def test_a_page_starts_from_an_empty_namespace():
    run_blocks("```python\nq = 1\n```\n", "a.md")
    with pytest.raises(AssertionError, match="name 'q' is not defined"):
        run_blocks("```python\nq\n```\n", "b.md")


@pytest.mark.slow
@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_blocks_run(page):
    text = page.read_text()
    ran = run_blocks(text, str(page.relative_to(ROOT)))
    python_blocks = [b for b in code_blocks(text) if b["lang"] == "python"]
    if page == README or page.parent.name == "guides" or page.stem == "getting_started":
        assert python_blocks, f"{page.name}: a guide starts from a complete runnable program"
        assert ran and ran[0] == python_blocks[0]["line"], f"{page.name}: its first block ran"
