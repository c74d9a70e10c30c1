"""What every command shares: the typer app and its global options, one-line errors, output checks, the
model loader under torchrun, and the option help texts."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from phaselens.errors import InputError, PhaseLensError


def _hide_flag_types(params: list[Any]) -> list[Any]:
    # typer labels every option with its Python type; on a flag (--debug, --help) "<bool>" says nothing
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _hide_flag_types(super().get_params(ctx))

    def invoke(self, ctx: Any) -> Any:
        _refuse_plan_out(ctx)
        return super().invoke(ctx)


def _refuse_plan_out(ctx: Any) -> None:
    """Every command with ``--plan`` and ``--out``: the plan is printed and nothing is written, so an ``--out``
    the user gave is refused (exit 3) instead of being left unwritten without a word."""
    source = ctx.get_parameter_source("out")  # by name: typer vendors its own click
    given = getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT")
    if not (ctx.params.get("plan") and given):
        return
    err = InputError(f"--plan prints what the run would cost and writes nothing, so --out {ctx.params['out']} would "
                     "stay unwritten: drop --out to see the plan (redirect it to keep it, e.g. > plan.txt), or drop "
                     "--plan to run and write --out.")
    if _state["debug"]:
        raise err
    _report(err)
    raise typer.Exit(3)


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _hide_flag_types(super().get_params(ctx))


app = typer.Typer(
    name="phaselens",
    help="Phase sensitivity and phase specialization in chunk-compressed KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Group,
)

_state: dict[str, Any] = {"debug": False, "gpus_per_replica": 1}
F = TypeVar("F", bound=Callable[..., Any])

MODEL_HELP = "Zoo name (see `phaselens zoo list`), checkpoint directory, or hf:PATH."
PROGRESS_HELP = "Show progress bars (named by model and stage) on stderr."
FORCE_HELP = ("Write into a directory that holds other files too, replacing only phaselens's own files there "
              "(without it such a directory is refused).")
FORCE_FILE_HELP = ("Replace the --out file even if phaselens cannot show it wrote it (without it, only a file "
                   "phaselens wrote there and nobody changed is replaced).")
# --n-per-residue of every analysis command: None means the analyses' one default (analyses.runner.N_PER_RESIDUE)
NPerResidueOpt = Annotated[int | None, typer.Option(
    "--n-per-residue", metavar="N", help="Items per residue (more: narrower CIs, slower; default 128, the one "
                                         "default of every analysis, or a --task preset's own).")]


def one_line(err: BaseException) -> str:
    """The error's message on one line (messages that wrap in source keep their words)."""
    return " ".join(str(err).split())


def as_phaselens_error(err: BaseException, options: Iterable[str] | None = None) -> PhaseLensError:
    """Any error a command meets, as a :class:`PhaseLensError` that says what happened in words: the OS's
    refusals (a full disk, a permission, a name too long), memory (naming the command's own size options among
    ``options``, its option names), numbers too large; anything else is an internal error to report."""
    import errno

    from phaselens.errors import OutputError, ResourceError
    from phaselens.storage.oserrors import why_os_error

    if isinstance(err, PhaseLensError):
        return err
    if _lost_peer(err):
        from phaselens.errors import DistributedError

        rank, size = _world_env()
        return DistributedError(
            f"rank {rank} of {size}: another rank died or lost contact ({one_line(err)[:160]}); its own error is "
            "printed above, or it was killed (out of memory, preempted). Rerun the same command: the run resumes "
            "from its --journal (or a training run from its last checkpoint).")
    if isinstance(err, MemoryError) or _out_of_memory(err):
        said = f" ({err})" if str(err) else ""
        sizes = [o for o in SIZE_OPTIONS if o in (options or ())]  # the running command's own options only
        use = f"a smaller {' or '.join(sizes[:2])}" if sizes else "smaller sizes (fewer items, smaller batches)"
        return ResourceError(f"ran out of memory{said}; use {use}, or free memory first.")
    if isinstance(err, OSError):
        writing = (errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EROFS, errno.EACCES, errno.EPERM,
                   errno.ENAMETOOLONG)
        return (OutputError if err.errno in writing else InputError)(why_os_error(err))
    if isinstance(err, OverflowError):
        return InputError(f"a number is too large for this computation ({err}); use a smaller value.")
    return PhaseLensError(f"internal error ({type(err).__name__}: {err}); rerun with --debug to see the traceback, "
                          "and please report it.")


# options that size a command's work, most telling first: an out-of-memory message names those its command has
SIZE_OPTIONS = ("--n-per-residue", "--batch-size", "--items", "--item-batch", "--batch", "--context",
                "--map-context", "--records", "--length")


def command_options(fn: Callable[..., Any]) -> set[str]:
    """The option names (``--n-per-residue``, ...) of the typer command function ``fn``, read from its
    annotations (an option without declared names is ``--`` and its parameter's name with dashes)."""
    import typing

    from typer.models import OptionInfo

    out: set[str] = set()
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001 (called while reporting another error: never mask it)
        return out
    for name, hint in hints.items():
        for info in getattr(hint, "__metadata__", ()):
            if isinstance(info, OptionInfo):
                # typer takes Option("--json") in Annotated as the declaration, kept as its first argument
                given = [info.default, *(info.param_decls or ())]
                decls = [d for d in given if isinstance(d, str) and d.startswith("--")]
                out.update(d.split("/")[0] for d in decls or [f"--{name.replace('_', '-')}"])
    return out


