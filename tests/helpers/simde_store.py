"""Build store_kernel.c's AVX-512 path on a CPU without AVX-512, its intrinsics emulated by SIMDe.

SIMDe (https://github.com/simd-everywhere/simde; Debian/Ubuntu: libsimde-dev) implements the x86
intrinsics in portable C. The source is compiled with PKV_STORE_AVX512 forced and every intrinsic,
vector type and compare predicate renamed to SIMDe's (`simde_` prefix); the two intrinsics SIMDe
0.7 lacks are given as plain loops. The result computes what the AVX-512 build computes, slowly,
so its bytes can be checked against the reference store on any x86 machine.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

SIMDE_HEADER = Path("/usr/include/simde/x86/avx512.h")

_SELECT = """#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PKV_STORE_AVX512 1
#define PKV_STORE_SIMD 1
#include <immintrin.h>
#elif defined(__AVX2__)"""

_SHIMS = """#define PKV_STORE_AVX512 1
#define PKV_STORE_SIMD 1
#include <simde/x86/avx512.h>
static inline simde__m128i simde_mm512_cvtepi32_epi8(simde__m512i a) {
    int32_t t[16]; int8_t r[16];
    simde_mm512_storeu_si512(t, a);
    for (int i = 0; i < 16; i++) r[i] = (int8_t)t[i];
    return simde_mm_loadu_si128(r);
}
static inline simde__mmask16 simde_mm512_cmplt_epu32_mask(simde__m512i a, simde__m512i b) {
    uint32_t x[16], y[16]; simde__mmask16 m = 0;
    simde_mm512_storeu_si512(x, a); simde_mm512_storeu_si512(y, b);
    for (int i = 0; i < 16; i++) m |= (simde__mmask16)((x[i] < y[i]) << i);
    return m;
}
#if 0"""


def emulated_source(source: str) -> str:
    """store_kernel.c's text with its AVX-512 path selected and written against SIMDe."""
    if _SELECT not in source:
        raise AssertionError("store_kernel.c's ISA selection changed: update tests/helpers/simde_store.py")
    text = source.replace(_SELECT, _SHIMS, 1)
    for native, emulated in ((r"\b_mm(512|256)?_", r"simde_mm\1_"), (r"\b__m(512|256|128)(i?)\b", r"simde__m\1\2"),
                             (r"\b__mmask16\b", "simde__mmask16"), (r"\b_CMP_", "SIMDE_CMP_")):
        text = re.sub(native, emulated, text)
    return text


def build(source: Path, out_dir: Path) -> Optional[ctypes.CDLL]:
    """The emulated library, or None where SIMDe's headers or a C compiler are missing."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not SIMDE_HEADER.exists():
        return None
    src = out_dir / "store_kernel_simde_avx512.c"
    src.write_text(emulated_source(source.read_text()))
    lib = out_dir / "store_kernel_simde_avx512.so"
    subprocess.run([cc, "-O2", "-std=gnu11", "-shared", "-fPIC", "-fno-math-errno", str(src), "-o", str(lib), "-lm"],
                   check=True, capture_output=True, timeout=600)
    return ctypes.CDLL(str(lib))
