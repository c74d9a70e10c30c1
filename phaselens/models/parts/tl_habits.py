"""TransformerLens habits on phaselens' own models (docs/transformer_lens.md).

* :class:`PhaseCache` is what ``run_with_cache`` returns on every model kind: TransformerLens's
  ``ActivationCache``, whose tuple keys also resolve phaselens' names (``cache["pattern_entry", 0]``,
  ``cache["kv", 1]``), whose missing names are a :class:`~phaselens.errors.HookNameError` that says what
  exists instead, and whose residual methods refuse, with the reason, what a model kind cannot mean (a
  DeepSeek-V4 residual is ``hc_mult`` hyper-connection streams: no additive decomposition).
  ``ln_final.hook_scale`` / ``blocks.{l}.ln{1,2}.hook_scale`` ``[batch, pos, 1]`` are computed from the cached
  residual (``hook_resid_post`` of the last block / ``hook_resid_pre`` / ``hook_resid_mid``) with the model's
  own norm, so ``apply_ln=True`` and ``logit_attrs`` work without a hook of their own.
* :class:`TLHabits` is the mixin of every model kind: ``tokenizer``, ``to_str_tokens``, ``to_string``,
  ``to_single_token``, ``tokens_to_residual_directions`` (what ``logit_attrs`` multiplies by) and a
  ``generate`` that says where to decode when a kind has none.
* :func:`check_names_filter`: a ``names_filter`` that selects no hook is an error naming what it wanted, never
  an empty cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.utilities import get_act_name

from phaselens.contract.hooknames import explain_missing
from phaselens.errors import HookNameError, InputError, UnsupportedModelError
from phaselens.models.parts.tl_cache import CacheCompletion, checked, limit

# TransformerLens names a filter may be written for; each is explained when the model lacks it
_TL_PROBES = ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_k", "blocks.0.attn.hook_v",
              "blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_result", "blocks.0.ln1.hook_scale",
              "ln_final.hook_scale", "hook_pos_embed", "blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k")
_SCALE = re.compile(r"^(?:ln_final|blocks\.(\d+)\.ln([12]))\.hook_scale$")
_BLOCK_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def _accepts(names_filter: Any, name: str) -> bool:
    try:
        return bool(names_filter(name))
    except Exception:  # a filter written for other names may fail on these: it does not select them
        return False


def check_names_filter(names: Sequence[str], names_filter: Any) -> list[str]:
    """The names of ``names`` (the model's hook names) that ``names_filter`` selects: ``None`` (all), a name,
    a list of names or a predicate.

    A filter that selects nothing raises a :class:`HookNameError`: for ``lambda n: n.endswith("pattern")`` on a
    compressed model it explains that the pattern is split into ``hook_pattern_local`` / ``_entry`` / ``_sink``.
    """
    names = list(names)
    if names_filter is None:
        return names
    if isinstance(names_filter, str) or (isinstance(names_filter, Iterable) and not callable(names_filter)):
        wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
        missing = [n for n in wanted if n not in names]
        if missing:
            raise HookNameError(explain_missing(missing[0], names))
        return [n for n in names if n in wanted]
    if not callable(names_filter):
        raise InputError(f"names_filter is None, a hook name, a list of names or a predicate, got {names_filter!r}.")
    chosen = [n for n in names if _accepts(names_filter, n)]
    if chosen:
        return chosen
    absent = [p for p in _TL_PROBES if p not in names and _accepts(names_filter, p)]
    if absent:
        raise HookNameError(f"names_filter selects none of this model's hooks; it was written for {absent[0]!r}: "
                            + explain_missing(absent[0], names))
    raise HookNameError(f"names_filter selects none of this model's {len(names)} hook names (e.g. "
                        f"{', '.join(names[:3])}); model.hook_dict lists them all (docs/hooks.md).")


class PhaseCache(CacheCompletion, ActivationCache):
    """TransformerLens's ``ActivationCache`` of a phaselens model (``model.run_with_cache`` returns it).

    Keys: full names (``"blocks.0.attn.hook_z"``), TransformerLens short names (``"embed"``) and tuples
    ``(name, layer[, sublayer])`` whose name is TransformerLens's or phaselens' own (``("z", 0)``,
    ``("pattern_entry", -1)``, ``("gate_k", 2)``). Every value keeps its hook's shape (docs/hooks.md).
    """

    def _candidates(self, key: Any) -> list[str]:
        if isinstance(key, str):
            out = [key]
            try:
                out.append(get_act_name(key))
            except Exception:
                pass
            return out
        name, layer, *rest = (*key, None) if len(key) == 1 else key
        if isinstance(layer, int) and layer < 0:
            layer += self.model.cfg.n_layers
        short = name[len("hook_"):] if name.startswith("hook_") else name
        try:
            tl = get_act_name(short, layer, *rest)
        except Exception:
            tl = None
        out = [] if tl is None else [tl]
        if layer is not None:
            attn = f"blocks.{layer}.attn.hook_{short}"
            # TransformerLens puts a name it does not know at block level: phaselens' own sites are attention's
            guessed = tl == f"blocks.{layer}.hook_{short}" and short not in _BLOCK_SITES
            out = [attn, *out] if guessed or tl is None else [*out, attn]
            out += [f"blocks.{layer}.hook_{short}", f"blocks.{layer}.mlp.hook_{short}"]
        return list(dict.fromkeys(out))

    def __getitem__(self, key: Any) -> Tensor:
        if isinstance(key, str) and key in self.cache_dict:
            return self.cache_dict[key]
        names = self._candidates(key)
        for name in names:
            if name in self.cache_dict:
                return self.cache_dict[name]
        for name in names:
            if _SCALE.match(name):
                return self._scale(name)
        table = getattr(self.model, "hook_dict", None)
        hooks = list(table) if table is not None else list(self.cache_dict)
        present = [n for n in names if n in hooks]
        if present:
            raise HookNameError(f"{present[0]!r} is a hook of this model but not in this cache: run_with_cache's "
                                f"names_filter left it out; include it (e.g. names_filter=[{present[0]!r}, ...]).")
        raise HookNameError(explain_missing(names[0], hooks))

    def __contains__(self, key: Any) -> bool:
        return any(n in self.cache_dict for n in self._candidates(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def _scale(self, name: str) -> Float[Tensor, "batch pos 1"]:
        """The norm's scale ``sqrt(mean(x**2) + eps)`` (RMS) or ``sqrt(var(x) + eps)`` (LN) of the residual it reads."""
        limit(self.model, "apply_ln")
        norm = getattr(self.model, "tl_norm", None)
        if norm is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} has no norm phaselens can rescale with.")
        kind, eps = norm
        m = _SCALE.match(name)
        assert m is not None
        layer = self.model.cfg.n_layers - 1 if m.group(1) is None else int(m.group(1))
        site = "resid_post" if m.group(1) is None else "resid_pre" if m.group(2) == "1" else "resid_mid"
        source = f"blocks.{layer}.hook_{site}"
        if source not in self.cache_dict:
            raise HookNameError(f"{name} is computed from {source} (phaselens has no hook_scale): include it in "
                                "run_with_cache's names_filter to use apply_ln or logit_attrs.")
        x = self.cache_dict[source]
        xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        if kind == "LN":
            xf = xf - xf.mean(-1, keepdim=True)
        return (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt().to(x.dtype)

    def _get_cached_ln_scale(self, layer: Any, mlp_input: bool, pos_slice: Any, batch_slice: Any = None) -> Tensor:
        key = "ln_final.hook_scale" if layer is None or layer == self.model.cfg.n_layers else \
            f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"
        scale = pos_slice.apply(self[key], dim=-2)
        return batch_slice.apply(scale) if batch_slice is not None and self.has_batch_dim else scale

    apply_ln_to_stack = checked("apply_ln_to_stack", lambda c: limit(c.model, "apply_ln"))
    decompose_resid = checked("decompose_resid", lambda c: limit(c.model, "decompose_resid"))
    logit_attrs = checked("logit_attrs", lambda c: limit(c.model, "logit_attrs"))
    logit_lens = checked("logit_lens", lambda c: limit(c.model, "logit_lens"), """TransformerLens's logit lens over
        this cache (``ln_final`` then ``unembed`` on every stacked residual; the last entry is the model's logits).""")
    _ensure_head_results = checked("_ensure_head_results", lambda c: limit(c.model, "head_results"), """TransformerLens's:
        per-head results ``[batch, pos, head, d_model]`` from ``hook_z`` and ``blocks[l].attn.W_O`` (views of every
        kind's weights), unless the kind refuses head results.""")


@dataclass(frozen=True, kw_only=True)
class TLConfig:
    """A model's sizes under TransformerLens's names (``model.cfg``), the fields TransformerLens's cache methods
    read included; each kind that has no TransformerLens config of its own extends it with its extra fields
    (analyses read :class:`~phaselens.contract.dims.ModelDims`, never this).

    Attributes:
        n_layers, n_heads, n_key_value_heads, d_head, d_model, d_vocab, n_ctx: the sizes.
        dtype, device: of the weights (torch objects on every kind).
        normalization_type: ``"RMS"`` or ``"LN"`` (``None``: no norm); final_rms: the final norm is an RMSNorm.
        attn_only: no MLPs; positional_embedding_type: ``"rotary"`` or ``"standard"`` (learned).
    """

    n_layers: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_model: int
    d_vocab: int
    n_ctx: int
    dtype: torch.dtype
    device: torch.device
    normalization_type: str | None = "RMS"
    final_rms: bool = True
    attn_only: bool = False
    positional_embedding_type: str = "rotary"


class TLHabits:
    """TransformerLens's model conveniences for a phaselens model kind.

    A kind sets ``tl_limits`` (``{"decompose_resid" | "apply_ln" | "logit_attrs" | "head_results": why}``),
    ``tl_norm`` (``("RMS" | "LN", eps)`` of its block and final norms, or ``None``), and may override
    :meth:`_find_tokenizer` and :meth:`_unembed_directions`.
    """

    tl_limits: Mapping[str, str] = {}
    tl_norm: tuple[str, float] | None = None

    # ---- tokenizer ---------------------------------------------------------------------------------
    def _find_tokenizer(self) -> Any:
        """The tokenizer of the checkpoint directory the model came from, else ``None``."""
        return None

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: one set with ``model.tokenizer = tok``, else its checkpoint directory's;
        without one an :class:`~phaselens.errors.InputError` says how to give it."""
        tok = self.__dict__.get("_tl_tokenizer")
        if tok is None:
            tok = self._find_tokenizer()
            if tok is not None:
                self.__dict__["_tl_tokenizer"] = tok
        if tok is None:
            raise InputError(
                f"{type(self).__name__} has no tokenizer: set one with "
                "model.tokenizer = transformers.AutoTokenizer.from_pretrained(DIR), or pass token ids."
            )
        return tok

    @tokenizer.setter
    def tokenizer(self, tok: Any) -> None:
        self.__dict__["_tl_tokenizer"] = tok

    def to_str_tokens(self, tokens: Any) -> list[str] | list[list[str]]:
        """Each token as text: a string (encoded first), ids ``[pos]`` or ``[1, pos]`` (a list), ``[batch, pos]``
        (a list per sequence)."""
        tok = self.tokenizer
        if isinstance(tokens, str):
            tokens = tok(tokens, add_special_tokens=False)["input_ids"]
        ids = torch.as_tensor(tokens)
        if ids.dim() == 2 and ids.shape[0] > 1:
            return [[tok.decode([int(i)]) for i in row] for row in ids]
        return [tok.decode([int(i)]) for i in ids.reshape(-1)]

    def to_string(self, tokens: Any) -> str | list[str]:
        """Ids ``[pos]`` as one string, ``[batch, pos]`` as one per sequence."""
        tok = self.tokenizer
        ids = torch.as_tensor(tokens)
        if ids.dim() == 2:
            return [tok.decode(row.tolist()) for row in ids]
        return tok.decode(ids.reshape(-1).tolist())

    def to_single_token(self, text: str) -> int:
        """The id of ``text``, which must encode to exactly one token."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise InputError(f"{text!r} is {len(ids)} tokens ({ids}), not one; pass the token id.")
        return int(ids[0])

    # ---- logit attribution -------------------------------------------------------------------------
    def _unembed_directions(self) -> Float[Tensor, "d_model d_vocab"]:
        """``W_U`` with the final norm's gain folded in (what TransformerLens's ``fold_ln`` computes)."""
        raise UnsupportedModelError(f"{type(self).__name__} has no linear unembedding to attribute logits to.")

    def tokens_to_residual_directions(self, tokens: Any) -> Float[Tensor, "*tokens d_model"]:
        """The residual direction of each token id (or text) ``tokens`` ``[*shape]``: ``[*shape, d_model]``.

        Directions include the final norm's gain, so ``cache.logit_attrs(cache.decompose_resid(...), t)``
        summed over components is the logit of ``t`` (less any unembedding bias)."""
        limit(self, "logit_attrs")
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        w = self._unembed_directions()
        ids = torch.as_tensor(tokens, device=w.device).long()
        return w[:, ids].movedim(0, -1)

    # ---- generation --------------------------------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(
            f"{type(self).__name__} has no generate(): phaselens analyses score one forward. Decode with the "
            "wrapped model (adapter.model.generate(input_ids, max_new_tokens=...) for transformers models)."
        )


