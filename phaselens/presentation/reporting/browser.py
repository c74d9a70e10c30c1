"""What a browser check of the report runs in the page (used by the browser test and the screenshot script)."""

from __future__ import annotations

# Per figure: ``[section id, count]`` of subplot-title or legend boxes that meet a tick label's box, as the
# browser lays them out (0 everywhere means no label overlaps).
OVERLAPS_JS = """
() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(fig => {
  const box = e => e.getBoundingClientRect();
  const meet = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const titles = Array.from(fig.querySelectorAll('.annotation-text, .legendtext')).map(box);
  const ticks = Array.from(fig.querySelectorAll('.xtick text, .ytick text')).map(box);
  let n = 0;
  for (const t of titles) for (const k of ticks) if (meet(t, k)) n++;
  return [fig.closest('section') ? fig.closest('section').id : '', n];
})
"""
