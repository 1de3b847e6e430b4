"""The w8a8 linear's own CPU kernel (`--quantization w8a8`): int8 weights times per-row int8
activations, in one C call.

In: fp32 activations x [M, K] (rows may be strided), the layer's int8 weight [N, K] in -63..63
with fp32 per-output-channel scales, and the weight's row sums. Out: y [M, N] fp32.

Each row of x is quantized on its own range: amax = max |x| of the row (at least 1e-30),
q = round(x * (127 / amax)) + 128, an unsigned byte in 1..255, with row scale amax / 127. The
integer dot product sum(q * w) - 128 * sum(w) is exact, and y = float(dot) * (row scale *
weight scale), so a row's result is the same whatever other rows share its call, at any M,
tiling or thread count. `reference()` is the same arithmetic in torch ops (bit-identical: the
integer part through float64, which holds it exactly): it is the path where no C compiler
works, and what the tests compare the kernel with.

Why a kernel of our own: fbgemm's dynamic linear needed six extra torch ops per call to get a
range per row (scale, a sentinel row, cat, slice, multiply back) and did its own packing per
call; in a decode step of one or two sequences those ops and fbgemm's call overhead cost more
than reading the weights. AVX2's u8 x s8 multiply (vpmaddubsw) sums pairs into 16 bits with
saturation: 2 x 255 x 63 fits, which is why the weights stay within +-63.

Threads: `threads` > 1 splits the output channels between the caller and a persistent pool of
worker threads that spin briefly between calls (then sleep on a futex), so the many small
linears of a decode step share both cores without waking a sleeping thread each time. One
parallel call runs at a time; a concurrent caller (split execution's two halves pass 1) runs
on its own thread.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

from iterserve.engine import native

logger = logging.getLogger(__name__)

WEIGHT_MAX = 63  # |w| bound: 2 x 255 x 63 fits vpmaddubsw's 16-bit pair sums
K_MULTIPLE = 32  # the kernel reads 32 bytes of a row at a time
MIN_AMAX = 1e-30  # an all-zero row gets this range (its result is 0)

_SOURCE = r"""
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_THREADS 16
#define PREFETCH_TILES 4
#define SPIN_ROUNDS 4000 /* pause + yield rounds a worker waits for the next call before it sleeps */

/* q = round(x * (127 / amax)) + 128 per row; scale = amax / 127 (NaN for a row with NaN or inf). */
static void quantize_rows(const float* x, int64_t ldx, int64_t m_rows, int64_t k, uint8_t* q, float* scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i bias = _mm256_set1_epi32(128);
    for (int64_t m = 0; m < m_rows; m++) {
        const float* row = x + m * ldx;
        uint8_t* out = q + m * k;
        __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float amax = lanes[0];
        for (int i = 1; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        if (_mm256_movemask_ps(bad) || amax > 3.4028234663852886e38f) {
            scale[m] = NAN;
            for (int64_t i = 0; i < k; i++) out[i] = 128;
            continue;
        }
        if (amax < 1e-30f) amax = 1e-30f;
        const float inv = 127.0f / amax;
        scale[m] = amax / 127.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int64_t i = 0; i < k; i += 32) {
            __m256i a[4];
            for (int j = 0; j < 4; j++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(row + i + 8 * j), vinv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                a[j] = _mm256_add_epi32(_mm256_cvtps_epi32(r), bias);
            }
            __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
            _mm256_storeu_si256((__m256i*)(out + i), _mm256_permutevar8x32_epi32(packed, order));
        }
    }
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

typedef struct {
    const uint8_t* q; const float* xscale; int64_t m_rows, k;
    const int8_t* w; const float* wscale; const int32_t* wsum;
    float* y; int64_t ldy; int64_t n_begin, n_end;
} share_t;

/* y[m, n] from the integer dot's 8 partial sums: the one place the result is rounded (reference()
   in Python rounds the same way). */
static inline void store(const share_t* s, int64_t m, int64_t n, __m256i acc) {
    const int32_t dot = hsum_epi32(acc) - 128 * s->wsum[n];
    s->y[m * s->ldy + n] = (float)dot * (s->xscale[m] * s->wscale[n]);
}

/* MR rows x NR output channels, the whole K: integer dots, then y. */
static inline __attribute__((always_inline)) void tile(const share_t* s, int64_t m, int64_t n, const int MR,
                                                       const int NR) {
    const int64_t k = s->k;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = _mm256_setzero_si256();
    const uint8_t* q = s->q + m * k;
    const int8_t* w = s->w + n * k;
    /* the weight is read once, in order: fetch PREFETCH_TILES tiles ahead, NR * 32 bytes per step */
    const int8_t* ahead = w + PREFETCH_TILES * NR * k;
    for (int64_t i = 0; i < k; i += 32) {
        __m256i b[NR];
        for (int c = 0; c < NR; c += 2) _mm_prefetch((const char*)(ahead + (i * NR) + c * 32), _MM_HINT_T0);
        for (int c = 0; c < NR; c++) b[c] = _mm256_loadu_si256((const __m256i*)(w + c * k + i));
        for (int r = 0; r < MR; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i*)(q + r * k + i));
            for (int c = 0; c < NR; c++)
                acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[c]), ones));
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) store(s, m + r, n + c, acc[r][c]);
}

