"""GGUF linears computed on the file's own blocks (`--quantization auto`, the default for GGUF models
on CPU): y = x . W^T with W as the file stores it (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K)
and x block-quantized to int8 as llama.cpp's Q8_1 does.

Activations: each row is cut into blocks of 32; a block's scale is dx = amax / 127 (amax = max |x|
of the block; a block with amax below MIN_AMAX is all zeros, one with NaN or inf has dx = NaN),
qx = round(x * (1 / dx)) (half to even) in -127..127, and the integer sums of qx over elements 0-15 and
16-31 are kept.

Weights, per block of 32 (a K-quant's sub-blocks of 32): unsigned q (2-bit, 3-bit, nibbles, 5-bit or
6-bit values; Q8_0's int8 through |w| and sign(x, w)), one scale wd per scale group (the whole block, or
Q6_K's, Q3_K's and Q2_K's two groups of 16 weights), and either an integer offset (Q4_0 8, Q5_0 16, Q6_K
32, Q3_K 4: w = wd * (q - offset)) or a float minimum per group (Q4_1, Q5_1 m; Q4_K, Q5_K -dmin * min;
Q2_K one per 16 weights: w = wd * q + wmin).

Arithmetic (what `reference()` repeats in torch ops, bit for bit): per block and scale group h, the exact
integer dot P = sum (q - offset) * qx over the group (int32: vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with
VNNI; the offset as -offset x the group's sum of qx), then, in fp32 with no fused multiply-adds,
acc = acc + float(P) * (dx * wd) and, for formats with a minimum, acc = acc + xs * wmin with
xs = float(S) * dx (S the group's sum of qx); blocks and groups in order, y = acc. One float step per
group where llama.cpp's AVX2 kernels scale 8 lanes a block: the integers are summed first (exact), so
fewer roundings and a quarter to an eighth of the float work. A row's result never
depends on the other rows of its call, the tiling or the thread count.

Tiling: below panel_rows(type) activation rows (plain AVX2: 3, Q8_0 12; AVX-512 VNNI: 8), register
tiles of 8 (activation row, weight row) pairs (4 x 2, 3 x 2, 2 x 4, 1 x 8; Q8_0 one weight row at 1-2
rows): each weight block decoded once for the tile's rows, the pairs' 8 integer lanes summed into one
vector of 8 pair totals (a vphaddd tree), scaled by one float multiply per group; the weight rows of
~160 KiB (an L2 share) pass every activation row before the next ones. From there on (batches, prefill
chunks), panels: 16 weight rows (AVX-512 VNNI; 8 with AVX2) decoded once per call into int8 vectors
whose 32-bit lane c holds weight row c's 4 values of one block lane (8 x 8 transposes), beside the rows'
scales as float vectors, so one broadcast activation word times one vector gives 4 products of 16 (8)
columns; a group's 8 (4) words add up in 16 bits before one vpmaddwd (AVX2: bounded below 2^15 per
format) or in int32 through vpdpbusd, and one float multiply-add scales 16 (8) columns. The panels are
per-thread scratch (the weights stay in the file's layout: no second copy); 4 activation rows pass
~160 KiB of panels at a time. Same integers, same float steps, same bits as the row tiles.

Threads: the output rows (weight rows) are split between the caller and a pool of workers, the
same spin-then-sleep pool as the w8a8 kernel's (cpu_w8a8.py). Where the kernel cannot be built (no
C compiler, no AVX2) GGUFLinear (quant.py) multiplies by the dequantized weight and says so once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
import threading
from pathlib import Path

import numpy as np
import torch

from iterserve.engine import native

logger = logging.getLogger(__name__)

BLOCK = 32  # activation block, and the weight blocks the kernel walks
MIN_AMAX = 1e-30  # an activation block below this is all zeros

# ggml type id -> (name, weights per file block, bytes per file block)
FORMATS = {
    8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
}
BY_NAME = {name: type_id for type_id, (name, _, _) in FORMATS.items()}
OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q3_K": 4}  # w = wd * (q - offset)
HAS_MIN = ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")  # w = wd * q + wmin

_SOURCE = r"""
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_THREADS 16
#define SPIN_ROUNDS 4000

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

static inline float f16(const uint8_t* p) {
    uint16_t h; memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 8 int32 lanes: lane l = sum of q[4l..4l+3] * x[4l..4l+3], q unsigned (< 128), x signed */
static inline __m256i dot_lanes(__m256i q, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

/* byte j = 16 where bit j of the 32 bits at p is set, else 0 */
static inline __m256i high_bits(const uint8_t* p) {
    uint32_t bits; memcpy(&bits, p, 4);
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
}

/* 16 bytes of nibbles: elements 0..15 the low nibbles, 16..31 the high ones */
static inline __m256i nibbles(const uint8_t* p) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)p);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

static inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* mn) {
    if (j < 4) { *sc = q[j] & 63; *mn = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* Block g (32 weights) of a row: unsigned q, the per-lane scale wd, the minimum wmin (formats with one). */
static inline __attribute__((always_inline)) void decode(const int type, const uint8_t* row, int64_t g,
                                                         __m256i* q, __m256* wd, __m256* wmin) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == Q8_0) {
        const uint8_t* b = row + g * 34;
        *q = _mm256_loadu_si256((const __m256i*)(b + 2)); /* signed: the caller takes |w| and sign(x, w) */
        *wd = _mm256_set1_ps(f16(b));
    } else if (type == Q4_0) {
        const uint8_t* b = row + g * 18;
        *q = nibbles(b + 2);
        *wd = _mm256_set1_ps(f16(b));
    } else if (type == Q4_1) {
        const uint8_t* b = row + g * 20;
        *q = nibbles(b + 4);
        *wd = _mm256_set1_ps(f16(b));
        *wmin = _mm256_set1_ps(f16(b + 2));
    } else if (type == Q5_0) {
        const uint8_t* b = row + g * 22;
        *q = _mm256_or_si256(nibbles(b + 6), high_bits(b + 2));
        *wd = _mm256_set1_ps(f16(b));
    } else if (type == Q5_1) {
        const uint8_t* b = row + g * 24;
        *q = _mm256_or_si256(nibbles(b + 8), high_bits(b + 4));
        *wd = _mm256_set1_ps(f16(b));
        *wmin = _mm256_set1_ps(f16(b + 2));
    } else if (type == Q4_K || type == Q5_K) {
        const int j = (int)(g & 7);
        const uint8_t* b = row + (g >> 3) * (type == Q4_K ? 144 : 176);
        const uint8_t* qs = b + (type == Q4_K ? 16 : 48) + 32 * (j >> 1);
        __m256i v = _mm256_loadu_si256((const __m256i*)qs);
        v = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
        if (type == Q5_K) {
            __m256i h = _mm256_loadu_si256((const __m256i*)(b + 16));
            h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
            v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
        }
        *q = v;
        int sc, mn;
        scale_min_k4(j, b + 4, &sc, &mn);
        *wd = _mm256_set1_ps(f16(b) * (float)sc);
        *wmin = _mm256_set1_ps(-(f16(b + 2) * (float)mn));
    } else if (type == Q2_K) { /* 16 weights per 4-bit scale and 4-bit minimum: lanes 0-3 and 4-7 */
        const int j = (int)(g & 7), h = j >> 2, r = j & 3;
        const uint8_t* b = row + (g >> 3) * 84;
        __m256i v = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * h));
        *q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
        const float d = f16(b + 80), dmin = f16(b + 82);
        const int lo = b[2 * j], hi = b[2 * j + 1];
        *wd = _mm256_set_m128(_mm_set1_ps(d * (float)(hi & 0xF)), _mm_set1_ps(d * (float)(lo & 0xF)));
        *wmin = _mm256_set_m128(_mm_set1_ps(-(dmin * (float)(hi >> 4))), _mm_set1_ps(-(dmin * (float)(lo >> 4))));
    } else if (type == Q3_K) { /* 2 low bits, the high bit in hmask, 6-bit signed scales per 16 weights */
        const int j = (int)(g & 7), h = j >> 2, r = j & 3;
        const uint8_t* b = row + (g >> 3) * 110;
        __m256i v = _mm256_loadu_si256((const __m256i*)(b + 32 + 32 * h));
        v = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
        __m256i m = _mm256_loadu_si256((const __m256i*)b);
        m = _mm256_and_si256(_mm256_srl_epi16(m, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        *q = _mm256_or_si256(v, _mm256_slli_epi16(m, 2));
        const uint8_t* sc = b + 96;
        int scale[2];
        for (int t = 0; t < 2; t++) {
            const int i = 2 * j + t;
            const int low = i < 8 ? sc[i] & 0xF : sc[i - 8] >> 4;
            scale[t] = (low | (((sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32;
        }
        const float d = f16(b + 108);
        *wd = _mm256_set_m128(_mm_set1_ps(d * (float)scale[1]), _mm_set1_ps(d * (float)scale[0]));
    } else { /* Q6_K */
        const int j = (int)(g & 7), h = j >> 2, r = j & 3;
        const uint8_t* b = row + (g >> 3) * 210;
        __m256i lo = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (r & 1)));
        lo = _mm256_and_si256(r >> 1 ? _mm256_srli_epi16(lo, 4) : lo, low4);
        __m256i hi = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * r)), _mm256_set1_epi8(3));
        *q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        const float d = f16(b + 208);
        const int8_t* scales = (const int8_t*)(b + 192);
        *wd = _mm256_set_m128(_mm_set1_ps(d * (float)scales[2 * j + 1]), _mm_set1_ps(d * (float)scales[2 * j]));
    }
}

typedef struct {
    int type; const uint8_t* w; int64_t row_bytes; int64_t k;
    const int8_t* xq; const float* xd; int64_t m_rows;
    float* y; int64_t ldy; int64_t n_begin, n_end;
    const float* xs; /* per block and scale group: float(the group's sum of x) x dx (formats with a minimum) */
    const int32_t* xi; /* per block and scale group: -offset x the group's sum of x (formats with an offset) */
    int panels; /* 1: the panel path (many rows), 0: the row tiles */
} share_t;

static inline int has_min_of(const int type) {
    return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K || type == Q2_K;
}
/* two scale groups of 16 weights per block (lanes 0-3 and 4-7), else one of 32 */
static inline int per16_of(const int type) { return type == Q6_K || type == Q3_K || type == Q2_K; }
/* w = wd * (q - offset); the row tiles take Q8_0's signed bytes as |w| x sign(x, w) (offset 0) */
static inline int offset_of(const int type) {
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : type == Q3_K ? 4 : 0;
}

/* Register tile: mr activation rows x nr weight rows, mr x nr <= 8 pairs (4 x 2, 3 x 2, 2 x 4, 1 x 8): each
   weight block decoded once for mr rows, each activation block loaded once for nr weight rows. Pair k (lane k
   of the tile's vectors) is activation row k % mr with weight row k / mr. Cache tile: the weight rows of about
   CHUNK_BYTES stay in L2 while every activation row passes them. */
#define MR 4
#define CHUNK_BYTES (160 * 1024)

/* lane k: the total of p[k]'s lanes 0-3 (*g0) and 4-7 (*g1) */
static inline void pair_totals(const __m256i* p, __m256i* g0, __m256i* g1) {
    const __m256i t0 = _mm256_hadd_epi32(p[0], p[1]), t1 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i t2 = _mm256_hadd_epi32(p[4], p[5]), t3 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    *g0 = _mm256_permute2x128_si256(u0, u1, 0x20);
    *g1 = _mm256_permute2x128_si256(u0, u1, 0x31);
}

/* Per-pair vectors built in registers (a vector assembled from scalar stores stalls the load that follows).
   by_row: lane k = v[k % mr], v the pair rows' values of one block (the activation arrays are block-major:
   rows m.. side by side); lanes past the pairs hold whatever is cheapest (never stored). */
static inline __attribute__((always_inline)) __m256 by_row(const float* v, int mr) {
    if (mr == 4) return _mm256_broadcast_ps((const __m128*)v);
    if (mr == 2) return _mm256_castpd_ps(_mm256_broadcast_sd((const double*)v));
    if (mr == 1) return _mm256_broadcast_ss(v);
    return _mm256_setr_ps(v[0], v[1], v[2], v[0], v[1], v[2], v[0], v[0]);
}
static inline __attribute__((always_inline)) __m256i by_row_i(const int32_t* v, int mr) {
    return _mm256_castps_si256(by_row((const float*)v, mr));
}
/* lanes k with k / mr == j (weight row j's pairs), as a blend mask */
static inline __attribute__((always_inline)) __m256 col_mask(int j, int mr) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_set1_epi32(j * mr - 1), hi = _mm256_set1_epi32((j + 1) * mr);
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(lane, lo), _mm256_cmpgt_epi32(hi, lane)));
}

