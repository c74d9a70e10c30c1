"""phaselens inside the tools researchers already evaluate with.

* :mod:`phaselens.integrations.lm_eval`: EleutherAI's lm-evaluation-harness (phaselens models as lm-eval models,
  phase-stratified variants of any lm-eval task, phaselens' own tasks exported as lm-eval tasks, and lm-eval's
  per-sample output read back as a :class:`~phaselens.PhaseEval`).

Nothing here is imported by ``import phaselens``; each integration imports its tool when first used.
"""