/* 4 rows x 2 channels written out: the generic tile spills accumulators at this size. */
static inline __attribute__((always_inline)) void tile42(const share_t* s, int64_t m, int64_t n) {
    const int64_t k = s->k;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    const uint8_t* q = s->q + m * k;
    const int8_t* w = s->w + n * k;
    const int8_t* ahead = w + PREFETCH_TILES * 2 * k;
    for (int64_t i = 0; i < k; i += 32) {
        _mm_prefetch((const char*)(ahead + 2 * i), _MM_HINT_T0);
        const __m256i b0 = _mm256_loadu_si256((const __m256i*)(w + i));
        const __m256i b1 = _mm256_loadu_si256((const __m256i*)(w + k + i));
        __m256i a = _mm256_loadu_si256((const __m256i*)(q + i));
        c00 = _mm256_add_epi32(c00, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
        c01 = _mm256_add_epi32(c01, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
        a = _mm256_loadu_si256((const __m256i*)(q + k + i));
        c10 = _mm256_add_epi32(c10, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
        c11 = _mm256_add_epi32(c11, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
        a = _mm256_loadu_si256((const __m256i*)(q + 2 * k + i));
        c20 = _mm256_add_epi32(c20, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
        c21 = _mm256_add_epi32(c21, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
        a = _mm256_loadu_si256((const __m256i*)(q + 3 * k + i));
        c30 = _mm256_add_epi32(c30, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
        c31 = _mm256_add_epi32(c31, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
    }
    const __m256i acc[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 2; c++) store(s, m + r, n + c, acc[r][c]);
}

static void run_share(const share_t* s) {
    int64_t n = s->n_begin, m;
    if (s->m_rows <= 2) { /* decode steps of one or two sequences: read the weight once, 4 channels at a time */
        for (; n + 4 <= s->n_end; n += 4) {
            if (s->m_rows == 2) tile(s, 0, n, 2, 4); else tile(s, 0, n, 1, 4);
        }
    } else {
        for (; n + 2 <= s->n_end; n += 2) {
            for (m = 0; m + 4 <= s->m_rows; m += 4) tile42(s, m, n);
            switch (s->m_rows - m) {
                case 3: tile(s, m, n, 3, 2); break;
                case 2: tile(s, m, n, 2, 2); break;
                case 1: tile(s, m, n, 1, 2); break;
            }
        }
    }
    for (; n < s->n_end; n++)
        for (m = 0; m < s->m_rows; m++) tile(s, m, n, 1, 1);
}

/* The pool: workers wait for pool_generation to change, run their share, count down pool_pending. */
""" + native.THREAD_POOL + r"""
/* y[m, n] for x [m_rows, k] (row stride ldx) and w [n, k]; scratch: m_rows * k bytes + m_rows floats.
   Returns 0, or 1 when k is not a multiple of 32. */
int w8a8_linear(const float* x, int64_t ldx, int64_t m_rows, int64_t k, const int8_t* w, const float* wscale,
                const int32_t* wsum, int64_t n, float* y, int64_t ldy, uint8_t* scratch, int threads) {
    if (k % 32) return 1;
    float* xscale = (float*)scratch;
    uint8_t* q = scratch + ((m_rows * sizeof(float) + 31) & ~(int64_t)31);
    quantize_rows(x, ldx, m_rows, k, q, xscale);
    share_t all = {q, xscale, m_rows, k, w, wscale, wsum, y, ldy, 0, n};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2 || n < 64 || pthread_mutex_trylock(&pool_lock) != 0) {
        run_share(&all);
        return 0;
    }
    const int workers = ensure_workers(threads - 1);
    const int parts = workers + 1 < threads ? workers + 1 : threads;
    int64_t bounds[MAX_THREADS + 1];
    for (int t = 0; t <= parts; t++) bounds[t] = (n * t / parts) & ~(int64_t)3;
    bounds[parts] = n;
    for (int t = 0; t < workers + 1; t++) {
        pool_shares[t] = all;
        pool_shares[t].n_begin = t < parts ? bounds[t] : n;
        pool_shares[t].n_end = t < parts ? bounds[t + 1] : n;
    }
    atomic_store(&pool_pending, workers);
    atomic_fetch_add(&pool_generation, 1);
    if (atomic_load(&pool_sleepers)) syscall(SYS_futex, &pool_generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_share(&pool_shares[0]);
    while (atomic_load(&pool_pending)) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
    return 0;
}
"""


# no reassociation: y = float(dot) * (row scale * weight scale) must round as reference() does
FLAGS = ["-fno-associative-math"]


def native_builds(every_isa: bool) -> list[tuple[str, str, list[str]]]:
    """The kernel as native.prebuild compiles it (one path for every AVX2 CPU)."""
    return [("w8a8_linear", _SOURCE, FLAGS)]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel (AVX2 CPUs with a C compiler), else None: w8a8 then runs `reference()`."""
    if not native.has_avx2():
        logger.warning("w8a8 linears run in torch ops (slow): this CPU has no AVX2")
        return None
    lib = native.build(*native_builds(False)[0])
    if lib is None:
        logger.warning("w8a8 linears run in torch ops (slow): the C kernel is unavailable")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.w8a8_linear.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    lib.w8a8_linear.restype = ctypes.c_int
    return lib


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weight within +-WEIGHT_MAX, fp32 per-channel scales, int32 row sums) of a float [N, K]."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / WEIGHT_MAX
    qweight = torch.round(weight / scales[:, None]).clamp(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8).contiguous()
    return qweight, scales.contiguous(), qweight.sum(dim=1, dtype=torch.int32).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q - 128 as float64 [M, K], row scales fp32 [M]): the kernel's activation quantization."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    finite = torch.isfinite(amax) & ~torch.isnan(x).any(dim=1)
    amax = amax.clamp(min=MIN_AMAX)
    inverse = torch.full_like(amax, 127.0) / amax  # not 127.0 / amax: torch computes that as 127 * (1 / amax)
    q = torch.round(x * inverse[:, None]).clamp(-128, 127)
    q = torch.where(finite[:, None], q, torch.zeros_like(q))
    scale = torch.where(finite, amax / 127.0, torch.full_like(amax, float("nan")))
    return q.double(), scale


def reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """The kernel's result in torch ops, bit for bit."""
    q, xscale = quantize_rows(x)
    dot = (q @ qweight.double().t()).float()  # exact: |dot| < 2^53
    return dot * (xscale[:, None] * wscale[None, :])


def supported(k: int) -> bool:
    return k % K_MULTIPLE == 0 and load() is not None


_serving_threads: int | None = None  # set_threads(): the server's CPUs for its kernels
_this_thread = threading.local()


def set_threads(threads: int | None) -> None:
    """Threads every kernel call uses from now on (None: torch's thread count at each call)."""
    global _serving_threads
    _serving_threads = threads


def one_thread_on_this_thread() -> None:
    """Calls from this OS thread use one thread (split execution's halves: each has its own core)."""
    _this_thread.threads = 1


def kernel_threads() -> int:
    return getattr(_this_thread, "threads", None) or _serving_threads or torch.get_num_threads()


def linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, wsum: torch.Tensor,
           threads: int) -> torch.Tensor:
    """y = x @ W.T for x fp32 [M, K] (unit stride along K) on the kernel; see the module docstring."""
    rows, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(rows, n)
    scratch = torch.empty(rows * (k + 4) + 32, dtype=torch.uint8)
    with native.profiled("cpu_w8a8::linear"):
        status = load().w8a8_linear(x.data_ptr(), x.stride(0), rows, k, qweight.data_ptr(), wscale.data_ptr(),
                                    wsum.data_ptr(), n, y.data_ptr(), n, scratch.data_ptr(), threads)
    if status:
        raise RuntimeError(f"w8a8_linear: K={k} is not a multiple of {K_MULTIPLE}")
    return y
