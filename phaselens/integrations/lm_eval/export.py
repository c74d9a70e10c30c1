"""phaselens' phase-controlled tasks as lm-eval tasks: YAML files over local JSONL data.

``export_task(task, OUT, tokenizer=..., spec=...)`` builds the items exactly as ``phaselens.evaluate`` does
(``task.build(spec, n_per_residue=, residues=, seed=)``: the target at exact residues, the query position
fixed) and writes, in ``OUT``:

* ``<name>.jsonl``: one document per item: the prompt as text (``context``: the ids after the tokenizer's
  special prefix, decoded), the answer and the distractor as continuations (``choices``), the answer's text
  for generation (``target``), and ``doc["phaselens"]``: the item's residue, phase, ``t_K``, ids and the
  geometry, which lm-eval's ``--log_samples`` carries back to :func:`~.samples.read_samples`;
* ``<name>.yaml``: a ``multiple_choice`` task over the two continuations: ``exact_match`` is phaselens'
  ``correct`` (the answer is the model's greedy next token), ``acc`` whether the answer beats the distractor;
  the read-back takes both log-probabilities (``nll``, ``logit_diff``) from the samples;
* ``<name>_gen.yaml``: the same items as ``generate_until`` of one token, for servers that return text only
  (``transformers serve``): ``exact_match`` is ``correct``.

Every prompt is checked to survive text: encoding the context (with the special prefix) gives the item's ids
exactly, and context + continuation gives them plus the answer (or distractor) token; else the export is
refused (:class:`~phaselens.errors.TokenizerMismatchError`), since a backend would then run other ids at
other phases. ``lm_eval --tasks <name> --include_path OUT`` runs them on any backend; both files carry the tag
``phaselens``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from phaselens.core.geometry import PhaseSpec
from phaselens.errors import InputError, TaskError, TokenizerMismatchError
from phaselens.integrations.lm_eval.tokens import TokenizerView, load_any_tokenizer
from phaselens.storage.writing import write_owned_file

KIND = "exported"
WRITER = "lm-eval export"  # the writer's name in the folder's manifest
NAMES = {"needle": "phaselens_needle", "kv_recall": "phaselens_kv_recall", "padding_probe": "phaselens_probe",
         "niah-128k": "phaselens_niah", "fp8-probe": "phaselens_fp8_probe"}


def export_task(task: Any = None, out: str | os.PathLike = "lm_eval_tasks", *, model: Any = None,
                tokenizer: Any = None, spec: PhaseSpec | None = None, stride: int | None = None,
                n_per_residue: int = 16, residues: Sequence[int] | None = None, seed: int = 0,
                name: str | None = None, overwrite: bool = False, **preset_options: Any) -> list[Path]:
    """Write ``task``'s items as lm-eval tasks in ``out``; returns the files written (JSONL, MC YAML, gen YAML).

    Args:
        task: a phaselens task (``Needle``, ``KVRecall``, ``PaddingProbe``, ...), a prepared ``TaskBatch``, or a
            preset name (``"niah-128k"``: the paper's 128K needle, built from the tokenizer with
            ``preset_options``, e.g. ``length=``, ``n_records=``); ``None``: the model's default task.
        out: the folder (created; a file of yours there is refused unless ``overwrite``).
        model: optional: supplies the tokenizer (``model.tokenizer``), the geometry (its analysis spec, or
            ``stride``'s) and the default task, as ``phaselens.evaluate(model, task)`` would.
        tokenizer: the tokenizer the backend will use (an object, a path, or ``zoo:NAME``).
        spec: the geometry the items are placed for (default: the model's, or ``PhaseSpec(stride)``).
        n_per_residue, residues, seed: as for ``phaselens.evaluate`` (the same items for the same values).
        name: the lm-eval task name (default ``phaselens_<kind>``: ``phaselens_needle``, ``phaselens_niah``, ...).
    """
    tok = _tokenizer(model, tokenizer)
    if isinstance(task, str):
        from phaselens.tasks.presets import preset

        name = name or NAMES.get(task, f"phaselens_{task.replace('-', '_')}")
        task = preset(task, tok, **preset_options)
    elif preset_options:
        raise InputError(f"{sorted(preset_options)} apply to a preset given by name (task='niah-128k').")
    if task is None:
        task = getattr(model, "default_task", None)
        if task is None:
            raise TaskError("export_task needs a task (or a model with a default task).")
    if hasattr(task, "frame") and hasattr(task, "tokens"):  # a prepared TaskBatch: its own geometry
        if spec is not None or stride is not None:
            raise InputError("a prepared TaskBatch carries its geometry (batch.spec); pass no spec or stride.")
        batch = task
    else:
        batch = task.build(_spec(model, spec, stride), n_per_residue=int(n_per_residue), residues=residues,
                           seed=int(seed))
    kind = str(getattr(batch, "task", "") or "task").split("/")[0]
    name = name or NAMES.get(kind, f"phaselens_{kind}")
    if not name.replace("_", "").replace("-", "").isalnum():
        raise InputError(f"name={name!r}: use letters, digits, '_' and '-' (it names files and the lm-eval task).")
    rows = documents(batch, TokenizerView(tok), name)
    folder = Path(out).expanduser().resolve()
    data = folder / f"{name}.jsonl"
    texts = {data: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
             folder / f"{name}.yaml": _yaml(name, data, "mc", batch, len(rows)),
             folder / f"{name}_gen.yaml": _yaml(f"{name}_gen", data, "gen", batch, len(rows))}
    for path, text in texts.items():
        write_owned_file(path, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"), by=WRITER,
                         overwrite=overwrite, force_hint="overwrite=True (--force)")
    return list(texts)


def documents(batch: Any, tokens: TokenizerView, name: str) -> list[dict[str, Any]]:
    """One lm-eval document per item of ``batch``, each checked to survive text (see the module docstring)."""
    prefix = list(tokens.prefix)
    records = batch.frame.reset_index(drop=True).to_dict("records")
    spec = batch.spec
    rows = []
    for i in range(len(batch)):
        ids = batch.tokens[i, : int(batch.query_pos[i]) + 1].tolist()
        answer, wrong = int(batch.answer[i]), int(batch.wrong[i])
        if ids[:len(prefix)] != prefix:
            raise TaskError(f"item {i} does not begin with the tokenizer's special prefix {prefix} ({tokens.name}), "
                            "which a backend puts before the text: build the items with this tokenizer.")
        body = ids[len(prefix):]
        context = tokens.decode(body, skip_special_tokens=False)
        _same(tokens, context, ids, i, "its prompt")
        choices = [_continuation(tokens, ids, context, t, i) for t in (answer, wrong)]
        meta = {k: _plain(v) for k, v in records[i].items()}
        meta.update({"kind": KIND, "task": name, "row": i, "answer": answer, "wrong": wrong,
                     "query_pos": int(batch.query_pos[i]), "n_tokens": len(ids), "stride": int(spec.stride),
                     "modulus": int(batch.modulus), "origin": int(spec.origin), "tokenizer": tokens.name})
        rows.append({"context": context, "choices": choices, "label": 0,
                     "target": tokens.decode([answer], skip_special_tokens=True), "phaselens": meta})
    return rows


def _continuation(tokens: TokenizerView, ids: list[int], context: str, token: int, i: int) -> str:
    """The text token ``token`` adds after ``context`` (the text of ``ids``), checked to encode back to exactly
    that token."""
    full = tokens.decode([*ids[len(tokens.prefix):], token], skip_special_tokens=False)
    if not full.startswith(context):
        raise TokenizerMismatchError(f"item {i}: the token {token} does not extend the prompt's text (decoding changes "
                                     f"the text before it, {tokens.name}); this task cannot go to a backend as text.")
    cont = full[len(context):]
    _same(tokens, context + cont, [*ids, token], i, f"its prompt with token {token}")
    return cont


def _same(tokens: TokenizerView, text: str, ids: list[int], i: int, what: str) -> None:
    got = tokens.encode(text, add_special_tokens=True)
    if got != ids:
        at = next((k for k, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
        raise TokenizerMismatchError(
            f"item {i}: {what} does not survive text with the tokenizer {tokens.name}: encoding it gives "
            f"{got[max(0, at - 2):at + 3]} at slot {at}, not {ids[max(0, at - 2):at + 3]}, so a backend would run "
            "other ids at other phases. Build the task with pieces that tokenize alike in context (docs/tasks.md).")


def _plain(value: Any) -> Any:
    """A frame cell as a JSON value."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _tokenizer(model: Any, tokenizer: Any) -> Any:
    if tokenizer is not None:
        return load_any_tokenizer(tokenizer)
    if model is None:
        raise InputError("export_task needs tokenizer= (or model= with a tokenizer): the prompts become text.")
    return model.tokenizer


def _spec(model: Any, spec: PhaseSpec | None, stride: int | None) -> PhaseSpec:
    if spec is not None:
        if stride is not None:
            raise InputError("pass spec or stride, not both.")
        return spec
    if model is not None:
        from phaselens.analyses.items import analysis_geometry

        return analysis_geometry(model, stride)
    if stride is None:
        raise InputError("export_task needs the geometry: spec=PhaseSpec(S), stride=S, or model=.")
    return PhaseSpec(int(stride))


def _yaml(task: str, data: Path, flavour: str, batch: Any, n: int) -> str:
    spec = batch.spec
    head = [f"# {n} items of phaselens' {batch.task or 'task'} at residues mod {batch.modulus} (stride {spec.stride}, "
            f"origin {spec.origin}), exported by phaselens",
            "# (docs/lm_eval.md). Each document's `phaselens` field records its residue; read the samples back with",
            "# `phaselens lm-eval read` or phaselens.integrations.lm_eval.read_samples.",
            f"task: {task}", "tag:", "  - phaselens", "dataset_path: json", "dataset_kwargs:", "  data_files:",
            f"    test: {json.dumps(str(data))}", "test_split: test", "doc_to_text: context"]
    if flavour == "mc":
        body = ["output_type: multiple_choice", "doc_to_choice: choices", "doc_to_target: label",
                'target_delimiter: ""', "metric_list:",
                "  - metric: exact_match  # phaselens' correct: the answer is the greedy next token",
                "    aggregation: mean", "    higher_is_better: true",
                "  - metric: acc  # the answer is more likely than the distractor", "    aggregation: mean",
                "    higher_is_better: true"]
    else:
        body = ["output_type: generate_until", "doc_to_target: target", "generation_kwargs:", "  until: []",
                "  max_gen_toks: 1", "  do_sample: false", "  temperature: 0.0", "metric_list:",
                "  - metric: exact_match  # phaselens' correct: the greedy next token is the answer",
                "    aggregation: mean", "    higher_is_better: true"]
    return "\n".join([*head, *body, "metadata:", "  version: 1", ""])
