"""The package version (one place: pyproject reads it from here too)."""

__version__ = "0.1.0"
