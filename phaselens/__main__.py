"""``python -m phaselens ...``: the command line, also under torchrun.

``torchrun --nproc-per-node N -m phaselens map w8s4 --out map.csv`` starts N ranks that split the map's
cells (see :mod:`phaselens.parallel.distributed`); rank 0 prints, shows the progress bar and writes the outputs.
"""

from phaselens.presentation.cli import app

if __name__ == "__main__":
    app(prog_name="phaselens")
