"""The ``phaselens`` command line: a thin layer over the Python API.

Exit codes: 0 ok; 2 bad usage (typer); 3 a ``PhaseLensError``, printed as one line (``--debug`` shows
the traceback); 130 interrupted (Ctrl-C). Nothing heavy is imported at module level, so ``--help`` and
``zoo list`` answer at once; each command imports what it needs.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from phaselens.core.errors import InputError, PhaseLensError


def _hide_flag_types(params: list[Any]) -> list[Any]:
    # typer labels every option with its Python type; on a flag (--debug, --help) "<bool>" says nothing
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class _Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _hide_flag_types(super().get_params(ctx))


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


def one_line(err: BaseException) -> str:
    """The error's message on one line (messages that wrap in source keep their words)."""
    return " ".join(str(err).split())


def as_phaselens_error(err: BaseException) -> PhaseLensError:
    """Any error a command meets, as a :class:`PhaseLensError` that says what happened in words: the OS's
    refusals (a full disk, a permission, a name too long), memory, numbers too large; anything else is an
    internal error to report."""
    import errno

    from phaselens.core.errors import OutputError, ResourceError
    from phaselens.runtime.oserrors import why_os_error

    if isinstance(err, PhaseLensError):
        return err
    if isinstance(err, MemoryError):
        said = f" ({err})" if str(err) else ""
        return ResourceError(f"ran out of memory{said}; use a smaller --n-per-residue (or --batch-size), or free "
                             "memory first.")
    if isinstance(err, OSError):
        writing = (errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EROFS, errno.EACCES, errno.EPERM,
                   errno.ENAMETOOLONG)
        return (OutputError if err.errno in writing else InputError)(why_os_error(err))
    if isinstance(err, OverflowError):
        return InputError(f"a number is too large for this computation ({err}); use a smaller value.")
    return PhaseLensError(f"internal error ({type(err).__name__}: {err}); rerun with --debug to see the traceback, "
                          "and please report it.")


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
            _report(as_phaselens_error(err))
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
    from phaselens.runtime.world import check_world_env

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
    from phaselens.core.errors import RankError

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
    from phaselens.core.errors import OutputError
    from phaselens.runtime.files import owns_file
    from phaselens.runtime.oserrors import why_not_written

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
    from phaselens.runtime.files import write_owned_file

    write_owned_file(path, lambda tmp: integer_columns(frame).to_csv(tmp, index=False), by=CLI_OUTPUT,
                     overwrite=force, force_hint="--force")


def _version(value: bool) -> None:
    if value:
        from phaselens import __version__

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
        from phaselens.runtime.distributed import init_from_env

        init_from_env(gpus_per_replica)


def _load(model: str) -> Any:
    import phaselens

    if _world_env()[1] <= 1:
        return phaselens.load(model)
    from phaselens.runtime.replicas import rank_device, replica_gpus

    k = int(_state["gpus_per_replica"])
    device = rank_device(k)
    if model.startswith("hf:") and k > 1 and device != "cpu":  # one copy spread over this rank's GPUs
        from phaselens.models.sources import meta_model
        from phaselens.runtime.replicas import replica_device_map

        return phaselens.load(model, device_map=replica_device_map(meta_model(model[3:]), replica_gpus(k)))
    return phaselens.load(model, device=device)


def _load_for_phases(model: str, stride: int | None) -> Any:
    """Load ``model``; a model without compressed layers needs ``--stride`` to fold residues into phases."""
    m = _load(model)
    if stride is None and all(s is None for s in m.dims.phase_specs):
        raise InputError(f"{model} has no compressed layers, so it has no stride to fold residues by: pass "
                         "--stride S (the stride of the compressed model you compare it with, e.g. --stride 4).")
    return m


def _label(model: str) -> Any:
    from phaselens.runtime.progress import progress_label

    return progress_label(model.split(":")[-1].rstrip("/").split("/")[-1])


