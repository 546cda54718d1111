"""`python -m pagedkv.integrations.vllm.calibrate MODEL_DIR --kv-format SPEC --out FILE`: fit the
per-layer statistics a vLLM engine serving MODEL_DIR with SPEC uses, ahead of time, into FILE
(pass it as the settings' `"calibration": FILE`).

For an engine that cannot fit at start (the served folder has no Hugging Face weights, e.g. a
dummy-weight config or a GGUF): run this where the HF model is. The fit is the engine's own
(`fit.fit` on the fixed calibration text, the same options and defaults, `fit.FitPlan`), so the
file holds what the engine would have fitted. Attention sinks are not known here: value centring
follows `--value-centring` in every layer (exact with sinks too, see `FitPlan.build`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ...errors import ConfigError
from ...options import CacheOptions, add_option_arguments, options_from_args
from ...spec import parse_spec
from .fit import FitPlan, capture, describe, fit, save
from .settings import DEFAULT_CALIBRATION_TOKENS

FIT_OPTIONS = ("hp_format", "key_centring", "value_centring", "key_scaling")  # the options a fit reads


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedkv.integrations.vllm.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="the model in Hugging Face format (the folder vLLM serves, or its source)")
    p.add_argument("--kv-format", required=True, help="the settings' kv_format (a spec: turbo3, turbo3+hp, plan.json)")
    p.add_argument("--out", required=True, help="statistics file to write (the settings' calibration)")
    p.add_argument("--high-precision-layers", default=None, help="N or auto (default: what the spec says)")
    add_option_arguments(p, FIT_OPTIONS)  # as the settings' keys (`pagedkv.options`)
    p.add_argument("--tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS,
                   help=f"tokens of the calibration text (default {DEFAULT_CALIBRATION_TOKENS})")
    return p


def calibrate_file(model_dir: str, kv_format, out: str, *, high_precision_layers=None,
                   options: Optional[CacheOptions] = None, tokens: int = DEFAULT_CALIBRATION_TOKENS) -> str:
    """Fit and write the statistics (hp format, centring and scaling from `options`, default
    pagedkv's); returns `describe`'s one-line summary."""
    from .layout import layer_formats

    opts = options or CacheOptions()
    spec = parse_spec(kv_format, "--kv-format").with_arguments(high_precision_layers, None, "--kv-format")
    if tokens < 16:
        raise ConfigError(f"--tokens must be >= 16, got {tokens}")
    layers = capture(model_dir, tokens)
    dims = [(int(k.shape[1]), int(k.shape[-1])) for _, k, _ in layers]
    formats = layer_formats(spec, spec.high_precision_layers, opts.hp_format, len(dims), dims)
    plan = FitPlan.build(formats, opts.key_centring, opts.value_centring, opts.key_scaling)
    cals = fit(model_dir, plan, tokens, cache_dir=None)
    save(out, cals)
    return describe(cals)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parser().parse_args(argv)
    hp = a.high_precision_layers
    hp = None if hp is None else hp if hp == "auto" else int(hp) if hp.isdigit() else hp
    try:
        summary = calibrate_file(a.model_dir, a.kv_format, a.out, high_precision_layers=hp,
                                 options=options_from_args(a, FIT_OPTIONS), tokens=a.tokens)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{a.out}: statistics per layer {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
