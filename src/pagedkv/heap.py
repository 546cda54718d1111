"""The C heap: hand its free pages back to the system (glibc `malloc_trim`; a no-op elsewhere).

Used where a one-time burst of small temporaries would otherwise stay resident as heap holes:
the transformers cache after each layer's first-chunk statistics, and the peak-memory benchmark
before it resets the peak mark.
"""

from __future__ import annotations

_TRIM = None  # libc's malloc_trim once looked up; False where there is none


def release_free_heap() -> None:
    """malloc_trim(0): free pages anywhere in the heap are returned (glibc only)."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)
