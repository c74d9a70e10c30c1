"""Figures and HTML of the report, built from computed results. No computation, no I/O."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from phaselens import plots
from phaselens.presentation.reporting.compute import ModelResults


@dataclass
class Section:
    """One figure with its key (file stem) and one or two sentences of what it shows."""

    key: str
    title: str
    caption: str
    figure: go.Figure


def sections(results: list[ModelResults]) -> list[Section]:
    control = next((r for r in results if r.is_control), None)
    out: list[Section] = []
    for r in results:
        if r.is_control:
            continue
        ev, S = r.eval, r.eval.stride
        out.append(Section(f"{r.name}_accuracy", f"{r.name}: accuracy by phase",
                           f"Accuracy of {r.name} with the target key at each phase (slot mod {S}), one line per cycle "
                           f"of {S} residues, Wilson 95% bars; lines that coincide show the effect repeats with period "
                           f"{S}. The dashed grey line is the full-attention control, folded by the same stride.",
                           plots.accuracy_by_residue(ev, control.eval if control else None, name=r.name)))
        out.append(Section(f"{r.name}_periodicity", f"{r.name}: periodicity",
                           "Left: DFT power of the per-residue accuracy; red bars are the frequencies periodic in the "
                           "stride. Right: the battery's p-values (dotted line p = 0.05).",
                           plots.periodicity_panel(ev)))
        if r.recording is not None:
            out.append(Section(f"{r.name}_read_side", f"{r.name}: read side",
                               "Attention mass at the query on the compressed entries that hold the target key, per head "
                               "and residue (boundary-phase residues outlined).",
                               plots.read_side_attention(r.recording)))
            out.append(Section(f"{r.name}_gates", f"{r.name}: gate profiles",
                               "Mean compressor gate weight per offset inside the window, per KV head, relative to uniform "
                               "pooling (1/W, white): blue cells carry more than their share of the window, red cells less. "
                               "The colour scale is logarithmic and symmetric around 1/W.",
                               plots.gate_profiles(r.recording)))
            out.append(Section(f"{r.name}_concentration", f"{r.name}: gate concentration",
                               "Static concentration exp(H(E[alpha])) against per-window E[exp(H(alpha))]; both are 1 when "
                               "a gate always picks one offset and W when it averages.",
                               plots.gate_concentration(r.recording)))
        cmap = control.map if control is not None else None
        names = (r.name, control.name if control is not None else "")
        beside = f" The full-attention control {control.name} stands on the right on the same colour scale." if control else ""
        if r.map is not None:  # a served model has no heads to knock out
            out.append(Section(f"{r.name}_head_map", f"{r.name}: per-head knockouts by residue",
                               f"Relative accuracy change when one head's output at the query is replaced by its calibration "
                               f"mean ({r.map.method} knockout); red means damage. Phase-specific heads hurt only some "
                               f"residues.{beside}{_undefined_note(r.map, cmap, 'head')}",
                               plots.head_phase_heatmap(r.map, control=cmap, names=names)))
            out.append(Section(f"{r.name}_layer_map", f"{r.name}: whole-layer knockouts",
                               "The same with every head of a layer knocked out at once, as in the paper's DeepSeek map."
                               f"{beside}{_undefined_note(r.map, cmap, 'layer')}",
                               plots.layer_knockout_map(r.map, control=cmap, names=names)))
        if r.cycling is not None:
            out.append(Section(f"{r.name}_cycling", f"{r.name}: gate cycling",
                               "Rolling the offset-specific gate parameters by delta should move the weak phases with them: "
                               "observed A_delta(p) against predicted A_0((p - delta) mod S). R^2 = 1 - SS_res / SS_tot "
                               "measures the fit to the identity line: 1 is a perfect prediction, 0 no better than the mean "
                               f"observed accuracy, below 0 worse than that. Here {plots.r2_note(r.cycling.r2)} (boundary "
                               "phase excluded).", plots.gate_cycling_scatter(r.cycling)))
        if r.repair is not None:
            out.append(Section(f"{r.name}_repair", f"{r.name}: phase repair",
                               "Accuracy by phase before and after test-time phase ensembling (shifted copies combined by "
                               "the most confident answer).", plots.repair_panel(r.repair)))
    curves = {r.name: r.training for r in results if r.training is not None}
    if curves:
        out.append(Section("training", "Training loss",
                           "The loss each model was trained to, per step (means of 10 steps, from its card), with its "
                           "validation accuracy where the card has it (dotted, right axis). A model whose loss is still "
                           "falling at the end is undertrained; read its phase profile with that in mind.",
                           plots.loss_curve(curves, x="step", title="Training loss")))
    if control is not None and all(r.is_control for r in results):  # only the control: its maps alone
        out.append(Section(f"{control.name}_head_map", f"{control.name}: per-head knockouts by residue",
                           "The full-attention control's knockout map: without compression no head should serve "
                           f"particular phases.{_undefined_note(control.map, None, 'head')}",
                           plots.head_phase_heatmap(control.map, names=(control.name, ""))))
    return out


def _undefined_note(pm: Any, control: Any, kind: str) -> str:
    import numpy as np

    if not any(np.isnan(m.values(kind).values).any() for m in (pm, control) if m is not None):
        return ""
    return (" Grey crosses mark undefined cells: the clean model's accuracy at that residue is below the "
            "threshold, so a relative change has nothing to be relative to.")


def headline_sentence(results: list[ModelResults]) -> str:
    """One sentence for the top of the report: each compressed model's phase gap, and whether the control is flat."""
    parts = []
    for r in results:
        c, (lo, hi) = r.eval.tests.counts, r.eval.gap_ci
        ci = f"{100 * c.phase_gap:.1f} pp [95% CI {100 * lo:.1f}, {100 * hi:.1f}]"
        p = c.gap_test.pvalue
        if r.is_control:
            flat = p >= 0.05
            verdict = "flat across phases (no significant phase gap" if flat else "not flat (phase gap"
            parts.append(f"the full-attention control {r.name} is {verdict}: {ci}, permutation p = {p:.2g})")
        else:
            S = r.eval.stride
            where = f"phase {c.worst_phase}" + (" (the boundary phase)" if c.worst_phase == S - 1 else "")
            parts.append(f"{r.name} loses {ci} at its worst {where} against its best phase "
                         f"({100 * c.worst_accuracy:.1f}% against {100 * c.best_accuracy:.1f}%)")
    text = "; ".join(parts)
    return text + "." if text else ""  # model names keep their case, even first


