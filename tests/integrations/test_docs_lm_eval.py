"""docs/lm_eval.md's Python examples run as written, in order, in an empty folder (offline; nothing downloaded)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "lm_eval.md"


def test_the_pages_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 3
    for i, code in enumerate(blocks):
        exec(compile(code, f"lm_eval.md[{i}]", "exec"), {})
    out = capsys.readouterr().out
    assert "PhaseEval: lm-eval PhaseLensLM on phaselens_kv_recall: 96 items, stride 4, residues mod 24" in out
    assert "'shift': 1, 'slot': 2, 'residue': 2" in out
    assert "['phaselens_needle.jsonl', 'phaselens_needle.yaml', 'phaselens_needle_gen.yaml']" in out
    assert (tmp_path / "tasks" / "phaselens_kv_recall.yaml").is_file()
