"""Reading a GGUF file's header and metadata without its tensors (torch-free, fast).

`pagedkv plan` needs a model's config only, and every command that loads a `.gguf` should
refuse a corrupt one with one line before minutes of work: `read_gguf(path)` parses the header,
the key/value metadata (array values are skipped, only their lengths kept) and the tensor
infos, and checks that every tensor's data lies inside the file. transformers' own GGUF path
(gguf.GGUFReader) parses every token string and merge of the tokenizer first: 3-5 s of CPU for
the embedded 135M model, against a few ms here. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from ..errors import ConfigError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 40  # more keys, tensors or array items than this: corrupt


@dataclass
class GGUFInfo:
    """Metadata of one GGUF file. fields: key -> value (scalars and strings; arrays as
    `ArrayInfo`); tensors: name -> (shape, ggml type)."""

    path: str
    version: int
    fields: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ArrayInfo:
    item_type: int
    count: int


class _Cursor:
    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ConfigError(f"{self.what}: not a valid GGUF file (truncated metadata at byte {self.pos})")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, kind: str) -> int:
        n = self.scalar("<Q")
        if n > _MAX_COUNT:
            raise ConfigError(f"{self.what}: not a valid GGUF file (implausible {kind} count {n})")
        return n

    def string(self) -> str:
        return self.take(self.count("string length")).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.scalar("<I"), self.count("array")
            if itype in _SCALARS:
                self.take(n * struct.calcsize(_SCALARS[itype]))
            elif itype == _STRING:
                for _ in range(n):
                    self.take(self.count("string length"))
            else:
                for _ in range(n):
                    self.value(itype)
            return ArrayInfo(itype, n)
        raise ConfigError(f"{self.what}: not a valid GGUF file (unknown value type {vtype} at byte {self.pos})")


def read_gguf(path: str, what: str = "--model") -> GGUFInfo:
    """Header, metadata and tensor infos of the GGUF file at `path`; ConfigError (one line,
    naming the file and what is wrong) for anything that is not a complete GGUF file."""
    label = f"{what} {path!r}"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(min(size, 64 << 20))  # metadata of real models is far smaller
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read it ({exc.strerror or exc})") from None
    if size < 24 or head[:4] != b"GGUF":
        raise ConfigError(f"{label}: not a GGUF file (it does not start with the GGUF magic)")
    cur = _Cursor(head, label)
    cur.take(4)
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ConfigError(f"{label}: unsupported GGUF version {version} (2 and 3 are read)")
    n_tensors, n_kv = cur.count("tensor"), cur.count("key")
    info = GGUFInfo(path, version)
    for _ in range(n_kv):
        key = cur.string()
        info.fields[key] = cur.value(cur.scalar("<I"))
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise ConfigError(f"{label}: not a valid GGUF file (tensor {name!r} has {n_dims} dimensions)")
        shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
        ttype, offset = cur.scalar("<I"), cur.scalar("<Q")
        info.tensors[name] = (shape, ttype, offset)
    align = int(info.fields.get("general.alignment", 32) or 32)
    data_start = -(-cur.pos // align) * align
    _check_tensor_data(info, data_start, size, label)
    return info


def _check_tensor_data(info: GGUFInfo, data_start: int, size: int, label: str) -> None:
    """Every tensor's bytes end inside the file (a truncated download fails here, not after a
    minute of dequantizing)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError:  # pragma: no cover - gguf comes with pagedkv[model]
        return
    for name, (shape, ttype, offset) in info.tensors.items():
        if ttype not in GGML_QUANT_SIZES:
            raise ConfigError(f"{label}: not a valid GGUF file (tensor {name!r} has unknown type {ttype})")
        block, nbytes = GGML_QUANT_SIZES[ttype]
        elems = 1
        for d in shape:
            elems *= d
        end = data_start + offset + elems // block * nbytes
        if end > size:
            raise ConfigError(f"{label}: truncated GGUF file (tensor {name!r} ends at byte {end}, "
                              f"the file has {size})")


# architectures whose transformers config is the mapped keys alone (transformers renames or
# patches the others, e.g. llama-named Mistral, stablelm, t5, gemma3 -> gemma3_text)
_SIMPLE_ARCHS = ("llama", "qwen2", "qwen3")


def gguf_config(info: GGUFInfo):
    """A transformers config from the metadata alone (the keys transformers maps for the
    architecture), or None when the architecture needs transformers' full reader."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = info.fields.get("general.architecture")
    if arch not in _SIMPLE_ARCHS or arch not in GGUF_CONFIG_MAPPING or "mistral" in str(info.fields.get("general.name")):
        return None
    values: dict = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for key, target in GGUF_CONFIG_MAPPING[arch].items():
        v = info.fields.get(f"{arch}.{key}")
        if v is not None and target is not None and not isinstance(v, ArrayInfo):
            values[target] = v
    tokens = info.fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in values and isinstance(tokens, ArrayInfo):
        values["vocab_size"] = tokens.count
    values["tie_word_embeddings"] = "output.weight" not in info.tensors
    return AutoConfig.for_model(arch, **values)
