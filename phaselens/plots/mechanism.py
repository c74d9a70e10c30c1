"""Mechanism figures: knockout maps, read-side attention, gate profiles, gate cycling, patching."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phaselens.plots.theme import (
    BOUNDARY,
    COMPRESSED,
    CONTROL,
    DIVERGING,
    SEQUENTIAL,
    TEMPLATE,
    figure,
    head_label,
)


def _mark_boundary(fig: go.Figure, stride: int, modulus: int, rows: int) -> None:
    for r in range(stride - 1, modulus, stride):
        for row in range(1, rows + 1):
            fig.add_vrect(x0=r - 0.5, x1=r + 0.5, line=dict(color=BOUNDARY, width=1.5), fillcolor="rgba(0,0,0,0)",
                          row=row, col=1)


def head_phase_heatmap(pm: Any, *, quantity: str = "rel_change", title: str | None = None) -> go.Figure:
    """Head x residue knockout effect of a ``PhaseMap``, one facet per layer, diverging colours centred at 0.

    Hover shows the value, its 95% CI and McNemar p. Boundary-phase residues are outlined.
    """
    lab = pm.values("head", quantity)
    p = pm.values("head", "pvalue").values
    L, H, M = lab.values.shape
    fig = make_subplots(rows=L, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[f"layer {layer}" for layer in range(L)])
    vmax = float(np.nanmax(np.abs(lab.values))) if np.isfinite(lab.values).any() else 1.0
    lo = lab.ci_low if lab.ci_low is not None else np.full_like(lab.values, np.nan)
    hi = lab.ci_high if lab.ci_high is not None else np.full_like(lab.values, np.nan)
    for layer in range(L):
        custom = np.stack([lo[layer], hi[layer], p[layer]], -1)
        fig.add_trace(go.Heatmap(
            z=lab.values[layer], x=list(range(M)), y=[head_label(layer, h) for h in range(H)],
            zmid=0, zmin=-vmax, zmax=vmax, colorscale=DIVERGING, showscale=layer == 0, customdata=custom,
            colorbar=dict(title="% change" if quantity == "rel_change" else quantity),
            hovertemplate="%{y}, residue %{x}<br>" + quantity + " %{z:.1f} [%{customdata[0]:.1f}, %{customdata[1]:.1f}]"
                          "<br>p=%{customdata[2]:.3g}<extra></extra>",
        ), layer + 1, 1)
    _mark_boundary(fig, pm.stride, M, L)
    fig.update_xaxes(title_text="residue of the target key (outlined: boundary phase)", row=L, col=1)
    fig.update_layout(template=TEMPLATE, height=220 + 160 * L,
                      title=title or f"Per-head knockout ({pm.method}) by residue: relative accuracy change")
    return fig


def layer_knockout_map(pm: Any, *, title: str | None = None) -> go.Figure:
    """Layer x residue map of whole-layer knockouts (the paper's DeepSeek-style map)."""
    lab = pm.values("layer", "rel_change")
    vmax = float(np.nanmax(np.abs(lab.values))) if np.isfinite(lab.values).any() else 1.0
    fig = figure(title or f"Whole-layer knockout ({pm.method}) by residue",
                 xaxis_title="residue of the target key", yaxis_title="layer")
    fig.add_trace(go.Heatmap(z=lab.values, x=list(range(pm.modulus)), y=[f"L{i}" for i in range(lab.values.shape[0])],
                             zmid=0, zmin=-vmax, zmax=vmax, colorscale=DIVERGING, colorbar=dict(title="% change"),
                             hovertemplate="%{y}, residue %{x}: %{z:.1f}%<extra></extra>"))
    return fig


def read_side_attention(rec: Any, quantity: str = "key_entries", *, title: str | None = None) -> go.Figure:
    """Attention mass at the query on the entries holding the target key, layer facets of head x residue."""
    lab = rec.read[quantity]
    layers = [int(x) for x in lab.coords["layer"]]
    L, H, M = lab.values.shape
    fig = make_subplots(rows=L, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[f"layer {layer}" for layer in layers])
    for i, layer in enumerate(layers):
        fig.add_trace(go.Heatmap(z=lab.values[i], x=list(range(M)), y=[head_label(layer, h) for h in range(H)],
                                 colorscale=SEQUENTIAL, zmin=0, showscale=i == 0, colorbar=dict(title="mass"),
                                 hovertemplate="%{y}, residue %{x}: %{z:.3f}<extra></extra>"), i + 1, 1)
    _mark_boundary(fig, rec.stride, M, L)
    fig.update_xaxes(title_text="residue of the target key", row=L, col=1)
    fig.update_layout(template=TEMPLATE, height=220 + 160 * L,
                      title=title or f"Read side: attention mass on {quantity.replace('_', ' ')}")
    return fig


def gate_profiles(rec: Any, *, title: str | None = None) -> go.Figure:
    """Mean gate weight E[alpha] per window offset: offset x KV-head heatmaps, one per (layer, path)."""
    lab = rec.gate_profile
    if lab is None:
        return figure(title or "Gate profiles: no compressed layers")
    layers, paths = list(lab.coords["layer"]), list(lab.coords["path"])
    panels = [(li, pi) for li in range(len(layers)) for pi in range(len(paths))]
    names = {"k": "key gates", "v": "value gates", "kv": "K=V gates"}
    fig = make_subplots(rows=len(panels), cols=1, vertical_spacing=0.08,
                        subplot_titles=[f"layer {layers[li]}, {names.get(paths[pi], paths[pi])}" for li, pi in panels])
    for n, (li, pi) in enumerate(panels):
        z = lab.values[li, pi]  # [kv_head, offset]
        fig.add_trace(go.Heatmap(z=z, x=list(lab.coords["offset"]), y=[f"KV{k}" for k in lab.coords["kv_head"]],
                                 colorscale=SEQUENTIAL, zmin=0, zmax=1, showscale=n == 0, colorbar=dict(title="E[alpha]"),
                                 hovertemplate="%{y}, offset %{x}: %{z:.3f}<extra></extra>"), n + 1, 1)
    fig.update_xaxes(title_text="offset inside the window", row=len(panels), col=1)
    fig.update_layout(template=TEMPLATE, height=200 + 150 * len(panels), title=title or "Write side: gate profiles")
    return fig


def gate_concentration(rec: Any, *, title: str | None = None) -> go.Figure:
    """Static exp(H(E[alpha])) against per-window E[exp(H(alpha))], one point per (layer, path, KV head)."""
    lab = rec.concentration
    fig = figure(title or "Gate concentration (1 = one offset, W = uniform)",
                 xaxis_title="static: exp(H(E[alpha]))", yaxis_title="per window: E[exp(H(alpha))]")
    if lab is None:
        return fig
    for pi, path in enumerate(lab.coords["path"]):
        xs, ys, text = [], [], []
        for li, layer in enumerate(lab.coords["layer"]):
            for k in lab.coords["kv_head"]:
                xs.append(lab.values[li, pi, k, 0])
                ys.append(lab.values[li, pi, k, 1])
                text.append(f"L{layer} KV{k} ({path})")
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=f"{path} gates", text=text, marker=dict(size=10),
                                 hovertemplate="%{text}<br>static %{x:.2f}, per window %{y:.2f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[1, np.nanmax(lab.values)], y=[1, np.nanmax(lab.values)], mode="lines",
                             line=dict(color=CONTROL, dash="dot"), name="equal"))
    return fig


