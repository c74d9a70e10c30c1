"""Phase-stratified variants of any lm-eval task: every document ``M`` times, its context behind ``k = 0..M-1``
filler tokens of prefix padding.

The paper's recommendation is that an evaluation of a chunk-compressed model place the same information at
every compression phase. Prefix padding (as the paper's completion probe does) moves a whole context by ``k``
slots, so its first token sits at slot ``prefix + k`` (``prefix``: the special tokens the backend puts first,
the BOS) and the residues ``(prefix + k - origin) mod M`` cover all of ``0..M-1`` for every document.

* Token-exact: the filler is one token of the model's tokenizer and shifts each context by exactly ``k``
  tokens, checked on every context at every shift (:mod:`.filler`); otherwise the task is refused.
* Recorded: each variant's document carries ``doc["phaselens"]`` (its source document, shift, first slot,
  residue, phase and the geometry), so lm-eval's ``--log_samples`` output holds it and
  :func:`~phaselens.integrations.lm_eval.samples.read_samples` reads it back.
* Paired: the variants of one document share its few-shot examples (built once per document, in the order
  the unstratified run builds them), so the ``k = 0`` variant is the plain task's prompt.

Two ways in: :func:`stratify` (a task object for ``simple_evaluate``) and :func:`write_stratified` (a YAML file
for ``--include_path``, whose ``class:`` is :class:`StratifiedTask`).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phaselens.errors import InputError, NotApplicableError, ResidueError, TaskError
from phaselens.integrations.lm_eval.filler import Filler, check_shift, choose_filler
from phaselens.integrations.lm_eval.harness import require_lm_eval
from phaselens.integrations.lm_eval.tokens import load_any_tokenizer
from phaselens.storage.writing import write_owned_file
from phaselens.tasks.text import special_prefix

PHASE_KEY = "phaselens"  # the key of each variant's record in its document
KIND = "stratified"


@dataclass(frozen=True)
class Design:
    """The geometry of a stratification: ``M`` shifts, read as residues mod ``M`` and phases mod ``S``."""

    stride: int
    modulus: int
    origin: int
    prefix: int
    filler: Filler

    def record(self, source: int, k: int) -> dict[str, Any]:
        """What variant ``k`` of document ``source`` carries in ``doc["phaselens"]``."""
        slot = self.prefix + k
        residue = (slot - self.origin) % self.modulus
        return {"kind": KIND, "source_doc": source, "shift": k, "slot": slot, "residue": residue,
                "phase": residue % self.stride, "stride": self.stride, "modulus": self.modulus, "origin": self.origin,
                "prefix_tokens": self.prefix, "filler": self.filler.text, "filler_id": self.filler.id,
                "tokenizer": self.filler.tokenizer}


@dataclass
class _State:
    design: Design
    tokenizer: Any
    docs: list[dict[str, Any]] | None = None
    contexts: dict[Any, Any] = field(default_factory=dict)


class _Stratified:
    """Mixed in front of the base task's class: the expanded documents and the shifted contexts."""

    __dict__: dict[str, Any]

    @property
    def eval_docs(self) -> list[dict[str, Any]]:
        st: _State = self.__dict__["_phaselens"]
        if st.docs is None:
            docs = []
            for i, doc in enumerate(super().eval_docs):  # type: ignore[misc]
                if not isinstance(doc, dict) or PHASE_KEY in doc:
                    raise TaskError(f"document {i} is {'already stratified' if isinstance(doc, dict) else 'not a dict'}"
                                    f"; stratify a task whose documents are dicts without a {PHASE_KEY!r} field.")
                docs += [{**doc, PHASE_KEY: st.design.record(i, k)} for k in range(st.design.modulus)]
            st.docs = docs
        return st.docs

    def fewshot_context(self, doc: Any, num_fewshot: int, **kwargs: Any) -> Any:
        meta = doc.get(PHASE_KEY) if isinstance(doc, dict) else None
        if meta is None:  # not one of the stratified documents (a few-shot example): as the base task
            return super().fewshot_context(doc, num_fewshot=num_fewshot, **kwargs)  # type: ignore[misc]
        if kwargs.get("apply_chat_template"):
            raise NotApplicableError("a chat template puts its own tokens around the context, so the prefix padding "
                                     "would not sit right after the BOS; run the stratified task without "
                                     "--apply_chat_template.")
        st: _State = self.__dict__["_phaselens"]
        key = (meta["source_doc"], num_fewshot, repr(sorted((k, v) for k, v in kwargs.items() if k != "chat_template")))
        if key not in st.contexts:  # once per document: every variant shares its few-shot examples
            base = {k: v for k, v in doc.items() if k != PHASE_KEY}
            ctx = super().fewshot_context(base, num_fewshot=num_fewshot, **kwargs)  # type: ignore[misc]
            for text in [ctx] if isinstance(ctx, str) else ctx:
                check_shift(st.tokenizer, st.design.filler, text, range(st.design.modulus))
            st.contexts[key] = ctx
        ctx, k, unit = st.contexts[key], int(meta["shift"]), st.design.filler
        return unit.pad(ctx, k) if isinstance(ctx, str) else [unit.pad(c, k) for c in ctx]


