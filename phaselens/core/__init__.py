"""The core layer: errors, phase geometry (``PhaseSpec``), head specifications, labelled arrays and argument
checks. Imports nothing else from phaselens."""
