"""A loaded Hugging Face causal LM (e.g. dequantized from a GGUF) written as a plain model folder.

Used by the converted-model cache (`pagedkv.eval.model_cache`) and by the vLLM converter
(`pagedkv.integrations.vllm.convert`): one writer, so both folders hold the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def write_folder(model: Any, tokenizer: Any, out: Path, dtype: Any = None,
                 architectures: Optional[list] = None) -> None:
    """config.json, model.safetensors and the tokenizer of a loaded (e.g. GGUF-dequantized) model.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the tensors are written with
    safetensors directly: a tied embedding once, as `model.embed_tokens.weight` (the name both
    transformers and vLLM load it from). dtype: torch dtype of the saved tensors (None: as loaded).
    The config drops the GGUF quantization entry (the saved tensors are plain) and records the
    dtype and, when given, the architectures.
    """
    from safetensors.torch import save_file

    cfg = model.config
    state = {k: (v.detach() if dtype is None else v.detach().to(dtype)).contiguous()
             for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state["model.embed_tokens.weight"] = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
        state.pop("lm_head.weight", None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data.pop("quantization_config", None)
    data["dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "")
    if architectures:
        data["architectures"] = list(architectures)
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