def headline_rows(results: list[ModelResults]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        c = r.eval.tests.counts
        lo, hi = r.eval.gap_ci
        top = r.map.most_specialized(1) if r.map is not None else None  # no map: a served model
        best = top.iloc[0] if top is not None and len(top) else None
        rows.append({
            "model": r.name, "description": r.description, "stride": r.eval.stride,
            "mean": c.mean_accuracy, "worst_phase": c.worst_phase, "worst": c.worst_accuracy,
            "boundary": c.boundary_accuracy, "gap": c.phase_gap, "gap_ci_low": lo, "gap_ci_high": hi,
            "period": c.period.period, "p_chi2": c.chi2.pvalue, "p_nested": c.nested.pvalue,
            "harmonic_fraction": c.harmonic.fraction, "p_gap": c.gap_test.pvalue,
            "most_specialized_head": None if best is None else str(best["label"]),
            "specialization": None if best is None else float(best["specialization"]),
            "specialization_ci_low": None if best is None else float(best["ci_low"]),
            "specialization_ci_high": None if best is None else float(best["ci_high"]),
            "specialization_phase": None if best is None else int(best["worst_phase"]),
            "cycling_r2": None if r.cycling is None else r.cycling.r2,
        })
    return rows


def _fmt_p(p: float) -> str:
    return "&lt;1e-300" if p == 0 else f"{p:.2g}"


def html_page(results: list[ModelResults], secs: list[Section], meta: dict[str, Any], plotly_js: str,
              static_note: str) -> str:
    rows = headline_rows(results)
    head = "".join(f"<th>{h}</th>" for h in ("model", "mean %", "worst phase", "worst %", "boundary %",
                                             "folded gap pp [95% CI]", "period", "p (chi2)", "p (nested)",
                                             "most specialized head"))
    body = []
    for r in rows:
        spec = "none significant" if r["most_specialized_head"] is None else (
            f"{r['most_specialized_head']} {r['specialization']:.2f} [{r['specialization_ci_low']:.2f}, "
            f"{r['specialization_ci_high']:.2f}], phase {r['specialization_phase']}")
        body.append(
            f"<tr><td><b>{html.escape(r['model'])}</b><br><small>{html.escape(r['description'])}</small></td>"
            f"<td>{100 * r['mean']:.1f}</td><td>{r['worst_phase']}</td><td>{100 * r['worst']:.1f}</td>"
            f"<td>{100 * r['boundary']:.1f}</td><td>{100 * r['gap']:.1f} [{100 * r['gap_ci_low']:.1f}, "
            f"{100 * r['gap_ci_high']:.1f}]</td><td>{r['period']}</td><td>{_fmt_p(r['p_chi2'])}</td>"
            f"<td>{_fmt_p(r['p_nested'])}</td><td>{spec}</td></tr>"
        )
    figs = []
    for i, s in enumerate(secs):
        div = s.figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig-{i}",
                               config={"displaylogo": False, "responsive": True})
        figs.append(f'<section id="{s.key}"><h2>{html.escape(s.title)}</h2><p>{html.escape(s.caption)}</p>{div}</section>')
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>phaselens report</title>
<style>
body {{ font-family: Inter, Helvetica, Arial, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; width: 100%; font-size: 14px; }} th, td {{ border-bottom: 1px solid #ddd; padding: 6px; text-align: left; }}
th {{ background: #f5f5f5; }} code, pre {{ background: #f6f8fa; padding: 2px 4px; }} section {{ margin-top: 2.5em; }}
small {{ color: #666; }}
</style>
<script type="text/javascript">{plotly_js}</script></head>
<body>
<h1>phaselens report</h1>
<p id="headline" style="font-size: 1.25em"><b>{html.escape(headline_sentence(results))}</b></p>
<p>Phase sensitivity (accuracy that depends on the target's slot modulo the compression stride) and phase
specialization (heads that serve particular phases) of {", ".join(html.escape(r.name) for r in results)}.
Accuracies use Wilson 95% intervals; the folded gap's interval bounds the largest phase difference from
pairwise contrasts (simultaneous over the pairs; coverage by simulation in docs/statistics.md); p-values come from
the phaselens statistics battery (chi2 on the residue table; nested fold test mod M against mod S).</p>
<table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>
{"".join(figs)}
<section id="provenance"><h2>How this was made</h2>
<p>Command: <code>{html.escape(meta["command"])}</code></p>
<p>Versions: {html.escape(versions)}. Wall time {meta["seconds"]:.0f} s. Settings: <code>{html.escape(str(meta["settings"]))}</code></p>
<p>Static images: {html.escape(static_note)}</p>
{"".join(f"<p>Not run on {html.escape(r.name)}: {html.escape(n)}</p>" for r in results for n in r.notes)}
<p>Every number in the figures is in <code>results.json</code> and the CSV files beside this page.</p></section>
</body></html>
"""
