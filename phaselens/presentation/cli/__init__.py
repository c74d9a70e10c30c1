"""The ``phaselens`` command line: a thin layer over the Python API.

Exit codes: 0 ok; 2 bad usage (typer); 3 a ``PhaseLensError``, printed as one line (``--debug`` shows
the traceback); 130 interrupted (Ctrl-C). Nothing heavy is imported at module level, so ``--help`` and
``zoo list`` answer at once; each command imports what it needs. One module per group of commands; importing
them registers the commands on ``app`` in the order ``--help`` lists them.
"""

from __future__ import annotations

# the order of these imports is the order of the commands in --help
# isort: off
from phaselens.presentation.cli import analysis_commands  # noqa: F401  eval, record, map
from phaselens.presentation.cli import model_commands  # noqa: F401  plan, zoo
from phaselens.presentation.cli import train_command  # noqa: F401  train
from phaselens.presentation.cli import report_command  # noqa: F401  report
from phaselens.presentation.cli import lm_eval_commands  # noqa: F401  lm-eval run, stratify, export, read
# isort: on
from phaselens.presentation.cli.common import _report, app, main, say, write_csv
from phaselens.presentation.cli.model_commands import zoo_table

__all__ = ["app", "main", "say", "write_csv", "zoo_table", "_report"]

if __name__ == "__main__":
    app()
