"""The registry of model kinds: for each kind, how phaselens recognises its sources, loads them, adapts a model
object of it, which options it takes and which capabilities its models offer.

``phaselens.load`` (:mod:`phaselens.models.sources`) and the object adapter (:mod:`phaselens.models.objects`,
behind ``phaselens.from_hf`` and every analysis) read this table, never an if-chain of their own. Adding a kind
means writing its adapter onto :mod:`phaselens.models.parts` and adding one :class:`Kind` here (docs/architecture.md).

Entries name their functions as ``"module:attribute"`` strings, imported on first use: reading the registry
imports no model code (and no torch).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# a kind's model_types entry that claims every transformers model_type no other kind claims
ANY_OTHER = "*"


def resolve(target: str) -> Any:
    """The object a ``"module:attribute"`` string names."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def keywords(loader: Callable[..., Any]) -> tuple[str, ...]:
    """The keyword arguments ``loader(source, *, device, ...)`` takes besides its source and ``device``."""
    params = list(inspect.signature(loader).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "device")


@dataclass(frozen=True)
class Kind:
    """One model kind, as ``load`` and the object adapter see it.

    Attributes:
        name: the registry key (``"deepseek_v4"``).
        what: how messages describe its sources (``"a DeepSeek-V4.1 checkpoint (model_type deepseek_v41)"``).
        model: ``"module:Class"`` of the models it yields (their capabilities are this class's).
        schemes: source prefixes it owns (``"zoo:"``, ``"http://"``); a source with one goes to this kind.
        model_types: the transformers ``model_type`` values it claims, for ``"hf:DIR"`` sources and model objects
            (:data:`ANY_OTHER`: every one no other kind claims).
        folder: ``"module:predicate"`` recognising a local folder (without ``hf:``) as its source.
        load: ``"module:function"``, ``fn(source, *, device, **options)``: what ``load`` calls (the source without
            its scheme).
        adapt: ``"module:function"``, ``fn(obj, module, how, *, stride, window, origin, **options)``: what the object
            adapter calls with a model object, its unwrapped ``nn.Module`` and how it was wrapped; ``None``: no
            model object of this kind exists.
        check: ``"module:function"``, ``fn(text, kwargs)``: refuses ``load``'s keywords before anything is read
            (``None``: any keyword not in ``options``, by name).
        options: the keywords ``load`` accepts for it (``"module:attribute"`` of a tuple, or ``None``: ``load``'s
            own keywords besides ``device``).
        capabilities: the optional methods (:data:`phaselens.contract.protocol.CAPABILITIES`) its models offer.
    """

    name: str
    what: str
    model: str
    load: str
    schemes: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    folder: str | None = None
    adapt: str | None = None
    options: str | None = None
    check: str | None = None
    capabilities: tuple[str, ...] = ()

    def loader(self) -> Callable[..., Any]:
        return resolve(self.load)

    def adapter(self) -> Callable[..., Any] | None:
        return None if self.adapt is None else resolve(self.adapt)

    def load_options(self) -> tuple[str, ...]:
        """The keywords ``load`` accepts for this kind (``device`` included)."""
        if self.options is not None:
            return tuple(resolve(self.options))
        return ("device", *keywords(self.loader()))

    def __repr__(self) -> str:
        return f"Kind({self.name!r}: {self.what})"


