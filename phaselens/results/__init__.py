"""Result objects: the shared base (tidy frames, plot, save/load, metadata, repr) and one type per analysis."""

from phaselens.results.base import Result

__all__ = ["Result"]
