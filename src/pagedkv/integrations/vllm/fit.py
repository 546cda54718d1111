"""Per-layer statistics for a vLLM engine, fixed once at engine start (never per request).

The vLLM backend stores keys and values relative to statistics (key centre, channel
multipliers, value centre, fp8 tensor scales) that must not depend on which request happened to
arrive first. So they are fitted once, on fixed calibration text that is not the evaluation
text (`calibration_text`: docstrings of standard-library modules), with the served model's own
weights: a transformers forward (fp32) records every attention layer's queries, keys and
values, and `pagedkv.cache.calibration.calibrate` (the fitter the transformers cache
uses) turns them into one `Calibration` per layer, with the options the transformers cache
would use for the same formats. The result is kept in a small file keyed by the model, the
text, the formats and the options, so later engine starts only read it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...errors import ConfigError
from ...private import private_dir, stat_problem
from ...safe_io import read_regular_file
from ...formats import KVFormat
from ...options import centres_values, default_key_centring, needs_tensor_scales, scales_keys
from ...cache.calibration import Calibration, CalibrationOptions, calibrate
from ...cache.transform_record import FIELDS as _FIELDS  # the transform's fields, named once
from .fleet import model_identity  # the one name of the exact weights (the connector's too)
from ..capture import CALIBRATION_MODULES, calibration_ids, calibration_text, capture_attention  # noqa: F401 (CALIBRATION_MODULES: re-exported)

FIT_VERSION = "pagedkv-vllm-fit-v1"
MAX_FILE_BYTES = 256 << 20  # a statistics file is a few float32 [H, D] per layer: far less


@dataclass(frozen=True)
class FitPlan:
    """What to fit: the layers' formats and the options the transformers cache would use."""

    formats: tuple[KVFormat, ...]
    key_centring: bool
    value_centring: tuple[bool, ...]
    key_scaling: tuple[bool, ...]

    @staticmethod
    def build(formats: Sequence[KVFormat], key_centring: Optional[bool],
              value_centring: Optional[bool], key_scaling: bool,
              has_sinks: Optional[Sequence[bool]] = None) -> "FitPlan":
        """The transformers cache's defaults, from the codecs' traits (`pagedkv.options`): key
        centring on when some K codec is not raw; value centring on for a non-raw V codec, by
        default off in layers with attention sinks (exact there too: the ops add v_centre times
        the token weights' sum); key multipliers when asked, for a non-raw K codec."""
        sinks = has_sinks or [False] * len(formats)
        return FitPlan(tuple(formats), default_key_centring(formats, key_centring),
                       tuple(centres_values(f, value_centring, sk) for f, sk in zip(formats, sinks)),
                       tuple(scales_keys(f, key_scaling) for f in formats))

    @property
    def needed(self) -> bool:
        """False when no layer uses any statistic (then nothing is fitted)."""
        return (self.key_centring or any(self.value_centring) or any(self.key_scaling)
                or any(needs_tensor_scales(f) for f in self.formats))

    def key(self, model_id: str, tokens: int) -> str:
        text = hashlib.blake2b(calibration_text().encode(), digest_size=8).hexdigest()
        parts = [FIT_VERSION, model_id, str(tokens), text, str(self.key_centring)]
        parts += [f"{f.name}:{v}:{s}" for f, v, s in zip(self.formats, self.value_centring, self.key_scaling)]
        return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


_captured: dict = {}  # (model identity, tokens) -> [(q, k, v)] per attention layer (one process)


