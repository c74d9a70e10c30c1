"""Sharded, resumable training checkpoints: one safetensors file per rank, committed by one atomic pointer.

Layout of ``run_dir/checkpoints``::

    step-000000120/rank0-of-2.safetensors   this rank's shards of the weights and the AdamW moments
    step-000000120/rank1-of-2.safetensors   (``DTensor.to_local()`` under FSDP; whole tensors on one process)
    step-000000120/log.json                 the loss log up to this step (rank 0)
    latest.json                             {"step": 120, "dir": "step-000000120", "world_size": 2, ...}

Every rank writes its file atomically, the ranks meet at a barrier, then rank 0 writes the log and replaces
``latest.json`` in one rename: a kill at any moment leaves ``latest.json`` naming a complete step (a half
written step directory is ignored and removed by the next save). The step that a commit replaces is kept (one
earlier step), so damage on disk leaves a step to resume from (:mod:`phaselens.train.family.steps`).

Each rank file's header records the sha256 of every tensor (:mod:`phaselens.storage.checksums`); a resume
and :func:`load_checkpoint` check them, and a damaged file is a :class:`CheckpointError` naming it and the
intact earlier step.

The ownership rule of :mod:`phaselens.storage.writing` holds here too: a rank file is phaselens's by its own
header, ``log.json`` and ``latest.json`` by the folder's manifest (or, for ``latest.json``, its format stamp).
The clean-up removes only those files, from folders named exactly ``step-NNNNNNNNN``, and a folder only once
it is empty: a user's ``step-keep/`` or a note inside a step folder stays. Nothing is pickled (safetensors + JSON; not
``torch.distributed.checkpoint``, whose metadata file is a pickle). Each rank file holds that rank's FSDP2 shards (dim-0 chunks); a run resumes on any world size, the
tensors resharded by row ranges on load (:func:`load`)..
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from phaselens.errors import CheckpointError, OutputError
from phaselens.storage import manifest as mf
from phaselens.storage.checksums import stamped, verify_file
from phaselens.storage.oserrors import writing
from phaselens.storage.reading import peek_json_object
from phaselens.storage.resumable import check_floating, load_safetensors, read_json, safetensors_metadata
from phaselens.storage.writing import owns_file, write_owned_file
from phaselens.train.family.steps import (
    BY,
    FORMAT,
    LATEST,
    LOG,
    RANK,
    STEP,
    earlier_fix,
    fallback,
    header_meta,
    parse_step,
    rank_file,
    read_step_log,
    step_dir,
)

_STEP, _RANK, _step_dir, _rank_file = STEP, RANK, step_dir, rank_file


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or optimizer tensor (``DTensor.to_local()``; a plain tensor as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_tensors(named: Iterable[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's tensors: ``model.NAME`` and ``adam.{exp_avg,exp_avg_sq,step}.NAME`` (CPU, contiguous)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in named:
        out[f"model.{name}"] = local(p).detach()
        st = opt.state.get(p)
        if st:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                out[f"adam.{key}.{name}"] = local(st[key]).detach().reshape(-1 if key != "step" else 1)
    return {k: v.to("cpu", copy=True).contiguous() for k, v in out.items()}


def save(root: Path, step: int, rank: int, size: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
         log: dict[str, Any] | None, barrier: Any) -> None:
    """Write this rank's shard of ``step``; rank 0 (``log`` given) commits it after ``barrier()``."""
    d = _step_dir(root, step)
    with writing(d):
        d.mkdir(parents=True, exist_ok=True)
    header = stamped({"format": FORMAT, "meta": json.dumps({**meta, "step": step, "rank": rank, "world_size": size})},
                     tensors)  # each tensor's sha256, checked on resume and on load
    write_owned_file(d / _rank_file(rank, size), lambda tmp: save_file(tensors, str(tmp), metadata=header), by=BY,
                     proves=_is_rank_file, record=False)  # ranks share the folder: the header is the proof
    barrier()
    if rank != 0:
        return
    assert log is not None
    write_log(d / LOG, log)
    before = peek_json_object(root / LATEST).get("dir")  # the step this commit replaces: kept
    text = json.dumps({"format": FORMAT, "step": step, "dir": d.name, "world_size": size,
                       "fingerprint": meta["fingerprint"]})
    write_owned_file(root / LATEST, lambda tmp: tmp.write_text(text, encoding="utf-8"), by=BY, proves=_is_pointer)
    for old in root.iterdir():  # older steps, and any step a kill left half written
        if old.name not in (d.name, before) and _STEP.fullmatch(old.name) and old.is_dir() and not old.is_symlink():
            _remove_own(old)


