"""Every docstring example (`>>>`) in mpjax runs, self-contained, and prints what it shows.

Each docstring runs in an empty namespace: an example imports what it uses.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import mpjax

PACKAGE = Path(mpjax.__file__).parent
# every module file, `_src` included (a namespace package, which pkgutil does not walk)
MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
    if p.name != "__main__.py"
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE | doctest.IGNORE_EXCEPTION_DETAIL


def docstring_tests(module_name: str) -> list[doctest.DocTest]:
    """The module's docstrings that hold examples, each with an empty namespace."""
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder().find(module, module_name, globs={})
    return [t for t in tests if t.examples]


def run_docstring(test: doctest.DocTest) -> str:
    """Runs one docstring's examples; returns doctest's report of the failures ('' if none)."""
    report = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test, out=report.append)
    return "".join(report)


def test_a_docstring_using_an_unimported_name_fails():
    parser = doctest.DocTestParser()
    test = parser.get_doctest(">>> jnp.ones(2).sum()\nArray(2., dtype=float32)\n", {}, "t", "t", 0)
    assert "NameError" in run_docstring(test)
    test = parser.get_doctest(">>> 1 + 1\n3\n", {}, "t", "t", 0)
    assert "Expected:" in run_docstring(test)


def test_the_package_has_docstring_examples():
    assert sum(len(docstring_tests(m)) for m in MODULES) >= 40


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
    failures = {t.name: run_docstring(t) for t in docstring_tests(module_name)}
    failures = {k: v for k, v in failures.items() if v}
    assert not failures, "\n".join(failures.values())


@pytest.mark.parametrize("module_name", MODULES)
def test_an_example_section_holds_doctest_examples(module_name):
    module = importlib.import_module(module_name)
    for test in doctest.DocTestFinder().find(module, module_name, globs={}):
        if test.docstring and "Example:" in test.docstring:
            assert test.examples, f"{test.name}: an Example: section without `>>>` lines"
