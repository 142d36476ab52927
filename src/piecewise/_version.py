"""The package version, importable from every layer (the package root imports everything)."""

__version__ = "0.1.0"
