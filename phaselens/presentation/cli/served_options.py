"""What ``eval`` and ``report`` share for served models (``http://HOST:PORT/v1``) and preset tasks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import typer

from phaselens.errors import InputError

TokenizerOpt = Annotated[str | None, typer.Option(
    "--tokenizer", metavar="PATH",
    help="A served model's tokenizer: the checkpoint's tokenizer.json or its folder (its config.json gives the "
         "stride). Without it the server's /tokenize is used (vLLM, SGLang). Also builds --task presets.")]
ServedModelOpt = Annotated[str | None, typer.Option(
    "--served-model", metavar="NAME", help="The model's name on the server (default: the only one it serves).")]
ConcurrencyOpt = Annotated[int | None, typer.Option(
    "--concurrency", metavar="N", min=1, help="Requests in flight at once (default by server: 32 for vLLM and "
                                              "SGLang, 2 for transformers serve).")]
TaskOpt = Annotated[str | None, typer.Option(
    "--task", metavar="NAME", help="A preset task built from the tokenizer: niah-128k (the paper's needle among "
                                   "16,000 records; default for a served model) or fp8-probe (the FP8 completion).")]
RetriesOpt = Annotated[int, typer.Option(
    "--retries", metavar="N", min=0, help="Attempts after the first on a dropped connection, a timeout or a busy "
                                          "server (429/503), with doubling waits from 1 s.")]
RecordsOpt = Annotated[int, typer.Option("--records", metavar="N", min=2, help="niah-128k: key-value records.")]
LengthOpt = Annotated[int, typer.Option("--length", metavar="T", min=16, help="niah-128k: prompt length in tokens.")]


def is_url(model: str) -> bool:
    return model.startswith(("http://", "https://"))


@dataclass(frozen=True)
class Served:
    """The served-model and preset options of one command."""

    tokenizer: str | None = None
    served_model: str | None = None
    concurrency: int | None = None
    task: str | None = None
    records: int = 16000
    length: int = 131072
    retries: int = 6

    def check(self, model: str) -> None:
        if not is_url(model) and (self.served_model is not None or self.concurrency is not None):
            raise InputError(f"--served-model and --concurrency apply to a served model (http://HOST:PORT/v1), not "
                             f"{model!r}.")
        if self.task is not None and not is_url(model) and self.tokenizer is None:
            raise InputError(f"--task {self.task} builds its items from a tokenizer: pass --tokenizer PATH.")

    def load(self, model: str, stride: int | None = None) -> Any:
        """The served model at ``model`` (a URL), its default task set to the preset."""
        from phaselens.models.sources import load

        m = load(model, model=self.served_model, tokenizer=self.tokenizer, stride=stride,
                           concurrency=self.concurrency, retries=self.retries)
        m.default_task = self.preset(m.tokenizer, model)
        return m

    def preset(self, tokenizer: Any, model: str) -> Any:
        """The ``--task`` preset (a served model's default: niah-128k), or ``None``."""
        from phaselens.tasks.presets import preset

        name = self.task or ("niah-128k" if is_url(model) else None)
        if name is None:
            return None
        kwargs = {"n_records": self.records, "length": self.length} if name == "niah-128k" else {}
        return preset(name, tokenizer, **kwargs)

    def items(self, n_per_residue: int | None, model: str) -> int:
        """``--n-per-residue``, or the preset's (the paper's) number, or the analyses' one default."""
        from phaselens.analyses.runner import N_PER_RESIDUE
        from phaselens.tasks.presets import PRESET_ITEMS

        if n_per_residue is not None:
            return n_per_residue
        name = self.task or ("niah-128k" if is_url(model) else None)
        return PRESET_ITEMS.get(name, N_PER_RESIDUE) if name else N_PER_RESIDUE


def price(model: str, opts: Served, *, n_per_residue: int, seed: int, stride: int | None, rate: float) -> Any:
    """The request plan of ``eval --plan`` (from the tokenizer alone: the server need not be up)."""
    from phaselens.models.served.loader import served_geometry
    from phaselens.models.served.vocabulary import load_tokenizer
    from phaselens.runtime.request_plan import plan_requests

    if not is_url(model):
        raise InputError("--plan prices a served model's requests (http://HOST:PORT/v1); for a checkpoint's memory "
                         "use `phaselens plan`, for a map `phaselens map --plan`.")
    if opts.tokenizer is None:
        raise InputError("--plan needs --tokenizer PATH (the served checkpoint's tokenizer) to build the items.")
    tok = load_tokenizer(opts.tokenizer)
    spec = served_geometry(opts.tokenizer, stride)
    return plan_requests(opts.preset(tok, model), spec, n_per_residue=n_per_residue, seed=seed,
                         prefill_tokens_per_s=rate, model=opts.served_model or model)
