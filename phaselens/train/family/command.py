"""The body of ``phaselens train --recipe paper-LAYOUT --size SIZE ...`` (the CLI stays a thin layer over it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phaselens.errors import InputError


@dataclass(frozen=True)
class FamilyArgs:
    """The command's options for a family recipe (see ``phaselens train --help``)."""

    recipe: str
    size: str = "tiny"
    out: str = "zoo-out"
    runs: str = "runs/family"
    steps: int | None = None
    tokens: float | None = None
    batch_size: int | None = None
    seed: int = 0
    vocab: int | None = None
    kv_heads: int | None = None
    precision: str | None = None
    recompute_activations: bool | None = None
    micro_batch: int | None = None
    pretrain: tuple[str, ...] = ()
    pretrain_ratio: float = 0.0
    pretrain_dtype: str = "uint16"
    eval_per_residue: int = 256
    time_limit: float | None = None
    threads: int | None = 1
    plan: bool = False
    gpus: tuple[int, ...] = ()
    mfu: float = 0.40
    peak_tflops: float = 989.0
    force: bool = False
    progress: bool = True


def check_args(a: FamilyArgs) -> tuple[Any, Any]:
    """Every argument of a family run, before anything is built or written: ``(recipe, token files or None)``.

    The run and its ``--plan`` both call this one function, so a plan refuses what the run would refuse, with
    the same message. Plain values are checked first (no torch import), then the recipe, the token files, and
    the host memory of the final evaluation's items."""
    import math

    from phaselens.core.checks import MAX_SEED

    def finite(name: str, value: float | None, low: float, high: float = math.inf, *, open_low: bool = False) -> None:
        ok = value is None or (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                               and (value > low if open_low else value >= low) and value <= high)
        if not ok:
            bound = "(" if open_low else "["
            span = f"in {bound}{low:g}, {high:g}]" if high < math.inf else f"{'>' if open_low else '>='} {low:g}"
            raise InputError(f"{name} must be a finite number {span}, got {value!r}.")

    if not isinstance(a.size, str) or not a.size.strip():
        raise InputError(f"--size must name a size (tiny, small, base or 0.6b), got {a.size!r}.")
    if a.precision not in (None, "fp32", "bf16"):
        raise InputError(f"--precision must be fp32 or bf16, got {a.precision!r}.")
    if a.tokens is not None and not (math.isfinite(a.tokens) and a.tokens >= 1):
        raise InputError(f"--tokens must be a positive token budget (e.g. 1e11), got {a.tokens}.")
    if a.time_limit is not None and not a.time_limit >= 0:  # NaN too (inf: no limit)
        raise InputError(f"--time-limit must be a number of seconds >= 0, got {a.time_limit!r}.")
    finite("--mfu", a.mfu, 0.0, 1.0, open_low=True)
    finite("--peak-tflops", a.peak_tflops, 0.0, open_low=True)
    finite("--pretrain-ratio", a.pretrain_ratio, 0.0, 0.99)
    if not 0 <= a.seed <= MAX_SEED:
        raise InputError(f"--seed must lie in 0..{MAX_SEED} (torch's generators take 64 bits), got {a.seed}.")
    if any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in a.gpus):
        raise InputError(f"--gpus {','.join(map(str, a.gpus))}: GPU counts must be positive whole numbers.")
    if a.pretrain_ratio and not a.pretrain:
        raise InputError("--pretrain-ratio needs --pretrain FILE (your token files).")
    if a.pretrain and not a.pretrain_ratio:
        raise InputError("--pretrain FILE needs --pretrain-ratio R (the fraction of each batch from your tokens).")
    recipe = build_recipe(a)
    pretraining = _token_files(a, recipe)
    _check_evaluation(a.eval_per_residue)
    return recipe, pretraining


def _token_files(a: FamilyArgs, recipe: Any) -> Any:
    """``--pretrain`` files: present, readable as 1-D ids, and one of them longer than a training row."""
    from phaselens.train.family.data import TokenFiles

    if not a.pretrain:
        return None
    files = TokenFiles(tuple(a.pretrain), a.pretrain_dtype)
    sizes = [int(arr.size) for arr in files.arrays()]
    need = recipe.seq_len + 1  # a row and its shifted targets
    if max(sizes) < need:
        raise InputError(f"the token files hold no window of {need} ids (sizes {sizes}); supply longer files.")
    return files


