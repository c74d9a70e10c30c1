"""Gate cycling on every shipped zoo model with learned offset-specific gates, and why w8s4 does not follow it.

    .venv/bin/python -m experiments.gate_cycling_zoo [--n 64] [--bootstrap 2000] [NAMES...]

Writes docs/data/gate_cycling.json (rendered into docs/zoo.md by ``python -m tools.gen_zoo_docs``); the shipped
file comes from ``python -m experiments.gate_cycling_zoo --n 64 --bootstrap 2000`` (about an hour). Each model is
written as soon as it is done, atomically; a rerun skips models whose weights and settings are unchanged.

Per model: ``gate_cycling_test`` with every distinct shift 1..S-1 once, the zoo's evaluation task, n items per
residue, seed 0, R^2 intervals from 2,000 item-bootstrap replicates. For every model with DeepSeek's overlap
split (w8s4 and its seeds) also a diagnosis: the position bias by window slot and the profile with every
phase-specific gate parameter removed; for zoo:w8s4 the cycled profiles with the entry's RoPE position moved
along, and the planted model of ``tests/analyses/test_cycling.py`` (a weakness put into the gates, which must move).
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

import phaselens
from phaselens.models.compressed.compressor import Compressor
from phaselens.models.compressed.gate_cycling import _offset_params
from phaselens.models.zoo import entry, list_models

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "docs" / "data" / "gate_cycling.json"


def cycling_record(model, n: int, n_bootstrap: int, deltas=None) -> dict:
    S = model.analysis_spec.stride
    deltas = tuple(range(1, S)) if deltas is None else deltas
    res = phaselens.gate_cycling_test(model, deltas=deltas, n_per_residue=n, seed=0, batch_size=256, progress=False,
                                      n_bootstrap=n_bootstrap)
    observed = {int(d): res.frame[res.frame["delta"] == d]["observed"].round(5).tolist() for d in deltas}
    return {"stride": S, "deltas": list(deltas), "r2": res.r2, "r2_ci": list(res.r2_ci), "r2_all": res.r2_all,
            "r2_all_ci": list(res.r2_all_ci), "base": res.base.round(5).tolist(), "observed": observed,
            "boundary": {int(k): v for k, v in res.boundary.items()}}


def _bias(model, layer: int) -> torch.nn.Parameter:
    return model.blocks[layer].attn.compressor.poolers["kv"].position_bias


def dephased(model):
    """``model`` with each half's position bias replaced by its mean over phases, in every layer."""
    with torch.no_grad():
        for block in model.blocks:
            b = block.attn.compressor.poolers["kv"].position_bias
            b.copy_(b.mean(1, keepdim=True).expand_as(b))
    return model


@contextmanager
def rope_anchor_shift(delta: int):
    """Entries rotate at slot jS + delta instead of jS while inside (a diagnostic, restored on exit)."""
    original = Compressor.finish

    def finish(self, path, pooled, first_entry):
        return original(self, path, pooled, first_entry) if not self.rotated(path) else _shifted(self, path, pooled,
                                                                                             first_entry, delta)

    with mock.patch.object(Compressor, "finish", finish):
        yield


def _shifted(comp, path, pooled, first_entry, delta):
    from phaselens.models.parts.norms import rms_norm
    from phaselens.models.parts.rope import apply_rope

    if comp.norm_weight is not None:
        pooled = rms_norm(pooled, comp.norm_weight[path], comp.spec.norm_eps)
    positions = (first_entry + torch.arange(pooled.shape[1], device=pooled.device)) * comp.stride + delta
    return apply_rope(pooled, positions, comp.inv_freq, attention_scaling=comp.attention_scaling)


def profile(model, n: int) -> list[float]:
    ev = phaselens.evaluate(model, n_per_residue=n, seed=0, batch_size=256, progress=False, n_permutations=1,
                            n_bootstrap=0)
    return ev.per_phase()["acc"].round(5).tolist()


def diagnose_overlap(name: str, n: int) -> dict:
    """Layer-by-layer position bias by window slot (mean and SD over channels) and the profile without any
    phase-specific gate parameter, for a model with the overlap split."""
    model = phaselens.load(f"zoo:{name}")
    layers = range(len(model.blocks))
    return {"bias_mean_by_slot": {f"layer{i}": _bias(model, i).detach().mean(-1).reshape(-1).round(decimals=3).tolist()
                                  for i in layers},
            "bias_sd_by_slot": {f"layer{i}": _bias(model, i).detach().std(-1).reshape(-1).round(decimals=3).tolist()
                                for i in layers},
            "dephased": profile(dephased(model), n)}


def w8s4_extras(n: int, n_bootstrap: int) -> dict:
    """For zoo:w8s4: the cycled profiles with the entry's RoPE position moved along, and the planted model."""
    base = phaselens.load("zoo:w8s4")
    rope = {}
    for d in (1, 2, 3):
        cycled = phaselens.analyses.cycling.cycle_gates(base, d)
        with rope_anchor_shift(d):
            rope[d] = profile(cycled, n)
    planted = dephased(phaselens.load("zoo:w8s4"))
    with torch.no_grad():
        _bias(planted, 0)[:, 1] -= 8.0  # tests/analyses/test_cycling.py::_planted_w8s4(1)
    return {"cycled_with_rope_anchor_shift": rope, "planted": cycling_record(planted, n, n_bootstrap)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--bootstrap", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    settings = {"n_per_residue": args.n, "n_bootstrap": args.bootstrap, "seed": 0}
    if data.get("settings") != settings:
        data = {"settings": settings, "models": {}}
    data["command"] = f"python -m experiments.gate_cycling_zoo --n {args.n} --bootstrap {args.bootstrap}"

    def save() -> None:
        tmp = OUT.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(OUT)

    names = args.names or [m for m in list_models() if _offset_params(phaselens.load(f"zoo:{m}"))]
    for name in names:
        sha = entry(name).card["weights_sha256"]
        if data["models"].get(name, {}).get("weights_sha256") == sha:
            continue
        data["models"][name] = {"weights_sha256": sha, **cycling_record(phaselens.load(f"zoo:{name}"), args.n,
                                                                         args.bootstrap)}
        print(name, round(data["models"][name]["r2"], 3), data["models"][name]["r2_ci"], flush=True)
        save()
    data.pop("w8s4_diagnosis", None)  # the layout before the overlap diagnosis covered every seed
    overlap = data.setdefault("overlap_diagnosis", {})
    for name in data["models"]:
        sha = entry(name).card["weights_sha256"]
        if phaselens.load(f"zoo:{name}").config.compression.overlap_split and overlap.get(name, {}).get(
                "weights_sha256") != sha:
            overlap[name] = {"weights_sha256": sha, **diagnose_overlap(name, args.n)}
            save()
    sha = entry("w8s4").card["weights_sha256"]
    if data.get("w8s4_extras", {}).get("weights_sha256") != sha:
        data["w8s4_extras"] = {"weights_sha256": sha, **w8s4_extras(args.n, args.bootstrap)}
        save()
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
