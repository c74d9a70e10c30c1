"""lm-eval's per-sample output read back as a :class:`~phaselens.PhaseEval` with the whole statistics battery.

``lm_eval ... --log_samples --output_path OUT`` writes ``OUT/<model>/samples_<task>_<date>.jsonl``: one line per
document with the document itself (``doc``), the requests, the model's responses and the task's metrics. A
task exported by :mod:`.export` or stratified by :mod:`.stratify` records each document's phase in
``doc["phaselens"]``; :func:`read_samples` turns the lines into phaselens' per-item frame and runs the battery
(per-residue accuracy with Wilson intervals, the folded gap with its interval, the period test, the worst and
boundary phases) exactly as ``phaselens.evaluate`` does.

* Exported tasks: ``correct`` is whether the answer is the model's greedy next token; the multiple-choice
  flavour also gives ``nll`` and ``logit_diff`` (the answer's and distractor's log-probabilities), the
  generation flavour accuracy alone.
* Stratified tasks: the item is the source document (paired across its shifts), ``t_K`` the slot of its
  first context token, ``correct`` the task's own 0/1 metric (``acc`` for multiple choice, ``exact_match`` for
  generation, or ``metric=``); multiple choice also gives ``nll`` (of the gold choice) and ``logit_diff``
  (gold minus the best other choice).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phaselens.errors import InputError, StatsInputError, TaskError, TokenizerMismatchError

PHASE_KEY = "phaselens"
GEOMETRY = ("stride", "modulus", "origin")
# bookkeeping of the records that is not an item column
BOOKKEEPING = {"kind", "task", "stride", "modulus", "origin", "tokenizer", "filler", "filler_id", "prefix_tokens"}
# lm-eval backends that put no BOS before token-id prompts unless add_bos_token=True
NO_PREFIX_BY_DEFAULT = {"local-completions": False, "openai-completions": False, "sglang": False}


def read_samples(source: Any, *, task: str | None = None, filter: str | None = None, metric: str | None = None,
                 model: str | None = None, n_permutations: int = 2000, n_bootstrap: int = 1000, seed: int = 0) -> Any:
    """A :class:`~phaselens.PhaseEval` from lm-eval's samples of a phaselens-exported or stratified task.

    Args:
        source: lm-eval's output folder (``--output_path``), one ``samples_<task>_<date>.jsonl`` file, the dict
            ``simple_evaluate(..., log_samples=True)`` returns, or a list of its samples.
        task: which task, when ``source`` holds several.
        filter: which of the task's filters (default: its only one, or ``none``).
        metric: the 0/1 metric read as ``correct`` for a stratified task (default ``acc``, or ``exact_match`` for
            generation).
        model: the model's name in the result (default: lm-eval's, where its results file says).
        n_permutations, n_bootstrap, seed: as for ``phaselens.evaluate`` (the same battery for the same values).
    """
    from phaselens.analyses.evaluation import eval_from_items

    samples, name, config, where = _load(source, task)
    if not samples:
        raise InputError(f"no samples to read in {where}: run lm-eval with --log_samples.")
    samples = _one_filter(samples, filter, name)
    items, geometry, info = sample_items(samples, metric=metric)
    _check_backend(config, info)
    stride, modulus = geometry["stride"], geometry["modulus"]
    present = np.unique(items["residue"].to_numpy())
    residues = None if len(present) == modulus else present
    finite = bool(len(items)) and bool(np.isfinite(items[["nll", "logit_diff"]].to_numpy(float)).all())
    scored = ("lm-eval samples: the answer's and distractor's log-probabilities (accuracy, nll, logit_diff)" if finite
              else "lm-eval samples: right or wrong answers only (generation), so the statistics use accuracy alone")
    lm = (config or {}).get("model")
    metadata = {"model": model or (f"lm-eval {lm}" if lm else "lm-eval"), "task": name, "task_spec": info,
                "source": where, "scored_by": scored, "lm_eval": {"config": _jsonable(config)} if config else {}}
    return eval_from_items(items, stride, modulus, metadata=metadata, n_permutations=n_permutations,
                           n_bootstrap=n_bootstrap, seed=seed, residues=residues,
                           metrics=("nll", "logit_diff") if finite else ())


def sample_items(samples: Sequence[Mapping[str, Any]], *, metric: str | None = None
                 ) -> tuple[pd.DataFrame, dict[str, int], dict[str, Any]]:
    """The per-item frame of ``samples`` (phaselens' columns, in item order), the geometry, and what was read."""
    if not samples:
        raise InputError("no samples to read: run lm-eval with --log_samples.")
    metas = []
    for s in samples:
        meta = (s.get("doc") or {}).get(PHASE_KEY) if isinstance(s, Mapping) else None
        if not isinstance(meta, Mapping) or meta.get("kind") not in ("exported", "stratified"):
            raise TaskError("these samples carry no phaselens record (doc['phaselens']): read back tasks exported by "
                            "phaselens (export_task) or stratified by it (stratify), run with --log_samples.")
        metas.append(meta)
    kinds = {m["kind"] for m in metas}
    geometry = {k: {int(m[k]) for m in metas} for k in GEOMETRY}
    if len(kinds) > 1 or any(len(v) > 1 for v in geometry.values()):
        raise TaskError(f"the samples mix tasks or geometries ({sorted(kinds)}, {geometry}); read one task's samples.")
    kind = kinds.pop()
    rows = [(_exported if kind == "exported" else _stratified)(s, m, metric) for s, m in zip(samples, metas)]
    frame = pd.DataFrame(rows)
    order = ["row"] if kind == "exported" else ["item_id", "shift"]
    frame = frame.sort_values(order, kind="stable").reset_index(drop=True)
    dup = frame.duplicated(["item_id", "residue"])
    if dup.any():
        first = frame[dup].iloc[0]
        raise TaskError(f"item {first['item_id']} appears twice at residue {first['residue']}: the samples hold two runs "
                        "or two filters of one task; read one file (and pass filter=).")
    lead = ["item_id", "residue", "phase", "t_K", "correct", "p_correct", "p_wrong", "logit_diff", "nll", "rank",
            "predicted"]
    frame = frame[lead + [c for c in frame.columns if c not in lead]]
    info = {"kind": kind, **{k: v.pop() for k, v in geometry.items()},
            **{k: metas[0][k] for k in ("task", "tokenizer", "filler", "prefix_tokens") if k in metas[0]},
            "n_samples": len(frame)}
    return frame, {k: info[k] for k in GEOMETRY}, info


def _exported(sample: Mapping[str, Any], meta: Mapping[str, Any], metric: str | None) -> dict[str, Any]:
    resps = sample.get("filtered_resps")
    extra = {k: v for k, v in meta.items() if k not in BOOKKEEPING}
    answer = int(meta["answer"])
    if _is_choices(resps) and len(resps) == 2:  # the multiple-choice flavour: [answer, distractor]
        (ll_a, greedy), (ll_w, _) = (_pair(r) for r in resps)
        correct = bool(greedy)
        scores = _scores(ll_a, ll_w)
    else:  # the generation flavour: the greedy text
        text = resps[0] if isinstance(resps, list) and resps else resps
        value = sample.get(metric or "exact_match")
        correct = bool(value) if value is not None else text == sample["doc"].get("target")
        scores = _scores(math.nan, math.nan)
    return {**extra, "correct": correct, **scores, "rank": 0.0 if correct else math.nan,
            "predicted": answer if correct else -1}


def _stratified(sample: Mapping[str, Any], meta: Mapping[str, Any], metric: str | None) -> dict[str, Any]:
    resps = sample.get("filtered_resps")
    choices = _is_choices(resps)
    name = metric or ("acc" if choices else "exact_match")
    if name not in sample:
        raise StatsInputError(f"the samples hold no metric {name!r} (they hold {sample.get('metrics')}); pass metric= "
                              "naming the task's right-or-wrong metric.")
    value = float(sample[name])
    if value not in (0.0, 1.0):
        raise StatsInputError(f"metric {name!r} is {value} for a sample, not 0 or 1: the battery needs a right or wrong "
                              "answer per sample; pass metric= naming a 0/1 metric (acc, exact_match).")
    scores = _scores(math.nan, math.nan)
    gold = _gold(sample.get("target"))
    if choices and gold is not None and 0 <= gold < len(resps) and len(resps) > 1:
        lls = [_pair(r)[0] for r in resps]
        scores = _scores(lls[gold], max(x for j, x in enumerate(lls) if j != gold))
    _check_shift(sample, meta)
    return {"item_id": int(meta["source_doc"]), "residue": int(meta["residue"]), "phase": int(meta["phase"]),
            "t_K": int(meta["slot"]), "correct": value == 1.0, **scores,
            "rank": 0.0 if value == 1.0 else math.nan, "predicted": -1, "shift": int(meta["shift"]),
            "doc_id": int(sample.get("doc_id", -1))}


def _scores(ll_answer: float, ll_other: float) -> dict[str, float]:
    return {"p_correct": math.exp(ll_answer), "p_wrong": math.exp(ll_other), "logit_diff": ll_answer - ll_other,
            "nll": -ll_answer}


def _is_choices(resps: Any) -> bool:
    """Whether ``resps`` are loglikelihood answers, one ``[logprob, greedy]`` per choice (lm-eval's samples file
    holds both as strings: ``["-3.71", "False"]``)."""
    return isinstance(resps, list) and bool(resps) and all(
        isinstance(r, list | tuple) and len(r) == 2 and _number(r[0]) and r[1] in (True, False, "True", "False")
        for r in resps)


def _number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float | str):
        return False
    try:
        float(x)
    except ValueError:
        return False
    return True