def capture(model_dir: str, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Queries [1, Hq, T, D], keys and values [1, H, T, D] (float32, after RoPE) of every
    attention layer of the transformers model in `model_dir` on the first `tokens` tokens of
    the calibration text (BOS first when the tokenizer has one). Kept in memory per process."""
    ident = (model_identity(model_dir), tokens)
    if ident in _captured:
        return _captured[ident]
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"pagedkv: fitting statistics at engine start needs transformers ({exc})") from None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32, attn_implementation="sdpa")
    except Exception as exc:  # no HF weights there (a dummy-weight config, a GGUF, ...)
        raise ConfigError(
            f"pagedkv: fitting the statistics at engine start needs the model in Hugging Face "
            f"format at {model_dir!r} ({type(exc).__name__}: {exc}); pass \"calibration\": FILE "
            "(python -m pagedkv.integrations.vllm.calibrate), or turn key/value centring off"
        ) from None
    ids = calibration_ids(tok, tokens, what=f"pagedkv calibration_tokens={tokens}")
    out = [layer[:3] for layer in capture_attention(model, torch.tensor([ids]))]
    _captured.clear()  # one model per process is the normal case: keep memory bounded
    _captured[ident] = out
    del model
    return out


def fit(model_dir: str, plan: FitPlan, tokens: int, cache_dir: Optional[str],
        geometry: Optional[Sequence[tuple[int, int]]] = None) -> list[Calibration]:
    """One Calibration per attention layer (in layer order), read from `cache_dir` when an
    earlier start fitted the same plan, else fitted now (and written there). geometry: per layer
    (kv heads, head dim), what a stored file's tensors must match.

    The file's name is computable by anyone who can read the model folder, so the statistics
    cache trusts nothing another user could have written: `cache_dir` is made private (0700) and
    must be owned by this user and not writable by others, as must the file (`pagedkv.private`);
    otherwise ConfigError naming `cache_dir`."""
    path = None
    if cache_dir:
        problem = private_dir(cache_dir)
        if problem is not None:
            raise ConfigError(f"pagedkv cache_dir {cache_dir!r} {problem}: statistics kept there "
                              "could have been planted by another user; use a directory owned by "
                              "this user and not writable by others (chmod 700), or cache_dir "
                              "null to fit at every engine start")
        path = os.path.join(cache_dir, plan.key(model_identity(model_dir), tokens) + ".pt")
        if os.path.lexists(path):
            return load(path, len(plan.formats), geometry, private=True)
    layers = capture(model_dir, tokens)
    if len(layers) != len(plan.formats):
        raise ConfigError(f"pagedkv: the transformers model has {len(layers)} attention layers, "
                          f"the vLLM model {len(plan.formats)}")
    cals = []
    for (q, k, v), fmt, vc, ks in zip(layers, plan.formats, plan.value_centring, plan.key_scaling):
        options = CalibrationOptions(key_centring=plan.key_centring, key_scaling=ks, value_centring=vc)
        cals.append(calibrate(k, v, q, fmt.k.name, fmt.v.name, options, "cpu"))
    if path is not None:
        save(path, cals)
    return cals


def save(path: str, cals: Sequence[Calibration]) -> None:
    """Write the per-layer statistics (a torch file of plain tensors) through an exclusive
    temporary file (`mkstemp`: never a name planted in advance) renamed into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    data = {"version": FIT_VERSION,
            "layers": [{f: getattr(c, f) for f in _FIELDS if getattr(c, f) is not None} for c in cals]}
    fd, tmp = tempfile.mkstemp(prefix=".fit-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(data, fh)
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            os.unlink(tmp)


def _read(path: str, private: bool) -> bytes:
    """The bytes of a statistics file: a regular file (no symlink, FIFO or device; never
    blocks), at most MAX_FILE_BYTES, and with `private` owned by this user and not writable by
    others."""
    check = (lambda st: stat_problem(st, directory=False)) if private else None
    return read_regular_file(path, MAX_FILE_BYTES, "pagedkv calibration file", follow=False,
                             check=check)


def _checked(path: str, layers, geometry) -> list[Calibration]:
    """Calibrations from the file's layer dicts, each tensor checked: float, finite, the
    layer's shape ([H, D] for centres and multipliers, [1] for scales), scales > 0."""
    out = []
    for i, d in enumerate(layers):
        if not isinstance(d, dict) or not set(d) <= set(_FIELDS):
            raise ConfigError(f"pagedkv calibration file {path!r}: layer {i} is not a mapping of "
                              f"{', '.join(_FIELDS)}")
        for f, x in d.items():
            want = (1,) if f.endswith("_scale") else (tuple(geometry[i]) if geometry else None)
            bad = (not isinstance(x, torch.Tensor) or x.dtype != torch.float32
                   or (want is not None and tuple(x.shape) != want) or not bool(torch.isfinite(x).all())
                   or (f.endswith("_scale") and not bool((x > 0).all())))
            if bad:
                got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ConfigError(f"pagedkv calibration file {path!r}: layer {i} {f} must be a finite "
                                  f"float32 tensor of shape {want or '[H, D]'}"
                                  f"{' (> 0)' if f.endswith('_scale') else ''}, got {got}")
        out.append(Calibration(**{f: d.get(f) for f in _FIELDS}))
    return out


def load(path: str, num_layers: int, geometry: Optional[Sequence[tuple[int, int]]] = None, *,
         private: bool = False) -> list[Calibration]:
    """Read a statistics file; ConfigError if it is not one (see `_read`, `_checked`), its
    layer count differs, or (with `geometry`: per layer (kv heads, head dim)) a shape differs."""
    raw = _read(path, private)
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        layers = data["layers"]
        assert data["version"] == FIT_VERSION and isinstance(layers, (list, tuple))
    except Exception as exc:
        raise ConfigError(f"pagedkv calibration file {path!r} is not a pagedkv statistics file "
                          f"({type(exc).__name__}: {exc})") from None
    if len(layers) != num_layers:
        raise ConfigError(f"pagedkv calibration file {path!r} has {len(layers)} layers, the model {num_layers}")
    return _checked(path, layers, geometry)


def describe(cals: Sequence[Calibration]) -> str:
    """One line for logs: which statistics are set in how many layers."""
    counts = {f: sum(getattr(c, f) is not None for c in cals) for f in _FIELDS}
    return json.dumps(counts)


def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The KV heads a tensor-parallel rank holds, as vLLM splits them: contiguous groups of
    total / tp when the heads divide over the ranks, else (more ranks than heads) every head
    replicated on tp / total consecutive ranks."""
    if tp_size <= 1:
        return list(range(total_heads))
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise ConfigError(f"pagedkv: {total_heads} KV heads do not split over tensor_parallel_size {tp_size}")
        n = total_heads // tp_size
        return list(range(tp_rank * n, (tp_rank + 1) * n))
    if tp_size % total_heads:
        raise ConfigError(f"pagedkv: tensor_parallel_size {tp_size} is not a multiple of the {total_heads} KV heads")
    return [tp_rank // (tp_size // total_heads)]


def for_rank(cal: Calibration, heads: Sequence[int]) -> Calibration:
    """A layer's statistics for the KV heads one rank holds: the per-head rows (key centre and
    multipliers, value centre) of those heads; the fp8 tensor scales are the layer's, the same
    on every rank (so each rank stores exactly its heads' bytes of the single-rank pages)."""
    idx = torch.tensor(list(heads), dtype=torch.long)

    def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.index_select(0, idx).contiguous()

    return Calibration(k_centre=pick(cal.k_centre), k_mult=pick(cal.k_mult), v_centre=pick(cal.v_centre),
                       k_scale=cal.k_scale, v_scale=cal.v_scale)
