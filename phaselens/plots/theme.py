"""One theme for every phaselens figure, and label helpers ("L3H1", "phase 2 (boundary)")."""

from __future__ import annotations

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