def write_log(path: Path, log: dict[str, Any]) -> None:
    """Write a loss log to ``path`` under the ownership rule (a ``log.json`` of the user's is never replaced)."""
    text = json.dumps(log)
    write_owned_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), by=BY)


def _is_rank_file(path: Path) -> bool:
    try:
        return safetensors_metadata(path, fix="").get("format") == FORMAT
    except CheckpointError:
        return False


def _is_pointer(path: Path) -> bool:
    return peek_json_object(path).get("format") == FORMAT


def _remove_own(d: Path) -> None:
    """Remove what phaselens wrote in the step folder ``d`` (rank files by their header, files its manifest
    lists unchanged), then ``d`` if nothing else is left; a file of the user's keeps the folder."""
    owned = mf.owned_by(d, BY)
    for f in d.iterdir():
        if f.name in owned or (_RANK.fullmatch(f.name) and mf.is_plain_file(f) and _is_rank_file(f)):
            f.unlink(missing_ok=True)
    manifest = d / mf.MANIFEST
    rest = [f.name for f in d.iterdir() if f != manifest]
    if not rest:
        manifest.unlink(missing_ok=True)
        os.rmdir(d)
    elif manifest.exists():
        mf.update(d, drop=tuple(n for n in owned if not (d / n).exists()))


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before the first step, a run directory whose files phaselens would have to overwrite: a
    ``log.json`` or ``checkpoints/latest.json`` that phaselens did not write (or that is not a regular file),
    or a ``--runs`` path that is a file. ``--force`` does not change this: these files are the user's."""
    for where in (run_dir, *run_dir.parents):
        if where.exists() and not where.is_dir():
            raise OutputError(f"the run directory {run_dir} lies under the file {where}; point --runs at a folder.")
    from phaselens.train.metrics import METRICS, is_metrics

    for path, proves in ((run_dir / LOG, None), (run_dir / "checkpoints" / LATEST, _is_pointer),
                         (run_dir / METRICS, is_metrics)):
        if os.path.lexists(path) and not owns_file(path, BY, proves):
            raise OutputError(f"{path} exists and phaselens did not write it (its manifest does not list it "
                              "unchanged), so training would overwrite it; move that file, or pass another "
                              "--runs folder. Nothing was trained.")


def latest(root: Path) -> dict[str, Any] | None:
    """The committed pointer (``latest.json``), or None when no checkpoint exists."""
    if not (root / LATEST).is_file():
        return None
    fix = f"delete {root} to restart from step 0, or pass another run directory."
    meta = read_json(root / LATEST, fix=fix)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root / LATEST} is not a phaselens family checkpoint pointer; {fix}")
    step, folder, size, fp = (meta.get(k) for k in ("step", "dir", "world_size", "fingerprint"))
    bad = [k for k, ok in (("step", _count(step, 0)), ("world_size", _count(size, 1)), ("fingerprint", _fingerprint_ok(fp)),
                           ("dir", isinstance(folder, str) and _STEP.fullmatch(folder) is not None
                            and _count(step, 0) and folder == _step_dir(root, step).name)) if not ok]
    if bad:  # a pointer is data: it never names a folder outside checkpoints/ or a step it does not hold
        raise CheckpointError(f"{root / LATEST} is damaged: its {', '.join(bad)} is missing or malformed "
                              f"(step {step!r}, dir {str(folder)[:40]!r}, world_size {size!r}); {fix}")
    return fallback(root, meta)  # the folder removed by the user (a damaged step): the intact one before it


def _fingerprint_ok(fp: Any) -> bool:
    """One hash, or the run's parts each hashed (``{"config": ..., "data": ...}``)."""
    return isinstance(fp, str) or (isinstance(fp, dict) and all(isinstance(v, str) for v in fp.values()))


