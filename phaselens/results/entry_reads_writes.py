"""The result of ``record``: what a model reads from compressed entries and how its compressors write them (:class:`PhaseRecording`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phaselens.core.labelled import Labelled
from phaselens.results.base import Result
from phaselens.stats.by_residue import residue_mean_ci

READ_QUANTITIES = ("key_entries", "value_entries", "other_entries", "entries", "local", "sink")


@dataclass(frozen=True, repr=False, eq=False)
class PhaseRecording(Result):
    """What a model reads from compressed entries and how its compressors write them.

    Attributes:
        read: attention mass at the query position, per quantity (``key_entries``: entries that contain the
            target key; ``value_entries``: those that contain its value; ``other_entries``; ``entries``: all
            entries (key and value entries may coincide, so these overlap); ``local``: raw
            tokens in the local window; ``sink``), each ``Labelled[layer, head, residue]`` with 95% CIs.
            Layers without compression hold NaN for the entry quantities and their full-attention mass in
            ``local``.
        gate_key, gate_value: gate weight on the target key's / value's offsets inside the entries that
            contain it (mean over those entries and channels), ``Labelled[layer, kv_head, residue]``.
        gate_profile: mean gate weight E[alpha] per window offset, ``Labelled[layer, path, kv_head, offset]``
            (path ``k``/``v``, or ``kv`` when K = V).
        concentration: ``Labelled[layer, path, kv_head, measure]`` with ``measure`` in
            (``static``: exp(H(E[alpha])), ``per_window``: E[exp(H(alpha))]), each between 1 and W.
        stride, modulus, n_items, metadata.
        values: per-item values behind the means: ``{quantity: [N, layer, head]}`` (read side) and
            ``{"gate_key" | "gate_value": [N, compressed layer, kv_head]}``; residue: ``[N]``.
    """

    read: dict[str, Labelled]
    gate_key: Labelled | None
    gate_value: Labelled | None
    gate_profile: Labelled | None
    concentration: Labelled | None
    stride: int
    modulus: int
    n_items: int
    values: dict[str, np.ndarray] = field(default_factory=dict)
    residue: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    metadata: dict[str, Any] = field(default_factory=dict)

    LEVELS = ("residue", "phase", "model")
    COLUMNS = {
        "residue": ("quantity", "layer", "residue", "phase", "value", "ci_low", "ci_high"),
        "phase": ("quantity", "layer", "phase", "value", "ci_low", "ci_high", "boundary"),
        "model": ("quantity", "layer", "value"),
    }

    def per_residue(self) -> pd.DataFrame:
        """Every per-residue quantity (read side and target gate weights) as tidy rows: ``quantity``, its
        dims, ``residue``, ``phase``, ``value``, ``ci_low``, ``ci_high``."""
        parts = [lab.to_frame() for lab in self.read.values()]
        parts += [lab.to_frame() for lab in (self.gate_key, self.gate_value) if lab is not None]
        out = pd.concat(parts, ignore_index=True)
        out.insert(out.columns.get_loc("residue") + 1, "phase", out["residue"] % self.stride)
        if self.residue.size:  # only the residues recorded (all, unless residues=... was passed)
            out = out[out["residue"].isin(np.unique(self.residue))].reset_index(drop=True)
        return out

    def per_phase(self) -> pd.DataFrame:
        """The same quantities with residues folded mod S (means over each phase's items, t intervals)."""
        phase = self.residue % self.stride
        parts = []
        for name, arr in self.values.items():
            m, lo, hi = residue_mean_ci(arr, phase, self.stride)  # [a, b, S]
            lab = self.read.get(name) or (self.gate_key if name == "gate_key" else self.gate_value)
            dims = (*lab.dims[:-1], "phase")
            coords = {**{d: lab.coords[d] for d in lab.dims[:-1]}, "phase": np.arange(self.stride)}
            parts.append(Labelled(m, dims, coords, lo, hi, name=lab.name).to_frame())
        out = pd.concat(parts, ignore_index=True)
        out["boundary"] = out["phase"] == self.stride - 1
        if phase.size:  # only the phases recorded
            out = out[out["phase"].isin(np.unique(phase))].reset_index(drop=True)
        return out

    def per_model(self) -> pd.DataFrame:
        """Quantities without a residue axis: gate profiles by offset and gate concentration."""
        parts = [lab.to_frame() for lab in (self.gate_profile, self.concentration) if lab is not None]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(self.COLUMNS["model"]))

    def summary(self) -> str:
        lay = self.read["local"].coords["layer"].tolist()
        return (
            f"PhaseRecording({self.n_items} items, layers {list(lay)}, stride {self.stride}, residues mod {self.modulus}; "
            f"read: {', '.join(self.read)}; write: "
            f"{'gate weights, profiles, concentration' if self.gate_profile is not None else 'none (no compressed layers)'})"
        )

    def plot(self, kind: str = "read", **kwargs: Any):
        return self._figure("read_side_attention" if kind == "read" else "gate_profiles", **kwargs)
