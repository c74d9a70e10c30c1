"""What a run costs before it runs: memory, FLOPs, model calls, GPUs and time, for every analysis and model kind.

``phaselens.plan(model_or_checkpoint, analysis, task, **options)`` (:mod:`.plans`) is the public call. It reads
what the analysis declares it will run (:meth:`~phaselens.analyses.runner.Analysis.units`) and the model's
sizes, and never runs the model:

* :mod:`.planned_items`: the items' shape without building them;
* :mod:`.counting`: model calls and token passes of the declared passes, cells and engine;
* :mod:`.peak_memory`: the run's largest step;
* :mod:`.run_plan`: :class:`Plan`, a run on a model in this process;
* :mod:`.checkpoint_plan` and :mod:`.checkpoint_report`: :class:`ModelPlan`, what a released checkpoint needs
  (``phaselens plan SOURCE``: weights, GPUs, a node for a per-head map), from its ``config.json``;
* :mod:`.flops` and :mod:`.gpu_time`: DeepSeek-V4.1's FLOPs and bytes per layer kind, and their time on GPUs.

Planning sits above analyses and models (it reads both) and below presentation (docs/architecture.md).
"""

from phaselens.planning.checkpoint_report import ModelPlan
from phaselens.planning.plans import plan
from phaselens.planning.run_plan import Plan

__all__ = ["ModelPlan", "Plan", "plan"]