def _check_evaluation(n: int) -> None:
    """``--eval-per-residue``: the final evaluation's items must fit in host memory (priced as the
    evaluation prices them), or training would end in an error minutes or days later."""
    from phaselens.errors import ResourceError
    from phaselens.runtime.budget import host_available, items_bytes
    from phaselens.train.family.recipes import MODULUS, paper_task

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InputError(f"--eval-per-residue must be a whole number >= 0, got {n!r}.")
    seq = paper_task().seq_len()
    need, host = items_bytes(n * MODULUS, seq), host_available()
    if n and host is not None and need > host:
        fits = host // items_bytes(MODULUS, seq)
        raise ResourceError(f"--eval-per-residue {n:,}: the final evaluation's {n * MODULUS:,} items of {seq} tokens "
                            f"need about {need / 2**30:,.1f} GiB to build, but {host / 2**30:,.1f} GiB is available; "
                            f"use --eval-per-residue {fits:,} or fewer (0: no evaluation).")


def build_recipe(a: FamilyArgs) -> Any:
    import dataclasses

    from phaselens.train.family.recipes import family_recipe

    r = family_recipe(a.recipe, a.size, vocab=a.vocab, seed=a.seed, steps=a.steps,
                      tokens=int(a.tokens) if a.tokens else None, batch_size=a.batch_size, kv_heads=a.kv_heads)
    if a.threads is not None and not a.plan:
        r = dataclasses.replace(r, settings=dataclasses.replace(r.settings, threads=a.threads))
    return r


def parallelism(a: FamilyArgs, recipe: Any = None, world: int = 1) -> Any:
    """Defaults where they help: bf16 on GPUs, fp32 on CPUs; activation recompute on a GPU only when the
    plan's memory without it (:func:`~phaselens.train.family.training_plan.plan_run` at this micro-batch and world size)
    exceeds 90% of the GPU's memory, never on CPUs."""
    import torch

    from phaselens.train.family.trainer import Parallelism

    gpu = torch.cuda.is_available()
    precision = a.precision or ("bf16" if gpu else "fp32")
    ac = a.recompute_activations
    if ac is None:
        ac = False
        if gpu and recipe is not None:
            from phaselens.train.family.training_plan import GiB, plan_run

            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            ac = plan_run(recipe, gpus=world, micro_batch=a.micro_batch, precision=precision,
                          recompute_activations=False, gpu_gib=total / GiB).needs_recompute
    return Parallelism(precision=precision, recompute_activations=ac, micro_batch=a.micro_batch)


DEFAULT_GPUS = (1, 8, 64)


def plan_text(a: FamilyArgs) -> str:
    from phaselens.train.family.training_plan import batch_split, format_plans, plan_run

    recipe, _ = check_args(a)
    batch = recipe.settings.batch_size
    if a.gpus:  # each count the user names must be one the run accepts (the same check, the same message)
        for g in a.gpus:
            batch_split(batch, g, a.micro_batch)
        gpus, left = a.gpus, ()
    else:
        ok = [g for g in DEFAULT_GPUS if _splits(batch, g, a.micro_batch)]
        gpus, left = tuple(ok) or (1,), tuple(g for g in DEFAULT_GPUS if g not in ok)
        if not ok:
            batch_split(batch, 1, a.micro_batch)  # refuses, naming the fix
    def planned(g: int) -> Any:  # recompute as given, or as the run on an 80 GB GPU would choose it
        kw = dict(gpus=g, micro_batch=a.micro_batch, precision=a.precision or "bf16",
                  pretrain_ratio=a.pretrain_ratio, peak_tflops=a.peak_tflops, mfu=a.mfu)
        ac = a.recompute_activations
        if ac is None:
            ac = plan_run(recipe, recompute_activations=False, **kw).needs_recompute
        return plan_run(recipe, recompute_activations=ac, **kw)

    text = format_plans([planned(g) for g in gpus])
    if left:
        text += (f"\n(not planned: {', '.join(map(str, left))} GPUs, over which the global batch of {batch} "
                 "sequences does not split; pass --gpus or --batch-size)")
    return text


def _splits(batch: int, gpus: int, micro: int | None) -> bool:
    from phaselens.errors import ConfigError
    from phaselens.train.family.training_plan import batch_split

    try:
        batch_split(batch, gpus, micro)
    except ConfigError:
        return False
    return True


def check_runs(runs: str, run_dir: Path) -> None:
    """``--runs``: a folder that exists or can be made, and written to (before any training)."""
    check_folder("--runs", runs, run_dir, "checkpoints")


