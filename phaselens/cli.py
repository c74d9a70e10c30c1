"""The ``phaselens`` command line: a thin layer over the Python API.

Exit codes: 0 ok; 2 bad usage (typer); 3 a ``PhaseLensError``, printed as one line (``--debug`` shows
the traceback).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

import phaselens
from phaselens.errors import PhaseLensError

app = typer.Typer(
    name="phaselens",
    help="Phase sensitivity and phase specialization in chunk-compressed KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}
F = TypeVar("F", bound=Callable[..., Any])


def friendly_errors(fn: F) -> F:
    """Turn a PhaseLensError into one readable line and exit code 3 (unless --debug)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PhaseLensError as err:
            if _state["debug"]:
                raise
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(3) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"phaselens {phaselens.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks of phaselens errors.")] = False,
) -> None:
    """phaselens: measure how a compressed-cache model's answers depend on token phase."""
    _state["debug"] = debug


@app.command()
@friendly_errors
def report(out: Annotated[str, typer.Option("--out", help="Directory to write the report into.")] = "report") -> None:
    """Write the figure report (placeholder until the report lands).

    Example: phaselens report --out report
    """
    typer.echo(
        "phaselens report is not implemented yet. When it lands it will evaluate the embedded default zoo "
        f"model against its full-attention control and write index.html, results.json and CSVs to {out}/."
    )


if __name__ == "__main__":
    app()