/* mr activation rows from m x nr weight rows from n, the whole K */
static inline __attribute__((always_inline)) void tile(const int type, const int mr, const int nr, const share_t* s,
                                                       int64_t m, int64_t n) {
    const int64_t nb = s->k / 32, rows_all = s->m_rows;
    const int pairs = mr * nr;
    const int offset = offset_of(type), has_min = has_min_of(type), per16 = per16_of(type);
    const int64_t block_bytes = s->row_bytes / nb; /* average bytes per 32 weights, for the prefetch */
    const uint8_t* rows[8];
    for (int j = 0; j < nr; j++) rows[j] = s->w + (n + j) * s->row_bytes;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        __m256i x[MR], p[8];
        for (int r = 0; r < mr; r++) x[r] = _mm256_loadu_si256((const __m256i*)(s->xq + ((m + r) * nb + g) * 32));
        /* the pairs' weight scales and minimums per group: lane k holds weight row k / mr's */
        __m256 wd[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, wm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int j = 0; j < nr; j++) {
            __m256i q;
            __m256 d, mn = _mm256_setzero_ps();
            decode(type, rows[j], g, &q, &d, &mn);
            if ((g & 3) == 0) _mm_prefetch((const char*)rows[j] + g * block_bytes + 512, _MM_HINT_T0);
            const __m256i qabs = type == Q8_0 ? _mm256_abs_epi8(q) : q;
            for (int r = 0; r < mr; r++)
                p[j * mr + r] = dot_lanes(qabs, type == Q8_0 ? _mm256_sign_epi8(x[r], q) : x[r]);
            const __m256 mask = col_mask(j, mr);
            for (int h = 0; h < 1 + per16; h++) {
                /* lane 4h: group h's value (decode's vectors hold group 0 in lanes 0-3, group 1 in 4-7) */
                const __m256i at = _mm256_set1_epi32(4 * h);
                wd[h] = _mm256_blendv_ps(wd[h], per16 ? _mm256_permutevar8x32_ps(d, at) : d, mask);
                if (has_min) wm[h] = _mm256_blendv_ps(wm[h], per16 ? _mm256_permutevar8x32_ps(mn, at) : mn, mask);
            }
        }
        for (int k = pairs; k < 8; k++) p[k] = _mm256_setzero_si256();
        __m256i P[2];
        if (pairs == 1) { /* one pair: each half summed in all its lanes */
            __m128i h0 = _mm256_castsi256_si128(p[0]), h1 = _mm256_extracti128_si256(p[0], 1);
            h0 = _mm_add_epi32(h0, _mm_shuffle_epi32(h0, 0x4E));
            h1 = _mm_add_epi32(h1, _mm_shuffle_epi32(h1, 0x4E));
            h0 = _mm_add_epi32(h0, _mm_shuffle_epi32(h0, 0xB1));
            h1 = _mm_add_epi32(h1, _mm_shuffle_epi32(h1, 0xB1));
            P[0] = _mm256_castsi128_si256(h0);
            P[1] = _mm256_castsi128_si256(h1);
        } else {
            pair_totals(p, &P[0], &P[1]);
        }
        if (!per16) P[0] = _mm256_add_epi32(P[0], P[1]);
        const __m256 dx = by_row(s->xd + g * rows_all + m, mr);
        for (int h = 0; h < 1 + per16; h++) {
            const int64_t at = (g * 2 + h) * rows_all + m;
            if (offset) P[h] = _mm256_add_epi32(P[h], by_row_i(s->xi + at, mr));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(P[h]), _mm256_mul_ps(dx, wd[h])));
            if (has_min) acc = _mm256_add_ps(acc, _mm256_mul_ps(by_row(s->xs + at, mr), wm[h]));
        }
    }
    float out[8];
    _mm256_storeu_ps(out, acc);
    for (int k = 0; k < pairs; k++) s->y[(m + k % mr) * s->ldy + n + k / mr] = out[k];
}

/* mr activation rows from m x the weight rows n0..n1: nr = 8 / mr weight rows a tile, then the rest */
static inline __attribute__((always_inline)) void cols(const int type, const int mr, const share_t* s, int64_t m,
                                                       int64_t n0, int64_t n1) {
    /* Q8_0 (32 bytes a block, nothing to decode once for several rows) measured fastest one weight row at a
       time for 1-2 activation rows */
    const int nr = type == Q8_0 && mr <= 2 ? 1 : 8 / mr;
    int64_t n = n0;
    for (; n + nr <= n1; n += nr) tile(type, mr, nr, s, m, n);
    /* the rest, fewer than nr weight rows (a count of c only where mr x c <= 8: the others never occur) */
#define TAIL(c) case c: tile(type, mr, mr * c <= 8 ? c : 1, s, m, n); break;
    switch (n1 - n) { TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) }
#undef TAIL
}

static inline __attribute__((always_inline)) void run_type(const int type, const share_t* s) {
    int64_t chunk = CHUNK_BYTES / s->row_bytes / 8 * 8;
    if (chunk < 8) chunk = 8;
    for (int64_t n0 = s->n_begin; n0 < s->n_end; n0 += chunk) {
        const int64_t n1 = n0 + chunk < s->n_end ? n0 + chunk : s->n_end;
        int64_t m = 0;
        for (; m + MR <= s->m_rows; m += MR) cols(type, MR, s, m, n0, n1);
        switch (s->m_rows - m) {
            case 3: cols(type, 3, s, m, n0, n1); break;
            case 2: cols(type, 2, s, m, n0, n1); break;
            case 1: cols(type, 1, s, m, n0, n1); break;
        }
    }
}

/* ---- Many activation rows (batches, prefill chunks): weight panels ----
   From gguf_panel_rows(type) activation rows on, PW weight rows (output columns; 16 with AVX-512 VNNI, 8
   otherwise) are decoded once per call into a panel: per block, 8 vectors of PW int32 lanes, vector l
   holding bytes 4l..4l+3 of each row (8 x 8 transposes of int32), and the rows' group scales and minimums
   as vectors of PW floats. One dot of a broadcast activation word against vector l gives 4 products of PW
   columns at once; a group's words add up before one conversion, and each scaling multiply serves PW
   columns. Formats with an offset keep q unsigned and start the dot at -offset x the group's sum (Q8_0
   with VNNI: q + 128, offset 128; on plain AVX2, whose vpmaddubsw would saturate there, |q| x sign(x, q)). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define HAS_VNNI 1
#else
#define HAS_VNNI 0
#endif
/* PW weight rows per panel: 16 (one 512-bit vector of int32 lanes) with AVX-512 VNNI, else 8 */
#if HAS_VNNI && defined(__AVX512F__) && defined(__AVX512VL__)
#define PW 16
typedef __m512 vps_t;
typedef __m512i vpi_t;
#define V_ZERO_PS() _mm512_setzero_ps()
#define V_LOAD_PS(p) _mm512_loadu_ps(p)
#define V_SET1_PS(v) _mm512_set1_ps(v)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_CVT(a) _mm512_cvtepi32_ps(a)
#define V_ZERO_SI() _mm512_setzero_si512()
#define V_SET1_EPI32(v) _mm512_set1_epi32(v)
#define V_LOAD_SI(p) _mm512_loadu_si512((const void*)(p))
#else
#define PW 8
typedef __m256 vps_t;
typedef __m256i vpi_t;
#define V_ZERO_PS() _mm256_setzero_ps()
#define V_LOAD_PS(p) _mm256_loadu_ps(p)
#define V_SET1_PS(v) _mm256_set1_ps(v)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_CVT(a) _mm256_cvtepi32_ps(a)
#define V_ZERO_SI() _mm256_setzero_si256()
#define V_SET1_EPI32(v) _mm256_set1_epi32(v)
#define V_LOAD_SI(p) _mm256_loadu_si256((const __m256i*)(p))
#endif
#define PANEL_BLOCK_BYTES (48 * PW) /* per block of 32: 32 bytes of q per row, 4 scales (floats) per row */
#define PMR 4 /* activation rows a panel tile: one accumulator each */