_DEEPSEEK_CHECK = "phaselens.models.sources:check_deepseek_arguments"
_COMPRESSED = "phaselens.models.compressed.transformer:CompressedTransformer"
# In the order ``load`` tries them: schemes first, then folders; model_types decide ``hf:`` sources and objects.
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("served", "a served model (an OpenAI-compatible endpoint)", "phaselens.models.served.model:ServedModel",
         "phaselens.models.served.loader:load_served", schemes=("http://", "https://"),
         capabilities=("estimate_memory", "answer_queries")),
    Kind("zoo", "a zoo model", _COMPRESSED, "phaselens.models.zoo:load_zoo_model", schemes=("zoo:",),
         capabilities=("query_engine", "cycle_gates")),
    Kind("deepseek_v41", "a DeepSeek-V4.1 checkpoint (model_type deepseek_v41)",
         "phaselens.models.deepseek_v41.model:DeepSeekV41", "phaselens.models.deepseek_v41.checkpoint:load_v41",
         model_types=("deepseek_v41",), check=_DEEPSEEK_CHECK, capabilities=("query_engine", "estimate_memory")),
    Kind("deepseek_v4", "a DeepSeek-V4 checkpoint", "phaselens.models.deepseek_v4.adapter:DeepSeekV4Adapter",
         "phaselens.models.deepseek_v4.checkpoint:load_hf", model_types=("deepseek_v4",),
         adapt="phaselens.models.deepseek_v4.construct:adapt_object",
         options="phaselens.models.deepseek_v4.checkpoint:OPTIONS", check=_DEEPSEEK_CHECK, capabilities=("query_engine", "estimate_memory")),
    Kind("causal_lm", "a causal LM without compression", "phaselens.models.causal_lm.adapter:CausalLMAdapter",
         "phaselens.models.causal_lm.construct:load_causal_lm", model_types=(ANY_OTHER,),
         adapt="phaselens.models.causal_lm.construct:adapt_object",
         capabilities=("query_engine", "query_engine_support", "estimate_memory")),
    Kind("training_run", "a phaselens training run", _COMPRESSED, "phaselens.models.kinds:load_training_run",
         folder="phaselens.models.kinds:is_training_folder",
         capabilities=("query_engine", "cycle_gates")),
    Kind("saved", "a model phaselens saved (model.save)", _COMPRESSED, "phaselens.models.compressed.loader:load_model",
         folder="phaselens.models.compressed.io:is_phaselens_checkpoint",
         capabilities=("query_engine", "cycle_gates")),
)}


def by_scheme(source: str) -> Kind | None:
    """The kind whose scheme ``source`` starts with."""
    return next((k for k in KINDS.values() if k.schemes and source.startswith(k.schemes)), None)


def by_model_type(model_type: str) -> Kind:
    """The kind that claims a transformers ``model_type`` (the :data:`ANY_OTHER` kind when no other does)."""
    return next((k for k in KINDS.values() if model_type in k.model_types),
                next(k for k in KINDS.values() if ANY_OTHER in k.model_types))


def by_folder(path: Any) -> Kind | None:
    """The kind whose folder predicate recognises ``path``."""
    return next((k for k in KINDS.values() if k.folder is not None and resolve(k.folder)(path)), None)


def compressed_model_types() -> tuple[str, ...]:
    """The ``model_type`` values kinds with compression claim: their geometry is read from the model."""
    return tuple(t for k in KINDS.values() if ANY_OTHER not in k.model_types for t in k.model_types)


# ---- the training-run source: a run directory, its checkpoints folder or one step-N folder ----------------------
def is_training_folder(path: Any) -> bool:
    """``path`` is a training run directory (``checkpoints/latest.json``), its ``checkpoints`` folder, or one
    ``checkpoints/step-N`` folder (rank files ``rank0-of-N.safetensors``)."""
    import re
    from pathlib import Path

    path = Path(path)
    if not path.is_dir():
        return False
    if re.fullmatch(r"step-\d+", path.name):
        return any(path.glob("rank0-of-*.safetensors"))
    return (path / "latest.json").is_file() or (path / "checkpoints" / "latest.json").is_file()


def load_training_run(path: Any, *, device: str = "cpu") -> Any:
    """The model of a training run's checkpoint, through the loader :mod:`phaselens.train` registers."""
    from phaselens.contract.adapting import run_loader
    from phaselens.errors import CheckpointError

    loader = run_loader()
    if loader is None:
        raise CheckpointError("this folder holds training checkpoints, but no loader of them is registered; load it "
                              "with phaselens.train.load_checkpoint(path).")
    model = loader(path)
    return model if device == "cpu" else model.to(device)


__all__ = ["ANY_OTHER", "KINDS", "Kind", "by_folder", "by_model_type", "by_scheme", "compressed_model_types",
           "is_training_folder", "keywords", "load_training_run", "resolve"]
