"""Compile the Triton kernels for an NVIDIA target without a GPU, and report their resources.

    python tests/triton_compile_check.py [--arch 90] [--codecs turbo3,bf16] [--full]

The interpreter tests check what the kernels compute, not that they compile: this script runs
the launchers on CPU tensors with a stand-in Triton driver that reports a CUDA target, so every
kernel launch compiles (Triton -> PTX -> cubin with the ptxas Triton ships) and is not run.
It prints registers / spill stack / shared memory per kernel variant (from cuobjdump) and exits
1 if any variant fails to compile or spills heavily (more than SPILL_LIMIT bytes of stack). Must run without TRITON_INTERPRET.
Used by test_triton.py::test_kernels_compile_for_a_gpu_target (in a subprocess).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


SPILL_LIMIT = 128  # bytes of spill stack per thread tolerated (a few registers' worth)
LATENT_DIMS = ((64, 32), (128, 64))  # (latent, rope) rows compiled as latent (MLA) MQA (<= 256 dims)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100/H200)")
    ap.add_argument("--codecs", default="turbo3,q4_0", help="codecs to compile (each as K and V)")
    ap.add_argument("--full", action="store_true", help="every codec, every precision, the options grid")
    args = ap.parse_args(argv)

    class TargetOnlyDriver:
        def get_current_target(self):
            return GPUTarget("cuda", args.arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(TargetOnlyDriver())
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows, seen = [], set()
    real_run = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        kernel = real_run(self, *a, grid=grid, warmup=True, **kw)
        key = (self.fn.__name__, kw.get("DOT"), kw.get("K_BITS"), kw.get("V_BITS"), kw.get("BITS"), kw.get("D"),
               kw.get("PASS"), kw.get("MODE"), kw.get("NORM"), kw.get("V_IS_K"))
        if key not in seen:
            seen.add(key)
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(kernel.asm["cubin"])
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
            os.unlink(f.name)
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
            regs, stack = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
            rows.append((key, regs, stack, kernel.metadata.shared, kernel.metadata.num_warps))
        return kernel

    JITFunction.run = compile_only

    import pagedkv.ops.triton as tr
    from helpers.backend_check import CheckCase
    from pagedkv.codecs import CODECS
    from pagedkv.ops.fused import NormSpec, RopeSpec

    assert not tr.interpreting(), "run without TRITON_INTERPRET"
    failures = []

    def attempt(label, fn):
        try:
            fn()
        except Exception as exc:  # a compile error: report and go on
            failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:2000]}")

    codecs = list(CODECS) if args.full else args.codecs.split(",")
    precisions = ("fp32", "bf16", "tf32") if args.full else ("fp32", "bf16")
    for name in codecs:
        cc = CheckCase(name, name, seq_lens=(40, 9), group=4, head_dim=128, num_kv_heads=2)
        case, p = cc.build(), cc.params()
        for prec in precisions:
            attempt(f"decode {name} {prec}", lambda: tr.decode_attention(
                case.q_decode, case.layer, case.block_tables, case.seq_lens, p, precision=prec))
            attempt(f"prefill {name} {prec}", lambda: tr.prefill_attention(
                case.q_prefill, case.layer, case.block_tables, case.seq_lens, case.query_start_loc, p, precision=prec))
        attempt(f"store {name}", lambda: tr.store(case.layer, torch.randn(5, 2, 128), torch.randn(5, 2, 128),
                                                 torch.arange(5)))
    extra = [CheckCase("turbo3", "turbo4", seq_lens=(40, 9), group=4, head_dim=128, centre=True, k_offset=2.0,
                       sliding_window=16, soft_cap=30.0, sinks=True, sparse_v_threshold=0.01)]
    if args.full:
        extra.append(CheckCase("bf16", "turbo2", seq_lens=(40, 9), group=8, head_dim=256))
    for cc in extra:
        case, p = cc.build(), cc.params()
        attempt(f"decode {cc.label}", lambda: tr.decode_attention(case.q_decode, case.layer, case.block_tables,
                                                                  case.seq_lens, p))
        attempt(f"prefill {cc.label}", lambda: tr.prefill_attention(case.q_prefill, case.layer, case.block_tables,
                                                                    case.seq_lens, case.query_start_loc, p))
    # latent (MLA) rows [latent | rope] as MQA with V = K (V_IS_K): 16 query heads on the one row
    from pagedkv.codecs import get_codec
    from pagedkv.ops import AttentionParams
    from pagedkv.ops.latent import LatentSpec, make_latent_layer

    for name in codecs:
        for lat, rope in LATENT_DIMS:
            if (lat + rope) % max(get_codec(name).group_size, 1):  # turbo2g64: rows of whole groups of 64
                continue
            sec = make_latent_layer(LatentSpec(lat, rope, get_codec(name), get_codec(name)), 8, 16).sections()[0]
            tables, lens = torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([40, 9], dtype=torch.int32)
            lp = AttentionParams(scale=0.1)
            attempt(f"latent decode {name} {lat}+{rope}", lambda: tr.decode_attention(
                torch.randn(2, 16, lat + rope), sec, tables, lens, lp))
            attempt(f"latent prefill {name} {lat}+{rope}", lambda: tr.prefill_attention(
                torch.randn(6, 16, lat + rope), sec, tables, lens, torch.tensor([0, 4, 6], dtype=torch.int32), lp))
    cc = CheckCase("turbo3", "fp8", seq_lens=(40,), head_dim=128)
    case = cc.build()
    attempt("fused norm+rope+store", lambda: tr.store_k_fused(
        case.layer, torch.randn(5, 2, 128), torch.arange(5), torch.arange(5),
        norm=NormSpec(torch.ones(128)), rope=RopeSpec(rotary_dim=64)))

    print(f"target sm_{args.arch}: kernel (name, DOT, K_BITS, V_BITS, BITS, D, PASS, MODE, NORM, "
          f"V_IS_K) -> registers, spill stack bytes, shared bytes, warps")
    for key, regs, stack, shared, warps in rows:
        print(f"  {key} -> regs {regs}, stack {stack}, shared {shared}, warps {warps}")
    spills = [r for r in rows if r[2] > SPILL_LIMIT]
    for f in failures:
        print("FAILED", f)
    for r in spills:
        print("SPILLS", r[0], f"stack {r[2]}")
    print(f"{len(rows)} variants compiled, {len(failures)} failures, {len(spills)} spilling > {SPILL_LIMIT} bytes")
    return 1 if failures or spills else 0


if __name__ == "__main__":
    sys.exit(main())
