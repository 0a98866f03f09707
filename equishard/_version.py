"""The package version: a leaf module, so that any floor can read it without importing
the package root."""

__version__ = "0.1.0"