def _lost_peer(err: BaseException) -> bool:
    """gloo's and NCCL's ways of saying the other end of a collective is gone (a rank crashed or was killed)."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(k in text for k in (
        "Connection closed by peer", "Connection reset by peer", "remote worker crashing", "NCCL communicator was aborted"))


def _out_of_memory(err: BaseException) -> bool:
    """torch's ways of saying memory ran out: ``torch.OutOfMemoryError`` (CUDA, MPS) and the CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory", "not enough memory")."""
    if type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        k in text for k in ("can't allocate memory", "not enough memory", "out of memory"))


def friendly_errors(fn: F) -> F:
    """Turn any error into one readable line (``error: ...``) and exit code 3, never a traceback (unless
    --debug); usage errors (exit 2), exits and Ctrl-C pass through."""
    from typer.exceptions import TyperException  # usage errors (typer vendors click)

    passed = (typer.Exit, typer.Abort, TyperException, SystemExit, KeyboardInterrupt)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except passed:
            raise
        except Exception as err:
            if _state["debug"]:
                raise
            _report(as_phaselens_error(err, command_options(fn)))
            raise typer.Exit(3) from None

    return wrapper  # type: ignore[return-value]


def _world_env() -> tuple[int, int]:
    """``(rank, world size)`` from torchrun's environment (``(0, 1)`` without it); no torch import."""
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 0, 1


def _check_world() -> None:
    """torchrun's RANK, LOCAL_RANK and WORLD_SIZE, when set, must be counts that agree (a typo would
    otherwise run every process as rank 0 of 1, each writing the same outputs). Every process prints it: the
    ranks themselves are in doubt."""
    from phaselens.parallel.world import check_world_env

    try:
        check_world_env(os.environ)
    except PhaseLensError as err:
        if _state["debug"]:
            raise
        typer.echo(f"error: {one_line(err)}", err=True)
        raise typer.Exit(3) from None


def main_rank() -> bool:
    """Whether this process writes outputs and prints: always outside torchrun, rank 0 under it."""
    return _world_env()[0] == 0


def say(text: str) -> None:
    """``typer.echo`` on the main rank only (under torchrun the other ranks print nothing)."""
    if main_rank():
        typer.echo(text)


def _report(err: PhaseLensError) -> None:
    """Print an error once per job: the rank whose share failed prints it with its rank; an error every rank
    meets alike (bad arguments) is printed by rank 0; a relayed one (RankError) by nobody else."""
    from phaselens.errors import RankError

    rank, size = _world_env()
    origin = getattr(err, "phaselens_rank", None)
    if size <= 1:
        typer.echo(f"error: {one_line(err)}", err=True)
    elif isinstance(err, RankError):
        return
    elif origin is not None:
        typer.echo(f"error: rank {origin} of {size}: {one_line(err)}", err=True)
    elif rank == 0:
        typer.echo(f"error: {one_line(err)}", err=True)


CLI_OUTPUT = "command-line output"  # the writer's name in a folder's manifest


def check_out(path: str | None, *, kind: str, what: str = "the output is a folder", force: bool = False) -> Path | None:
    """Refuse an output path before any computation: its parent must exist and be writable, and an existing
    file there must be one phaselens wrote (by the folder's manifest) unless ``force``.

    ``kind`` is ``"file"`` (a CSV; must not be a directory) or ``"dir"`` (must not be a file; ``what`` says
    why in the message).
    """
    from phaselens.errors import OutputError
    from phaselens.storage.oserrors import why_not_written
    from phaselens.storage.writing import owns_file

    if path is None:
        return None
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    try:
        if parent.exists() and not parent.is_dir():
            raise OutputError(f"--out {path}: {parent} is a file, not a folder; choose another path.")
        if not parent.is_dir():
            raise OutputError(f"--out {path}: the folder {parent} does not exist; create it first or choose another "
                              "path.")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"--out {path}: the folder {parent} is not writable (permission denied); choose a path "
                              "you can write to.")
        if kind == "file" and p.is_dir():
            raise OutputError(f"--out {path} is a directory; give a file name such as {p / 'out.csv'}.")
        if kind == "dir" and p.exists() and not p.is_dir():
            raise OutputError(f"--out {path} is an existing file; give a directory name ({what}).")
        if p.exists() and not os.access(p, os.W_OK):
            raise OutputError(f"--out {path} exists and is not writable (permission denied); choose another path.")
        if kind == "file" and os.path.lexists(p) and not (p.is_file() and not p.is_symlink()):
            raise OutputError(f"--out {path} is not a regular file (a device, a pipe, a socket or a symbolic "
                              "link); phaselens never replaces one, even with --force: give the path of a "
                              "regular file or a new one.")
        if kind == "file" and os.path.lexists(p) and not force and not owns_file(p, CLI_OUTPUT):
            raise OutputError(f"--out {path} already exists and phaselens cannot show it wrote it (it is not in "
                              "that folder's phaselens manifest, or was changed since), so it is kept; choose "
                              "another name, or pass --force to replace that file.")
        if len(p.name.encode()) > 255:
            raise OSError(36, "File name too long", str(p))
    except OSError as err:
        raise OutputError(f"--out {path}: {why_not_written(err, p)}") from None
    return p


