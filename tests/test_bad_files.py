"""Bad files and bad model/cache inputs raise a PhaseLensError subclass whose message names the fix (issue 14,
section 3: corrupt files, ``hf:`` directories, caches, devices, empty inputs).

Every case is one row of ``CASES``: ``(id, make, error class, a phrase of the fix)``; ``make(tmp_path)``
returns the call that must fail.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import phaselens
from phaselens.errors import (
    CacheError,
    CheckpointError,
    InputError,
    JournalError,
    PhaseLensError,
    UnsupportedModelError,
)
from tests.support.models import LAYOUTS, make_model

MODEL = make_model(LAYOUTS["w4s4-scalar"])
NULL = object()  # an edit returning this writes the JSON literal null


def saved(tmp_path, card=None):
    MODEL.save(tmp_path / "m", metadata=card)
    return tmp_path / "m"


def truncate(path, frac=0.5):
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * frac)])


def with_config(edit):
    """A saved checkpoint whose config.json is ``raw`` edited in place by ``edit``, or replaced by the list or
    ``NULL`` that ``edit`` returns."""
    def make(tmp_path):
        d = saved(tmp_path)
        raw = json.loads((d / "config.json").read_text())
        out = edit(raw)
        (d / "config.json").write_text(json.dumps(None if out is NULL else out if isinstance(out, list) else raw))
        return lambda: phaselens.load(d)
    return make


def _truncated_weights(tmp_path):
    d = saved(tmp_path)
    truncate(d / "model.safetensors")
    return lambda: phaselens.load(d)


def _random_weights(tmp_path):
    d = saved(tmp_path)
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    return lambda: phaselens.load(d)


def _bad_card(tmp_path):
    d = saved(tmp_path, card={"name": "x"})
    (d / "card.json").write_text("{bad")
    return lambda: phaselens.load(d)


def _cache_after_dtype_change(tmp_path):
    model = make_model(LAYOUTS["w4s4-scalar"])
    cache = model.new_cache(1)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    model.double()
    return lambda: model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def _cache_of_another_model(tmp_path):
    cache = make_model(LAYOUTS["w4s4-scalar"]).new_cache(1)
    return lambda: MODEL(torch.zeros(1, 2, dtype=torch.long), cache=cache)


CASES = [
    ("truncated safetensors", _truncated_weights, CheckpointError, "save the model again"),
    ("random-bytes safetensors", _random_weights, CheckpointError, "save the model again"),
    ("invalid card.json", _bad_card, CheckpointError, "save the model again"),
    ("config missing field", with_config(lambda r: r["config"].pop("n_layers")), CheckpointError, "add them"),
    ("config wrong type (str int)", with_config(lambda r: r["config"].update(n_layers="2")), CheckpointError,
     "n_layers must be an int, got '2'; fix the config"),
    ("config wrong type (str float)", with_config(lambda r: r["config"].update(norm_eps="x")), CheckpointError,
     "norm_eps must be a number"),
    ("config wrong type (bool)", with_config(lambda r: r["config"].update(sink="yes")), CheckpointError,
     "must be true or false"),
    ("config wrong type (compression str)", with_config(lambda r: r["config"].update(compression="abc")),
     CheckpointError, r"compression must be a CompressorSpec \(a JSON object\) or null"),
    ("config null", with_config(lambda r: NULL), CheckpointError, "JSON object is needed"),
    ("config list", with_config(lambda r: [1, 2]), CheckpointError, "JSON object is needed"),
    ("config.config null", with_config(lambda r: r.update(config=None)), CheckpointError, "save the model again"),
    ("config.config list", with_config(lambda r: r.update(config=[1])), CheckpointError, "save the model again"),
    ("config field null", with_config(lambda r: r["config"].update(d_model=None)), CheckpointError,
     "d_model must be an int, got None"),
    ("config rope list", with_config(lambda r: r["config"].update(rope=[1])), CheckpointError, "JSON object"),
    ("config float where int", with_config(lambda r: r["config"].update(local_window=2.5)), CheckpointError,
     "local_window must be an int"),
    ("config negative size", with_config(lambda r: r["config"].update(n_heads=-4)), CheckpointError,
     "must be a positive int"),
    ("config compressed_layers str", with_config(lambda r: r["config"].update(compressed_layers="01")),
     CheckpointError, "compressed_layers must be a list of ints or null"),
    ("config stride str", with_config(lambda r: r["config"]["compression"].update(stride="4")), CheckpointError,
     "stride"),
    ("config bad default_task", with_config(lambda r: r.update(default_task={"kind": "nope"})), CheckpointError,
     "known kinds"),
    ("new_cache(max_len=0)", lambda p: lambda: MODEL.new_cache(1, max_len=0), CacheError, "positive int max_len"),
    ("new_cache(batch_size=1.5)", lambda p: lambda: MODEL.new_cache(1.5), CacheError, "positive int batch_size"),
    ("new_cache(batch_size=0)", lambda p: lambda: MODEL.new_cache(0), CacheError, "positive int batch_size"),
    ("prefill(chunk=-2)", lambda p: lambda: MODEL.prefill(torch.zeros(1, 4, dtype=torch.long), MODEL.new_cache(1),
                                                          chunk=-2), InputError, "positive int"),
    ("prefill(chunk=1.5)", lambda p: lambda: MODEL.prefill(torch.zeros(1, 4, dtype=torch.long), MODEL.new_cache(1),
                                                           chunk=1.5), InputError, "positive int"),
    ("cache after dtype change", _cache_after_dtype_change, CacheError, "make a new cache"),
    ("cache of another model", _cache_of_another_model, CacheError, "for this model"),
    ("empty batch [0, T]", lambda p: lambda: MODEL(torch.zeros(0, 5, dtype=torch.long)), InputError,
     "drop empty batches"),
    ("zero-length [B, 0]", lambda p: lambda: MODEL(torch.zeros(2, 0, dtype=torch.long)), InputError,
     "at least one token"),
    ("prefill zero-length", lambda p: lambda: MODEL.prefill(torch.zeros(1, 0, dtype=torch.long), MODEL.new_cache(1)),
     InputError, "at least one token"),
    ("device='cuda:99'", lambda p: lambda: phaselens.load("zoo:w4s4", device="cuda:99"), InputError, "device"),
    ("device='banana'", lambda p: lambda: phaselens.load("zoo:w4s4", device="banana"), InputError, "use 'cpu'"),
]


@pytest.mark.parametrize(("make", "error", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_file_or_input_raises_a_phaselens_error_naming_the_fix(tmp_path, make, error, fix):
    call = make(tmp_path)
    with pytest.raises(error, match=fix) as info:
        call()
    assert isinstance(info.value, PhaseLensError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_one():
    with pytest.raises(InputError, match=r"no CUDA GPU.*use device='cpu'"):
        phaselens.load("zoo:w4s4", device="cuda")


def test_a_failed_zero_length_append_leaves_the_cache_usable():
    tokens = torch.randint(0, 61, (2, 11))
    cache = MODEL.new_cache(2)
    MODEL(tokens[:, :5], cache=cache)
    with pytest.raises(InputError):
        MODEL(tokens[:, :0], cache=cache)
    assert cache.length == 5
    out = MODEL(tokens[:, 5:], cache=cache)
    assert torch.allclose(out, MODEL(tokens)[:, 5:], atol=1e-5)


# ---- hf: directories (a tiny transformers DeepSeek-V4 written once per module) ------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.support.deepseek import tiny_v4_model

    d = tmp_path_factory.mktemp("hf") / "ckpt"
    tiny_v4_model().save_pretrained(d)
    return d


def hf_copy(hf_dir, tmp_path, edit):
    d = tmp_path / "copy"
    shutil.copytree(hf_dir, d)
    edit(d)
    return d


def _edit_config(fn):
    def edit(d):
        raw = json.loads((d / "config.json").read_text())
        fn(raw)
        (d / "config.json").write_text(json.dumps(raw))
    return edit


def _pickled_only(d):
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle stand-in")  # never opened: refused by name
    (d / "model.safetensors").unlink()


HF_CASES = [
    ("invalid JSON", lambda d: (d / "config.json").write_text("{bad"), {}, CheckpointError, "restore config.json"),
    ("config is a list", lambda d: (d / "config.json").write_text("[1]"), {}, CheckpointError, "JSON object"),
    ("truncated shard", lambda d: truncate(d / "model.safetensors"), {}, CheckpointError, "download this shard"),
    ("random shard", lambda d: (d / "model.safetensors").write_bytes(os.urandom(999)), {}, CheckpointError,
     "download this shard"),
    ("index names a missing shard", lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00002-of-00002.safetensors"}})), {}, CheckpointError, "missing"),
    ("layer_types too short in config", _edit_config(lambda r: r.update(layer_types=r["layer_types"][:2])), {},
     CheckpointError, "layer_types"),  # the config's own fields: the same check and message as `phaselens plan`
    ("layer_types= too long", lambda d: None, {"layer_types": ["sliding_attention"] * 9}, UnsupportedModelError,
     "num_hidden_layers=4"),
    ("layer_types= a string", lambda d: None, {"layer_types": "sliding_attention"}, UnsupportedModelError,
     "pass a list"),
    ("pytorch_model.bin only", _pickled_only, {}, UnsupportedModelError, "safetensors only"),
]


@pytest.mark.parametrize(("edit", "kwargs", "error", "fix"), [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES])
def test_bad_hf_directory_is_refused_before_transformers_reads_it(hf_dir, tmp_path, edit, kwargs, error, fix):
    d = hf_copy(hf_dir, tmp_path, edit)
    with pytest.raises(error, match=fix):
        phaselens.load(f"hf:{d}", **kwargs)


# ---- weights the config does not match: refused by name on every loader (issue 24) -------------------------
def _drop_tensor(name):
    def edit(d):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        tensors.pop(name)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def _add_tensor(d):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors["extra.stray"] = torch.zeros(3)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _config(**fields):
    return _edit_config(lambda r: r.update(fields))


# edits transformers answered with its own errors (or loaded a different model); each names the field now
V4_WEIGHT_CASES = [
    ("no lm_head (was random-initialised)", _drop_tensor("head.weight"), "missing tensor.*lm_head.weight"),
    ("an unexpected tensor", _add_tensor, "unexpected tensor.*extra.stray"),
    ("hidden_size=7 (weights mismatch)", _config(hidden_size=7), "wrong shape.*where the model needs"),
    ("vocab_size=7 (weights mismatch)", _config(vocab_size=7), "wrong shape"),
    ("num_attention_heads=0", _config(num_attention_heads=0), "num_attention_heads must be a positive integer"),
    ("head_dim='4'", _config(head_dim="4"), "head_dim must be a positive integer, got '4'"),
    ("o_groups=3", _config(o_groups=3), "o_groups=3 must divide num_attention_heads=4"),
    ("hidden_act='bogus'", _config(hidden_act="bogus"), "hidden_act must name an activation"),
    ("scoring_func='bogus'", _config(scoring_func="bogus"), "scoring_func must be one of"),
    ("dtype='bogus'", _config(dtype="bogus"), "dtype must name a torch dtype"),
    ("sliding_window=-1 (loaded)", _config(sliding_window=-1), "sliding_window must be a positive integer"),
    ("hc_sinkhorn_iters=0 (loaded)", _config(hc_sinkhorn_iters=0), "hc_sinkhorn_iters must be a positive"),
    ("rms_norm_eps=-1 (loaded)", _config(rms_norm_eps=-1), "rms_norm_eps must be a finite number > 0"),
    ("partial_rotary_factor=2 (loaded)", _config(partial_rotary_factor=2.0), r"partial_rotary_factor must be .* \(0, 1\]"),
    ("num_experts_per_tok > experts", _config(num_experts_per_tok=7), "num_experts_per_tok=7 exceeds n_routed_experts=4"),
    ("index_topk=0 (loaded)", _config(index_topk=0), "index_topk must be a positive integer"),
    ("mlp_layer_types bogus", _config(mlp_layer_types=["bogus"] * 4), "mlp_layer_types holds"),
    ("layer_types entry bogus", _config(layer_types=["sliding_attention", "bogus", "heavily_compressed_attention",
                                                      "compressed_sparse_attention"]), "layer_types holds"),
    ("compress_rates negative", _config(compress_rates={"compressed_sparse_attention": -4,
                                                         "heavily_compressed_attention": 16}), "integer >= 2"),
    ("rope_type bogus (loaded)", _config(rope_parameters={"main": {"rope_type": "bogus"}}), "rope_type"),
]


@pytest.mark.parametrize(("edit", "fix"), [c[1:] for c in V4_WEIGHT_CASES], ids=[c[0] for c in V4_WEIGHT_CASES])
def test_v4_weights_or_config_that_disagree_are_named_at_the_boundary(hf_dir, tmp_path, edit, fix):
    d = hf_copy(hf_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=fix):
        phaselens.load(f"hf:{d}")


def test_a_v4_config_override_is_checked_and_named_as_an_argument(hf_dir):
    with pytest.raises(CheckpointError, match="sliding_window must be a positive integer.*passed to load"):
        phaselens.load(f"hf:{hf_dir}", sliding_window=0)


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    from tests.support.deepseek_v41 import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("v41") / "ckpt")


def _v41(edit_text=None, drop=None):
    def edit(d):
        if edit_text is not None:
            raw = json.loads((d / "config.json").read_text())
            edit_text(raw["text_config"])
            (d / "config.json").write_text(json.dumps(raw))
        if drop is not None:
            from safetensors.torch import load_file, save_file

            index = json.loads((d / "model.safetensors.index.json").read_text())
            shard = d / index["weight_map"].pop(drop)
            tensors = load_file(str(shard))
            tensors.pop(drop)
            save_file(tensors, str(shard))
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


V41_CASES = [
    ("no head", _v41(drop="head.weight"), "missing tensor.*head.weight"),
    ("a KV source the weights lack", _v41(lambda t: t.update(kv_source_layer_ids=[2, 4, 5])),
     "layer 5's weights lack a compressor, but kv_source_layer_ids lists it"),
    ("an index source the config omits", _v41(lambda t: t.update(index_source_layer_ids=[2, 4])),
     "layer 5's weights hold an indexer, but index_source_layer_ids omits it"),
    ("a gated source made ratio 1", _v41(lambda t: t.update(compress_ratios=[0, 0, 1, 1, 1, 1, 1, 0])),
     r"compress_ratios\[2\] is 1"),
]


@pytest.mark.parametrize(("edit", "fix"), [c[1:] for c in V41_CASES], ids=[c[0] for c in V41_CASES])
def test_v41_config_and_weights_that_disagree_are_named(v41_dir, tmp_path, edit, fix):
    d = hf_copy(v41_dir, tmp_path, edit)
    with pytest.raises(CheckpointError, match=fix):
        phaselens.load(f"hf:{d}")


def test_v41_records_its_configs_hash(v41_dir):
    import hashlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = phaselens.load(f"hf:{v41_dir}")
    assert model.analysis_metadata["config_sha256"] == hashlib.sha256((v41_dir / "config.json").read_bytes()).hexdigest()


# ---- a damaged analysis journal: malformed arrays (was a pandas ValueError) ----------------------------
def _malformed(tmp_path, cut):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from tests.support.models import task_model

    model, path = task_model(), tmp_path / "ev.journal"
    kw = dict(n_per_residue=1, progress=False, n_bootstrap=0, n_permutations=1, journal=path)
    phaselens.evaluate(model, **kw)
    with safe_open(str(path), "np") as f:  # as written before checksums (with them, the sha256 catches it first)
        meta = {k: v for k, v in f.metadata().items() if k != "phaselens.sha256"}
    arrays = load_file(str(path))
    arrays = {k: (cut(v) if i == 0 else v) for i, (k, v) in enumerate(sorted(arrays.items()))}
    save_file(arrays, str(path), metadata=meta)
    return lambda: phaselens.evaluate(model, **kw)


MALFORMED = [("one field shorter", lambda a: a[:3]), ("a field 2-D", lambda a: a.reshape(1, -1)),
             ("a field of the wrong dtype and length", lambda a: a[:5].astype("float64"))]


@pytest.mark.parametrize("cut", [c[1] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_a_journal_with_malformed_arrays_is_a_journal_error(tmp_path, cut):
    with pytest.raises(JournalError, match="malformed.*delete it to start over"):
        _malformed(tmp_path, cut)()


N_CASES = (len(CASES) + 2 + len(HF_CASES) + len(V4_WEIGHT_CASES) + 1 + len(V41_CASES) + 1
           + len(MALFORMED))  # quoted in the report: cases of this module
