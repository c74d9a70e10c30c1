"""Stamp each shipped zoo card with the sha256 of its model's weights and config (with the default task).

Run after a deliberate change to a shipped ``config.json`` (or after adding a hashed file): it first checks
that each model still reproduces its card's fixed evaluation batch item by item, and refuses to stamp one
that does not (so damage is never blessed).

    .venv/bin/python -m tools.rehash_zoo_cards            # every shipped model
    .venv/bin/python -m tools.rehash_zoo_cards w4s4 full  # some
    .venv/bin/python -m tools.rehash_zoo_cards --check    # report only, change nothing (exit 1 if stale)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from phaselens.analyses.scoring import answer_metrics
from phaselens.models.compressed.loader import load_model
from phaselens.models.zoo import HASHED, entry, file_digests, list_models
from phaselens.storage.writing import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def reproduces_card(name: str) -> bool:
    """Whether the model's files give the card's per-item answers on its fixed evaluation batch."""
    from safetensors.torch import load_file

    e = entry(name)
    card = e.card
    model = load_model(e.path)
    batch = load_file(str(e.path / card["eval_batch"]["file"]))
    with torch.no_grad():
        logits = model(batch["tokens"])[torch.arange(len(batch["answer"])), batch["query_pos"]]
    correct = answer_metrics(logits, batch["answer"], batch["wrong"])["correct"].astype(int).tolist()
    return correct == card["eval_batch"]["correct"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="zoo models (default: all shipped)")
    ap.add_argument("--check", action="store_true", help="only report stale cards")
    args = ap.parse_args()
    stale = 0
    for name in args.names or list_models():
        e = entry(name)
        card = e.card
        digests = file_digests(e.path)
        changed = {k: v for k, v in digests.items() if card.get(k) != v}
        if not changed:
            print(f"{name}: up to date")
            continue
        stale += 1
        for key, value in changed.items():
            print(f"{name}: {key} ({HASHED[key]}) {str(card.get(key))[:12]}... -> {value[:12]}...")
        if args.check:
            continue
        if not reproduces_card(name):
            print(f"{name}: NOT stamped: the files do not reproduce the card's evaluation batch; retrain with make zoo")
            return 2
        card.update(digests)
        atomic_write_text(e.path / "card.json", json.dumps(card, indent=1, sort_keys=True) + "\n")
        print(f"{name}: stamped")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
