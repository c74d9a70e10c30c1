"""One theme for every phaselens figure, and label helpers ("L3H1", "phase 2 (boundary)")."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

TEMPLATE = "phaselens"
DIVERGING = "RdBu"  # negative (damage) red, positive blue
SEQUENTIAL = "Viridis"
COMPRESSED = "#1f5fa8"
CONTROL = "#7f7f7f"
BOUNDARY = "#c0392b"
CYCLE_COLORS = ["#1f5fa8", "#2e8b57", "#8e44ad", "#d35400", "#16a085", "#7f8c8d", "#c0392b", "#2c3e50"]

pio.templates[TEMPLATE] = go.layout.Template(
    layout=dict(
        font=dict(family="Inter, Helvetica, Arial, sans-serif", size=13),
        paper_bgcolor="white",
        plot_bgcolor="white",
        colorway=CYCLE_COLORS,
        xaxis=dict(showgrid=True, gridcolor="#eeeeee", zeroline=False, ticks="outside"),
        yaxis=dict(showgrid=True, gridcolor="#eeeeee", zeroline=False, ticks="outside"),
        legend=dict(bgcolor="rgba(255,255,255,0.8)"),
        margin=dict(l=70, r=30, t=70, b=60),
        title=dict(x=0.02, xanchor="left"),
    )
)


def head_label(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def phase_label(phase: int, stride: int) -> str:
    return f"phase {phase} (boundary)" if phase == stride - 1 else f"phase {phase}"


def figure(title: str, **layout) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(template=TEMPLATE, title=title, **layout)
    return fig


UNDEFINED = "#9a9a9a"  # grey crosses on cells whose value is undefined


def mark_boundary(fig: go.Figure, stride: int, modulus: int, *, rows: Any = None, col: int | None = None) -> None:
    """Outline the boundary-phase residues (r mod S = S - 1) of a residue x-axis, in each of ``rows`` (subplots)."""
    for r in range(stride - 1, modulus, stride):
        kw = dict(x0=r - 0.5, x1=r + 0.5, line=dict(color=BOUNDARY, width=1.5), fillcolor="rgba(0,0,0,0)")
        if rows is None:
            fig.add_vrect(**kw)
        else:
            for row in rows:
                fig.add_vrect(**kw, row=row, col=col or 1)


def mark_undefined(fig: go.Figure, z: np.ndarray, x: list[Any], y: list[Any], reason: str, *,
                   row: int | None = None, col: int | None = None) -> None:
    """Grey crosses on the NaN cells of heatmap ``z`` ``[len(y), len(x)]``, with one legend entry saying why."""
    rr, cc = np.nonzero(~np.isfinite(np.asarray(z, dtype=float)))
    if rr.size == 0:
        return
    first = not any(getattr(t, "legendgroup", None) == "undefined" for t in fig.data)
    trace = go.Scatter(x=[x[c] for c in cc], y=[y[r] for r in rr], mode="markers", name=reason,
                       legendgroup="undefined", showlegend=first,
                       marker=dict(symbol="x-thin", size=10, line=dict(width=2, color=UNDEFINED)),
                       hovertemplate="%{y}, residue %{x}: " + reason + "<extra></extra>")
    if row is None:
        fig.add_trace(trace)
    else:
        fig.add_trace(trace, row, col)
    fig.update_layout(showlegend=True)
