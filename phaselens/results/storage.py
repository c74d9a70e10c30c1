"""Results on disk: one safetensors file holding every array, with a JSON skeleton of the rest in its header.

:func:`encode` walks a result (frozen dataclasses, dicts, lists, tuples, NumPy arrays, pandas frames,
tensors, scalars) and puts each array into a flat ``{key: ndarray}`` dict, leaving a JSON-able skeleton
that names them; :func:`decode` rebuilds the same objects. Only phaselens' own dataclasses are rebuilt (the
skeleton names a class; anything outside ``phaselens.`` is refused), and nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.errors import CheckpointError, InputError, OutputError

FORMAT = "phaselens.result/1"


class _Writer:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, a: np.ndarray) -> dict[str, Any]:
        if a.dtype.kind in "OUS":  # strings and objects: JSON, element by element
            return {"__objects__": [self.encode(x) for x in a.ravel().tolist()], "shape": list(a.shape)}
        key = f"a{len(self.arrays)}"
        self.arrays[key] = np.ascontiguousarray(a)
        return {"__array__": key}

    def encode(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, bool | str):
            return obj
        if isinstance(obj, np.generic):
            return self.encode(obj.item())
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, np.ndarray):
            return self.array(obj)
        if type(obj).__module__.startswith("torch") and hasattr(obj, "detach"):
            return {"__tensor__": self.array(obj.detach().cpu().numpy())}
        if isinstance(obj, pd.DataFrame):
            return {"__frame__": [[self.encode(c), self.encode(obj[c].to_numpy())] for c in obj.columns],
                    "index": self.encode(obj.index.to_numpy())}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {"__dataclass__": _class_name(obj),
                    "fields": {f.name: self.encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                               if f.init}}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
            return {"__namedtuple__": _class_name(obj), "fields": [self.encode(x) for x in obj]}
        if isinstance(obj, dict):
            return {"__dict__": [[self.encode(k), self.encode(v)] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(x) for x in obj]}
        if isinstance(obj, list):
            return [self.encode(x) for x in obj]
        if isinstance(obj, Path):
            return str(obj)
        raise InputError(f"cannot save a {type(obj).__name__} inside a result ({obj!r:.60}).")


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _class(name: str) -> type:
    module, _, qual = name.partition(":")
    if not module.startswith("phaselens.") or not qual:
        raise CheckpointError(f"a saved result names the class {name!r}, which is not phaselens'; phaselens only "
                              "rebuilds its own result types.")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def decode(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The objects :func:`encode` described (see the module docstring)."""
    if isinstance(skeleton, list):
        return [decode(x, arrays) for x in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__array__" in skeleton:
        return arrays[skeleton["__array__"]]
    if "__objects__" in skeleton:
        out = np.empty(len(skeleton["__objects__"]), dtype=object)
        out[:] = [decode(x, arrays) for x in skeleton["__objects__"]]
        return out.reshape(skeleton["shape"])
    if "__float__" in skeleton:
        return float(skeleton["__float__"])
    if "__tensor__" in skeleton:
        import torch

        return torch.from_numpy(np.array(decode(skeleton["__tensor__"], arrays)))
    if "__frame__" in skeleton:
        cols = [(decode(c, arrays), decode(v, arrays)) for c, v in skeleton["__frame__"]]
        index = decode(skeleton["index"], arrays)
        return pd.DataFrame({c: v for c, v in cols}, index=index, columns=[c for c, _ in cols])
    if "__dataclass__" in skeleton:
        cls = _class(skeleton["__dataclass__"])
        return cls(**{k: decode(v, arrays) for k, v in skeleton["fields"].items()})
    if "__namedtuple__" in skeleton:
        return _class(skeleton["__namedtuple__"])(*(decode(x, arrays) for x in skeleton["fields"]))
    if "__dict__" in skeleton:
        return {_hashable(decode(k, arrays)): decode(v, arrays) for k, v in skeleton["__dict__"]}
    if "__tuple__" in skeleton:
        return tuple(decode(x, arrays) for x in skeleton["__tuple__"])
    raise CheckpointError(f"a saved result holds an entry this version cannot read ({sorted(skeleton)[:3]}).")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def save_result(result: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``result`` to ``path`` (one file, written beside and renamed into place); an existing file is
    replaced only with ``overwrite=True`` and only if phaselens wrote it as a result (its header proves it:
    the ownership rule of :mod:`phaselens.runtime.files`). Refusals, and what the OS refuses (a full disk, a
    permission), are :class:`~phaselens.core.errors.OutputError`."""
    from safetensors.numpy import save_file

    from phaselens.runtime.files import write_owned_file

    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path} is a directory; pass a file path such as {str(path / 'result.phaselens')!r}.")
    if os.path.lexists(path) and not overwrite:
        raise OutputError(f"{path} exists; pass overwrite=True to replace it (only a result phaselens saved).")
    if os.path.lexists(path) and _format(path) != FORMAT:
        raise OutputError(f"{path} exists and is not a phaselens result; phaselens never replaces a file it did "
                          "not write: pass another path.")
    w = _Writer()
    skeleton = w.encode(result)
    meta = {"format": FORMAT, "skeleton": json.dumps(skeleton)}
    write_owned_file(path, lambda tmp: save_file(w.arrays, str(tmp), metadata=meta), by="result",
                     proves=lambda p: _format(p) == FORMAT, record=False)
    return path


def _format(path: Path) -> str | None:
    from phaselens.runtime.checkpoints import safetensors_metadata

    try:
        return safetensors_metadata(path, fix="").get("format")
    except CheckpointError:
        return None


def load_result(path: str | os.PathLike) -> Any:
    """The result :func:`save_result` wrote to ``path``."""
    from phaselens.runtime.checkpoints import load_safetensors, safetensors_metadata

    path = Path(path)
    fix = "pass the path of a result saved with result.save(path)."
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file; {fix}")
    meta = safetensors_metadata(path, fix=fix)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a saved phaselens result (format {meta.get('format')!r}); {fix}")
    try:
        skeleton = json.loads(meta["skeleton"])
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"{path} has a damaged header ({err}); save the result again.") from None
    arrays = load_safetensors(path, fix=fix, framework="np")
    return decode(skeleton, arrays)
