"""Phase-sensitivity figures: accuracy by residue, phase rose, periodicity panel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from phaselens.errors import InputError
from phaselens.plots.theme import BOUNDARY, COMPRESSED, CONTROL, CYCLE_COLORS, TEMPLATE, figure, phase_label

if TYPE_CHECKING:  # annotations only: plots read the result types (a layer below), without importing pandas or scipy
    from phaselens.results.ablation_effects import PhaseAblation
    from phaselens.results.phase_eval import PhaseEval
    from phaselens.results.repair_rules import PhaseRepairTable


def accuracy_by_residue(ev: PhaseEval, control: PhaseEval | None = None, *, title: str | None = None, name: str | None = None) -> go.Figure:
    """Accuracy against phase with Wilson 95% bars, one line per cycle of S residues (``PhaseEval``).

    Residues ``c*S .. c*S + S - 1`` form cycle ``c``; lines that coincide show the effect is periodic in S.
    A full-attention ``control`` (another ``PhaseEval``) is overlaid as a grey band of its per-phase mean.
    """
    if control is not None and not callable(getattr(control, "per_phase", None)):
        raise InputError(f"control must be the PhaseEval of a full-attention control (or None), got "
                         f"{type(control).__name__} {control!r:.40}.")
    pr = ev.per_residue()
    S = ev.stride
    fig = figure(title or f"Accuracy by phase: {name or ev.metadata.get('model', 'model')}",
                 xaxis_title="phase of the target key (slot mod S)", yaxis_title="accuracy")
    ticks = [phase_label(p, S) for p in range(S)]
    for c in range(ev.modulus // S):
        sub = pr[(pr["residue"] // S) == c]
        if sub.empty:  # a cycle with no residue evaluated (evaluate(..., residues=[...]))
            continue
        fig.add_trace(go.Scatter(
            x=[ticks[p] for p in sub["phase"]], y=sub["acc"], mode="lines+markers",
            name=f"residues {c * S}-{c * S + S - 1}", line=dict(color=CYCLE_COLORS[c % len(CYCLE_COLORS)], width=1.5),
            error_y=dict(type="data", symmetric=False, array=sub["ci_high"] - sub["acc"],
                         arrayminus=sub["acc"] - sub["ci_low"], thickness=1),
            customdata=np.stack([sub["residue"], sub["n"], sub["ci_low"], sub["ci_high"]], -1),
            hovertemplate="residue %{customdata[0]}<br>acc %{y:.3f} [%{customdata[2]:.3f}, %{customdata[3]:.3f}]"
                          "<br>n %{customdata[1]}<extra></extra>",
        ))
    if control is not None:
        cp = control.per_phase()
        fig.add_trace(go.Scatter(x=[ticks[p] for p in cp["phase"]], y=cp["acc"], mode="lines+markers",
                                 name="full-attention control", line=dict(color=CONTROL, width=3, dash="dash"),
                                 error_y=dict(type="data", symmetric=False, array=cp["ci_high"] - cp["acc"],
                                              arrayminus=cp["acc"] - cp["ci_low"])))
    fig.add_vrect(x0=S - 1.5, x1=S - 0.5, fillcolor=BOUNDARY, opacity=0.07, line_width=0)
    fig.update_yaxes(range=[0, 1.02])
    return fig


def phase_rose(result: PhaseEval | PhaseAblation, *, title: str | None = None) -> go.Figure:
    """Barpolar of accuracy (``PhaseEval``) or knockout damage (``PhaseAblation``) by phase."""
    if hasattr(result, "per_phase") and "rel_change" in result.per_phase().columns:
        ph = result.per_phase()
        r = -ph["rel_change"].fillna(0).clip(lower=0)
        label, S = "damage (% of clean accuracy)", result.stride
        heads = ", ".join(map(str, result.heads[:4]))
        title = title or f"Knockout damage by phase: {heads}"
    else:
        ph = result.per_phase()
        r = ph["acc"]
        label, S = "accuracy", result.stride
        title = title or "Accuracy by phase"
    theta = [phase_label(p, S) for p in ph["phase"]]
    colors = [BOUNDARY if p == S - 1 else COMPRESSED for p in ph["phase"]]
    fig = go.Figure(go.Barpolar(r=r, theta=theta, marker_color=colors, name=label,
                                hovertemplate="%{theta}: %{r:.3f}<extra></extra>"))
    fig.update_layout(template=TEMPLATE, title=title, polar=dict(radialaxis=dict(title=label)))
    return fig


def periodicity_panel(ev: PhaseEval, *, title: str | None = None) -> go.Figure:
    """Harmonic-energy bars (DFT power of the residue profile; period-S bins highlighted) and battery p-values."""
    counts = ev.tests.counts if hasattr(ev, "tests") else ev
    h = counts.harmonic
    if h is None:
        from phaselens.errors import NotApplicableError

        raise NotApplicableError(f"no periodicity panel: {counts.skipped.get('harmonic', 'no harmonic fraction')} "
                                 "(evaluate with residues=None).")
    M, S = h.modulus, h.stride
    k = np.arange(1, M // 2 + 1)
    power = np.asarray(h.power)[1 : M // 2 + 1]
    periodic = (k % (M // S)) == 0
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4],
                        subplot_titles=(f"DFT power of accuracy over {M} residues", "battery p-values"))
    fig.add_trace(go.Bar(x=[f"{M / kk:.3g}" for kk in k], y=power, marker_color=[BOUNDARY if p else CONTROL for p in periodic],
                         name="power", hovertemplate="period %{x} slots: %{y:.3g}<extra></extra>"), 1, 1)
    tests = counts.tests_frame()
    p = tests["pvalue"].clip(lower=1e-300)
    fig.add_trace(go.Bar(x=-np.log10(p), y=tests["test"], orientation="h", marker_color=COMPRESSED, name="-log10 p",
                         customdata=tests["pvalue"], hovertemplate="%{y}: p=%{customdata:.3g}<extra></extra>"), 1, 2)
    fig.add_vline(x=-np.log10(0.05), line_dash="dot", line_color=CONTROL, row=1, col=2)
    fig.update_xaxes(title_text="period (slots); red = multiples of the stride's frequency", row=1, col=1)
    fig.update_yaxes(title_text="power", row=1, col=1)
    fig.update_xaxes(title_text="-log10 p (dotted: p = 0.05)", row=1, col=2)
    fig.update_layout(template=TEMPLATE, showlegend=False,
                      title=title or f"Periodicity: harmonic fraction {h.fraction:.3f} (null {h.null_fraction:.3f}), "
                                     f"detected period {counts.period.period}")
    return fig


def repair_panel(table: PhaseRepairTable, key: tuple[str, str] | None = None, *, title: str | None = None) -> go.Figure:
    """Accuracy by phase before and after phase repair (a ``PhaseRepairTable``), Wilson 95% bars."""
    key = key or (("all", "max_conf") if ("all", "max_conf") in table.evals else table.best())
    before, after = table.base.per_phase(), table.evals[key].per_phase()
    S = table.stride
    ticks = [phase_label(p, S) for p in range(S)]
    row = table.rows[(table.rows["shifts"] == key[0]) & (table.rows["combine"] == key[1])].iloc[0]
    fig = figure(title or f"Phase repair ({key[1]}, shifts {key[0]}, {row['cost']}x cost): accuracy by phase",
                 xaxis_title="phase of the target key", yaxis_title="accuracy", barmode="group")
    for df, name, color in ((before, "unrepaired", CONTROL), (after, "repaired", COMPRESSED)):
        fig.add_trace(go.Bar(x=ticks, y=df["acc"], name=name, marker_color=color,
                             error_y=dict(type="data", symmetric=False, array=df["ci_high"] - df["acc"],
                                          arrayminus=df["acc"] - df["ci_low"]),
                             hovertemplate="%{x}: %{y:.3f}<extra>" + name + "</extra>"))
    fig.update_yaxes(range=[0, 1.02])
    return fig
