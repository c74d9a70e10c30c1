"""The loss curve of a training run (``RUN_DIR/log.json``, written by :mod:`phaselens.train.family.trainer`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from phaselens.plots.theme import COMPRESSED, CONTROL, figure


def loss_curve(logs: Mapping[str, Mapping[str, Any]] | Mapping[str, Any], *, x: str = "tokens",
               title: str | None = None) -> go.Figure:
    """Training loss (and validation accuracy, on a second axis, where the log has it) against ``x``.

    Args:
        logs: one log (the dict of ``log.json``) or ``{name: log}`` for several runs on one figure.
        x: ``"tokens"`` (processed tokens) or ``"step"``.
    """
    runs = {"run": logs} if "loss" in logs else dict(logs)
    fig = figure(title or "Training loss", xaxis_title="tokens" if x == "tokens" else "step",
                 yaxis_title="loss (nats per trained token)",
                 yaxis2=dict(title="validation accuracy", overlaying="y", side="right", range=[0, 1],
                             showgrid=False))
    for name, log in runs.items():
        color = None if len(runs) > 1 else COMPRESSED
        fig.add_trace(go.Scatter(x=log[x], y=log["loss"], name=f"{name} loss", mode="lines",
                                 line=dict(width=1.5, color=color)))
        if log.get("val"):
            steps = {s: t for s, t in zip(log["step"], log[x])}
            vx = [steps.get(s, s) for s, _ in log["val"]]
            fig.add_trace(go.Scatter(x=vx, y=[a for _, a in log["val"]], name=f"{name} val acc", yaxis="y2",
                                     mode="lines+markers", line=dict(dash="dot", color=color or CONTROL)))
    return fig