@app.command("eval", cls=_Command)
@friendly_errors
def eval_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")],
    n_per_residue: Annotated[int, typer.Option("--n-per-residue", metavar="N",
                                               help="Items per residue (more: narrower CIs, slower).")] = 256,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items and of the battery's resampling.")] = 0,
    stride: Annotated[int | None, typer.Option(
        metavar="S", help="Fold residues by this stride; required for a model without compressed layers "
                          "(the full-attention control: use the compressed model's stride, e.g. 4).")] = None,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the per-item frame as CSV.")] = None,
    checkpoint: Annotated[str | None, typer.Option(metavar="FILE",
                                                   help="Resumable file of finished item blocks (rerun to resume).")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
) -> None:
    """Phase-aware evaluation with the statistics battery.

    Example: phaselens eval w8s4 --n-per-residue 256 --out w8s4.csv
    """
    import phaselens

    path = check_out(out, kind="file", force=force)
    with _label(model):
        ev = phaselens.evaluate(_load_for_phases(model, stride), n_per_residue=n_per_residue, seed=seed,
                                progress=progress, stride=stride, checkpoint=checkpoint)
    say(ev.summary())
    if path and main_rank():
        write_csv(ev.to_frame("item"), path, force=force)


@app.command("record", cls=_Command)
@friendly_errors
def record_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")],
    n_per_residue: Annotated[int, typer.Option("--n-per-residue", metavar="N",
                                               help="Items per residue to average attention and gates over.")] = 64,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items.")] = 0,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the tidy recording as CSV.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
) -> None:
    """Record attention into compressed entries and the compressors' gate weights, by residue.

    Example: phaselens record w8s4 --out w8s4-recording.csv
    """
    import phaselens

    path = check_out(out, kind="file", force=force)
    with _label(model):
        rec = phaselens.record(_load(model), n_per_residue=n_per_residue, seed=seed, progress=progress)
    say(repr(rec))
    if path and main_rank():
        write_csv(rec.to_frame(), path, force=force)


KINDS = ("head", "kv_head", "layer")


def _parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise typer.BadParameter(f"{text!r}: give a comma-separated subset of {','.join(KINDS)}.")
    return kinds