def gate_cycling_scatter(res: Any, *, title: str | None = None) -> go.Figure:
    """Observed A_delta(p) against predicted A_0((p - delta) mod S), with R^2 (boundary phase separate)."""
    f = res.frame
    fig = figure(title or f"Gate cycling: R^2 = {res.r2:.2f} without the boundary phase ({res.r2_all:.2f} with it)",
                 xaxis_title="predicted: A_0((p - delta) mod S)", yaxis_title="observed: A_delta(p)")
    for is_b, color, name in ((False, COMPRESSED, "non-boundary phases"), (True, BOUNDARY, "boundary phase")):
        sub = f[f["boundary"] == is_b]
        fig.add_trace(go.Scatter(x=sub["predicted"], y=sub["observed"], mode="markers", name=name,
                                 marker=dict(color=color, size=9), customdata=np.stack([sub["delta"], sub["phase"]], -1),
                                 hovertemplate="delta %{customdata[0]}, phase %{customdata[1]}<br>"
                                               "predicted %{x:.3f}, observed %{y:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(color=CONTROL, dash="dot"), name="identity"))
    fig.update_xaxes(range=[0, 1.02])
    fig.update_yaxes(range=[0, 1.02])
    return fig


def patch_heatmap(res: Any, *, title: str | None = None) -> go.Figure:
    """Normalized recovery per head and residue from activation patching."""
    lab = res.recovery
    L, H, M = lab.values.shape
    z = lab.values.reshape(L * H, M)
    fig = figure(title or f"Activation patching ({res.direction}): normalized recovery",
                 xaxis_title="residue of the target key", yaxis_title="head")
    fig.add_trace(go.Heatmap(z=z, x=list(range(M)), y=[head_label(layer, h) for layer in range(L) for h in range(H)],
                             zmid=0, colorscale=DIVERGING, colorbar=dict(title="recovery"),
                             hovertemplate="%{y}, residue %{x}: %{z:.2f}<extra></extra>"))
    return fig


def attribution_heatmap(am: Any, *, title: str | None = None) -> go.Figure:
    """Estimated change of the logit difference per head and residue (an ``AttributionMap``)."""
    lab = am.estimate
    L, H, M = lab.values.shape
    rho = "" if am.spearman is None else f" (Spearman with the exact map: {am.spearman:.2f})"
    fig = figure(title or f"Attribution screen ({am.method} knockout): estimated change of the logit difference{rho}",
                 xaxis_title="residue of the target key", yaxis_title="head")
    fig.add_trace(go.Heatmap(z=lab.values.reshape(L * H, M), x=list(range(M)),
                             y=[head_label(layer, h) for layer in range(L) for h in range(H)], zmid=0,
                             colorscale=DIVERGING, colorbar=dict(title="est. delta"),
                             hovertemplate="%{y}, residue %{x}: %{z:.3f}<extra></extra>"))
    return fig