def tokenizer_from_dir(path: Any) -> Any:
    """The tokenizer saved in the local directory ``path`` (a checkpoint's), else ``None``; never a download."""
    from pathlib import Path

    if not path or not Path(str(path)).is_dir():
        return None
    folder = Path(str(path))
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


# DeepSeek-V4 and V4.1: what TransformerLens's residual methods cannot mean on hyper-connection streams
_STREAMS = ("its residual is hc_mult hyper-connection streams [batch, pos, hc, d_model] that every block mixes "
            "(resid_post = comb @ resid_pre + post * out, with input-dependent comb and post)")
HYPER_CONNECTION_LIMITS: Mapping[str, str] = {
    "decompose_resid": f"{_STREAMS}, so attention and MLP outputs do not sum to it; stack the residual itself with "
                       "accumulated_resid() or stack_activation('resid_post').",
    "apply_ln": f"{_STREAMS}, and the final norm reads them after a learned, input-dependent collapse (hc_head), so "
                "no norm scale applies to one stream; call it with apply_ln=False.",
    "logit_attrs": f"{_STREAMS}, collapsed nonlinearly before the final norm, so a linear logit attribution would "
                   "not sum to the logits; compare logits under patch() or ablate() instead.",
    "logit_lens": f"{_STREAMS}, collapsed by a learned, input-dependent map (hc_head) before the final norm, so no "
                  "stream read through ln_final and W_U is what the model predicts; compare logits of the model "
                  "under patch() or ablate() instead.",
    "head_results": "the output projection is grouped and low-rank (o_groups, o_lora_rank), so there is no per-head "
                    "W_O to form results with; read blocks.{l}.attn.hook_z per head.",
}