_CLASSES: dict[type, type] = {}


def _stratified_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Stratified{base.__name__}", (_Stratified, base), {"__module__": __name__})
    return _CLASSES[base]


def stratify(task: Any, *, tokenizer: Any, stride: int, modulus: int | None = None, filler: str = "auto",
             origin: int = 0, prefix_tokens: int | None = None, name: str | None = None,
             include_path: str | os.PathLike | None = None) -> Any:
    """A phase-stratified copy of the lm-eval task ``task`` (the task itself is left as it was).

    Args:
        task: an lm-eval ``Task``, a task name (lm-eval's own or one under ``include_path``), a YAML path, or a
            task config dict.
        tokenizer: the model's tokenizer (an object, a ``tokenizer.json`` or its folder, or ``zoo:NAME``).
        stride: S, the compression stride phases are read at.
        modulus: M, the number of shifts and the residues' period (a multiple of S; default S).
        filler: the padding unit, or ``"auto"``: the first of :data:`~.filler.CANDIDATES` that is token-exact.
        origin: the compression geometry's origin (residues count from it).
        prefix_tokens: how many tokens the backend puts before the context (default: the tokenizer's special
            prefix, as lm-eval's ``hf`` and ``phaselens`` models add it; ``local-completions`` adds none unless
            ``add_bos_token=True``).
        name: the stratified task's name (default ``<task>_phase<S>``).

    Returns:
        a task whose documents are the base's, each ``M`` times with ``doc["phaselens"]`` recorded, and whose
        contexts are shifted; pass it to ``lm_eval.simple_evaluate(tasks=[...])``.

    Raises:
        PaddingError: a filler that is not exactly one token in front of a context (names tokenizer and filler).
        NotApplicableError: a ``loglikelihood_rolling`` task (perplexity scores every token at every slot already).
    """
    require_lm_eval()
    base = load_task(task, include_path)
    if isinstance(base, _Stratified):
        raise TaskError(f"{base.task_name} is already stratified; stratify the base task.")
    if getattr(base, "OUTPUT_TYPE", None) == "loglikelihood_rolling":
        raise NotApplicableError(f"{base.task_name} is a perplexity task (loglikelihood_rolling): it scores every token "
                                 "of the text at every slot already, and has no context to shift.")
    tok = load_any_tokenizer(tokenizer)
    s, m = _count("stride", stride), _count("modulus", stride if modulus is None else modulus)
    if m % s:
        raise ResidueError(f"modulus={m} is not a multiple of stride={s}; residues mod M must fold onto phases mod S.")
    prefix = len(special_prefix(tok)) if prefix_tokens is None else _count("prefix_tokens", prefix_tokens, low=0)
    docs = list(base.eval_docs)
    if not docs:
        raise TaskError(f"{base.task_name} has no documents to stratify.")
    sample = []
    for doc in docs[:8]:  # the filler is checked on every context at request time; chosen on a sample
        ctx = base.fewshot_context(doc, num_fewshot=0)
        sample += [ctx] if isinstance(ctx, str) else list(ctx)
    unit = choose_filler(tok, filler, sample, range(m))
    design = Design(s, m, int(origin), prefix, unit)
    cls = _stratified_class(type(base))
    out = cls.__new__(cls)
    out.__dict__.update(base.__dict__)
    out.__dict__["_config"] = copy.copy(base._config)
    out._config.task = name or f"{base.task_name}_phase{s}"
    out.__dict__["_phaselens"] = _State(design, tok)
    return out


