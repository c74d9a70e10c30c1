"""lm-evaluation-harness itself: importing it with a clear error, registering phaselens' models, running its CLI.

lm-eval 0.4.13 finds models in its own registry (``lm_eval.api.registry.model_registry``) and offers no plugin
hook (no entry-point group) through which an installed package could add one to its command line. So
:func:`register` adds phaselens' models in the process that runs lm-eval (``simple_evaluate`` finds them after
it), and :func:`run_cli` (``phaselens lm-eval run ...``) registers them, then hands the arguments to lm-eval's
own entry point unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from phaselens.errors import MissingDependencyError

INSTALL = 'pip install "lm-eval[hf,api]>=0.4.13,<0.5"'
# lm-eval model name -> where the class is (registered as lazy placeholders: the class imports on first use)
MODEL_NAMES = {
    "phaselens": "phaselens.integrations.lm_eval.phaselens_lm:PhaseLensLM",
    "phaselens-completions": "phaselens.integrations.lm_eval.completions:PhaseCompletions",
}


def require_lm_eval() -> Any:
    """The ``lm_eval`` package, or a :class:`~phaselens.errors.MissingDependencyError` naming the install."""
    try:
        import lm_eval
    except ImportError as err:
        raise MissingDependencyError(
            f"lm-evaluation-harness is not installed ({err}); phaselens' lm-eval integration needs it: {INSTALL} "
            "(or install phaselens with its dev extra).") from None
    return lm_eval


def register() -> list[str]:
    """Add ``phaselens`` and ``phaselens-completions`` to lm-eval's model registry (idempotent); returns the names.

    lm-eval's own models are registered first: its ``get_model`` fills an empty registry with them, and would
    not if phaselens' names were the only entries.
    """
    require_lm_eval()
    import lm_eval.models  # noqa: F401  (registers lm-eval's own models)
    from lm_eval.api.registry import model_registry

    for name, target in MODEL_NAMES.items():
        if name not in model_registry:
            model_registry.register(name, target=target)
    return list(MODEL_NAMES)


def run_cli(argv: Sequence[str]) -> None:
    """lm-eval's command line (``lm-eval [run|ls|validate] ...``) with phaselens' models registered.

    ``argv`` is what follows ``lm-eval`` on its command line; lm-eval parses it and may exit (``SystemExit``).
    """
    require_lm_eval()
    register()
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
