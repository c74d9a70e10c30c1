"""The harness of ``tests.reference.v4_parity``: DeepSeek-V4's reference model on CPU emulations of its kernels
(``loader``) and the op-by-op comparison with transformers' ops (``ops``)."""
