"""What every model kind shares: the kinds map their own modules onto these parts and never import each other.

* hooks: :mod:`.hook_sites` (the one hook-site table format, the one dispatch of user hooks and the one check of
  what they return), :mod:`.hooking` (hook contexts and dispatch on TransformerLens modules, and on models the
  kind did not build), :mod:`.tl_habits` (TransformerLens's model surface: ``PhaseCache``, ``TLConfig``);
* engines: :mod:`.suffix_engine` (the query-suffix engine base every kind's engine subclasses) and
  :mod:`.cache_repeat` (a transformers cache repeated for a pass of cells);
* numerics: :mod:`.formats` (FP8 / FP4 values and round trips), :mod:`.packed` (weights in their stored FP8 / FP4
  layouts), :mod:`.rope` (RoPE / YaRN), :mod:`.norms` (RMSNorm), :mod:`.dtypes` (the compute dtype),
  :mod:`.chunks` (prefill pieces and the query piece), :mod:`.index_topk` (a sparse indexer's top-k notice);
* :mod:`.tokens` (checked token ids), :mod:`.config_fields` (a ``config.json``'s fields checked by type and
  range) and :mod:`.wrappers` (views of models other libraries rewired).

Nothing is re-exported here: import from the defining module.
"""
