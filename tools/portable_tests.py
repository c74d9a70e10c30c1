"""``make test-portable``: the tests that touch numerics, once per CPU capability this machine can emulate.

torch picks its vectorised kernels by CPU (``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``, ``avx512`` on x86;
``default`` and ``sve*`` on ARM), and MKL and oneDNN pick theirs too. Each sums in its own order, so float32
results differ in their last bits from one CPU to another. A test that holds only on the CPU it was written on
fails on the next machine; running the numerics tests under every capability here shows it before CI does.

For each capability: the tests marked ``numerics`` (tests/conftest.py marks them by folder) and not ``slow``,
with ``ATEN_CPU_CAPABILITY`` set, and MKL and oneDNN held to the same instruction set
(``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``). Capabilities above the machine's own are skipped (torch
would silently fall back). Before each run the capability torch reports under that environment is checked.

    python -m tools.portable_tests [-n WORKERS] [pytest args...]

Prints one JSON line per capability and a summary; exits non-zero when any run fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# capability -> what MKL and oneDNN are held to alongside it (None: the machine's own)
LIBRARIES = {
    "default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
ORDER = ["default", "avx2", "avx512"]
PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability())"


def reported(env: dict[str, str]) -> str:
    """The capability torch reports under ``env`` (lower case)."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().lower()


def capabilities(native: str) -> list[str]:
    """``default``, then each x86 level up to the machine's own, then the machine's own if it is another kind
    (an ARM ``sve256``, say)."""
    if native in ORDER:
        return ORDER[: ORDER.index(native) + 1]
    return ["default", native] if native != "default" else ["default"]


def environment(capability: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", *LIBRARIES["default"])}
    env["ATEN_CPU_CAPABILITY"] = capability
    env.update(LIBRARIES.get(capability, {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv: list[str]) -> int:
    workers = "2"
    if argv[:1] == ["-n"] and len(argv) > 1:
        workers, argv = argv[1], argv[2:]
    native = reported({k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"})
    summary = []
    for cap in capabilities(native):
        env = environment(cap)
        got = reported(env)
        if got != cap:
            print(json.dumps({"capability": cap, "error": f"torch reports {got!r} under it"}), flush=True)
            summary.append({"capability": cap, "passed": False})
            continue
        cmd = [sys.executable, "-m", "pytest", "-m", "numerics and not slow", "-q", "-p", "no:cacheprovider",
               *(["-n", workers, "--dist", "loadfile"] if workers != "0" else []), *argv]
        start = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        row = {"capability": cap, "libraries": LIBRARIES.get(cap, "native"), "passed": rc == 0, "exit": rc,
               "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row), flush=True)
        summary.append(row)
    print(json.dumps({"native": native, "runs": summary}), flush=True)
    return 0 if summary and all(r["passed"] for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