static inline int panel_offset(const int type) {
    if (type == Q8_0) return HAS_VNNI ? 128 : 0;
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q6_K ? 32 : type == Q3_K ? 4 : 0;
}

static inline void transpose8(__m256i* v) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int l = 0; l < 4; l++) {
        v[l] = _mm256_permute2x128_si256(u[l], u[l + 4], 0x20);
        v[l + 4] = _mm256_permute2x128_si256(u[l], u[l + 4], 0x31);
    }
}

/* The panel of weight rows n..n+nc-1 (nc <= PW; the missing ones repeat the last, never stored): per
   block, 8 vectors of PW int32 lanes (vector l: bytes 4l..4l+3 of each row), then the rows' scales as
   4 x PW floats (wd of lanes 0-3, of lanes 4-7, wmin of lanes 0-3, of lanes 4-7). */
static inline __attribute__((always_inline)) void pack_panel(const int type, const share_t* s, int64_t n, int nc,
                                                             uint8_t* panel) {
    const int64_t nb = s->k / 32;
    const uint8_t* rows[PW];
    for (int c = 0; c < PW; c++) rows[c] = s->w + (n + (c < nc ? c : nc - 1)) * s->row_bytes;
    float* scales = (float*)(panel + nb * 32 * PW);
    for (int64_t g = 0; g < nb; g++) {
        __m256i q[PW];
        float* sc = scales + g * 4 * PW;
        for (int c = 0; c < PW; c++) {
            __m256 wd, wmin = _mm256_setzero_ps();
            decode(type, rows[c], g, &q[c], &wd, &wmin);
#if HAS_VNNI
            if (type == Q8_0) q[c] = _mm256_xor_si256(q[c], _mm256_set1_epi8((char)0x80));
#endif
            sc[c] = _mm256_cvtss_f32(wd);
            sc[PW + c] = _mm_cvtss_f32(_mm256_extractf128_ps(wd, 1));
            sc[2 * PW + c] = _mm256_cvtss_f32(wmin);
            sc[3 * PW + c] = _mm_cvtss_f32(_mm256_extractf128_ps(wmin, 1));
        }
        for (int h = 0; h < PW / 8; h++) {
            transpose8(q + 8 * h);
            for (int l = 0; l < 8; l++)
                _mm256_storeu_si256((__m256i*)(panel + g * 32 * PW + 4 * PW * l + 32 * h), q[8 * h + l]);
        }
    }
}

/* mr activation rows from m x the panel's PW columns from n (nc of them stored), the whole K. Per block and
   scale group, each row's exact integer dot for PW columns at once: one broadcast activation word (4 values)
   times vector l of the panel gives lane l's 4 products of every column; with plain AVX2 the vpmaddubsw pairs
   of up to sum16_words() words add up in 16 bits (bounded below 2^15: no saturation) before one vpmaddwd;
   with VNNI one vpdpbusd a word. Then one float multiply-add per row, group and PW columns. */
static inline int sum16_words(const int type) {
    /* |pair| <= 2 x 127 x the largest q: Q4 15, Q5 31, Q6_K 63, Q2_K 3, Q3_K 7 */
    if (type == Q8_0) return 1;
    if (type == Q5_0 || type == Q5_1 || type == Q5_K) return 4;
    if (type == Q6_K) return 2;
    return 8;
}

static inline __attribute__((always_inline)) void panel_tile(const int type, const int mr, const share_t* s,
                                                             const uint8_t* panel, int64_t m, int64_t n, int nc) {
    const int64_t nb = s->k / 32;
    const int has_min = has_min_of(type), per16 = per16_of(type);
    const int offset = panel_offset(type);
    const float* scales = (const float*)(panel + nb * 32 * PW);
    vps_t acc[PMR];
    for (int r = 0; r < mr; r++) acc[r] = V_ZERO_PS();
    for (int64_t g = 0; g < nb; g++) {
        const float* sc = scales + g * 4 * PW;
        const uint8_t* qp = panel + g * 32 * PW;
        vpi_t P[PMR][2];
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 1 + per16; h++)
                P[r][h] = offset ? V_SET1_EPI32(s->xi[(g * 2 + h) * s->m_rows + m + r]) : V_ZERO_SI();
#if HAS_VNNI
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) {
            const vpi_t w = V_LOAD_SI(qp + 4 * PW * l);
            const int h = per16 && l >= 4;
            for (int r = 0; r < mr; r++) {
                int32_t word;
                memcpy(&word, s->xq + ((m + r) * nb + g) * 32 + 4 * l, 4);
#if PW == 16
                P[r][h] = _mm512_dpbusd_epi32(P[r][h], w, V_SET1_EPI32(word));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
                P[r][h] = _mm256_dpbusd_epi32(P[r][h], w, V_SET1_EPI32(word));
#else
                P[r][h] = _mm256_dpbusd_avx_epi32(P[r][h], w, V_SET1_EPI32(word));
#endif
            }
        }
#else
        const int words16 = sum16_words(type);
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i s16[PMR];
        for (int r = 0; r < mr; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int l = 0; l < 8; l++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(qp + 4 * PW * l));
            const __m256i wabs = type == Q8_0 ? _mm256_abs_epi8(w) : w;
            const int h = per16 && l >= 4;
            for (int r = 0; r < mr; r++) {
                int32_t word;
                memcpy(&word, s->xq + ((m + r) * nb + g) * 32 + 4 * l, 4);
                const __m256i x = _mm256_set1_epi32(word);
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(wabs, type == Q8_0 ? _mm256_sign_epi8(x, w) : x));
            }
            if ((l + 1) % words16 == 0 || l == 7 || (per16 && l == 3))
                for (int r = 0; r < mr; r++) {
                    P[r][h] = _mm256_add_epi32(P[r][h], _mm256_madd_epi16(s16[r], ones));
                    s16[r] = _mm256_setzero_si256();
                }
        }
