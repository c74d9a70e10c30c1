"""What a released checkpoint needs, from its ``config.json`` alone: ``phaselens plan SOURCE``.

:func:`plan_model` builds the model on the meta device (shapes and dtypes, no memory, no weights read) and
reports, in bytes:

* the weights **as stored** (the text model in the checkpoint's formats: FP8 projections, FP4 experts, bf16
  and fp32 tensors; Engram's tables separately; the draft layers and the vision tower are not counted) and
  **as loaded** on GPUs by phaselens (DeepSeek-V4.1: packed, :mod:`phaselens.models.parts.packed`;
  DeepSeek-V4: as transformers' finegrained-fp8 integration keeps them on CUDA), with the dequantized size
  for comparison;
* one forward at ``context`` tokens, prefilled in pieces of ``chunk``: the cache, the attention scores (the
  softmax holds about four copies), the other activations and the logits (each model's ``estimate_memory``);
* how many GPUs of ``gpu_memory`` that takes: the layers (whole, as accelerate never splits one) in contiguous
  runs filled one GPU after another, as ``device_map="auto"`` fills them, with the cache and one call's
  transients on every GPU, 90% of each GPU usable (CUDA's context, the allocator's fragmentation);
* the smallest node (1, 2, 4 or 8 of those GPUs) that runs a per-head map at ``map_context`` tokens (one
  forward per cell and item, batch 1, as ``specialization_map(engine="full")`` runs it), and the largest
  prefill chunk that fits there;
* DeepSeek-V4.1's Engram: device maps keep its tables in host memory
  (:mod:`phaselens.models.deepseek_v41.device_maps`), so the GPUs hold every layer but the tables, and the plan
  states the host memory and the bytes per token its lookups send to the GPUs;
* DeepSeek-V4.1's time (``time``, :mod:`phaselens.planning.gpu_time`): FLOPs, bytes, seconds and GPU-hours of
  the forward above and of a per-head map with the query-suffix engine (its cells as
  :meth:`~phaselens.analyses.maps.Map.units` declares them), at ``mfu`` of the GPU's peaks.

Sizes are estimates from the code's tensors, not measurements on a GPU (see ``docs/scale.md``).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from phaselens.errors import CheckpointError, InputError, UnsupportedModelError
from phaselens.models.numerics.sizing import addressable
from phaselens.planning.checkpoint_report import GPU_TYPES, USABLE, GiB, ModelPlan, gpu_bytes, gpu_type
from phaselens.planning.gpu_time import MFU, gpu_spec, plan_time
from phaselens.storage.reading import parse_json

NODE_SIZES = (1, 2, 4, 8)
CHUNKS = (4096, 2048, 1024, 512, 256, 128, 64)
MAP_ITEMS = 8  # the time of a map: items (one per residue mod 8, as docs/scale.md's plans)
MAP_CONTEXT = 131072  # the per-head map's default context
MAX_COUNT = 2**53  # tokens, sequences, items: counts priced as float sums stay exact
MAX_CALLS = 2**20  # prefill calls one estimate walks (the released 1M-token context in chunks of 1)
FP32_STORED = ("hc_", "attn_sink", "gate.bias")  # V4.1 tensors the release stores in fp32 (the rest: bf16)


# ---- the two model families ----------------------------------------------------------------------------
class _Sized:
    """A meta-device model and how to size one of its forwards."""

    def __init__(self, root: Path, raw: dict[str, Any], engram: str = "run") -> None:
        self.root, self.raw, self.engram_mode = root, raw, engram
        self.model_type = str(raw.get("model_type"))
        self.notes: list[str] = []
        if self.model_type == "deepseek_v41":
            self._v41()
        elif self.model_type == "deepseek_v4":
            self._v4()
        else:
            raise UnsupportedModelError(f"{root}/config.json has model_type {self.model_type!r}; phaselens plans "
                                        "DeepSeek-V4 ('deepseek_v4') and DeepSeek-V4.1 ('deepseek_v41').")

    def _v41(self) -> None:
        from phaselens.models.deepseek_v41.checkpoint import meta_v41
        from phaselens.models.deepseek_v41.config import quantization

        # the loader's own build (its config checks included); no quantization_config: weights stored dense
        packed = bool(quantization(self.raw)) or any(self.root.glob("*.safetensors"))
        self.meta = meta_v41(self.root, engram=self.engram_mode, weights="packed" if packed else "dequantized")
        if not packed:
            self.notes.append("config.json has no quantization_config: weights planned dense (bf16), as stored.")
        self.dense = _v41_dequantized(self.meta)
        self.stored = self._v41_stored()
        cfg = self.meta.config
        dim = cfg.engram_head_dim
        self.engram = sum(cfg.engram_num_embeddings) * (dim + dim // 32)  # FP8 values + a UE8M0 scale per 32
        layers = list(cfg.engram_layer_ids)
        if self.engram and self.engram_mode == "drop":
            self.notes.append(f"Engram's tables ({self.engram / GiB:,.1f} GiB as stored, layers {layers}) are not "
                              "loaded (engram='drop', an ablation); weights as loaded leave them out.")
        elif self.engram:
            self.notes.append(f"Engram's tables ({self.engram / GiB:,.1f} GiB, FP8 as stored, layers {layers}) stay "
                              "in host memory under a device map; each lookup sends only its rows to the layer's "
                              "GPU. --engram drop plans the model without them.")

    def _v41_stored(self) -> int:
        """The text model's bytes in the checkpoint: shard headers when present, else the release's formats."""
        from phaselens.models.deepseek_v41.weights import read_index, target, wanted

        if any(self.root.glob("*.safetensors")):
            keep = {"skip_engram": self.engram_mode == "drop", "n_layers": self.meta.config.num_hidden_layers}
            return sum(st.nbytes for name, st in read_index(self.root).items()
                       if wanted(name, **keep) and target(name).module != "")  # type: ignore[arg-type]
        total = 0
        for name, t in [*self.meta.named_parameters()]:
            if t.element_size() == 1:  # packed bytes, or FP8 kept as stored (Engram's tables): as is
                total += t.numel()
            else:
                total += t.numel() * (4 if any(m in name for m in FP32_STORED) else 2)
        return total

    def _v4(self) -> None:
        from phaselens.models.deepseek_v4 import from_transformers
        from phaselens.models.deepseek_v4.config_checks import check_v4_config

        check_v4_config(self.raw, where=f"{self.root / 'config.json'}")  # load_hf's check, its message
        meta = _v4_meta(self.root, packed=True)
        self.dense = held_bytes(_v4_meta(self.root, packed=False))
        self.stored = held_bytes(meta)
        self.engram = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.meta = from_transformers(meta, index_topk="all")
        self.notes.append("weights as loaded: FP8/FP4 kept packed, as transformers' finegrained-fp8 integration "
                          "does on CUDA (on CPU transformers dequantizes them).")

    def weights(self) -> int:
        return held_bytes(self.meta)

    def host_bytes(self) -> int:
        """Bytes device maps keep in host memory (``host_resident`` modules: Engram's tables)."""
        from phaselens.contract.protocol import module_of

        return sum(t.numel() * t.element_size() for m in module_of(self.meta).modules()
                   if getattr(type(m), "host_resident", False) for t in [*m.parameters(), *m.buffers()])

    def max_positions(self) -> int:
        """The longest sequence a forward takes (``max_position_embeddings``; the V4.1 model refuses more)."""
        c = self.meta.config if self.model_type == "deepseek_v41" else self.meta.model.config
        return int(c.max_position_embeddings)

    def estimate(self, context: int, batch: int, chunk: int | None) -> dict[str, int]:
        """One forward's memory: the model's ``estimate_memory`` (from its layer table), and for DeepSeek-V4 the
        table's other transients (the fp32 hyper-connection streams), which the adapter's run-time price leaves
        out."""
        if self.model_type == "deepseek_v41":
            from phaselens.models.deepseek_v41.memory import estimate_memory

            e = estimate_memory(self.meta, context, batch=batch, chunk=chunk, logits="query")
            return {"cache": e.cache, "attention": e.attention, "activations": e.activations, "logits": e.logits}
        from phaselens.models.deepseek_v4.layer_table import layer_table
        from phaselens.models.deepseek_v4.memory import estimate_memory as v4_estimate
        from phaselens.models.parts.chunks import plan_chunks

        e = v4_estimate(self.meta, context, batch=batch, chunk=chunk, logits="query")
        table = layer_table(self.meta)
        streams = max(table.transient_bytes(a, b, batch) for a, b in plan_chunks(context, chunk, None).calls)
        return {"cache": e.cache, "attention": e.attention, "activations": streams, "logits": e.logits}

    def units(self) -> list[int]:
        """Bytes of the pieces a device map places, in execution order (layers whole: accelerate's no-split)."""
        from phaselens.contract.protocol import module_of
        from phaselens.parallel.replicas import _units

        if not hasattr(self, "_sizes"):
            self._sizes = [b for _, b in _units(module_of(self.meta))]
        return self._sizes


def _v41_dequantized(model: Any) -> int:
    """Bytes of the V4.1 model with every packed weight dequantized to the model dtype."""
    total = 0
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if getattr(module, "fmt", None) is None:
            total += sum(t.numel() * t.element_size() for t in own)
            continue
        item = torch.empty((), dtype=module.dtype).element_size()
        shapes = module.shapes.values() if hasattr(module, "shapes") else [module.shape]
        total += sum(math.prod(s) for s in shapes) * item
    return total


def head_map_layers(model: Any, context: int, items: int, item_batch: int) -> tuple[int, ...]:
    """The layer of each cell of a per-head map (``kinds=("head",)``, the query-suffix engine) of ``items``
    items of ``context`` tokens, as :meth:`~phaselens.analyses.maps.Map.units` declares them."""
    from phaselens.analyses.maps import Map
    from phaselens.analyses.runner import Common
    from phaselens.planning.planned_items import PlannedItems

    shape = PlannedItems(items, context, (context - 1,), 1)
    units = Map(method="zero", kinds=("head",), engine="suffix").units(model, shape, Common(1, batch_size=item_batch))
    return units.cell_layers


def gpus_for(sizes: list[int], room: float) -> int | None:
    """GPUs that hold ``sizes`` (contiguous runs, in order) with ``room`` bytes of weights each: filled one after
    another, as ``device_map="auto"`` fills GPUs (the fewest contiguous runs); ``None`` if a piece exceeds it."""
    if room <= 0 or max(sizes) > room:
        return None
    n, used = 1, 0
    for size in sizes:
        if used + size > room:
            n, used = n + 1, 0
        used += size
    return n


def fullest(sizes: list[int], k: int) -> int:
    """The fullest GPU's weights in the most even cut of ``sizes`` into at most ``k`` contiguous runs."""
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        n = gpus_for(sizes, mid)
        lo, hi = (lo, mid) if n is not None and n <= k else (mid + 1, hi)
    return lo


def held_bytes(model: Any) -> int:
    """Bytes the model's module holds in parameters and buffers (at their dtypes; meta tensors count too)."""
    from phaselens.contract.protocol import module_of

    m = module_of(model)
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def _v4_meta(root: Path, *, packed: bool) -> Any:
    """transformers' DeepSeek-V4 on the meta device in bf16; ``packed``: with the FP8/FP4 modules its quantizer
    puts in place on CUDA (FP8Linear, FP8Experts)."""
    from transformers import AutoConfig, DeepseekV4ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
        config._attn_implementation = "eager"
        with torch.device("meta"), addressable(str(root / "config.json")):
            model = DeepseekV4ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
        quant = getattr(config, "quantization_config", None)
        if packed and quant:
            from transformers.integrations import finegrained_fp8
            from transformers.quantizers.auto import AutoHfQuantizer

            # transformers wraps FP8Experts.__init__ / forward again for every experts module it replaces, so
            # a process that planned ~20 V4 models hit a RecursionError: the class is put back as it was
            experts = finegrained_fp8.FP8Experts
            saved = {k: experts.__dict__[k] for k in ("__init__", "forward") if k in experts.__dict__}
            try:
                AutoHfQuantizer.from_config(quant, pre_quantized=True).preprocess_model(model, dtype=torch.bfloat16)
            finally:
                for k, v in saved.items():
                    setattr(experts, k, v)
    return model


def _read_config(source: str) -> tuple[Path, dict[str, Any]]:
    text = str(source)
    root = Path(text[3:] if text.startswith("hf:") else text).expanduser()
    cfg = root / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"no config.json in {root}; pass a checkpoint directory (or one that holds only its "
                              "config.json), e.g. `phaselens plan hf:/data/DeepSeek-V4.1-Flash`.")
    from phaselens.storage.resumable import read_json

    return root, read_json(cfg, fix="restore config.json from the checkpoint's source.")  # the loaders' reader


