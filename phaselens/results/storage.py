"""Results on disk: one safetensors file holding every array, with a JSON skeleton of the rest in its header.

:func:`encode` walks a result (frozen dataclasses, dicts, lists, tuples, NumPy arrays, pandas frames,
tensors, scalars) and puts each array into a flat ``{key: ndarray}`` dict, leaving a JSON-able skeleton
that names them; :func:`decode` rebuilds the same objects. Only the result and value types of the closed
registry (:mod:`phaselens.results.registry`) are rebuilt, each after its fields are checked against its
declaration: nothing in a file chooses code to run, and nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phaselens.errors import CheckpointError, InputError, OutputError, ResultFileError
from phaselens.results.registry import check_fields, name_of, resolve

FORMAT = "phaselens.result/2"
_EARLIER = ("phaselens.result/1",)  # named classes by module path: refused, never rebuilt


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
            return {"__dataclass__": name_of(obj),  # only a registered type (what load can rebuild)
                    "fields": {f.name: self.encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                               if f.init}}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            raise InputError(f"cannot save the NamedTuple {type(obj).__name__} inside a result; use a tuple.")
        if isinstance(obj, dict):
            return {"__dict__": [[self.encode(k), self.encode(v)] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(x) for x in obj]}
        if isinstance(obj, list):
            return [self.encode(x) for x in obj]
        if isinstance(obj, Path):
            return str(obj)
        raise InputError(f"cannot save a {type(obj).__name__} inside a result ({obj!r:.60}).")


def decode(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    """The objects :func:`encode` described (see the module docstring).

    Raises:
        ResultFileError: the skeleton names a type outside :data:`~phaselens.results.registry.TYPES`, a field
            its type does not declare, lacks or mistypes, an array the file does not hold, or is malformed;
            raised before any type is called.
    """
    try:
        return _decode(skeleton, arrays)
    except ResultFileError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as err:
        raise ResultFileError(f"the result file's skeleton is malformed ({type(err).__name__}: {str(err)[:120]}); "
                              "it was edited or damaged: save the result again.") from None


def _decode(skeleton: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(skeleton, list):
        return [_decode(x, arrays) for x in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if len(skeleton) == 0 or not set(skeleton) <= _ENTRIES.get(next(iter(skeleton)), set()):
        raise ResultFileError(f"the result file holds an entry this version cannot read ({sorted(skeleton)[:3]}); "
                              "it was written by another phaselens, or edited: save the result again.")
    if "__array__" in skeleton:
        key = skeleton["__array__"]
        if not isinstance(key, str) or key not in arrays:
            raise ResultFileError(f"the result file's skeleton names the array {str(key)[:40]!r}, which the file "
                                  "does not hold; it was edited or damaged: save the result again.")
        return arrays[key]
    if "__objects__" in skeleton:
        out = np.empty(len(skeleton["__objects__"]), dtype=object)
        out[:] = [_decode(x, arrays) for x in skeleton["__objects__"]]
        return out.reshape([int(n) for n in skeleton["shape"]])
    if "__float__" in skeleton:
        text = skeleton["__float__"]
        if text not in ("nan", "inf", "-inf"):
            raise ResultFileError(f"the result file holds the non-finite float {str(text)[:20]!r}; only nan, inf "
                                  "and -inf are written: save the result again.")
        return float(text)
    if "__tensor__" in skeleton:
        import torch

        return torch.from_numpy(np.array(_decode(skeleton["__tensor__"], arrays)))
    if "__frame__" in skeleton:
        cols = [(_decode(c, arrays), _decode(v, arrays)) for c, v in skeleton["__frame__"]]
        index = _decode(skeleton["index"], arrays)
        return pd.DataFrame({c: v for c, v in cols}, index=index, columns=[c for c, _ in cols])
    if "__dataclass__" in skeleton:
        cls = resolve(skeleton["__dataclass__"])  # the closed registry: refused before anything is called
        fields = skeleton["fields"]
        if not isinstance(fields, dict):
            raise ResultFileError(f"the result file's {cls.__name__} has no fields object; save the result again.")
        values = {k: _decode(v, arrays) for k, v in fields.items()}
        check_fields(cls, values)
        try:
            return cls(**values)
        except Exception as err:  # the type's own checks refuse the values
            raise ResultFileError(f"the result file's {cls.__name__} does not hold a valid {cls.__name__} "
                                  f"({type(err).__name__}: {str(err)[:160]}); save the result again.") from None
    if "__dict__" in skeleton:
        return {_hashable(_decode(k, arrays)): _decode(v, arrays) for k, v in skeleton["__dict__"]}
    return tuple(_decode(x, arrays) for x in skeleton["__tuple__"])


# each entry kind -> the keys it may have (its tag first)
_ENTRIES = {"__array__": {"__array__"}, "__objects__": {"__objects__", "shape"}, "__float__": {"__float__"},
            "__tensor__": {"__tensor__"}, "__frame__": {"__frame__", "index"},
            "__dataclass__": {"__dataclass__", "fields"}, "__dict__": {"__dict__"}, "__tuple__": {"__tuple__"}}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def save_result(result: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``result`` to ``path`` (one file, written beside and renamed into place); an existing file is
    replaced only with ``overwrite=True`` and only if phaselens wrote it as a result (its header proves it:
    the ownership rule of :mod:`phaselens.storage.writing`). Refusals, and what the OS refuses (a full disk, a
    permission), are :class:`~phaselens.errors.OutputError`."""
    from safetensors.numpy import save_file

    from phaselens.storage.writing import write_owned_file

    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path} is a directory; pass a file path such as {str(path / 'result.phaselens')!r}.")
    if os.path.lexists(path) and not overwrite:
        raise OutputError(f"{path} exists; pass overwrite=True to replace it (only a result phaselens saved).")
    if os.path.lexists(path) and _format(path) not in (FORMAT, *_EARLIER):
        raise OutputError(f"{path} exists and is not a phaselens result; phaselens never replaces a file it did "
                          "not write: pass another path.")
    w = _Writer()
    skeleton = w.encode(result)
    from phaselens.storage.checksums import stamped

    meta = stamped({"format": FORMAT, "skeleton": json.dumps(skeleton)}, w.arrays)
    write_owned_file(path, lambda tmp: save_file(w.arrays, str(tmp), metadata=meta), by="result",
                     proves=lambda p: _format(p) in (FORMAT, *_EARLIER), record=False)
    return path


