"""Every GPU check of the open issues in one run, for a lent GPU machine whose time is short.

    python -m tests.gpu.session [--budget SECONDS]

Runs each check as its own process (one failing or hanging cannot take the others down), each within its own
time limit, and writes what each printed to ``$OUT/<name>.json`` / ``$OUT/<name>.log`` (or ``gpu_session/``
when ``OUT`` is unset), then a summary ``$OUT/gpu_session.json``. The checks:

* ``env``: the versions of torch, transformers, accelerate and CUDA, and that phaselens imports;
* ``packed`` (issue 28): ``python -m tests.gpu.packed``, packed V4.1 on CUDA and the V4 adapter on
  transformers' packed FP8 modules;
* ``reliability`` (issue 24): ``python -m tests.gpu.reliability``, loads through the boundary checks and
  pricing against the GPU's memory;
* ``numerics`` (issue 25): ``python -m benchmarks.bench_v4_numerics --device cuda``, the reference numerics' fused
  half-precision products on CUDA;
* ``family`` (issue 26): ``python -m benchmarks.bench_family_gpu``, tokens/s and peak memory of the 0.6B size;
* ``served`` (issue 36): ``python -m tests.gpu.served``, a served model's vLLM and SGLang paths (token-id
  prompts, log-probabilities, the prefix cache) against transformers' forward of the same tiny weights; an
  engine that is not installed is reported as skipped;
* ``v41-engine`` (issue 35): ``python -m benchmarks.bench_v41_maps --device cuda``, DeepSeek-V4.1's query-suffix
  engine against one full forward per cell on CUDA (wall seconds), with the largest logit difference.

Needs torch with CUDA, phaselens's requirements, and transformers >= 5.24 (``deepseek_v4``). A machine with no
network and an older transformers can take wheels carried with the repository, e.g. transformers,
huggingface_hub, transformer_lens, datasets, kernels and their small dependencies in ``.whl/``:
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site python -m
tests.gpu.session --budget 560`` (about 9 minutes with every check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.paths import ROOT

ENV = ("import json, sys, torch, transformers, accelerate; import phaselens, phaselens.models.deepseek_v41; "
       "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, "
       "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "
       "'transformers': transformers.__version__, 'accelerate': accelerate.__version__, "
       "'deepseek_v4': hasattr(transformers, 'DeepseekV4ForCausalLM')}))")
CHECKS = [  # name, command, seconds
    ("env", [sys.executable, "-c", ENV], 60),
    ("packed", [sys.executable, "-m", "tests.gpu.packed"], 130),
    ("reliability", [sys.executable, "-m", "tests.gpu.reliability"], 100),
    ("numerics", [sys.executable, "-m", "benchmarks.bench_v4_numerics", "--device", "cuda", "--tokens", "4096"], 110),
    ("family", [sys.executable, "-m", "benchmarks.bench_family_gpu"], 230),
    ("served", [sys.executable, "-m", "tests.gpu.served"], 300),
    ("v41-engine", [sys.executable, "-m", "benchmarks.bench_v41_maps", "--device", "cuda", "--lengths", "1024",
                    "4096", "--full-cells", "0"], 120),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=580, help="seconds for all checks together")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "gpu_session")
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "PHASELENS_GPU_SESSION": "1"}
    start, summary = time.monotonic(), {}
    for name, cmd, limit in CHECKS:
        if args.only and name not in args.only:
            continue
        left = args.budget - (time.monotonic() - start)
        if left < 20:
            summary[name] = {"status": "skipped: no time left"}
            continue
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=min(limit, left))
            status, stdout, stderr = f"exit {p.returncode}", p.stdout, p.stderr
        except subprocess.TimeoutExpired as err:
            status = f"timed out after {min(limit, left):.0f} s"
            stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        (out / f"{name}.log").write_text(stdout + "\n--- stderr ---\n" + stderr[-20000:])
        parsed = _last_json(stdout)
        if parsed is not None:
            (out / f"{name}.json").write_text(json.dumps(parsed, indent=1))
        summary[name] = {"status": status, "seconds": round(time.monotonic() - t0, 1), "json": parsed is not None,
                         "tail": (stderr or stdout)[-600:] if status != "exit 0" else ""}
        print(f"{name}: {status} in {summary[name]['seconds']} s", flush=True)
    (out / "gpu_session.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v["status"] for k, v in summary.items()}))


def _last_json(text: str):
    """The last JSON object a script printed (its result), or ``None``."""
    for start in [i for i, ch in enumerate(text) if ch == "{"]:
        try:
            obj, end = json.JSONDecoder().raw_decode(text[start:])
        except ValueError:
            continue
        if not text[start + end:].strip():
            return obj
    return None


if __name__ == "__main__":
    main()