def _files_bytes(root: Path) -> int | None:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            return int(parse_json(index.read_text()).get("metadata", {}).get("total_size"))
        except (ValueError, TypeError, AttributeError, OSError):  # a damaged index: the size is unknown
            return None
    shards = list(root.glob("*.safetensors"))
    return sum(p.stat().st_size for p in shards) if shards else None


def option(name: str) -> str:
    """How ``phaselens plan`` spells ``plan_model``'s keyword ``name``, with the keyword: ``--map-context
    (map_context=)``; plan's messages name its own options."""
    return f"--{name.replace('_', '-')} ({name}=)"


def plan_model(source: str, *, context: int = 131072, gpu_memory: str | float = "141", chunk: int | None = None,
               batch: int = 1, map_context: int | None = None, engram: str = "run", items: int = MAP_ITEMS,
               item_batch: int = 1, mfu: float = MFU, peak_tflops: float | None = None,
               fp32_tflops: float | None = None, hbm_tbps: float | None = None) -> ModelPlan:
    """The :class:`ModelPlan` of the checkpoint directory ``source`` (``hf:DIR`` or ``DIR``; ``config.json``
    alone is enough). ``chunk=None`` takes the chunk of the smallest node found for the map; ``engram``
    (DeepSeek-V4.1) is ``load``'s: ``"run"`` (the tables in host memory, the rest on the GPUs) or ``"drop"``;
    ``map_context`` (default: 128K tokens, or the model's longest sequence if shorter).

    Time (DeepSeek-V4.1): a map of ``items`` items in batches of ``item_batch``; ``mfu`` the fraction of the
    GPU's peaks reached; ``peak_tflops`` (bf16 dense), ``fp32_tflops`` and ``hbm_tbps`` override the peaks of
    the GPU type ``gpu_memory`` names or sizes (an H100's when it names none; see :mod:`phaselens.planning.gpu_time`).

    The config goes through the loader's own checks (the same error, the same message as ``load``), and every
    size is priced from numbers before anything is built at that size: a context longer than the model's
    ``max_position_embeddings`` is refused, as its forward would be."""
    if engram not in ("run", "drop"):
        raise InputError(f"{option('engram')} must be 'run' or 'drop', got {engram!r}.")
    for name, value in (("context", context), ("batch", batch), ("map_context", map_context), ("items", items),
                        ("item_batch", item_batch), ("chunk", chunk)):
        if value is None and name in ("map_context", "chunk"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            # every count is bounded before anything is priced: costs are float sums of counts
            raise InputError(f"{option(name)} must be an integer in 1..{MAX_COUNT:,} (2^53), got {value!r}.")
    for name, rate, most in (("mfu", mfu, 1.0), ("peak_tflops", peak_tflops, math.inf),
                             ("fp32_tflops", fp32_tflops, math.inf), ("hbm_tbps", hbm_tbps, math.inf)):
        number = isinstance(rate, int | float) and not isinstance(rate, bool)
        if (rate is not None or name == "mfu") and not (number and 0 < rate <= most and rate < math.inf):
            raise InputError(f"{option(name)} must be a positive number{' of at most 1' if name == 'mfu' else ''}, "
                             f"got {rate!r}.")
    usable = USABLE * gpu_bytes(gpu_memory)
    root, raw = _read_config(source)
    sized = _Sized(root, raw, engram)
    most = sized.max_positions()
    map_context = min(MAP_CONTEXT, most) if map_context is None else map_context
    for name, value, step in (("context", context, chunk or min(CHUNKS)), ("map_context", map_context, min(CHUNKS))):
        if value > most:
            raise InputError(f"{option(name)}={value:,} tokens exceeds the model's max_position_embeddings={most:,} "
                             f"(config.json): a forward of more is refused; plan at most {most:,} tokens.")
        calls = -(-value // step)
        if calls > MAX_CALLS:  # each model's estimate walks every prefill call: price, never hang
            fix = (f"use --chunk {-(-value // MAX_CALLS)} or larger" if name == "context" else
                   f"use --map-context {MAX_CALLS * step} or fewer")
            raise InputError(f"{option(name)}={value:,} tokens in chunks of {step:,} is {calls:,} prefill calls, "
                             f"more than phaselens prices ({MAX_CALLS:,}); {fix}.")
    weights, sizes = sized.weights(), sized.units()

    def transient(ctx: int, b: int, c: int | None) -> int:
        e = sized.estimate(ctx, b, c)
        return e["cache"] + 4 * e["attention"] + e["activations"] + e["logits"]

    fits = {c: transient(map_context, 1, c) for c in CHUNKS if c < map_context}  # a map: batch 1
    node = next(((k, c) for k in NODE_SIZES for c, t in fits.items()
                 if (n := gpus_for(sizes, usable - t)) is not None and n <= k), (None, None))
    use_chunk = chunk if chunk is not None else (node[1] or min(CHUNKS))
    use_chunk = None if use_chunk >= context else use_chunk
    e = sized.estimate(context, batch, use_chunk)
    peak = e["cache"] + 4 * e["attention"] + e["activations"] + e["logits"]
    gpus = gpus_for(sizes, usable - peak)
    gpus = gpus if gpus is not None and gpus <= 64 else None
    extra: dict[str, Any] = {}
    if sized.model_type == "deepseek_v41":
        from phaselens.models.deepseek_v41.engram import engram_traffic
        from phaselens.models.deepseek_v41.layer_table import layer_table

        host = sized.host_bytes()
        per_token = engram_traffic(sized.meta.config).bytes_per_token if host else 0
        rows = (min(use_chunk, context) if use_chunk else context)
        extra = dict(
            engram_placement="host" if host else None, engram_host_bytes=host, engram_bytes_per_token=per_token,
            engram_map_context_bytes=per_token * map_context,
            time=plan_time(layer_table(sized.meta), gpu=gpu_spec(gpu_type(gpu_memory), bf16_tflops=peak_tflops,
                                                    fp32_tflops=fp32_tflops, hbm_tbps=hbm_tbps), mfu=mfu,
                           context=context, chunk=use_chunk, batch=batch, head_rows=rows, gpus=gpus,
                           map_context=map_context, map_chunk=node[1] or min(CHUNKS), map_gpus=node[0],
                           map_layers=head_map_layers(sized.meta, map_context, items, item_batch),
                           items=items, item_batch=item_batch))
    else:
        sized.notes.append("time (FLOPs, GPU-hours) is priced for DeepSeek-V4.1 only.")
    return ModelPlan(
        source=str(source), model_type=sized.model_type, config_only=not any(root.glob("*.safetensors")),
        weights_stored_bytes=sized.stored, engram_stored_bytes=sized.engram, files_bytes=_files_bytes(root),
        weights_bytes=weights, weights_dequantized_bytes=sized.dense, context=context, batch=batch,
        chunk=use_chunk, cache_bytes=e["cache"], attention_bytes=e["attention"], activation_bytes=e["activations"],
        logits_bytes=e["logits"], peak_bytes=weights + peak, gpu_memory_bytes=gpu_bytes(gpu_memory), gpus=gpus,
        per_gpu_bytes=None if gpus is None else fullest(sizes, gpus) + peak, map_context=map_context,
        map_node_gpus=node[0], map_node_chunk=node[1], notes=sized.notes, **extra)


__all__ = ["GPU_TYPES", "ModelPlan", "gpu_bytes", "plan_model"]