def _format(path: Path) -> str | None:
    from phaselens.storage.resumable import safetensors_metadata

    try:
        return safetensors_metadata(path, fix="").get("format")
    except CheckpointError:
        return None


def _read(path: Path, fix: str, what: str) -> Any:
    """The header metadata or the arrays of a result file; the shared reader's refusal (a checkpoint's error
    class, since it reads weights too) is re-raised as the saved result's own."""
    from phaselens.storage.resumable import load_safetensors, safetensors_metadata

    try:
        if what == "metadata":
            return safetensors_metadata(path, fix=fix)
        return load_safetensors(path, fix=fix, framework="np")
    except CheckpointError as err:
        raise ResultFileError(str(err)) from None


def load_result(path: str | os.PathLike) -> Any:
    """The result :func:`save_result` wrote to ``path``."""
    path = Path(path)
    fix = "pass the path of a result saved with result.save(path)."
    if not path.is_file():
        raise ResultFileError(f"{path} is not a file; {fix}")
    meta = _read(path, fix, "metadata")
    if meta.get("format") in _EARLIER:
        raise ResultFileError(f"{path} was saved by a development version of phaselens whose files named code "
                              "to rebuild; it is not loaded (loading must never run code): run the analysis "
                              "again and save it with this version.")
    if meta.get("format") != FORMAT:
        raise ResultFileError(f"{path} is not a saved phaselens result (format {meta.get('format')!r}); {fix}")
    try:
        skeleton = json.loads(meta["skeleton"])
    except (KeyError, ValueError, RecursionError) as err:
        raise ResultFileError(f"{path} has a damaged header ({type(err).__name__}: {str(err)[:100]}); save the "
                              "result again.") from None
    arrays = _read(path, fix, "arrays")
    return decode(skeleton, arrays)