#endif
        for (int h = 0; h < 1 + per16; h++) {
            const vps_t wd = V_LOAD_PS(sc + h * PW);
            const vps_t wm = has_min ? V_LOAD_PS(sc + (2 + h) * PW) : V_ZERO_PS();
            for (int r = 0; r < mr; r++) {
                acc[r] = V_ADD(acc[r], V_MUL(V_CVT(P[r][h]), V_MUL(V_SET1_PS(s->xd[g * s->m_rows + m + r]), wd)));
                if (has_min) acc[r] = V_ADD(acc[r], V_MUL(V_SET1_PS(s->xs[(g * 2 + h) * s->m_rows + m + r]), wm));
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        float* out = s->y + (m + r) * s->ldy + n;
#if PW == 16
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << nc) - 1), acc[r]);
#else
        if (nc == 8) {
            _mm256_storeu_ps(out, acc[r]);
        } else {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r]);
            memcpy(out, lanes, sizeof(float) * nc);
        }
#endif
    }
}

/* Cache tile: the panels of about CHUNK_BYTES (in L2) pass every activation row, PMR at a time. */
static inline __attribute__((always_inline)) void run_panels(const int type, const share_t* s, uint8_t* panel) {
    const int64_t panel_bytes = s->k / 32 * PANEL_BLOCK_BYTES;
    int64_t groups = CHUNK_BYTES / panel_bytes;
    if (groups < 1) groups = 1;
    for (int64_t n0 = s->n_begin; n0 < s->n_end; n0 += PW * groups) {
        const int64_t n1 = n0 + PW * groups < s->n_end ? n0 + PW * groups : s->n_end;
        for (int64_t n = n0; n < n1; n += PW)
            pack_panel(type, s, n, n1 - n < PW ? (int)(n1 - n) : PW, panel + (n - n0) / PW * panel_bytes);
#define PANELS(mr)                                                                                          \
        for (int64_t n = n0; n < n1; n += PW)                                                               \
            panel_tile(type, mr, s, panel + (n - n0) / PW * panel_bytes, m, n, n1 - n < PW ? (int)(n1 - n) : PW);
        int64_t m = 0;
        for (; m + PMR <= s->m_rows; m += PMR) { PANELS(PMR) }
        switch (s->m_rows - m) {
            case 3: PANELS(3) break;
            case 2: PANELS(2) break;
            case 1: PANELS(1) break;
        }
#undef PANELS
    }
}

/* This thread's panels (kept between calls), or NULL where they cannot be allocated. */
static uint8_t* panel_scratch(int64_t k) {
    static __thread uint8_t* buffer;
    static __thread int64_t capacity;
    const int64_t panel_bytes = k / 32 * PANEL_BLOCK_BYTES;
    int64_t wanted = CHUNK_BYTES > panel_bytes ? CHUNK_BYTES / panel_bytes * panel_bytes : panel_bytes;
    wanted = (wanted + 63) / 64 * 64;
    if (capacity < wanted) {
        free(buffer);
        buffer = aligned_alloc(64, wanted);
        capacity = buffer ? wanted : 0;
    }
    return buffer;
}

static void run_share(const share_t* s) {
    uint8_t* panel = s->panels ? panel_scratch(s->k) : NULL;
    if (panel) {
        switch (s->type) {
            case Q8_0: run_panels(Q8_0, s, panel); break;
            case Q4_0: run_panels(Q4_0, s, panel); break;
            case Q4_1: run_panels(Q4_1, s, panel); break;
            case Q5_0: run_panels(Q5_0, s, panel); break;
            case Q5_1: run_panels(Q5_1, s, panel); break;
            case Q4_K: run_panels(Q4_K, s, panel); break;
            case Q5_K: run_panels(Q5_K, s, panel); break;
            case Q6_K: run_panels(Q6_K, s, panel); break;
            case Q2_K: run_panels(Q2_K, s, panel); break;
            case Q3_K: run_panels(Q3_K, s, panel); break;
        }
        return;
    }
    switch (s->type) {
        case Q8_0: run_type(Q8_0, s); break;
        case Q4_0: run_type(Q4_0, s); break;
        case Q4_1: run_type(Q4_1, s); break;
        case Q5_0: run_type(Q5_0, s); break;
        case Q5_1: run_type(Q5_1, s); break;
        case Q4_K: run_type(Q4_K, s); break;
        case Q5_K: run_type(Q5_K, s); break;
        case Q6_K: run_type(Q6_K, s); break;
        case Q2_K: run_type(Q2_K, s); break;
        case Q3_K: run_type(Q3_K, s); break;
    }
}

/* Blocks of 32: q = round(x / dx) with dx = amax / 127 (q row-major: [m][block][32]), dx block-major
   (d[g * m_rows + m]) and the sums of q over elements 0-15 and 16-31 (sums[(2g + h) * m_rows + m]). */
static void quantize_rows(const float* x, int64_t ldx, int64_t m_rows, int64_t k, int8_t* q, float* d,
                          int32_t* sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int64_t nb = k / 32;
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t g = 0; g < nb; g++) {
            const float* v = x + m * ldx + g * 32;
            const int64_t mb = m * nb + g;
            __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps(), part[4];
            for (int j = 0; j < 4; j++) {
                part[j] = _mm256_loadu_ps(v + 8 * j);
                vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, part[j]));
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(part[j], part[j], _CMP_UNORD_Q));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, vmax);
            float amax = lanes[0];
            for (int i = 1; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
            int8_t* out = q + mb * 32;
            if (_mm256_movemask_ps(bad) || amax > 3.4028234663852886e38f || amax < 1e-30f) {
                d[g * m_rows + m] = amax < 1e-30f && !_mm256_movemask_ps(bad) ? 0.0f : NAN;
                memset(out, 0, 32);
                sums[2 * g * m_rows + m] = sums[(2 * g + 1) * m_rows + m] = 0;
                continue;
            }
            const float dx = amax / 127.0f;
            const __m256 inv = _mm256_set1_ps(1.0f / dx);
            d[g * m_rows + m] = dx;
            __m256i a[4];
            for (int j = 0; j < 4; j++)
                a[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(part[j], inv),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
            packed = _mm256_permutevar8x32_epi32(packed, order);
            packed = _mm256_max_epi8(packed, _mm256_set1_epi8(-127));
            _mm256_storeu_si256((__m256i*)out, packed);
            int32_t lane_sums[8];
            _mm256_storeu_si256((__m256i*)lane_sums, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), packed),
                                                                       _mm256_set1_epi16(1)));
            sums[2 * g * m_rows + m] = lane_sums[0] + lane_sums[1] + lane_sums[2] + lane_sums[3];
            sums[(2 * g + 1) * m_rows + m] = lane_sums[4] + lane_sums[5] + lane_sums[6] + lane_sums[7];
        }
    }
}

/* The pool: workers wait for pool_generation to change, run their share, count down pool_pending. */
""" + native.THREAD_POOL + r"""
/* all's output rows 0..n split between the caller and the pool's workers, shares of whole panels (the last takes
   the rest); on the caller alone with one thread, under 32 rows, or while another call holds the pool. */
