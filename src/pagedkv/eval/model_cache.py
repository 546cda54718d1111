"""A GGUF model converted once into a private local folder, so that later loads skip the GGUF.

Loading the embedded SmolLM2 GGUF through transformers parses the file (its 49k-entry vocabulary
included) for the config, the weights and the tokenizer, and dequantizes every tensor: measured
here ~37 s of CPU for the model and ~11 s for the tokenizer, on every `pagedkv eval`, `generate`
and test process. The converted folder holds exactly what that load produced (the float32
dequantized tensors as safetensors, the config, the tokenizer), so a model loaded from it computes
bit-identical logits (tests/test_model_cache.py) and loads in a few seconds.

The folder is keyed by the GGUF's content (a blake2b of its bytes, read once per process: far
cheaper than the conversion) and by the transformers version, so every checkout or install of the
same file shares one folder (a key by path and modification time left one folder per clone); it
is written to a temporary folder and renamed (never half a folder; two
processes racing keep one), and it is used only when it and its files belong to this user and
are not writable by others (nobody else could have planted weights). safetensors holds no code.
A cache that cannot be written is skipped: the model still loads, from the GGUF.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import lru_cache
from hashlib import blake2b
from pathlib import Path
from typing import Any, Optional

from ..integrations.hf_folder import write_folder
from ..private import private_problem

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def folder_key(gguf_path: str) -> str:
    """Name of the converted folder for one GGUF file as it is now (its bytes, transformers' version)."""
    import transformers

    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    return _content_key(real, st.st_size, st.st_mtime_ns, transformers.__version__)


@lru_cache(maxsize=8)
def _content_key(real: str, size: int, mtime_ns: int, version: str) -> str:
    """Hashed once per process and file state (a lookup and a save read the file once)."""
    h = blake2b(digest_size=12)
    with open(real, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    h.update(b"\0" + version.encode())
    return f"{Path(real).stem}-{h.hexdigest()}"


def lookup(root: Path, gguf_path: str) -> Optional[Path]:
    """The converted folder for `gguf_path` under `root`, or None (missing, partial or not private)."""
    folder = Path(root) / folder_key(gguf_path)
    if private_problem(Path(root), directory=True) or private_problem(folder, directory=True):
        return None
    for name in FILES:
        if private_problem(folder / name, directory=False):
            return None
    return folder


def save(root: Path, gguf_path: str, model: Any, tokenizer: Any) -> Optional[Path]:
    """Write the loaded GGUF model and tokenizer under `root`; None (nothing written) when the
    write fails for any reason or `root` is not private. The saved config drops the GGUF quantization entry:
    the saved tensors are plain float32."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if private_problem(root, directory=True):
            return None
        folder = root / folder_key(gguf_path)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    except OSError:
        return None
    try:
        write_folder(model, tokenizer, tmp)
        if not all((tmp / name).is_file() for name in FILES):
            return None
        os.rename(tmp, folder)  # fails if another process renamed its copy first: keep that one
        return folder
    except Exception:  # an optimisation only: a model it cannot write still loads, from the GGUF
        return folder if lookup(root, gguf_path) else None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
