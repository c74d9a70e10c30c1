"""Head x residue maps: knockout maps (with the control beside them), patching and attribution.

One orientation everywhere: layer 0 and head 0 at the top (reading order), residues left to right, the
boundary-phase residues outlined. Cells whose value is undefined are marked and explained in the legend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phaselens.plots.theme import (
    DIVERGING,
    TEMPLATE,
    figure,
    head_label,
    mark_boundary,
    mark_undefined,
)

if TYPE_CHECKING:  # annotations only: plots read the result types (a layer below), without importing pandas or scipy
    from phaselens.results.attribution_estimate import PhaseAttribution
    from phaselens.results.patch_recovery import PhasePatch
    from phaselens.results.phase_map import PhaseMap

try:  # the threshold below which a relative change is undefined (a constant of the analysis, for the legend)
    from phaselens.stats.effects import EPS_CLEAN
except ImportError:  # pragma: no cover
    EPS_CLEAN = None


def undefined_reason() -> str:
    """Legend text of an undefined knockout cell."""
    lim = "" if EPS_CLEAN is None else f" {100 * EPS_CLEAN:.0f}%"
    return f"undefined: clean accuracy below{lim} at this residue (no accuracy to lose)"


def _vmax(*arrays: np.ndarray) -> float:
    vals = np.concatenate([np.abs(a[np.isfinite(a)]).ravel() for a in arrays])
    return float(vals.max()) if vals.size and vals.max() > 0 else 1.0


def _colorbar_title(quantity: str) -> str:
    return {"rel_change": "% change", "delta_logit_diff": "Δ logit diff"}.get(quantity, quantity)


def head_phase_heatmap(pm: PhaseMap, *, control: PhaseMap | None = None, quantity: str = "rel_change", names: tuple[str, str] | None = None,
                       title: str | None = None) -> go.Figure:
    """Head x residue knockout effect of a ``PhaseMap``, one row per layer, diverging colours centred at 0.

    With ``control`` (the full-attention control's ``PhaseMap``) the two maps stand side by side on one
    shared colour scale. Hover shows the value, its 95% CI and McNemar p; boundary-phase residues are
    outlined; undefined cells are marked with a grey cross and a legend entry.
    """
    maps = [pm] if control is None else [pm, control]
    names = names or (pm.metadata.get("model", "model"), control.metadata.get("model", "control") if control else "")
    labs = [m.values("head", quantity) for m in maps]
    rows = max(lab.values.shape[0] for lab in labs)
    cols = len(maps)
    titles = [f"{names[c]}: layer {r}" if cols > 1 else f"layer {r}" for r in range(rows) for c in range(cols)]
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, vertical_spacing=0.06, horizontal_spacing=0.08,
                        subplot_titles=titles)
    vmax = _vmax(*(lab.values for lab in labs))
    for c, (m, lab) in enumerate(zip(maps, labs)):
        p = m.values("head", "pvalue").values
        L, H, M = lab.values.shape
        lo = lab.ci_low if lab.ci_low is not None else np.full_like(lab.values, np.nan)
        hi = lab.ci_high if lab.ci_high is not None else np.full_like(lab.values, np.nan)
        for layer in range(L):
            y = [head_label(layer, h) for h in range(H)]
            fig.add_trace(go.Heatmap(
                z=lab.values[layer], x=list(range(M)), y=y, coloraxis="coloraxis", name=names[c],
                customdata=np.stack([lo[layer], hi[layer], p[layer]], -1),
                hovertemplate="%{y}, residue %{x}<br>" + quantity + " %{z:.1f} [%{customdata[0]:.1f}, "
                              "%{customdata[1]:.1f}]<br>p=%{customdata[2]:.3g}<extra></extra>",
            ), layer + 1, c + 1)
            mark_undefined(fig, lab.values[layer], list(range(M)), y, undefined_reason(), row=layer + 1, col=c + 1)
        mark_boundary(fig, m.stride, M, rows=range(1, L + 1), col=c + 1)
    for c in range(cols):
        fig.update_xaxes(title_text="residue of the target key (outlined: boundary phase)", row=rows, col=c + 1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(
        template=TEMPLATE, height=240 + 170 * rows,
        coloraxis=dict(colorscale=DIVERGING, cmid=0, cmin=-vmax, cmax=vmax, colorbar=dict(title=_colorbar_title(quantity))),
        legend=dict(orientation="h", x=0, y=-0.12 - 0.1 / rows, yanchor="top"),
        title=title or (f"Per-head knockout ({pm.method}) by residue: relative accuracy change"
                        + (f", {names[0]} beside the control {names[1]} on one colour scale" if cols > 1 else "")),
    )
    return fig


def layer_knockout_map(pm: PhaseMap, *, control: PhaseMap | None = None, names: tuple[str, str] | None = None,
                       title: str | None = None) -> go.Figure:
    """Layer x residue map of whole-layer knockouts (the paper's DeepSeek-style map); ``control`` beside it."""
    maps = [pm] if control is None else [pm, control]
    names = names or (pm.metadata.get("model", "model"), control.metadata.get("model", "control") if control else "")
    labs = [m.values("layer", "rel_change") for m in maps]
    cols = len(maps)
    fig = make_subplots(rows=1, cols=cols, horizontal_spacing=0.08,
                        subplot_titles=[f"{n}" for n in names[:cols]] if cols > 1 else None)
    vmax = _vmax(*(lab.values for lab in labs))
    for c, (m, lab) in enumerate(zip(maps, labs)):
        y = [f"L{i}" for i in range(lab.values.shape[0])]
        x = list(range(m.modulus))
        fig.add_trace(go.Heatmap(z=lab.values, x=x, y=y, coloraxis="coloraxis", name=names[c],
                                 hovertemplate="%{y}, residue %{x}: %{z:.1f}%<extra></extra>"), 1, c + 1)
        mark_undefined(fig, lab.values, x, y, undefined_reason(), row=1, col=c + 1)
        mark_boundary(fig, m.stride, m.modulus, rows=[1], col=c + 1)
        fig.update_xaxes(title_text="residue of the target key (outlined: boundary phase)", row=1, col=c + 1)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1)
    fig.update_yaxes(autorange="reversed")
    n_layers = max(lab.values.shape[0] for lab in labs)
    fig.update_layout(template=TEMPLATE, height=260 + 45 * n_layers,
                      coloraxis=dict(colorscale=DIVERGING, cmid=0, cmin=-vmax, cmax=vmax, colorbar=dict(title="% change")),
                      legend=dict(orientation="h", x=0, y=-0.35, yanchor="top"),
                      title=title or f"Whole-layer knockout ({pm.method}) by residue: relative accuracy change")
    return fig


def patch_heatmap(res: PhasePatch, *, title: str | None = None) -> go.Figure:
    """Normalized recovery per head and residue from activation patching."""
    lab = res.recovery
    L, H, M = lab.values.shape
    z = lab.values.reshape(L * H, M)
    y = [head_label(layer, h) for layer in range(L) for h in range(H)]
    fig = figure(title or f"Activation patching ({res.direction}): normalized recovery",
                 xaxis_title="residue of the target key", yaxis_title="head")
    fig.add_trace(go.Heatmap(z=z, x=list(range(M)), y=y, zmid=0, colorscale=DIVERGING, colorbar=dict(title="recovery"),
                             hovertemplate="%{y}, residue %{x}: %{z:.2f}<extra></extra>"))
    mark_undefined(fig, z, list(range(M)), y, "undefined: clean and corrupted runs score alike (nothing to recover)")
    stride = getattr(res, "stride", None)
    if stride:
        mark_boundary(fig, stride, M)
    fig.update_yaxes(autorange="reversed")
    return fig


def attribution_heatmap(am: PhaseAttribution, *, title: str | None = None) -> go.Figure:
    """Estimated change of the logit difference per head and residue (a ``PhaseAttribution``)."""
    lab = am.estimate
    L, H, M = lab.values.shape
    rho = "" if am.spearman is None else f" (Spearman with the exact map: {am.spearman:.2f})"
    fig = figure(title or f"Attribution screen ({am.method} knockout): estimated change of the logit difference{rho}",
                 xaxis_title="residue of the target key", yaxis_title="head")
    fig.add_trace(go.Heatmap(z=lab.values.reshape(L * H, M), x=list(range(M)),
                             y=[head_label(layer, h) for layer in range(L) for h in range(H)], zmid=0,
                             colorscale=DIVERGING, colorbar=dict(title="est. delta"),
                             hovertemplate="%{y}, residue %{x}: %{z:.3f}<extra></extra>"))
    stride = getattr(am, "stride", None)
    if stride:
        mark_boundary(fig, stride, M)
    fig.update_yaxes(autorange="reversed")
    return fig


__all__ = ["attribution_heatmap", "head_phase_heatmap", "layer_knockout_map", "patch_heatmap",
           "undefined_reason"]
