"""The tool's version, in a module of its own so that modules inside the package (the store, exports) read it
without importing the package face (calibrate/__init__.py re-exports it). pyproject.toml states the same
version (a packaging test checks they agree)."""

__version__ = "0.1.0"
