"""Result objects' shared base (:class:`~phaselens.results.base.Result`: declared frames, plot, save/load,
metadata, repr) and storage. Each result type lives with its analysis (``phaselens.analyses``)."""

from phaselens.results.base import VOCABULARY, Result


def load(path):
    """Any saved phaselens result (the type is read from the file)."""
    from phaselens.results.storage import load_result

    return load_result(path)


__all__ = ["Result", "VOCABULARY", "load"]