@app.command("map", cls=_Command)
@friendly_errors
def map_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")],
    n_per_residue: Annotated[int, typer.Option("--n-per-residue", metavar="N",
                                               help="Items per residue for every knockout cell.")] = 64,
    method: Annotated[str, typer.Option(metavar="NAME", help="Replacement of a head's output: mean, zero or resample.")] = "mean",
    kinds: Annotated[str, typer.Option(metavar="LIST", help="Cells to map, comma-separated: head, kv_head, layer.")]
    = ",".join(KINDS),
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the items (and of resample knockouts).")] = 0,
    stride: Annotated[int | None, typer.Option(
        metavar="S", help="Fold residues by this stride; required for a model without compressed layers.")] = None,
    checkpoint: Annotated[str | None, typer.Option(metavar="FILE.npz",
                                                   help="Resumable file of finished cells (rerun to resume).")] = None,
    out: Annotated[str | None, typer.Option("--out", metavar="FILE.csv", help="Write the tidy map as CSV.")] = None,
    force: Annotated[bool, typer.Option("--force", help=FORCE_FILE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
    plan: Annotated[bool, typer.Option("--plan", help="Print what the map would run (cells, forwards, token passes, "
                                                      "a memory estimate) and exit without running it.")] = False,
) -> None:
    """Knock out every head, KV head and layer at the query; effects per residue, specialization index.

    Example: phaselens map w8s4 --checkpoint runs/w8s4-map.npz --out w8s4-map.csv
    """
    import phaselens

    kind_tuple = _parse_kinds(kinds)
    if plan:
        say(repr(phaselens.specialization_map(_load_for_phases(model, stride), method=method,
                                                     n_per_residue=n_per_residue, seed=seed, kinds=kind_tuple,
                                                     stride=stride, plan=True)))
        return
    path = check_out(out, kind="file", force=force)
    with _label(model):
        pm = phaselens.specialization_map(_load_for_phases(model, stride), method=method, n_per_residue=n_per_residue, seed=seed,
                                          kinds=kind_tuple, stride=stride, checkpoint=checkpoint, progress=progress)
    say(repr(pm))
    if "head" in kind_tuple:
        say(pm.specialization_index().to_string(index=False))
    if path and main_rank():
        write_csv(pm.to_frame(), path, force=force)


@app.command("plan", cls=_Command)
@friendly_errors
def plan_cmd(
    source: Annotated[str, typer.Argument(
        metavar="SOURCE", help="A checkpoint directory (or hf:DIR); one that holds only config.json is enough.")],
    context: Annotated[int, typer.Option("--context", metavar="T", min=1, help="Tokens per sequence.")] = 131072,
    gpu_memory: Annotated[str, typer.Option(
        "--gpu-memory", metavar="GB", help="Memory of one GPU: GB (141), '80GiB', or H100 / H200 / B200.")] = "141",
    chunk: Annotated[int | None, typer.Option(
        "--chunk", metavar="N", min=1,
        help="Prefill chunk (default: the largest that fits the smallest node found for a 128K map).")] = None,
    batch: Annotated[int, typer.Option("--batch", metavar="B", min=1, help="Sequences per forward.")] = 1,
    engram: Annotated[str, typer.Option(
        "--engram", metavar="run|drop", help="DeepSeek-V4.1: plan with Engram's tables (run, load's default) or "
                                             "without them (drop).")] = "run",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (bytes).")] = False,
) -> None:
    """What a DeepSeek-V4 / V4.1 checkpoint needs, from config.json alone (no weights read): weights as stored
    and as loaded, cache and activations at --context, GPUs of --gpu-memory, the smallest node for a 128K map.

    Example: phaselens plan hf:/data/DeepSeek-V4.1-Flash --gpu-memory H200 --json
    """
    import json

    from phaselens.models.capacity import plan_model

    plan = plan_model(source, context=context, gpu_memory=gpu_memory, chunk=chunk, batch=batch, engram=engram)
    say(json.dumps(plan.to_dict(), indent=2) if as_json else str(plan))


zoo_app = typer.Typer(help="The embedded zoo of tiny compressed models.", no_args_is_help=True, cls=_Group)
app.add_typer(zoo_app, name="zoo")


FAMILY_HELP = "Paper family only (--recipe paper-*)."


@app.command(cls=_Command)
@friendly_errors
def train(
    recipe: Annotated[str, typer.Option("--recipe", metavar="NAME", help=(
        "A zoo recipe name (see `phaselens zoo list`), or NAME-seedK for another seed K; or a recipe of the "
        "paper's family: paper-full, paper-w4s4, paper-w8s4, paper-w6s6, paper-w12s6, paper-w8s8, paper-w16s8, "
        "paper-w12s12, paper-w24s12, paper-w4s4-mean, paper-w4s4-norope (with --size)."))],
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory that receives the model directory.")]
    = "zoo-out",
    runs: Annotated[str | None, typer.Option("--runs", metavar="DIR", help=(
        "Where resumable checkpoints (and a family run's log.json) live (default: runs/zoo, runs/family).")
    )] = None,
    steps: Annotated[int | None, typer.Option(
        "--steps", metavar="N", min=1,
        help="Train this many steps instead of the recipe's (a different run: its schedule and checkpoints differ).")]
    = None,
    threads: Annotated[int, typer.Option("--threads", metavar="N", min=1,
                                         help="Torch threads (a bit-identical resume needs the same count).")] = 1,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
    size: Annotated[str | None, typer.Option("--size", metavar="SIZE", help=(
        f"{FAMILY_HELP} The backbone's size: tiny, small, base or 0.6b (Qwen3-0.6B) (default: tiny).")
    )] = None,
    plan: Annotated[bool, typer.Option("--plan", help=(
        f"{FAMILY_HELP} Print what the run costs (parameters, tokens, 6ND FLOPs, memory per GPU under FSDP, "
        "GPU-hours) without building the model, and exit."))] = False,
    gpus: Annotated[str | None, typer.Option("--gpus", metavar="LIST", help=(
        f"{FAMILY_HELP} GPU counts to plan for, comma-separated (default: 1,8,64)."))] = None,
    mfu: Annotated[float, typer.Option("--mfu", metavar="U", min=0.01, max=1.0, help=(
        f"{FAMILY_HELP} Model-FLOPs utilisation the plan's GPU-hours assume."))] = 0.40,
    peak_tflops: Annotated[float, typer.Option("--peak-tflops", metavar="T", min=1.0, help=(
        f"{FAMILY_HELP} Peak TFLOP/s per GPU the plan assumes (default: 989, dense bf16 H100/H200)."))] = 989.0,
    tokens: Annotated[float | None, typer.Option("--tokens", metavar="N", help=(
        f"{FAMILY_HELP} Token budget (sets the steps; e.g. 1e11) (default: the size's; 0.6b: 1e11)."))] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", metavar="B", min=1, help=(
        f"{FAMILY_HELP} Global batch in sequences (split over the ranks)."))] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", metavar="B", min=1, help=(
        f"{FAMILY_HELP} Sequences per forward on each rank (gradient accumulation)."))] = None,
    precision: Annotated[str | None, typer.Option("--precision", metavar="P", help=(
        f"{FAMILY_HELP} fp32 or bf16 (default: bf16 with CUDA, fp32 on CPU)."))] = None,
    activation_checkpointing: Annotated[bool | None, typer.Option(
        "--activation-checkpointing/--no-activation-checkpointing", help=(
            f"{FAMILY_HELP} Recompute block activations in the backward (default: on with CUDA)."))] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", min=0, help=(
        f"{FAMILY_HELP} Seed of the initial weights and the data."))] = 0,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", metavar="N", min=1, help=(
        f"{FAMILY_HELP} KV heads, a divisor of the query heads (the paper's baseline: 1; Qwen3-0.6B: 8; "
        "default: the size's)."))] = None,
    vocab: Annotated[int | None, typer.Option("--vocab", metavar="N", min=1, help=(
        f"{FAMILY_HELP} Vocabulary size (default: the task's below 0.6b; Qwen3's 151,936 at 0.6b)."))] = None,
    pretrain: Annotated[list[str] | None, typer.Option("--pretrain", metavar="FILE", help=(
        f"{FAMILY_HELP} Your pretraining tokens: a 1-D .npy or a raw binary file of ids (repeatable)."))] = None,
    pretrain_ratio: Annotated[float, typer.Option("--pretrain-ratio", metavar="R", min=0.0, max=0.99, help=(
        f"{FAMILY_HELP} Fraction of each batch's sequences cut from --pretrain files."))] = 0.0,
    pretrain_dtype: Annotated[str, typer.Option("--pretrain-dtype", metavar="T", help=(
        f"{FAMILY_HELP} Id type of raw --pretrain files: uint16, uint32, int32, int64."))] = "uint16",
    eval_per_residue: Annotated[int, typer.Option("--eval-per-residue", metavar="N", min=0, help=(
        f"{FAMILY_HELP} Items per residue of the final evaluation with the battery (0: none)."))] = 256,
    time_limit: Annotated[float | None, typer.Option("--time-limit", metavar="SECONDS", min=0.0, help=(
        f"{FAMILY_HELP} Stop with a checkpoint once this many seconds have passed (e.g. inside a job's "
        "wall-clock limit); rerun to resume."))] = None,
) -> None:
    """Train one zoo model or a member of the paper's family, resuming if interrupted; writes OUT/NAME.

    Under torchrun a family recipe trains across the ranks with FSDP2:
    torchrun --nproc-per-node 8 -m phaselens train --recipe paper-w4s4 --size 0.6b

    Example: phaselens train --recipe w8s4 --out my-zoo

    Example: phaselens train --recipe paper-w4s4 --size tiny

    Example: phaselens train --recipe paper-w4s4 --size 0.6b --plan
    """
    from phaselens.runtime.budget import check_threads

    check_threads(threads, name="--threads")  # torch/OpenMP abort the whole process on a count they cannot start
    if recipe.startswith("paper-"):
        from phaselens.train.family.command import FamilyArgs
        from phaselens.train.family.command import run as run_family

        if precision not in (None, "fp32", "bf16"):
            raise InputError(f"--precision must be fp32 or bf16, got {precision!r}.")
        try:
            gpu_list = tuple(int(g) for g in gpus.split(",")) if gpus else ()
        except ValueError:
            raise InputError(f"--gpus {gpus!r}: give GPU counts separated by commas, e.g. 1,8,64.") from None
        if any(g < 1 for g in gpu_list):
            raise InputError(f"--gpus {gpus!r}: GPU counts must be positive.")
        if not plan:
            check_out(out, kind="dir", what="the trained model is written into a folder")
        run_family(FamilyArgs(
            recipe=recipe, size=size or "tiny", out=out, runs=runs or "runs/family", steps=steps, tokens=tokens,
            batch_size=batch_size, seed=seed, vocab=vocab, kv_heads=kv_heads, precision=precision,
            activation_checkpointing=activation_checkpointing, micro_batch=micro_batch, pretrain=tuple(pretrain or ()),
            pretrain_ratio=pretrain_ratio, pretrain_dtype=pretrain_dtype, eval_per_residue=eval_per_residue,
            time_limit=time_limit,
            threads=threads, plan=plan, gpus=gpu_list, mfu=mfu, peak_tflops=peak_tflops, force=force,
            progress=progress), say)
        return
    family_only = {"--size": size, "--plan": plan or None, "--gpus": gpus, "--tokens": tokens,
                   "--batch-size": batch_size, "--micro-batch": micro_batch, "--precision": precision,
                   "--activation-checkpointing": activation_checkpointing, "--vocab": vocab, "--pretrain": pretrain,
                   "--kv-heads": kv_heads,
                   "--seed": seed or None, "--pretrain-ratio": pretrain_ratio or None, "--time-limit": time_limit}
    given = [k for k, v in family_only.items() if v is not None]
    if given:
        raise InputError(f"{', '.join(given)} apply to the paper's family only (--recipe paper-LAYOUT); zoo recipe "
                         f"{recipe!r} takes --out, --runs, --steps, --threads and --force (use {recipe}-seedK for "
                         "another seed).")
    runs = runs or "runs/zoo"
    from phaselens.train.loop import saved_step
    from phaselens.train.recipes import get_recipe

    chosen = get_recipe(recipe)  # a clear error for an unknown name, before any work
    check_out(out, kind="dir", what="the trained model is written into a folder")
    from phaselens.models.compressed.io import checkpoint_kind
    from phaselens.runtime.files import check_output_dir

    check_output_dir(Path(out) / recipe, checkpoint_kind(extra=("eval_batch.safetensors",)), overwrite=force)
    run_dir = Path(runs) / recipe
    _check_runs(runs, run_dir)
    total = steps or chosen.settings.steps
    again = " ".join(["phaselens", "train", "--recipe", recipe, "--out", out, "--runs", runs, "--threads", str(threads),
                      *(["--steps", str(steps)] if steps else []), *(["--force"] if force else [])])
    done = saved_step(run_dir)
    if done is not None:
        typer.echo(f"resuming {recipe} from step {done} of {total} (checkpoint in {run_dir})", err=True)

    import torch

    from phaselens.train.zoo import build_zoo_model

    torch.set_num_threads(threads)
    try:
        with _label(recipe):
            card = build_zoo_model(recipe, out, run_dir=runs, progress=progress, steps=steps, threads=threads,
                                   overwrite=force)
    except KeyboardInterrupt:
        at = saved_step(run_dir)
        where = f"the last checkpoint is step {at} of {total} in {run_dir}" if at else "no checkpoint was written yet"
        typer.echo(f"\ninterrupted: {where}; resume with: {again}", err=True)
        raise typer.Exit(130) from None
    b = card["battery"]
    typer.echo(f"{recipe}: mean {100 * b['mean']:.1f}%, worst {100 * b['worst']:.1f}%, gap {100 * b['gap']:.1f} pp, "
               f"period {b['period']}; written to {Path(out) / recipe}")


