"""Mechanism figures: read-side attention, gate profiles and concentration, gate cycling."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    mark_boundary,
)

if TYPE_CHECKING:  # annotations only: plots read the result types (a layer below), without importing pandas or scipy
    from phaselens.results.entry_reads_writes import PhaseRecording
    from phaselens.results.gate_cycling import PhaseGateCycling


def read_side_attention(rec: PhaseRecording, quantity: str = "key_entries", *, title: str | None = None) -> go.Figure:
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
    mark_boundary(fig, rec.stride, M, rows=range(1, L + 1))
    fig.update_xaxes(title_text="residue of the target key (outlined: boundary phase)", row=L, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(template=TEMPLATE, height=220 + 160 * L,
                      title=title or f"Read side: attention mass on {quantity.replace('_', ' ')}")
    return fig


def gate_profiles(rec: PhaseRecording, *, title: str | None = None) -> go.Figure:
    """Mean gate weight E[alpha] per window offset relative to uniform pooling (1/W): one panel per (layer, path).

    Colour is log2(W * E[alpha]) on a diverging scale centred at uniform (white), labelled as multiples of
    1/W, so gates that sit near 1/W read as near-white instead of one flat colour on a 0..1 scale. Each
    panel uses its own layer's window W; hover shows E[alpha] itself.
    """
    lab = rec.gate_profile
    if lab is None:
        return figure(title or "Gate profiles: no compressed layers")
    layers, paths = list(lab.coords["layer"]), list(lab.coords["path"])
    names = {"k": "key gates", "v": "value gates", "kv": "K=V gates"}
    rows, cols = len(layers), len(paths)
    height = 170 + 190 * rows
    # room between panels for the upper panel's offset ticks and the lower panel's title (in pixels)
    gap = min(0.4, 95 / (height - 130))
    fig = make_subplots(rows=rows, cols=cols, vertical_spacing=gap, horizontal_spacing=0.08,
                        subplot_titles=[f"layer {layers[li]}, {names.get(paths[pi], paths[pi])}"
                                        for li in range(rows) for pi in range(cols)])
    ratios = []
    for li in range(rows):
        for pi in range(cols):
            z = lab.values[li, pi]  # [kv_head, offset]; offsets past this layer's window are NaN
            W = int(np.isfinite(z).all(0).sum()) or z.shape[-1]
            ratio = np.log2(np.clip(W * z[:, :W], 2.0**-6, None))  # log2 of E[alpha] / (1/W)
            ratios.append(ratio)
            offsets = [int(o) for o in lab.coords["offset"][:W]]
            fig.add_trace(go.Heatmap(
                z=ratio, x=offsets, y=[f"KV{k}" for k in lab.coords["kv_head"]], coloraxis="coloraxis",
                customdata=np.stack([z[:, :W], np.full_like(z[:, :W], 1 / W)], -1),
                hovertemplate="%{y}, offset %{x}: E[alpha] %{customdata[0]:.3f} (uniform 1/W = %{customdata[1]:.3f})"
                              "<extra></extra>"), li + 1, pi + 1)
            fig.update_xaxes(tickmode="array", tickvals=offsets, ticktext=[str(o) for o in offsets], row=li + 1, col=pi + 1)
    span = max(1.0, float(np.ceil(max(np.nanmax(np.abs(r)) for r in ratios))))
    ticks = np.arange(-span, span + 1)
    text = ["1/W (uniform)" if t == 0 else f"{2.0 ** t:g}/W" for t in ticks]  # 0.5/W, 1/W, 2/W, ...
    for pi in range(cols):
        fig.update_xaxes(title_text="offset inside the window", row=rows, col=pi + 1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(template=TEMPLATE, height=height,
                      coloraxis=dict(colorscale=DIVERGING, cmid=0, cmin=-span, cmax=span,
                                     colorbar=dict(title="E[alpha]<br>(log scale)", tickvals=ticks.tolist(),
                                                   ticktext=text)),
                      title=title or "Write side: gate profiles, mean gate weight per offset relative to uniform (1/W)")
    return fig


def gate_concentration(rec: PhaseRecording, *, title: str | None = None) -> go.Figure:
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


def r2_note(r2: float) -> str:
    """What an R^2 value says about gate cycling, in words (a negative R^2 is common and needs saying)."""
    if not np.isfinite(r2):
        return ("R^2 undefined: the observed accuracies do not vary over the phases, so the test cannot tell "
                "whether the weak phases move with the gates")
    if r2 < 0:
        return (f"R^2 = {r2:.2f} < 0: the cycled prediction fits worse than a flat line at the mean accuracy, "
                "so the weak phases did not move with the gates")
    return f"R^2 = {r2:.2f}: the cycled prediction explains {100 * r2:.0f}% of the variance of the observed accuracy"


def gate_cycling_scatter(res: PhaseGateCycling, *, title: str | None = None) -> go.Figure:
    """Observed A_delta(p) against predicted A_0((p - delta) mod S), with R^2 (boundary phase separate).

    R^2 = 1 - SS_res / SS_tot around the identity line; it is negative when the prediction is worse than
    the observed mean, which the title then says in words.
    """
    f = res.frame
    head = (f"Gate cycling: R^2 = {res.r2:.2f} without the boundary phase ({res.r2_all:.2f} with it)"
            if np.isfinite(res.r2) else
            "Gate cycling: R^2 undefined (the observed accuracy does not vary over the phases: no finding)")
    if res.r2 < 0:
        head += "<br><sup>R^2 < 0: predicting A_0((p - delta) mod S) fits worse than a flat line at the mean</sup>"
    fig = figure(title or head, xaxis_title="predicted: A_0((p - delta) mod S)", yaxis_title="observed: A_delta(p)")
    for is_b, color, name in ((False, COMPRESSED, "non-boundary phases"), (True, BOUNDARY, "boundary phase")):
        sub = f[f["boundary"] == is_b]
        fig.add_trace(go.Scatter(x=sub["predicted"], y=sub["observed"], mode="markers", name=name,
                                 marker=dict(color=color, size=9), customdata=np.stack([sub["delta"], sub["phase"]], -1),
                                 hovertemplate="delta %{customdata[0]}, phase %{customdata[1]}<br>"
                                               "predicted %{x:.3f}, observed %{y:.3f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(color=CONTROL, dash="dot"), name="identity"))
    fig.update_xaxes(range=[0, 1.02])
    fig.update_yaxes(range=[0, 1.02])
    if res.r2 < 0:
        fig.update_layout(margin=dict(t=95))
    return fig