def load_task(task: Any, include_path: str | os.PathLike | list[Any] | None = None) -> Any:
    """One lm-eval task from a ``Task``, a name, a YAML path or a config dict (``include_path``: more task folders)."""
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager

    if isinstance(task, Task):
        return task
    is_file = isinstance(task, str | os.PathLike) and Path(task).suffix in (".yaml", ".yml") and Path(task).is_file()
    if not isinstance(task, str | dict | os.PathLike):
        raise InputError(f"task must be an lm-eval Task, a task name, a YAML path or a config dict, got "
                         f"{type(task).__name__}.")
    # lm-eval's own ~15,000 task files are indexed only for a name that is not found in include_path
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path or is_file else None
    spec = os.fspath(task) if isinstance(task, os.PathLike) else task
    if manager is None or (isinstance(spec, str) and not is_file and spec not in manager.all_tasks):
        manager = TaskManager(include_path=include_path)
    try:
        tasks = manager.load(spec)["tasks"]
    except KeyError as err:
        raise TaskError(f"lm-eval knows no task {task!r} ({err}); pass include_path=DIR for your own tasks.") from None
    if len(tasks) != 1:
        raise TaskError(f"{task!r} is a group of {len(tasks)} tasks ({', '.join(sorted(tasks)[:6])}...); stratify one "
                        "task at a time.")
    return next(iter(tasks.values()))


class StratifiedTask:
    """lm-eval's ``class:`` for a stratified task written by :func:`write_stratified`: lm-eval calls it with the
    YAML's config and gets the stratified task (:func:`stratify` with the YAML's keys)."""

    KEYS = ("base_task", "tokenizer", "stride", "modulus", "filler", "origin", "prefix_tokens", "include_path")

    def __new__(cls, config: dict[str, Any] | None = None) -> Any:  # type: ignore[misc]
        cfg = {k: v for k, v in dict(config or {}).items() if k not in ("class", "task", "metadata")}
        unknown = sorted(set(cfg) - set(cls.KEYS))
        if unknown or "base_task" not in cfg or "tokenizer" not in cfg or "stride" not in cfg:
            raise TaskError(f"a stratified task's YAML needs base_task, tokenizer and stride (and may give "
                            f"{', '.join(cls.KEYS[3:])}); got unknown {unknown}." if unknown else
                            "a stratified task's YAML needs base_task, tokenizer and stride.")
        base = cfg.pop("base_task")
        return stratify(base, name=(config or {}).get("task"), **cfg)

    def __init__(self, config: dict[str, Any] | None = None) -> None:  # lm-eval reads this signature
        pass


def write_stratified(task: str, out: str | os.PathLike, *, tokenizer: str | os.PathLike, stride: int,
                     modulus: int | None = None, filler: str = "auto", origin: int = 0,
                     prefix_tokens: int | None = None, name: str | None = None,
                     include_path: str | os.PathLike | None = None, overwrite: bool = False) -> Path:
    """Write ``OUT/<name>.yaml``: the stratified variant of ``task`` as an lm-eval task for ``--include_path``.

    The task is stratified once here, so a filler that is not token-exact is refused now, and ``"auto"`` is
    written down as the unit it chose. ``tokenizer`` is a path or ``zoo:NAME`` (the YAML names it). Returns the
    file's path. Run it with ``lm_eval --tasks <name> --include_path OUT ...`` (phaselens must be importable
    there: the YAML's ``class`` is :class:`StratifiedTask`). The file is written atomically; a file of that name
    phaselens did not write is kept unless ``overwrite``.
    """
    if not isinstance(tokenizer, str | os.PathLike):
        raise InputError("write_stratified needs the tokenizer as a path or zoo:NAME (the YAML names it).")
    tok_ref = tokenizer if str(tokenizer).startswith("zoo:") else str(Path(tokenizer).expanduser().resolve())
    inc = None if include_path is None else str(Path(include_path).expanduser().resolve())
    strat = stratify(task, tokenizer=tok_ref, stride=stride, modulus=modulus, filler=filler, origin=origin,
                     prefix_tokens=prefix_tokens, name=name, include_path=inc)
    design: Design = strat.__dict__["_phaselens"].design
    base = str(Path(task).resolve()) if Path(str(task)).suffix in (".yaml", ".yml") else str(task)
    values = {"task": strat.task_name, "base_task": base, "include_path": inc, "tokenizer": tok_ref,
              "stride": design.stride, "modulus": design.modulus, "origin": design.origin,
              "filler": design.filler.text, "prefix_tokens": design.prefix}
    lines = [f"# The phase-stratified variant of {base}, written by phaselens (docs/lm_eval.md): every document",
             f"# {design.modulus} times, behind k = 0..{design.modulus - 1} filler tokens of prefix padding.",
             f"task: {json.dumps(values['task'])}",
             "class: !function phaselens.integrations.lm_eval.stratification.StratifiedTask"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in values.items() if k != "task" and v is not None]
    path = Path(out).expanduser().resolve() / f"{strat.task_name}.yaml"
    text = "\n".join(lines) + "\n"
    return write_owned_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), by="lm-eval stratify",
                            overwrite=overwrite, force_hint="overwrite=True (--force)")


def _count(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)