def _check_runs(runs: str, run_dir: Path) -> None:
    """``--runs``: a folder that exists or can be made, and written to (before any training)."""
    from phaselens.core.errors import OutputError
    from phaselens.runtime.files import nearest_existing, writable
    from phaselens.runtime.oserrors import why_not_written

    try:
        for where in (run_dir, *run_dir.parents):
            if where.exists() and not where.is_dir():
                raise InputError(f"--runs {runs}: {where} is a file; point --runs at a directory.")
        if any(len(part.encode()) > 255 for part in run_dir.parts):
            raise OSError(36, "File name too long", str(run_dir))
        where = nearest_existing(run_dir)
        if not writable(where):
            raise OutputError(f"--runs {runs}: {where} is not writable (permission denied), so checkpoints cannot "
                              "be written there; point --runs at a folder you can write to.")
    except OSError as err:
        raise OutputError(f"--runs {runs}: {why_not_written(err, run_dir)}") from None


def _p(p: float | None) -> str:
    return "n/a" if p is None else "<1e-300" if p == 0 else f"{p:.2g}"


def zoo_table(rows: list[dict[str, Any]], width: int = 80) -> str:
    """The zoo's headline numbers as plain text that never cuts a model's name (description on its own line)."""
    import textwrap

    head = ("model", "mean", "worst", "bound", "gap [95% CI]", "period", "p(G)", "p(nested)")
    cells = []
    for r in rows:
        b = r["battery"]
        lo, hi = b["gap_ci"]
        cells.append((r["name"], f"{100 * b['mean']:.1f}", f"{100 * b['worst']:.1f}", f"{100 * b['boundary']:.1f}",
                      f"{100 * b['gap']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]", str(b["period"] or "none"),
                      _p(b["p_g"]), _p(b["p_nested"])))
    widths = [max(len(str(c[i])) for c in [head, *cells]) for i in range(len(head))]

    def line(c: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)]
    for r, c in zip(rows, cells):
        out.append(line(c))
        out += textwrap.wrap(r["description"], width=max(40, width - 1), initial_indent="  ", subsequent_indent="  ")
    out += ["", *textwrap.wrap("mean, worst, bound: accuracy in % (mean over phases, worst phase, boundary phase); "
                               "gap: folded phase gap in percentage points with its bootstrap CI; period: detected "
                               "period; p(G): G test of accuracy by residue; p(nested): residues mod M against mod S.",
                               width=max(40, width - 1))]
    return "\n".join(out)


