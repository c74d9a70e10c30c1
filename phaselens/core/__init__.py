"""The core layer: errors, phase geometry (``PhaseSpec``), head specifications, labelled arrays, argument
checks and the rounding margins of discrete steps (``margins``). Imports nothing else from phaselens."""
