"""Comparisons with DeepSeek's official inference code, which phaselens cannot ship (a local copy is needed).

Not collected by pytest (no ``test_`` files); run from the repository root as modules:
``python -m tests.reference.v4_parity --reference DIR`` (DeepSeek-V4) and
``python -m tests.reference.v41_parity --reference DIR`` (DeepSeek-V4.1). docs/deepseek_v4.md and
docs/deepseek_v41.md quote their results (docs/data/v4*_parity*.json). ``tests/models/deepseek_v4/test_reference_parity.py``
runs the V4 comparison under pytest when ``PHASELENS_DEEPSEEK_V4_INFERENCE`` points at a copy.
"""