def _count(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def rows(n: int, size: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dimension of ``n`` that ``rank`` of ``size`` holds under FSDP2's
    dim-0 sharding (``torch.chunk``: chunks of ``ceil(n / size)``, trailing ranks possibly empty)."""
    c = -(-n // size)
    return min(rank * c, n), min((rank + 1) * c, n)


def load(root: Path, pointer: dict[str, Any], rank: int, size: int, shapes: dict[str, tuple[int, ...]], *,
         resume: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors of the committed step, for a run of ``size`` ranks, and the step's loss log.

    A step written by the same world size is read as it is (a bit-identical resume). One written by another
    world size is resharded: each tensor's rows for this rank are read, by row ranges, from the saved ranks'
    files that hold them (``safe_open(...).get_slice``: no rank reads a file it takes no rows from).
    ``shapes`` maps a parameter name to its global shape (AdamW's moments are saved flattened).
    Every tensor a rank reads is checked against the sha256 its file records (each file it takes rows from,
    in full); damage raises a :class:`CheckpointError` naming the file and the intact earlier step (how to
    resume from it with ``resume``, how to load it otherwise).
    """
    fix = f"delete {root} to restart from step 0, or pass another run directory."
    d, old = root / pointer["dir"], int(pointer["world_size"])
    try:
        log = read_step_log(d, fix)
        paths = [d / _rank_file(r, old) for r in range(old)]
        for path in paths if old != size else paths[rank:rank + 1]:
            _check_step(path, pointer, fix, root)
        if old == size:  # every tensor checked against its sha256 as it is read
            return load_safetensors(paths[rank], fix=fix), log
        return _reshard(paths, old, rank, size, shapes, fix), log
    except CheckpointError as err:  # damage of the committed step: name the intact earlier one to resume from
        if not _STEP.fullmatch(d.name):
            raise
        said = str(err).removesuffix(fix).rstrip("; ")  # the generic fix gives way to the intact step's
        raise CheckpointError(f"{said}; {earlier_fix(root, int(pointer['step']), d, resume=resume)}") from None


def _check_step(path: Path, pointer: dict[str, Any], fix: str, root: Path) -> None:
    step = header_meta(path, fix).get("step")
    if step != pointer["step"]:
        raise CheckpointError(f"{path} holds step {step}, but {root / LATEST} names {pointer['step']}; {fix}")


def _reshard(paths: list[Path], old: int, rank: int, size: int, shapes: dict[str, tuple[int, ...]],
             fix: str) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of ``size``'s shard of every tensor that ``old`` ranks saved in ``paths``."""
    from contextlib import ExitStack

    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    touched = {0}  # the files this rank reads from: each is checked against its sha256 below
    with ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(p), framework="pt")) for p in paths]
        for key in files[0].keys():
            kind, _, name = _split(key)
            if name not in shapes:
                raise CheckpointError(f"{paths[0]} holds {key}, which this model does not have; {fix}")
            shape = shapes[name]
            if kind == "adam.step" or not shape:  # a per-parameter scalar: the same on every rank
                out[key] = files[0].get_tensor(key)
                continue
            row = int(torch.Size(shape[1:]).numel())
            start, stop = rows(shape[0], size, rank)
            pieces = []
            for k, f in enumerate(files):
                a, b = rows(shape[0], old, k)
                lo, hi = max(start, a), min(stop, b)
                if lo < hi:
                    touched.add(k)
                    part = f.get_slice(key)
                    pieces.append(part[lo - a:hi - a] if kind == "model" else part[(lo - a) * row:(hi - a) * row])
            empty = (0, *shape[1:]) if kind == "model" else (0,)
            dtype = files[0].get_slice(key).get_dtype()
            out[key] = torch.cat(pieces) if pieces else torch.empty(empty, dtype=_DTYPE.get(dtype, torch.float32))
    for k in sorted(touched):
        verify_file(paths[k], fix=fix)
    return out


_DTYPE = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_KINDS = ("adam.exp_avg_sq.", "adam.exp_avg.", "adam.step.", "model.")


