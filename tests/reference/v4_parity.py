"""The DeepSeek-V4 adapter against DeepSeek's own reference inference code, on a tiny random V4 (CPU).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.reference.v4_parity --reference PATH/TO/inference [--out f.json]

``PATH/TO/inference`` is a local copy of DeepSeek-V4's ``inference/`` directory (``model.py``; the released
checkpoints ship it, and GitHub ``Mockingjay1316/deepseek-v4-flash-spark`` holds a byte-identical copy in its
first commit with real files). Nothing is downloaded; phaselens vendors none of it. ``kernel.py`` (TileLang,
CUDA only) is replaced by the CPU emulations of ``tests/support/deepseek_reference.py`` (see ``tests/reference/v4``).

The model: the 4-layer test V4 of ``tests/support/deepseek.py`` (sliding, CSA 4, HCA 16, CSA 4) at the smallest sizes
the quantization blocks admit (``head_dim`` 80 with 16 RoPE dims, ``index_head_dim`` 32), 8 indexer heads,
one hash-routed layer with distinct random experts per token, a random expert-selection bias, and the
embedding scaled x50 so that the residual dominates as in a trained model (at x1 a random V4 is chaotic in
bf16: rounding alone changes its logits by percents). Saved and loaded back in bf16 as ``from_pretrained``
loads a checkpoint; the reference gets the same (bf16-rounded) weights.

Printed (JSON; docs/deepseek_v4.md quotes it):

* ``fp32``: adapter (plain and reference numerics) against the reference run all in fp32;
* ``bf16``: the floor (the reference against itself under two other legitimate emulations of its attention
  kernel: blocks of 8 instead of 64, or probabilities kept in fp32), and the adapter against the reference,
  for ``index_topk`` keeping every entry and binding; per layer the residual streams' drift; the indexer's
  pick agreement;
* ``ops``: op by op, each transformers op fed the reference's own input (``tests/reference/v4/ops.py``);
* ``quantize``: each ``quantize`` setting against the reference with the matching kernel emulation, and
  what each does to the logits.

Logit metrics: ``mean_rel = mean|a - r| / mean|r|`` and ``max_rel = max|a - r| / max|r|``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from phaselens.models.deepseek_v4 import IndexTopKWarning, from_transformers
from tests.reference.v4 import loader, ops
from tests.support.deepseek import QUANTIZABLE, tiny_v4_model


def build(seed: int, layers_hash: int = 1) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(fp32 model, the same saved and loaded back in bf16)``."""
    from transformers import DeepseekV4ForCausalLM

    model = tiny_v4_model(seed, num_hash_layers=layers_hash, index_n_heads=8, **QUANTIZABLE)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):  # distinct experts per token (zeros would route twice to expert 0)
                n, k = gate.tid2eid.shape
                gate.tid2eid.copy_(torch.rand(n, gate.num_experts, generator=g).argsort(-1)[:, :k])
            else:
                gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    return model.eval(), bf16.eval()


