"""Progress bars that name the model and the stage ("w8s4: map"), in terminals and notebooks.

Analyses call :func:`progress_bar` with their stage; whoever knows the model's name (the report, the CLI,
a user) wraps the calls in :func:`progress_label`. In a notebook the bar is tqdm's widget when ipywidgets
is installed, and a plain text bar otherwise (``tqdm.auto`` would warn "IProgress not found").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_LABEL: ContextVar[str | None] = ContextVar("phaselens_progress_label", default=None)


@contextmanager
def progress_label(label: str | None) -> Iterator[None]:
    """Prefix every progress bar opened inside the block with ``label`` (e.g. the model's name).

    Example:
        >>> with progress_label("w8s4"):  # doctest: +SKIP
        ...     phaselens.evaluate(model)  # the bar reads "w8s4: evaluate"
    """
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def describe(stage: str, model: Any = None) -> str:
    """The bar's text: ``"LABEL: stage"`` inside :func:`progress_label`, else ``"MODEL: stage"`` when the
    analysis names its model, else ``stage``."""
    label = _LABEL.get()
    if label is None and model is not None:
        from phaselens.contract.protocol import model_name

        label = model_name(model)
    return f"{label}: {stage}" if label else stage


def quiet_tqdm_auto() -> None:
    """Import ``tqdm.auto`` once without its "IProgress not found" warning.

    transformers (imported by transformer_lens and the DeepSeek-V4 adapter) imports ``tqdm.auto`` at module
    level; in a notebook without ipywidgets that import warns, and tqdm falls back to text bars anyway.
    Importing it first, quietly, gives the same fallback without the warning.
    """
    import sys
    import warnings

    if "tqdm.auto" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import tqdm.auto  # noqa: F401


def _tqdm_class() -> Any:
    try:
        import ipywidgets  # noqa: F401  (tqdm's notebook bar needs it)
    except ImportError:
        from tqdm.std import tqdm

        return tqdm
    from tqdm.auto import tqdm

    return tqdm


def progress_bar(iterable: Iterable[Any] | None = None, *, stage: str, unit: str = "batch", total: int | None = None,
                 initial: int = 0, leave: bool = False, model: Any = None) -> Any:
    """A tqdm bar described by :func:`describe` (``stage`` prefixed by the current label or the model's name).

    Under torch.distributed only rank 0 shows bars (the sharded loops count every rank's units there)."""
    from phaselens.parallel.world import is_main_process

    return _tqdm_class()(iterable, desc=describe(stage, model), unit=unit, total=total, initial=initial, leave=leave,
                         dynamic_ncols=True, disable=not is_main_process())