def _pair(r: Any) -> tuple[float, bool]:
    ll, greedy = r
    return float(ll), greedy in (True, 1, "True", "true")


def _gold(target: Any) -> int | None:
    try:
        return int(target)
    except (TypeError, ValueError):
        return None


def _check_shift(sample: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """The logged prompt must begin with the recorded shift's padding (else the samples are not this design's)."""
    prompt = _prompt(sample.get("arguments"))
    want = str(meta["filler"]) * int(meta["shift"])
    if prompt is not None and not prompt.startswith(want):
        raise TaskError(f"document {sample.get('doc_id')}: its prompt does not begin with the {meta['shift']} filler "
                        f"unit(s) its record names ({prompt[:30]!r}); the samples were not written by this design.")


def _prompt(arguments: Any) -> str | None:
    if isinstance(arguments, Mapping):  # as lm-eval writes them: {"gen_args_0": {"arg_0": context, ...}}
        first = arguments.get("gen_args_0") or {}
        return first.get("arg_0") if isinstance(first, Mapping) else None
    if isinstance(arguments, list | tuple) and arguments and isinstance(arguments[0], list | tuple):
        return arguments[0][0] if isinstance(arguments[0][0], str) else None
    return None


def _check_backend(config: Mapping[str, Any] | None, info: Mapping[str, Any]) -> None:
    """A backend that put no BOS before token-id prompts ran every context one slot earlier than recorded."""
    if not config or not int(info.get("prefix_tokens") or 0):
        return
    name = str(config.get("model"))
    args = config.get("model_args") or {}
    if isinstance(args, str):
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(args)
    if name in NO_PREFIX_BY_DEFAULT and not _truthy(args.get("add_bos_token", False)) and \
            _truthy(args.get("tokenized_requests", True)):
        raise TokenizerMismatchError(
            f"lm-eval's {name} sent token ids without the BOS (add_bos_token is off), but the task was stratified "
            f"for {info['prefix_tokens']} special token(s) before each context: every context sat "
            f"{info['prefix_tokens']} slot(s) earlier than its record says. Rerun with add_bos_token=True in "
            "--model_args, or stratify with prefix_tokens=0.")


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def _one_filter(samples: list[dict[str, Any]], filter: str | None, name: str) -> list[dict[str, Any]]:
    keys = sorted({str(s.get("filter", "none")) for s in samples})
    if filter is None:
        if len(keys) > 1 and "none" not in keys:
            raise InputError(f"task {name} has the filters {keys}; pass filter= to read one.")
        filter = keys[0] if len(keys) == 1 else "none"
    chosen = [s for s in samples if str(s.get("filter", "none")) == filter]
    if not chosen:
        raise InputError(f"task {name} has no samples of filter {filter!r}; it has {keys}.")
    return chosen


def _load(source: Any, task: str | None) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None, str]:
    """``(samples, task name, lm-eval's run config or None, where they came from)``."""
    if isinstance(source, Mapping) and "samples" in source:  # simple_evaluate's result
        tasks = sorted(source["samples"])
        name = _pick(tasks, task)
        return list(source["samples"][name]), name, dict(source.get("config") or {}), "simple_evaluate"
    if isinstance(source, list):
        meta = ((source[0].get("doc") or {}).get(PHASE_KEY) or {}) if source and isinstance(source[0], Mapping) else {}
        return source, task or str(meta.get("task", "task")), None, "samples"
    if not isinstance(source, str | os.PathLike):
        raise InputError(f"source must be lm-eval's output folder, a samples file, simple_evaluate's result or its "
                         f"samples, got {type(source).__name__}.")
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("samples_*.jsonl"))
        names = sorted({_task_of(f) for f in files})
        if not files:
            raise InputError(f"{path} holds no samples_*.jsonl: run lm-eval with --log_samples --output_path {path}.")
        name = _pick(names, task)
        runs = sorted((f for f in files if _task_of(f) == name), key=lambda f: f.stat().st_mtime)
        path = runs[-1]  # the latest run of the task
    elif not path.is_file():
        raise InputError(f"no samples at {path}: give lm-eval's --output_path folder or a samples_*.jsonl file.")
    samples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    samples.append(json.loads(line))
                except ValueError as err:
                    raise InputError(f"{path}, line {n}: not a JSON sample ({err}).") from None
    return samples, _task_of(path), _results_config(path), str(path)