def logit_metrics(a: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    a, r = a.detach().double(), r.detach().double()
    return {"mean_rel": float((a - r).abs().mean() / r.abs().mean()),
            "max_rel": float((a - r).abs().max() / r.abs().max())}


def adapter_run(model: torch.nn.Module, tokens: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
    """Logits, streams after each layer and every CSA layer's picks of ``from_transformers(model, **kwargs)``."""
    adapter = from_transformers(model, **kwargs)
    names = [f"blocks.{i}.hook_resid_post" for i in range(adapter.cfg.n_layers)]
    names += [f"blocks.{g.layer}.attn.hook_indexer_topk" for g in adapter.layer_geometry if g.kind == "csa"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexTopKWarning)
        logits, cache = adapter.run_with_cache(tokens, names_filter=names)
    return {"logits": logits, "streams": [cache[f"blocks.{i}.hook_resid_post"] for i in range(adapter.cfg.n_layers)],
            "picks": {g.layer: cache[f"blocks.{g.layer}.attn.hook_indexer_topk"]
                      for g in adapter.layer_geometry if g.kind == "csa"},
            "metadata": adapter.analysis_metadata}


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    agreement = {str(k): ops.pick_agreement(run["picks"][k], ref["picks"][k]) for k in ref["picks"]}
    out = {**logit_metrics(run["logits"], ref["logits"]),
           "streams_rel_per_layer": [ops.rel(a, b) for a, b in zip(run["streams"], ref["streams"])],
           "pick_agreement": agreement, "pick_agreement_mean": sum(agreement.values()) / len(agreement)}
    if "metadata" in run and run["metadata"].get("index_topk_fragile_picks") is not None:
        out["adapter_fragile_picks"] = run["metadata"]["index_topk_fragile_picks"]
    return out


def reference(ref: Any, hf: torch.nn.Module, tokens: torch.Tensor, *, fp32: bool = False, **kernels: Any):
    loader.use_kernels(ref, fp32=fp32, **kernels)
    model = loader.build_reference(ref, hf, tokens=tokens.shape[1], batch=tokens.shape[0], fp32=fp32)
    return model, loader.reference_run(model, tokens)


def run(reference_dir: Path, *, tokens: int = 256, batch: int = 2, binding_topk: int = 16, seed: int = 0
        ) -> dict[str, Any]:
    """Every comparison of the module docstring, as a dict."""
    torch.manual_seed(seed)
    ref = loader.import_reference(reference_dir)
    fp32_model, bf16_model = build(seed)
    ids = torch.randint(0, fp32_model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed + 2))
    out: dict[str, Any] = {"tokens": tokens, "batch": batch, "seed": seed, "reference": str(reference_dir),
                           "entries_csa": tokens // 4, "binding_topk": binding_topk}
    topks = (("all_entries", "all"), ("binding", binding_topk))

    _, r32 = reference(ref, fp32_model, ids, fp32=True, quant="none")
    out["fp32"] = {n: logit_metrics(adapter_run(fp32_model, ids, numerics=n)["logits"], r32["logits"])
                   for n in ("transformers", "reference")}

    out["bf16"] = {}
    for label, topk in topks:
        from_transformers(bf16_model, index_topk=topk)  # sets config.index_topk, which the reference reads
        ref_model, base = reference(ref, bf16_model, ids, quant="none")
        section: dict[str, Any] = {}
        for name, kw in (("floor_blocks_of_8", dict(block=8)), ("floor_fp32_probabilities", dict(round_probs=False))):
            section[name] = compare(reference(ref, bf16_model, ids, quant="none", **kw)[1], base)
        for numerics in ("transformers", "reference"):
            section[numerics] = compare(adapter_run(bf16_model, ids, numerics=numerics, index_topk=topk), base)
        out["bf16"][label] = section
        record: list = []
        loader.use_kernels(ref, quant="none", record=record)
        cap = ops.capture(ref_model, ids, record)
        key = "ops" if label == "all_entries" else "ops_binding"
        out[key] = {"floor": ops.core_floor(cap)}
        for numerics in ("transformers", "reference"):
            from_transformers(bf16_model, numerics=numerics)
            out[key][numerics] = ops.op_errors(bf16_model, cap, ids, lambda s, m=ref_model: loader.head_logits(m, s))

    out["quantize"] = {}
    for label, topk in topks:
        from_transformers(bf16_model, index_topk=topk)
        refs = {q: reference(ref, bf16_model, ids, quant=q)[1] for q in ("none", "published", "e4m3")}
        floors = {q: reference(ref, bf16_model, ids, quant=q, block=8)[1] for q in ("published", "e4m3")}
        runs = {q: adapter_run(bf16_model, ids, quantize=q, index_topk=topk) for q in (None, "published", "fp8")}
        pairs = {
            "adapter None vs reference without rounding": (runs[None], refs["none"]),
            "adapter 'published' vs reference as published": (runs["published"], refs["published"]),
            "floor as published (reference, blocks of 8)": (floors["published"], refs["published"]),
            "adapter 'fp8' vs reference with e4m3": (runs["fp8"], refs["e4m3"]),
            "floor with e4m3 (reference, blocks of 8)": (floors["e4m3"], refs["e4m3"]),
            "adapter 'fp8' vs reference as published": (runs["fp8"], refs["published"]),
            "adapter None vs reference as published": (runs[None], refs["published"]),
            "effect of 'published' on the adapter (vs None)": (runs["published"], runs[None]),
            "effect of 'fp8' on the adapter (vs None)": (runs["fp8"], runs[None]),
            "reference: effect of e4m3 (vs as published)": (refs["e4m3"], refs["published"]),
        }
        out["quantize"][label] = {k: compare(x, y) for k, (x, y) in pairs.items()}
    from_transformers(bf16_model, index_topk="all")
    return out


def _e(v: float | None) -> str:
    return "–" if v is None else ("0" if v == 0 else f"{v:.1e}")


def markdown(out: dict[str, Any]) -> str:
    """The tables docs/deepseek_v4.md quotes, from :func:`run`'s output."""
    b, lines = out["bf16"], []
    lines += ["| logits against DeepSeek's reference | fp32 | bf16, every entry | bf16, binding `index_topk` "
              "| picks agreeing (binding) |", "|---|---|---|---|---|"]
    rows = (("floor: reference, blocks of 8", "floor_blocks_of_8"),
            ("floor: reference, fp32 probabilities", "floor_fp32_probabilities"),
            ('adapter, `numerics="transformers"`', "transformers"), ('adapter, `numerics="reference"`', "reference"))
    for name, key in rows:
        f32 = out["fp32"].get(key)
        cells = [f"{_e(f32['mean_rel'])} / {_e(f32['max_rel'])}" if f32 else "–"]
        cells += [f"{_e(b[t][key]['mean_rel'])} / {_e(b[t][key]['max_rel'])}" for t in ("all_entries", "binding")]
        fragile = b["binding"][key].get("adapter_fragile_picks")
        agree = f"{100 * b['binding'][key]['pick_agreement_mean']:.2f}%"
        cells.append(agree + (f" (fragile: {100 * fragile:.2f}%)" if fragile is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| op (given the reference's input), layers 0 / 1 / 2 / 3 | `\"transformers\"` | `\"reference\"` "
              "| floor |", "|---|---|---|---|"]
    floor = out["ops"]["floor"]
    for op, values in out["ops"]["reference"].items():
        section, name = ("ops_binding", f"{op}, binding `index_topk`") if op.startswith("indexer") else ("ops", op)
        plain, values = out[section]["transformers"][op], out[section]["reference"][op]
        fmt = (lambda v: "–" if v is None else f"{100 * v:.2f}%") if "agreement" in op else _e
        f = floor["attention core, floor (blocks of 8)"] if op == "attention core" else None
        lines.append(f"| {name} | " + " / ".join(map(fmt, plain)) + " | " + " / ".join(map(fmt, values)) + " | "
                     + (" / ".join(map(_e, f)) if f else "–") + " |")
    lines += ["", "| residual streams after layer | " + " | ".join(str(i) for i in range(4)) + " |",
              "|---|" + "---|" * 4]
    for name, key in rows:
        lines.append(f"| {name} | " + " | ".join(_e(v) for v in b["all_entries"][key]["streams_rel_per_layer"]) + " |")
    lines += ["", "| quantize (bf16, `numerics=\"reference\"`) | every entry | binding `index_topk` "
              "| picks agreeing (binding) |", "|---|---|---|---|"]
    q = out["quantize"]
    for name in q["binding"]:
        cells = [f"{_e(q[t][name]['mean_rel'])} / {_e(q[t][name]['max_rel'])}" for t in ("all_entries", "binding")]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * q['binding'][name]['pick_agreement_mean']:.2f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reference", type=Path, required=True, help="DeepSeek-V4's inference/ directory (model.py)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--binding-topk", type=int, default=16, help="a binding index_topk (CSA entries: tokens / 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--markdown", action="store_true", help="print the tables docs/deepseek_v4.md quotes instead")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = run(a.reference, tokens=a.tokens, batch=a.batch, binding_topk=a.binding_topk, seed=a.seed)
    text = json.dumps(out, indent=2)
    print(markdown(out) if a.markdown else text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
