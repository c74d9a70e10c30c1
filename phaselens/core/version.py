"""The package's version, in one place (``phaselens.__version__`` re-exports it; pyproject reads it too)."""

__version__ = "0.1.0"
