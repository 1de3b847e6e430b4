"""The ceiling of AVX2's 8-bit multiply on this CPU: a register-only loop of the w8a8 kernel's
inner step (vpmaddubsw, vpmaddwd against ones, vpaddd) in 8 independent chains, no memory
traffic, one thread. The reference point for the w8a8 linear (engine/model/cpu_w8a8.py,
bench/quant_linear.py): a kernel close to this figure can only get faster by doing fewer
multiplies. Not run in CI.

    python bench/int8_peak.py
"""

from __future__ import annotations

import ctypes
import time

import common

from iterserve.engine import native

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
/* 8 chains x 32 u8 x s8 products per iteration; returns a value so the loop is not removed. */
int64_t maddubs_loop(int64_t iterations) {
    __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(5), b0 = _mm256_set1_epi8(7), b1 = _mm256_set1_epi8(9);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int64_t i = 0; i < iterations; i++) {
        c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, b0), ones));
        c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(_mm256_maddubs_epi16(a0, b1), ones));
        c2 = _mm256_add_epi32(c2, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, b0), ones));
        c3 = _mm256_add_epi32(c3, _mm256_madd_epi16(_mm256_maddubs_epi16(a1, b1), ones));
        c4 = _mm256_add_epi32(c4, _mm256_madd_epi16(_mm256_maddubs_epi16(b0, a0), ones));
        c5 = _mm256_add_epi32(c5, _mm256_madd_epi16(_mm256_maddubs_epi16(b0, a1), ones));
        c6 = _mm256_add_epi32(c6, _mm256_madd_epi16(_mm256_maddubs_epi16(b1, a0), ones));
        c7 = _mm256_add_epi32(c7, _mm256_madd_epi16(_mm256_maddubs_epi16(b1, a1), ones));
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(b0), "+x"(b1));
    }
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                 _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
    return _mm256_extract_epi32(s, 0);
}
"""


def main() -> int:
    lib = native.build("int8_peak", _SOURCE)
    if lib is None:
        raise SystemExit("needs a C compiler and an x86-64 CPU with AVX2")
    lib.maddubs_loop.argtypes = [ctypes.c_int64]
    lib.maddubs_loop.restype = ctypes.c_int64
    info = common.machine(1)
    iterations = 25_000_000
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        lib.maddubs_loop(iterations)
        best = min(best, time.perf_counter() - start)
    gmacs = iterations * 8 * 32 / best / 1e9
    print(f"{info['cpu_model']}: {gmacs:.1f} G u8 x s8 multiply-adds per second on one thread (best of 5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