static void run_split(const share_t* all, int threads) {
    const int64_t n = all->n_end;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2 || n < 32 || pthread_mutex_trylock(&pool_lock) != 0) {
        run_share(all);
        return;
    }
    const int workers = ensure_workers(threads - 1);
    const int parts = workers + 1 < threads ? workers + 1 : threads;
    int64_t bounds[MAX_THREADS + 1];
    for (int t = 0; t < parts; t++) bounds[t] = n / PW * t / parts * PW;
    bounds[parts] = n;
    for (int t = 0; t < workers + 1; t++) {
        pool_shares[t] = *all;
        pool_shares[t].n_begin = t < parts ? bounds[t] : n;
        pool_shares[t].n_end = t < parts ? bounds[t + 1] : n;
    }
    atomic_store(&pool_pending, workers);
    atomic_fetch_add(&pool_generation, 1);
    if (atomic_load(&pool_sleepers)) syscall(SYS_futex, &pool_generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_share(&pool_shares[0]);
    while (atomic_load(&pool_pending)) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
}

/* 0 where the kernel takes type with k weights a row, 1 when k is not whole blocks, 2 for an unknown type */
static int check_format(int type, int64_t k) {
    const int super = type == Q4_K || type == Q5_K || type == Q6_K || type == Q2_K || type == Q3_K;
    if (type != Q8_0 && type != Q4_0 && type != Q4_1 && type != Q5_0 && type != Q5_1 && !super) return 2;
    return k % (super ? 256 : 32) ? 1 : 0;
}

/* The row count from which gguf_linear computes on panels by default, per format. On plain AVX2 (this EPYC,
   one thread, 3072 x 768) the panels were 1.2-1.8x faster than the row tiles from 3 rows on in every format
   but Q8_0, whose 32 bytes a block leave nothing to decode once for several rows: its panels were 0.55x at 4
   rows, 0.81x at 8 and 1.01x at 12 on the LM head (49152 x 576), 1.23x at 16. With AVX-512 VNNI 8
   (unmeasured). */
int gguf_panel_rows(int type) {
    if (PW == 16) return 8;
    return type == Q8_0 ? 12 : 3;
}

/* Scratch bytes gguf_linear needs for m_rows x k activations: per block 32 bytes of q, dx, and two group
   sums, two xs and two xi. */
int64_t gguf_scratch_bytes(int64_t m_rows, int64_t k) {
    const int64_t blocks = m_rows * (k / 32);
    return blocks * (32 + 4 + 3 * 8) + 6 * 64;
}

static inline void* align64(void* p) { return (void*)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

/* y [m_rows, n] (row stride ldy) = x [m_rows, k] (row stride ldx) . W^T, W's n rows of row_bytes in
   ggml type `type`. Returns 0, 1 when k is not a multiple of the format's block, 2 for an unknown type. */
int gguf_linear(int type, const float* x, int64_t ldx, int64_t m_rows, int64_t k, const uint8_t* w,
                int64_t row_bytes, int64_t n, float* y, int64_t ldy, uint8_t* scratch, int threads, int panel_rows) {
    const int status = check_format(type, k);
    if (status) return status;
    const int64_t blocks = m_rows * (k / 32);
    int8_t* q = (int8_t*)align64(scratch);
    float* d = (float*)align64(q + blocks * 32);
    int32_t* sums = (int32_t*)align64(d + blocks);
    quantize_rows(x, ldx, m_rows, k, q, d, sums);
    const int panels = m_rows >= panel_rows;
    const int per16 = per16_of(type);
    /* per block and scale group, block-major as d ((2g + h) * m_rows + m; one group of 32: its sum as h = 0) */
    const int64_t nb = k / 32;
    float* xs = NULL;
    int32_t* xi = NULL;
    const int offset = panels ? panel_offset(type) : offset_of(type);
    if (has_min_of(type)) xs = (float*)align64(sums + blocks * 2);
    if (offset) xi = (int32_t*)align64((float*)align64(sums + blocks * 2) + blocks * 2);
    for (int64_t g = 0; g < nb; g++)
        for (int64_t m = 0; m < m_rows; m++) {
            const int64_t i0 = 2 * g * m_rows + m, i1 = (2 * g + 1) * m_rows + m;
            const int32_t s0 = per16 ? sums[i0] : sums[i0] + sums[i1], s1 = sums[i1];
            const float dx = d[g * m_rows + m];
            if (xs) {
                xs[i0] = (float)s0 * dx;
                if (per16) xs[i1] = (float)s1 * dx;
            }
            if (xi) {
                xi[i0] = -offset * s0;
                if (per16) xi[i1] = -offset * s1;
            }
        }
    share_t all = {type, w, row_bytes, k, q, d, m_rows, y, ldy, 0, n, xs, xi, panels};
    run_split(&all, threads);
    return 0;
}

"""


@functools.cache  # read once: every linear call asks (load()), and reading /proc/cpuinfo took ~0.1 ms
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def isa_path() -> str:
    """The integer dot product the kernel compiles to on this CPU: avx512-vnni, avx-vnni or avx2."""
    flags = _cpu_flags()
    if {"avx512_vnni", "avx512vl"} <= flags:
        return "avx512-vnni"
    if "avx_vnni" in flags:
        return "avx-vnni"
    return "avx2"


ISA_FLAGS = {"avx512-vnni": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"], "avx-vnni": ["-mavxvnni"],
             "avx2": []}


def compile_flags(isa: str) -> list[str]:
    """The kernel's own flags for isa, after native.build's."""
    # no reassociation and no contraction: the float steps must round as reference() does
    return ["-mf16c", "-fno-associative-math", "-ffp-contract=off", *ISA_FLAGS[isa]]


def _native_build(isa: str) -> tuple[str, str, list[str]]:
    return f"gguf_linear_{isa.replace('-', '_')}", _SOURCE, compile_flags(isa)


def native_builds(every_isa: bool) -> list[tuple[str, str, list[str]]]:
    """The kernel as native.prebuild compiles it: this CPU's path, or every path (an image)."""
    return [_native_build(isa) for isa in (sorted(ISA_FLAGS) if every_isa else [isa_path()])]


def load() -> ctypes.CDLL | None:
    """The compiled kernel (AVX2 CPUs with a C compiler), else None (logged)."""
    return build(isa_path())


@functools.cache
def build(isa: str) -> ctypes.CDLL | None:
    """The kernel compiled for isa (isa_path()'s names; the tests also build the plain AVX2 path on a
    VNNI CPU), or None where it cannot be built here."""
    if not native.has_avx2() or "f16c" not in _cpu_flags():
        logger.warning("GGUF linears multiply by the dequantized weight: this CPU has no AVX2/F16C")
        return None
    lib = native.build(*_native_build(isa))
    if lib is None:
        logger.warning("GGUF linears multiply by the dequantized weight: the C kernel is unavailable")
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gguf_linear.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int,
                                ctypes.c_int]
    lib.gguf_linear.restype = ctypes.c_int
    lib.gguf_panel_rows.argtypes = [ctypes.c_int]
    lib.gguf_panel_rows.restype = ctypes.c_int
    lib.gguf_scratch_bytes.argtypes = [i64, i64]
    lib.gguf_scratch_bytes.restype = i64
    return lib


