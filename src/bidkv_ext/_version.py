"""Single source of the distribution version (read by pyproject and the manifest test)."""

__version__ = "0.1.0"