@zoo_app.command("list", cls=_Command)
@friendly_errors
def zoo_list() -> None:
    """Each shipped model with its card's headline.

    Example: phaselens zoo list
    """
    import shutil

    from phaselens.models.zoo import entry, list_models

    rows = [entry(name).card for name in list_models()]
    typer.echo(zoo_table(rows, width=shutil.get_terminal_size((80, 24)).columns))


@app.command(cls=_Command)
@friendly_errors
def report(
    models: Annotated[list[str] | None, typer.Argument(
        metavar="[MODELS]...", help="Zoo names, checkpoint dirs or hf:PATH (default: w8s4 full).")] = None,
    out: Annotated[str, typer.Option("--out", metavar="DIR", help="Directory to write the report into.")] = "report",
    quick: Annotated[bool, typer.Option("--quick", help="Smaller samples (a fast look, wider CIs).")] = False,
    static: Annotated[bool, typer.Option("--static/--no-static", help="Write PNGs when a Chromium is present.")] = True,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help=PROGRESS_HELP)] = True,
) -> None:
    """Write the figure report: evaluation, battery, recordings, maps, gate cycling and repair.

    Example: phaselens report w8s4 full --out report
    """
    from phaselens.presentation.reporting import ReportSettings
    from phaselens.presentation.reporting import report as build

    check_out(out, kind="dir", what="the report is a folder")
    settings = ReportSettings(n_eval=40, n_record=8, n_map=12, n_cycle=24, n_repair=24) if quick else ReportSettings()
    path = build(models or None, out, settings=settings, progress=progress, static=static, overwrite=force,
                 command=" ".join(["phaselens", *sys.argv[1:]]))
    say(f"report written to {path}/index.html")


if __name__ == "__main__":
    app()
