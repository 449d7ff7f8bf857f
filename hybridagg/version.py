"""The package version (one place; the root package re-exports it)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
