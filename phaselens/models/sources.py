"""``phaselens.load``: one entry point for checkpoints, the zoo, local transformers models and served models."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from phaselens.errors import CheckpointError, InputError
from phaselens.models.kinds import (
    ANY_OTHER,
    KINDS,
    by_folder,
    by_model_type,
    by_scheme,
    resolve,
)
from phaselens.storage.oserrors import reading
from phaselens.storage.reading import peek_json


def load(source: Any, *, device: str = "cpu", **kwargs: Any) -> Any:
    """Load a model.

    Args:
        source: ``"zoo:NAME"`` (a model shipped in the package; a bare zoo name works too), ``"hf:PATH"``
            (a local checkpoint directory, never downloaded: DeepSeek-V4 through transformers,
            DeepSeek-V4.1, ``model_type`` ``deepseek_v41``, through phaselens' own implementation, or any other
            transformers causal LM at a ``stride=`` you give: docs/causal_lm.md), a model object (a transformers
            model, an nnsight envoy or a TransformerLens bridge; :mod:`phaselens.models.objects`), a
            directory written by ``model.save``, or ``"http://HOST:PORT/v1"``: a served model (an
            OpenAI-compatible endpoint of vLLM, SGLang or ``transformers serve``; a black box that
            ``evaluate``, ``repair_table`` and padding probes run on; docs/served.md).
        device: where to put the model (not for a served model).
        kwargs: for ``hf:`` (V4: ``dtype``, ``device_map``, ``layer_types``, ``index_topk``, ``chunk``, ...;
            V4.1: ``dtype``, ``quantize``, ``index_topk``, ``analysis_stride``, ``engram``; another causal LM:
            ``stride`` (required), ``window``, ``origin``, ``dtype``, ``device_map``, ``attn_implementation``, ``strict``),
            for a model object (``stride``, ``window``, ``origin``; V4: ``from_hf``'s keywords), or for a served
            model (``model``, ``tokenizer``, ``stride``, ``concurrency``, ``protocol``, ``timeout``, ``retries``,
            ...: :func:`phaselens.models.served.load_served`). An unknown keyword, or a ``dtype`` that is not a
            floating one, is an :class:`InputError` naming what the source accepts, before anything is read.

    Example:
        >>> model = phaselens.load("zoo:w8s4")  # doctest: +SKIP
        >>> served = phaselens.load("http://127.0.0.1:8000/v1", tokenizer="/data/DeepSeek-V4-Flash")  # doctest: +SKIP
    """
    if not isinstance(source, str | os.PathLike):  # a model object: never a path (its repr is no file name)
        from phaselens.models.objects import ROUTES, adapt_object

        if device != "cpu":
            raise InputError(f"device={device!r} does not apply to a model object: phaselens never moves it (move "
                             "it yourself, e.g. model.to('cuda'), before phaselens.load(model)).")
        out = adapt_object(source, **kwargs)
        if out is None:
            raise InputError(f"load() takes a name, a path, a URL or a model object; got a {type(source).__name__}. "
                             f"Use {ROUTES}.")
        return out
    text = str(source)
    if (kind := by_scheme(text)) is not None and kind.name == "served":
        if device != "cpu":
            raise InputError(f"device={device!r} does not apply to a served model: it runs on its server.")
        accepted = [o for o in kind.load_options() if o != "device"]
        _refuse_unknown(text, kwargs, accepted, _accepts(kind.what, accepted))
        return kind.loader()(text, **kwargs)
    from phaselens.models.compressed.io import resolve_device

    resolve_device(device)  # a GPU this machine lacks is an InputError here, not an AssertionError in torch
    with reading(text.split(":", 1)[-1] if text.startswith(("zoo:", "hf:")) else text):  # name too long, ...
        return _load(text, device, kwargs)


def _load(text: str, device: str, kwargs: dict[str, Any]) -> Any:
    """A string source through the registry (:mod:`phaselens.models.kinds`): its scheme, else the ``model_type``
    of an ``hf:`` directory, else a folder a kind recognises."""
    if not text.startswith(("zoo:", "hf:")) and not Path(text).exists():
        from phaselens.models.zoo import list_models

        # a bare name with no path separator is meant as a zoo name: a ZooError then lists the names
        if text in list_models() or not any(sep in text for sep in ("/", "\\", ".")):
            text = f"zoo:{text}"
    if kwargs and not text.startswith("hf:"):
        raise InputError(
            f"load({text!r}) takes no {sorted(kwargs)}: a zoo model or a saved phaselens model accepts device only "
            "(keyword arguments apply to 'hf:PATH' and served sources); convert it afterwards (e.g. "
            "model.double(), model.to('cuda'))."
        )
    if (kind := by_scheme(text)) is not None:
        return kind.loader()(text.split(":", 1)[1], device=device)
    if text.startswith("hf:"):
        _check_hf_path(text[3:])
        _refuse_phaselens_folder(text[3:])
        model_type = _model_type(Path(text[3:]))
        # no model_type: the DeepSeek-V4 loader says what the folder lacks
        kind = KINDS["deepseek_v4"] if model_type is None else by_model_type(model_type)
        if kind.check is not None:
            resolve(kind.check)(text, kwargs)
        else:
            what = kind.what if ANY_OTHER not in kind.model_types else \
                f"a {model_type!r} checkpoint (a causal LM without compression)"
            _refuse_unknown(text, kwargs, kind.load_options(), _accepts(what, kind.load_options()))
        return kind.loader()(text[3:], device=device, **kwargs)
    path = Path(text)
    if not path.exists():
        hint = ""
        if not path.is_absolute() and len(path.parts) == 2 and not text.startswith("."):  # "org/name": a hub id
            hint = (f" It looks like a Hugging Face repository id: phaselens never downloads; download it first "
                    f"(e.g. `huggingface-cli download {text} --local-dir DIR`), then phaselens.load('hf:DIR').")
        raise CheckpointError(f"no checkpoint at {path}; pass a directory written by model.save(path), 'zoo:NAME', "
                              f"or 'hf:DIR' for a local transformers checkpoint.{hint}")
    model_type = _model_type(path)
    if model_type is not None:
        raise CheckpointError(f"{path} holds a transformers checkpoint (model_type {model_type!r}), not one phaselens "
                              f"saved; load it with phaselens.load('hf:{path}').")
    kind = by_folder(path) or KINDS["saved"]  # not one: the saved-model loader says what is missing
    return kind.loader()(path, device=device)


FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _refuse_unknown(text: str, kwargs: dict[str, Any], accepted: Iterable[str], described: str) -> None:
    """An :class:`InputError` naming the keywords of ``kwargs`` that are not ``accepted`` (a close match
    suggested), and ``described``: what the source accepts."""
    accepted = set(accepted)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(accepted), n=1)
        raise InputError(f"load({text!r}) got the unknown keyword argument(s) {unknown}"
                         f"{f' (did you mean {near[0]!r}?)' if near else ''}; {described}.")


def _accepts(what: str, names: Iterable[str]) -> str:
    return f"{what} accepts {', '.join(sorted(names))}"


def check_deepseek_arguments(text: str, kwargs: dict[str, Any]) -> None:
    """The registry's option check of DeepSeek-V4 and V4.1 checkpoints, before their weights are read: a ``dtype``
    that is a torch dtype must be a floating one of at least 16 bits (names are the loaders' to check), and every
    keyword must be one that a DeepSeek-V4 or V4.1 loader takes (the other's named); then the kind's own check."""
    import torch

    dtype = kwargs.get("dtype")
    if not (dtype is None or isinstance(dtype, str)
            or isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2):
        raise InputError(f"load({text!r}, dtype={dtype!r}): the dtype the model computes in must be a floating one; "
                         f"pass one of {', '.join(f'torch.{d}' for d in FLOAT_DTYPES)} (bfloat16 is the release's). "
                         "Packed FP8/FP4 weights stay packed whatever the dtype.")
    from phaselens.models.deepseek_v4.checkpoint import OPTIONS, check_arguments, config_fields

    v41 = KINDS["deepseek_v41"].load_options()
    if set(kwargs) - {*v41, *OPTIONS}:  # transformers' config fields are imported only then
        v4 = _accepts("a DeepSeek-V4 checkpoint", OPTIONS)
        _refuse_unknown(text, kwargs, {*v41, *OPTIONS, *config_fields()},
                        f"{_accepts('a DeepSeek-V4.1 checkpoint', v41)}; {v4}, and any DeepseekV4Config field as a "
                        "config override (e.g. sliding_window)")
    if _model_type(Path(text[3:])) == "deepseek_v41":
        _refuse_unknown(text, kwargs, v41, _accepts(KINDS["deepseek_v41"].what, v41))
    else:
        check_arguments(kwargs.get("dtype"), {k: v for k, v in kwargs.items() if k != "dtype"},
                        where=f"load({text!r})")


def meta_model(path: str | os.PathLike) -> Any:
    """The model of the local checkpoint directory ``path`` (``hf:`` prefix optional) on the meta device, as
    ``load("hf:PATH")`` would build it (no weights read, no memory): what
    :func:`phaselens.parallel.replicas.replica_device_map` needs before loading. DeepSeek-V4.1 comes in its
    packed layout; anything else is transformers' model."""
    text = str(path)
    root = text[3:] if text.startswith("hf:") else text
    from phaselens.models.deepseek_v41 import is_v41_checkpoint

    if is_v41_checkpoint(root):
        from phaselens.models.deepseek_v41.checkpoint import meta_v41

        return meta_v41(root)
    from phaselens.parallel.replicas import meta_model as transformers_meta

    return transformers_meta(root)


def is_causal_lm_dir(source: str) -> bool:
    """Whether ``source`` is ``hf:DIR`` of a transformers causal LM without compression (what ``load`` adapts at
    a ``stride=``), not DeepSeek-V4 / V4.1."""
    model_type = _model_type(Path(source[3:])) if source.startswith("hf:") else None
    return model_type is not None and ANY_OTHER in by_model_type(model_type).model_types


def _model_type(path: Path) -> str | None:
    """The ``model_type`` of a transformers checkpoint directory (``None``: not one, e.g. a phaselens save)."""
    raw = peek_json(path / "config.json")
    kind = raw.get("model_type") if isinstance(raw, dict) and "format" not in raw else None
    return str(kind) if kind else None


def _refuse_phaselens_folder(rest: str) -> None:
    """``hf:`` pointing at a folder a kind recognises (a model phaselens saved, a training run): say to drop the
    prefix."""
    kind = by_folder(Path(rest)) if Path(rest).is_dir() else None
    if kind is not None:
        raise CheckpointError(f"'hf:{rest}' names {kind.what}, not a transformers checkpoint: load it with "
                              f"phaselens.load({rest!r}), without 'hf:'.")


def _check_hf_path(rest: str) -> None:
    """An ``hf:`` source naming a zoo model (``hf:w4s4``, ``hf:zoo:w4s4``) gets the ``zoo:`` form suggested."""
    from phaselens.models.zoo import list_models

    name = rest[4:] if rest.startswith("zoo:") else rest
    if not Path(rest).exists() and name in list_models():
        raise CheckpointError(f"'hf:{rest}' names a local transformers checkpoint directory, but {name!r} is a zoo "
                              f"model: use phaselens.load('zoo:{name}').")
