"""mpjax's version: the one place it is written (pyproject.toml reads it, `mpjax.__version__`
re-exports it)."""

__version__ = "0.2.0"
