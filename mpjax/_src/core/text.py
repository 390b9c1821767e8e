"""Quoting user input in error messages; imports nothing from mpjax."""

from __future__ import annotations

from typing import Any

__all__ = ["excerpt"]


def excerpt(value: Any, limit: int = 200) -> str:
    """`repr(value)`, or for a longer string its first `limit` characters and its length.

    An error quotes what it refuses; a spec built by a program can be megabytes long, and
    the message should stay readable.

    Args:
      value: what the error quotes (usually a string).
      limit: the most characters of a string quoted.

    Returns:
      `repr(value)` when `value` is not a string longer than `limit`, else e.g.
      `"'params=float32,...'... (600042 characters)"`.

    Example:
      >>> from mpjax._src.core.text import excerpt
      >>> excerpt("c=bf16")
      "'c=bf16'"
      >>> excerpt("x" * 1000, limit=5)
      "'xxxxx'... (1000 characters)"
    """
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return repr(value)
