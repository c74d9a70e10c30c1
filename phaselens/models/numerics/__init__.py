"""The numerics every model kind shares: one implementation each, below the kinds (no kind imports another;
this package imports none of them).

* :mod:`.formats`: FP8 (E4M3) and FP4 (E2M1) values, power-of-two scales, block-scaled round trips;
* :mod:`.packed`: weights kept in their stored FP8 / FP4 layouts, and dequantizing them;
* :mod:`.rope`: RoPE / YaRN inverse frequencies and the rotation;
* :mod:`.dtypes`: the compute dtype (at least fp32); :mod:`.norms`: RMSNorm in it;
* :mod:`.chunks`: splitting a forward into prefill pieces and the hooked query piece;
* :mod:`.sizing`: bytes of dtypes and modules, for memory estimates;
* :mod:`.notices`: warnings every kind emits (:class:`~.notices.IndexTopKWarning`).

Nothing is re-exported here: import from the defining module.
"""
