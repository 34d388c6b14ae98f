"""The package version, in a module of its own so that the CLI and the server can read it without
importing the top-level facade (pagedllm/__init__.py), which sits above them."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