def _split(key: str) -> tuple[str, str, str]:
    """``"adam.exp_avg.blocks.0.w"`` -> ``("adam.exp_avg", ".", "blocks.0.w")``."""
    for prefix in _KINDS:
        if key.startswith(prefix):
            return prefix[:-1], ".", key[len(prefix):]
    raise CheckpointError(f"a checkpoint holds the tensor {key!r}, which no phaselens trainer writes; "
                          "delete the run directory to restart from step 0.")


def restore(tensors: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer,
            where: Path) -> None:
    """Copy ``tensors`` into the parameters (their local shards) and rebuild AdamW's state exactly."""
    fix = f"delete {where} to restart from step 0, or pass another run directory."
    check_floating(tensors, where=str(where), fix=fix)  # never cast silently into the parameters
    with torch.no_grad():
        for name, p in named:
            saved = tensors.get(f"model.{name}")
            mine = local(p)
            if saved is None or saved.shape != mine.shape:
                raise CheckpointError(f"{where}: parameter {name} is missing or has another shape; {fix}")
            mine.copy_(saved)
            if f"adam.step.{name}" not in tensors:
                continue
            state = {"step": tensors[f"adam.step.{name}"].reshape(()).clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                buf = torch.zeros_like(p)
                local(buf).copy_(tensors[f"adam.{key}.{name}"].view_as(mine))
                state[key] = buf
            opt.state[p] = state


def load_checkpoint(path: str | os.PathLike, step: int | str | None = None) -> Any:
    """The model of a committed training step, for evaluation: a run stopped early (``--time-limit``,
    ``stop_after``, a preemption) still gives a model.

    ``path``: a run directory, its ``checkpoints`` folder, or one ``checkpoints/step-NNNNNNNNN`` folder;
    ``step``: which step of a run directory (default: the committed one, ``latest.json``; the step before it is
    kept too): an int, or ``"1200"`` or ``"step-000001200"``. The step's rank files (from any number of ranks)
    are checked against the sha256 they record and resharded to one whole fp32 model on the CPU, built from the
    config the checkpoint records. Save it with ``model.save(DIR)`` to get a directory that
    :func:`phaselens.load` reads.

    Raises:
        InputError: ``step`` is not a step number.
        CheckpointError: no such step, or a damaged one (naming the file and the intact earlier step).
    """
    from phaselens.models.compressed.config import CompressedConfig
    from phaselens.models.compressed.transformer import CompressedTransformer

    p = Path(path)
    step = None if step is None else parse_step(step)
    root = p if p.name == "checkpoints" else p / "checkpoints"
    if _STEP.fullmatch(p.name) and p.is_dir():
        root, d = p.parent, p
    elif step is not None:
        d = _step_dir(root, step)
    else:
        pointer = latest(root)
        if pointer is None:
            raise CheckpointError(f"{p} holds no committed training step (no {root / LATEST}); pass a run directory "
                                  "or a checkpoints/step-NNNNNNNNN folder.")
        d = root / pointer["dir"]
    fix = "pass another step, or the run's last committed one (its checkpoints/latest.json)."
    files = sorted(f for f in d.glob("rank0-of-*.safetensors")) if d.is_dir() else []
    if not files:
        raise CheckpointError(f"{d} holds no training step's files (rank0-of-N.safetensors); {fix}")
    size = int(files[0].name.split("-of-")[1].split(".")[0])
    try:
        meta = json.loads(safetensors_metadata(files[0], fix=fix).get("meta", ""))
        cfg = CompressedConfig.from_dict(meta["config"])
        saved = int(meta["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{files[0]} records no model config ({err}); it was written by a phaselens before "
                              f"checkpoints loaded as models; {fix}") from None
    model = CompressedTransformer(cfg)
    params = dict(model.named_parameters())
    pointer = {"dir": d.name, "world_size": size, "step": saved}
    tensors, _ = load(root, pointer, 0, 1, {n: tuple(q.shape) for n, q in params.items()}, resume=False)
    restore({k: v for k, v in tensors.items() if k.startswith("model.")}, list(params.items()),
            _NoOptimizer(), d)
    model.training_step = saved
    return model.eval()


class _NoOptimizer:
    state: dict[Any, Any] = {}
