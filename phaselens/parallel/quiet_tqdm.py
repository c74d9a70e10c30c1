"""Imported for its effect: ``tqdm.auto`` is imported once, without its "IProgress not found" warning.

transformers (imported by transformer_lens and by the DeepSeek-V4 adapter) imports ``tqdm.auto`` at module
level; in a notebook without ipywidgets that import warns, and tqdm falls back to text bars anyway.
Importing it first, quietly, keeps the same fallback without the warning. The packages that import
transformers import this module first.
"""

from phaselens.parallel.progress import quiet_tqdm_auto

quiet_tqdm_auto()