def write_csv(frame: Any, path: Path, *, force: bool = False) -> None:
    """Write ``frame`` as CSV to ``path`` atomically (a kill leaves the old file or the new one, never half),
    recorded in the folder's manifest; an existing file phaselens cannot prove it wrote needs ``force``."""
    from phaselens.presentation.reporting.write import integer_columns
    from phaselens.storage.writing import write_owned_file

    write_owned_file(path, lambda tmp: integer_columns(frame).to_csv(tmp, index=False), by=CLI_OUTPUT,
                     overwrite=force, force_hint="--force")


def _version(value: bool) -> None:
    if value:
        from phaselens.core.version import __version__

        typer.echo(f"phaselens {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks of phaselens errors.")] = False,
    gpus_per_replica: Annotated[int, typer.Option(
        "--gpus-per-replica", metavar="K", min=1,
        help="Under torchrun with GPUs: GPUs each rank's copy of the model spreads over (local rank r owns "
             "GPUs r*K..r*K+K-1).")] = 1,
) -> None:
    """phaselens: measure how a compressed-cache model's answers depend on token phase.

    Under torchrun (`torchrun --nproc-per-node N -m phaselens map w8s4 --out map.csv`) the work is split
    across the ranks; only rank 0 prints and writes.
    """
    _state["debug"] = debug
    _state["gpus_per_replica"] = gpus_per_replica
    _check_world()
    if _world_env()[1] > 1:
        if not main_rank():
            import warnings

            warnings.simplefilter("ignore")  # the other ranks print nothing
        from phaselens.parallel.distributed import init_from_env

        init_from_env(gpus_per_replica)


def _load(model: str, **kwargs: Any) -> Any:
    from phaselens.models.sources import load

    if _world_env()[1] <= 1:
        return load(model, **kwargs)
    from phaselens.parallel.replicas import rank_device, replica_gpus

    k = int(_state["gpus_per_replica"])
    device = rank_device(k)
    if model.startswith("hf:") and k > 1 and device != "cpu":  # one copy spread over this rank's GPUs
        from phaselens.models.sources import meta_model
        from phaselens.parallel.replicas import replica_device_map

        return load(model, device_map=replica_device_map(meta_model(model[3:]), replica_gpus(k)), **kwargs)
    return load(model, device=device, **kwargs)


def _load_for_phases(model: str, stride: int | None) -> Any:
    """Load ``model``; a model without compressed layers needs ``--stride`` to fold residues into phases (a
    transformers causal LM, ``hf:DIR``, is adapted at it: the one rule for strides)."""
    from phaselens.models.sources import is_causal_lm_dir

    causal = is_causal_lm_dir(model)
    m = None if causal and stride is None else _load(model, stride=stride) if causal else _load(model)
    if stride is None and (m is None or not m.dims.black_box and all(s is None for s in m.dims.phase_specs)):
        raise InputError(f"{model} has no compressed layers, so it has no stride to fold residues by: pass "
                         "--stride S (the stride of the compressed model you compare it with, e.g. --stride 4).")
    return m


def require_default_task(m: Any, model: str, command: str, *, task_option: bool) -> Any:
    """``m``, or a :class:`NoDefaultTaskError` in the command line's words when it has no default task (the
    Python API's message would ask for a task object): ``--task`` and its presets where the command has it."""
    if getattr(m, "default_task", None) is not None:
        return m
    from phaselens.errors import NoDefaultTaskError
    from phaselens.tasks.presets import PRESETS

    names = " or ".join(f"--task {name}" for name in PRESETS)
    if task_option:
        raise NoDefaultTaskError(
            f"{model} has no default task, so `phaselens {command}` needs one: pass {names} (a preset built from a "
            f"tokenizer, so also --tokenizer PATH), e.g. `phaselens {command} {model} --task {next(iter(PRESETS))} "
            "--tokenizer /data/tokenizer-dir`.")
    raise NoDefaultTaskError(
        f"{model} has no default task, and `phaselens {command}` runs a model's default task (it has no --task "
        f"option): run it on a model that has one (a zoo model), or evaluate this one with `phaselens eval {model} "
        f"{names.split(' or ')[0]} --tokenizer PATH`.")


def _label(model: str) -> Any:
    from phaselens.parallel.progress import progress_label

    if model.startswith(("http://", "https://")):  # a served model: its host and port
        return progress_label(model.split("://", 1)[1].split("/", 1)[0])
    return progress_label(model.split(":")[-1].rstrip("/").split("/")[-1])