def _task_of(path: Path) -> str:
    """``samples_<task>_<date>.jsonl`` -> ``<task>`` (the date is lm-eval's ``%Y-%m-%dT%H-%M-%S.%f``)."""
    stem = path.stem[len("samples_"):]
    return stem.rsplit("_", 1)[0] if "_" in stem else stem


def _results_config(samples: Path) -> dict[str, Any] | None:
    """The run's config from the results file lm-eval wrote beside the samples (same date), if any."""
    date = samples.stem.rsplit("_", 1)[-1]
    for f in samples.parent.glob(f"results_{date}*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            return None
        return {**dict(data.get("config") or {}), **({"model_name": data["model_name"]} if "model_name" in data else {})}
    return None


def _pick(names: list[str], task: str | None) -> str:
    if task is not None:
        if task not in names:
            raise InputError(f"no samples of task {task!r}; there are {names}.")
        return task
    if len(names) != 1:
        raise InputError(f"the samples hold several tasks {names}; pass task= to read one.")
    return names[0]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def read_all(source: Any, **options: Any) -> dict[str, Any]:
    """Every phaselens task in ``source`` (lm-eval's output folder, a samples file or ``simple_evaluate``'s result)
    read back: ``{task: PhaseEval}``, in name order; tasks whose samples carry no phaselens record are skipped."""
    if isinstance(source, Mapping) and "samples" in source:
        names = sorted(source["samples"])
    elif isinstance(source, str | os.PathLike) and Path(source).expanduser().is_dir():
        names = sorted({_task_of(f) for f in Path(source).expanduser().rglob("samples_*.jsonl")})
    else:
        return {_load(source, None)[1]: read_samples(source, **options)}
    out = {}
    for name in names:
        samples = _load(source, name)[0]
        if samples and isinstance((samples[0].get("doc") or {}).get(PHASE_KEY), Mapping):
            out[name] = read_samples(source, task=name, **options)
    if not out:
        raise TaskError(f"no task in {source if not isinstance(source, Mapping) else 'the result'} carries phaselens "
                        "records: read back tasks exported or stratified by phaselens, run with --log_samples.")
    return out
