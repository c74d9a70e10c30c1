"""``Labelled``: a NumPy array with named axes and coordinates, plus optional CI bounds (Penzai-style).

Results carry quantities such as attention mass as ``Labelled`` arrays with dims like
``("layer", "head", "residue")`` so that code selects by name, never by remembered axis order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from phaselens.errors import LabelError


def _take(a: np.ndarray | None, idx: int, axis: int) -> np.ndarray | None:
    return None if a is None else np.take(a, idx, axis=axis)


@dataclass(frozen=True, eq=False)
class Labelled:
    """Values with named dims. ``coords[dim]`` labels each index along ``dim``.

    Attributes:
        values: the estimates, shape ``[len(coords[d]) for d in dims]``.
        dims: axis names.
        coords: labels per axis.
        ci_low, ci_high: optional confidence bounds, same shape as ``values``.
        name: what the values are.
    """

    values: np.ndarray
    dims: tuple[str, ...]
    coords: dict[str, np.ndarray]
    ci_low: np.ndarray | None = None
    ci_high: np.ndarray | None = None
    name: str = "value"

    def __post_init__(self) -> None:
        shape = tuple(len(self.coords[d]) for d in self.dims)
        if self.values.shape != shape:
            raise ValueError(f"{self.name}: values have shape {self.values.shape}, coords imply {shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def axis(self, dim: str) -> int:
        return self.dims.index(dim)

    def sel(self, **labels: Any) -> Labelled:
        """Select one label along each named dim (that dim disappears)."""
        out = self
        for dim, label in labels.items():
            if dim not in out.dims:
                raise LabelError(f"{self.name} has no dim {dim!r}; dims are {out.dims}.")
            ax = out.axis(dim)
            hits = np.flatnonzero(out.coords[dim] == label)
            if not len(hits):
                raise LabelError(f"{self.name}: no {dim}={label!r}; {dim} labels are {out.coords[dim].tolist()}.")
            idx = int(hits[0])
            out = Labelled(
                np.take(out.values, idx, axis=ax),
                tuple(d for d in out.dims if d != dim),
                {d: c for d, c in out.coords.items() if d != dim},
                _take(out.ci_low, idx, ax),
                _take(out.ci_high, idx, ax),
                out.name,
            )
        return out

    def to_frame(self) -> pd.DataFrame:
        """Tidy rows: one column per dim, then ``value`` (and ``ci_low`` / ``ci_high``)."""
        grids = np.meshgrid(*[self.coords[d] for d in self.dims], indexing="ij")
        data = {d: g.ravel() for d, g in zip(self.dims, grids)}
        data["quantity"] = self.name
        data["value"] = self.values.ravel()
        if self.ci_low is not None and self.ci_high is not None:
            data["ci_low"] = self.ci_low.ravel()
            data["ci_high"] = self.ci_high.ravel()
        return pd.DataFrame(data)

    def __repr__(self) -> str:
        dims = ", ".join(f"{d}={len(self.coords[d])}" for d in self.dims)
        return f"Labelled({self.name}: {dims})"
