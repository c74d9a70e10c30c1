"""GPU check of issue 36: the vLLM and SGLang paths of a served model, which the CPU tests cannot run.

For each engine installed (``vllm``, ``sglang``), on a tiny Llama built from a config with a tokenizer trained on
the spot (nothing downloaded), served in float32 from a local folder:

* ``phaselens.load`` picks the engine's dialect (token-id prompts) and the ``/tokenize`` agreement check;
* ``evaluate`` on a paired needle task: the greedy answers equal transformers' own forward of the same weights
  item by item, and the answer and distractor log-probabilities match its ``log_softmax`` where the server
  reports them (vLLM: top-20; SGLang: exact);
* the server's prefix cache served tokens (``served_traffic.cached_tokens``) on the shared-prefix padding.

Prints one JSON object (``tests/gpu/session.py`` keeps it). An engine that is not installed is reported as
skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch


def tiny_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from phaselens.tasks import train_toy_tokenizer

    tok = train_toy_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.token_to_id("<bos>"), eos_token_id=tok.token_to_id("<pad>"))
    LlamaForCausalLM(cfg).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>",
                            eos_token="<pad>").save_pretrained(path)
    return path


def command(engine: str, model: Path, port: int) -> list[str]:
    if engine == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
                "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--gpu-memory-utilization", "0.3",
                "--max-logprobs", "20", "--enable-prompt-tokens-details", "--enable-prefix-caching"]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
            "--dtype", "float32", "--context-length", "4096", "--mem-fraction-static", "0.3"]


def check(engine: str, model_dir: Path, port: int) -> dict:
    import phaselens
    from phaselens.tasks import Needle

    log = open(model_dir.parent / f"{engine}.log", "wb")
    proc = subprocess.Popen(command(engine, model_dir, port), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return {"status": f"server exited {proc.returncode}",
                        "log": (model_dir.parent / f"{engine}.log").read_text()[-3000:]}
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        m = phaselens.load(f"http://127.0.0.1:{port}/v1", tokenizer=str(model_dir), stride=4, progress=False)
        task = Needle(m.tokenizer, n_records=16, n_demos=1, paired=True, modulus=8, padding="shared_prefix")
        ev = phaselens.evaluate(m, task, n_per_residue=4, progress=False, n_permutations=100, n_bootstrap=0)
        from transformers import LlamaForCausalLM

        ref = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
        batch = task.build(m.dims.analysis_spec, n_per_residue=4)
        with torch.no_grad():
            logp = ref(batch.tokens.cuda()).logits[torch.arange(len(batch)), batch.query_pos.cuda()].float()
        logp = logp.log_softmax(-1).cpu()
        rows = torch.arange(len(batch))
        want_pred = logp.argmax(-1).numpy()
        want_a, want_w = logp[rows, batch.answer].numpy(), logp[rows, batch.wrong].numpy()
        got = ev.items
        got_a, got_w = np.log(got["p_correct"].to_numpy()), np.log(got["p_wrong"].to_numpy())
        known = np.isfinite(got_a) & np.isfinite(got_w)
        return {
            "status": "ok", "protocol": m.dialect.name, "checks": m.checks, "items": len(got),
            "predicted_equal": float((got["predicted"].to_numpy() == want_pred).mean()),
            "logprobs_reported": float(known.mean()),
            "logprob_max_abs_diff": float(np.abs(np.r_[got_a[known] - want_a[known], got_w[known] - want_w[known]]).max())
            if known.any() else None,
            "traffic": m.endpoint.traffic.as_dict(), "scored_by": ev.metadata.get("scored_by"),
        }
    except Exception as err:  # the check reports, the session goes on
        return {"status": f"failed: {type(err).__name__}: {err}"}
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def main() -> None:
    out: dict = {"check": "served"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_llama(Path(tmp) / "tiny-llama")
        for i, engine in enumerate(("vllm", "sglang")):
            if importlib.util.find_spec(engine) is None:
                out[engine] = {"status": f"skipped: {engine} is not installed"}
                continue
            out[engine] = check(engine, model_dir, 8100 + i)
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