def panel_rows(type_id: int, lib: ctypes.CDLL | None = None) -> int:
    """The activation row count from which the kernel (lib, else this CPU's) computes on type_id's weight
    panels."""
    return (lib or load()).gguf_panel_rows(type_id)


def block_shape(type_id: int) -> tuple[int, int]:
    """(weights, bytes) of one file block of ggml type type_id."""
    _, weights, nbytes = FORMATS[type_id]
    return weights, nbytes


def row_bytes(type_id: int, k: int) -> int:
    weights, nbytes = block_shape(type_id)
    return k // weights * nbytes


def file_blocks(tensor) -> tuple[int, torch.Tensor] | None:
    """(ggml type, blocks uint8 [rows, row bytes], a copy) of a 2-D GGUF tensor (gguf_file.Tensor) in a
    format the kernel takes, else None."""
    if tensor.tensor_type not in FORMATS or len(tensor.shape) != 2:
        return None
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists dims innermost first
    weights, nbytes = block_shape(tensor.tensor_type)
    if cols % weights:
        return None
    raw = np.array(tensor.data, dtype=np.uint8).reshape(rows, cols // weights * nbytes)
    return tensor.tensor_type, torch.from_numpy(raw)


_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's scratch for the quantized activations, grown as needed and kept: a fresh buffer of a
    prefill's size per call is a fresh mmap, and its page faults cost more than the product at 64 rows."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _local.scratch = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buffer


def _check(status: int, call: str, type_id: int, k: int) -> None:
    if status:
        raise ValueError(f"{call}: K={k} does not fit {FORMATS.get(type_id, ('type ' + str(type_id),))[0]} "
                         f"blocks (status {status})")


def linear(x: torch.Tensor, blocks: torch.Tensor, type_id: int, threads: int,
           lib: ctypes.CDLL | None = None, panel_rows: int | None = None) -> torch.Tensor:
    """y = x @ W.T, x fp32 [M, K] (unit stride along K), W as blocks uint8 [N, row bytes]. panel_rows: the
    row count from which the kernel decodes weight panels (panel_rows(type_id); the tests and the benchmark
    move it to run either block path at any row count: the same bits)."""
    rows, k = x.shape
    n = blocks.shape[0]
    lib = lib or load()
    y = torch.empty(rows, n)
    scratch = _scratch(lib.gguf_scratch_bytes(rows, k))
    with native.profiled("cpu_gguf::linear"):
        status = lib.gguf_linear(type_id, x.data_ptr(), x.stride(0), rows, k, blocks.data_ptr(), blocks.stride(0),
                                 n, y.data_ptr(), n, scratch.data_ptr(), threads,
                                 lib.gguf_panel_rows(type_id) if panel_rows is None else panel_rows)
    _check(status, "gguf_linear", type_id, k)
    return y


# -- the same arithmetic in torch ---------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] fp32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(raw: np.ndarray) -> np.ndarray:
    """[..., 4] bytes -> [..., 32]: bit j of the little-endian 32 bits, times 16."""
    return np.unpackbits(raw, axis=-1, bitorder="little") << 4


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = scales.astype(np.int32)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack(blocks: torch.Tensor | np.ndarray, type_id: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                      torch.Tensor | None, int]:
    """(q [N, K] int16 (Q8_0 signed, else unsigned), wd [N, K/32, 8] fp32, wmin [N, K/32] fp32 (Q2_K:
    [N, K/32, 8], a minimum per 16 weights) or None, offset) of the blocks uint8 [N, row bytes]:
    w = wd * (q - offset) (+ wmin)."""
    name, weights, nbytes = FORMATS[type_id]
    raw = np.asarray(blocks, dtype=np.uint8)
    n = raw.shape[0]
    b = raw.reshape(n, -1, nbytes)
    wmin = None
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b[..., 0:2])
        if name == "Q8_0":
            q = b[..., 2:].view(np.int8).astype(np.int16)
        elif name == "Q4_0":
            q = _nibbles(b[..., 2:18]).astype(np.int16)
        elif name == "Q4_1":
            q = _nibbles(b[..., 4:20]).astype(np.int16)
            wmin = _f16(b[..., 2:4])
        elif name == "Q5_0":
            q = (_nibbles(b[..., 6:22]) | _bits(b[..., 2:6])).astype(np.int16)
        else:
            q = (_nibbles(b[..., 8:24]) | _bits(b[..., 4:8])).astype(np.int16)
            wmin = _f16(b[..., 2:4])
        wd = np.repeat(d[..., None], 8, axis=-1)
    elif name in ("Q4_K", "Q5_K"):
        d = _f16(b[..., 0:2])
        dmin = _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        start = 16 if name == "Q4_K" else 48
        qs = b[..., start:start + 128].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: two sub-blocks each
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if name == "Q5_K":
            qh = b[..., 16:48]  # bit j of byte i: element i of sub-block j
            q = q | (((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        q = q.reshape(n, -1).astype(np.int16)
        wd = np.repeat((d[..., None] * sc).reshape(n, -1)[..., None], 8, axis=-1)
        wmin = -(dmin[..., None] * mn).reshape(n, -1)
    elif name in ("Q2_K", "Q3_K"):
        # sub-block j (32 weights) of a super-block: 2 bits at shift 2 (j & 3) of bytes 32 (j >> 2)..+31;
        # its two halves of 16 weights have scales 2j and 2j + 1 (lanes 0-3, 4-7)
        qs = b[..., 16:80] if name == "Q2_K" else b[..., 32:96]
        low = (qs.reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [N, S, 2, 4, 32]
        q = low.reshape(n, -1, 8, 32)
        if name == "Q2_K":
            scales = b[..., 0:16].astype(np.int32)
            d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
            per16 = d[..., None] * (scales & 0xF).astype(np.float32)
            wmin = np.repeat(-(dmin[..., None] * (scales >> 4).astype(np.float32)).reshape(n, -1, 2), 4, axis=-1)
        else:
            hm = b[..., 0:32]
            q = q | (((hm[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 2)
            raw = b[..., 96:108].astype(np.int32)
            i = np.arange(16)
            low4 = np.where(i < 8, raw[..., i % 8] & 0xF, raw[..., i % 8] >> 4)
            scales = (low4 | (((raw[..., 8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4)) - 32
            per16 = _f16(b[..., 108:110])[..., None] * scales.astype(np.float32)
        q = q.reshape(n, -1).astype(np.int16)
        wd = np.repeat(per16.reshape(n, -1, 2), 4, axis=-1)
        if wmin is not None:
            wmin = wmin.reshape(n, -1, 8)
    else:  # Q6_K
        ql, qh = b[..., 0:128], b[..., 128:192]
        scales = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        groups = []
        for j in range(8):
            h, r = j >> 2, j & 3
            lo = ql[..., 64 * h + 32 * (r & 1):64 * h + 32 * (r & 1) + 32]
            lo = (lo >> 4) if r >> 1 else (lo & 0x0F)
            hi = (qh[..., 32 * h:32 * h + 32] >> (2 * r)) & 3
            groups.append(lo | (hi << 4))
        q = np.stack(groups, axis=2).reshape(n, -1).astype(np.int16)
        per16 = (d[..., None] * scales).reshape(n, -1, 2)  # [N, K/32, 2]: lanes 0-3, lanes 4-7
        wd = np.repeat(per16, 4, axis=-1)
    to = torch.from_numpy
    return (to(np.ascontiguousarray(q.reshape(n, -1))), to(np.ascontiguousarray(wd, dtype=np.float32)),
            None if wmin is None else to(np.ascontiguousarray(wmin, dtype=np.float32)), OFFSET.get(name, 0))


def dequantize(blocks: torch.Tensor | np.ndarray, type_id: int) -> torch.Tensor:
    """The weight as fp32 [N, K] (gguf's own dequantization: the values `--quantization none` runs)."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    raw = np.asarray(blocks, dtype=np.uint8)
    quant = getattr(gguf.quants, FORMATS[type_id][0])
    weights, nbytes = block_shape(type_id)
    out = quant.dequantize_blocks(raw.reshape(-1, nbytes)).astype(np.float32)
    assert GGMLQuantizationType(type_id).name == FORMATS[type_id][0]
    return torch.from_numpy(out.reshape(raw.shape[0], -1))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [M, K/32, 32] int64, dx [M, K/32] fp32, sums [M, K/32, 2] int64 of q over elements 0-15 and
    16-31): the kernel's blocks."""
    rows, k = x.shape
    v = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = v.abs().amax(-1)
    bad = torch.isnan(v).any(-1) | torch.isinf(amax)
    tiny = (amax < MIN_AMAX) & ~bad
    dx = amax / torch.full_like(amax, 127.0)
    inverse = torch.ones_like(dx) / dx
    q = torch.round(v * inverse[..., None]).clamp(-127, 127)
    zero = (bad | tiny)[..., None]
    q = torch.where(zero, torch.zeros_like(q), q).to(torch.int64)
    dx = torch.where(bad, torch.full_like(dx, float("nan")), torch.where(tiny, torch.zeros_like(dx), dx))
    return q, dx, q.view(rows, k // BLOCK, 2, 16).sum(-1)


def scale_groups(type_id: int) -> int:
    """Scale groups per block of 32: 2 (16 weights each) for Q6_K, Q3_K and Q2_K, else 1."""
    return 2 if FORMATS[type_id][0] in ("Q6_K", "Q3_K", "Q2_K") else 1


def reference(x: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    """The kernel's result in torch ops, bit for bit (slow: tests and tools)."""
    q_w, wd, wmin, offset = unpack(blocks, type_id)
    rows, k = x.shape
    n, nb = q_w.shape[0], k // BLOCK
    groups = scale_groups(type_id)
    width = BLOCK // groups
    qx, dx, halves = quantize_activations(x)
    sums = halves if groups == 2 else halves.sum(-1, keepdim=True)  # [M, K/32, groups]
    # exact integer group dots through float64: [K/32 * groups, M, width] @ [K/32 * groups, width, N]
    group_x = qx.view(rows, nb * groups, width).transpose(0, 1).double()
    group_w = q_w.view(n, nb * groups, width).permute(1, 2, 0).double()
    dots = torch.bmm(group_x, group_w).view(nb, groups, rows, n)
    if offset:
        dots = dots - offset * sums.permute(1, 2, 0)[..., None].double()
    dots = dots.float()  # exact: |dot| < 2^24
    xs = sums.float() * dx[..., None]  # the minimum's activation factor, per block and group
    acc = torch.zeros(rows, n)
    for g in range(nb):
        for h in range(groups):
            acc = acc + dots[g, h] * (dx[:, g, None] * wd[None, :, g, 4 * h])
            if wmin is not None:
                group_min = wmin[:, g, 4 * h] if wmin.dim() == 3 else wmin[:, g]
                acc = acc + xs[:, g, h, None] * group_min[None, :]
    return acc


# -- embedding tables in their file format ------------------------------------------------------------


def rows(ids: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    """Rows ids of the table whose rows are blocks uint8 [vocab, row bytes], dequantized: fp32 [*ids.shape,
    width], the values of the dense table (gguf's own dequantization) bit for bit."""
    flat = ids.reshape(-1).to(torch.int64)
    vocab = blocks.shape[0]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise IndexError(f"token id out of range: the embedding has {vocab} rows (ids 0..{vocab - 1})")
    out = dequantize(blocks.index_select(0, flat).numpy(), type_id)
    return out.reshape(*ids.shape, out.shape[-1])


class BlockRows:
    """An embedding table kept in its file's block format (Q8_0, Q6_K, Q4_1, ... as FORMATS): a lookup
    dequantizes the rows it takes, so the table costs its file bytes instead of 4 bytes a weight. Where the
    LM head is tied to it, the two share the blocks."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, type_id: int, blocks: torch.Tensor):
        weights, nbytes = block_shape(type_id)
        self.type_id, self.blocks = type_id, blocks.contiguous()
        self.shape = (blocks.shape[0], blocks.shape[1] // nbytes * weights)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.iterserve.gguf_rows(ids, self.blocks, self.type_id)
        return rows(ids, self.blocks, self.type_id)


@torch.library.custom_op("iterserve::gguf_rows", mutates_args=())
def _rows_op(ids: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    return rows(ids, blocks, type_id)


@_rows_op.register_fake
def _(ids: torch.Tensor, blocks: torch.Tensor, type_id: int) -> torch.Tensor:
    weights, nbytes = block_shape(type_id)
    return blocks.new_empty((*ids.shape, blocks.shape[1] // nbytes * weights), dtype=torch.float32)


def embedding(ids: torch.Tensor, table: torch.Tensor | BlockRows) -> torch.Tensor:
    """F.embedding for a dense table or a BlockRows."""
    return table.lookup(ids) if isinstance(table, BlockRows) else torch.nn.functional.embedding(ids, table)
