"""Served models: an OpenAI-compatible endpoint (vLLM, SGLang, ``transformers serve``) as a black-box model
kind. ``phaselens.load("http://HOST:PORT/v1", model=NAME, tokenizer=PATH)`` builds one (:mod:`.loader`); the
model answers prompts (:mod:`.model`), asked in each server's dialect (:mod:`.protocols`), every reply checked
against the dialect's schema before it is read (:mod:`.replies`), over one HTTP client with a deadline per
request and retries (:mod:`.endpoint`), many at a time (:mod:`.dispatch`), in the served tokenizer's ids
(:mod:`.vocabulary`). See docs/served.md.
"""

from phaselens.models.served.loader import load_served, stride_from_config
from phaselens.models.served.model import ServedModel

__all__ = ["ServedModel", "load_served", "stride_from_config"]