def check_folder(option: str, given: str, path: Path, what: str) -> None:
    """``option`` (``--runs`` or ``--out``): a folder that exists or is created with its missing parents (as
    ``mkdir -p`` would), under a writable folder; refused before any training when it cannot be."""
    from phaselens.errors import OutputError
    from phaselens.storage.oserrors import why_not_written
    from phaselens.storage.writing import nearest_existing, writable

    try:
        for where in (path, *path.parents):
            if where.exists() and not where.is_dir():
                raise InputError(f"{option} {given}: {where} is a file, not a folder (an existing file is never "
                                 f"replaced); point {option} at a directory.")
        if any(len(part.encode()) > 255 for part in path.parts):
            raise OSError(36, "File name too long", str(path))
        where = nearest_existing(path)
        if not writable(where):
            raise OutputError(f"{option} {given}: {where} is not writable (permission denied), so {what} cannot "
                              f"be written there; point {option} at a folder you can write to.")
    except OSError as err:
        raise OutputError(f"{option} {given}: {why_not_written(err, path)}") from None


def _check_memory(recipe: Any, world: int) -> None:
    """The least a run holds (fp32 weights, gradients and AdamW's two moments, sharded over the ranks, and one
    global batch of ids) against the memory there is: a too-large --vocab or --batch-size fails here, not at
    the first step."""
    import torch

    from phaselens.errors import ResourceError
    from phaselens.runtime.budget import device_available, host_available
    from phaselens.train.family.training_plan import plan_run

    n = plan_run(recipe, gpus=world).parameters  # a meta-device model: nothing allocated
    state, ids = 16 * n // world, 2 * 8 * recipe.settings.batch_size * recipe.seq_len
    gpu = torch.cuda.is_available()
    free = device_available(torch.device("cuda", torch.cuda.current_device())) if gpu else host_available()
    need = state + (0 if gpu else ids)
    if free is not None and need > free:
        raise ResourceError(f"the run holds at least {need / 2**30:,.1f} GiB per rank ({n:,} parameters: fp32 weights, "
                            f"gradients and AdamW state over {world} rank(s)) but {free / 2**30:,.1f} GiB is free "
                            "on its device; use a smaller --size or --vocab, or more GPUs.")


def run(a: FamilyArgs, say: Any) -> None:
    """Train, resume or plan; ``say`` prints on the main rank. Every argument is checked before anything is
    built or written (:func:`check_args`)."""
    if a.plan:
        say(plan_text(a))
        return
    from phaselens.models.compressed.io import checkpoint_kind
    from phaselens.parallel.world import process_world
    from phaselens.storage.writing import check_output_dir
    from phaselens.train.family import checkpoints as ckpt
    from phaselens.train.family.run import member_name, run_recipe
    from phaselens.train.family.training_plan import batch_split

    recipe, pretraining = check_args(a)
    world = process_world().size
    batch_split(recipe.settings.batch_size, world, a.micro_batch)  # the trainer's own check, before the model
    parallel = parallelism(a, recipe, world)
    name = member_name(recipe)
    check_output_dir(Path(a.out) / name, checkpoint_kind(), overwrite=a.force)
    check_runs(a.runs, Path(a.runs) / name)
    ckpt.check_run_dir(Path(a.runs) / name)
    _check_memory(recipe, world)
    pointer = ckpt.latest(Path(a.runs) / name / "checkpoints")
    if pointer is not None:
        print(f"resuming {name} from step {pointer['step']} of {recipe.settings.steps}", file=sys.stderr)
    card = run_recipe(recipe, out=a.out, runs=a.runs, parallel=parallel, pretraining=pretraining,
                      ratio=a.pretrain_ratio, eval_per_residue=a.eval_per_residue, progress=a.progress,
                      overwrite=a.force, time_limit=a.time_limit,
                      peak_tflops=a.peak_tflops if _on_gpu() else None)  # no MFU against a GPU peak on a CPU
    if card is None:
        pointer = ckpt.latest(Path(a.runs) / name / "checkpoints")
        if pointer is not None and pointer["step"] < recipe.settings.steps:
            say(f"{name}: stopped at step {pointer['step']} of {recipe.settings.steps} (time limit); rerun the same "
                "command to resume (phaselens.train.load_checkpoint loads the step as a model).")
        return
    t = card["training"]
    line = f"{name}: {t['tokens']:,} tokens, final loss {t['final_loss']:.4f}"
    if "battery" in card:
        b = card["battery"]
        line += (f"; mean {100 * b['mean']:.1f}%, worst {100 * b['worst']:.1f}%, gap {100 * b['gap']:.1f} pp, "
                 f"period {b['period']}")
    say(f"{line}; written to {Path(a.out) / name} (loss log: {Path(a.runs) / name / 'log.json'})")


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
