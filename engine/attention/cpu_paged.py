"""Paged decode attention for CPUs: a small C kernel that reads each sequence's KV blocks in place.

In: fp32 queries [T, heads, head_dim] (the decode rows among them), the layer's k/v caches in the
layout of backend.py, block tables and sequence lengths. Out: the decode rows of the attention
output, written in place. Per sequence the kernel walks the block table once for the keys (token
rows in block order; a KV head's key serves its whole group of query heads: GQA without
repeating KV) and once for the values, with an exact two-pass fp32 softmax in between, so
nothing is gathered into a padded batch and no mask is built. A sliding window starts the walk at
the window's oldest key (the blocks before it are never read); a logit soft-cap applies
cap * tanh(score / cap) to each scaled score. `threads` > 1 (with at least 1024
cached tokens in all) splits the decodes into that many contiguous shares of about equal token
counts, one pthread each (the caller's thread takes the first); the torch backend passes 1: on
this 2-vCPU machine two threads were 1.25-1.5x slower at 64 x 64 and no faster at 64 x 256
(bench/kernels/cpu_attention.py --kernel-threads 2), whatever torch's own thread count. torch has
no eager op that reads through a block table: its
reference path copies every decode's blocks (`index_select`) before SDPA, which at 64 sequences
costs as much as the attention itself.

The source is compiled once per machine (engine/native.py) and loaded with ctypes, which
releases the GIL during the call. Without a compiler, `load()` returns None and the torch
backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from iterserve.engine import native

logger = logging.getLogger(__name__)

MAX_HEADS, MAX_HEAD_DIM = 64, 256  # query heads and head_dim the kernel's stack buffer holds

_SOURCE = native.AVX2_HELPERS + r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_THREADS 64
#define MIN_PARALLEL_TOKENS 1024 /* below this many cached tokens in all, one thread: starting more costs more */


static inline float dot(const float *a, const float *b, int64_t n) {
#ifdef VECTOR
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t d = 0; d < n; d += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
        }
        return hsum(_mm256_add_ps(s0, s1));
    }
#endif
    float s = 0.0f;
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* The cache rows of a token PREFETCH_TOKENS ahead: its block may be anywhere, which the
   hardware prefetcher cannot guess (bench/kernels/cpu_attention_ab.py, docs/perf/cpu_attention_prefetch.json:
   1.19-1.35x per layer at 2-64 sequences). */
#define PREFETCH_TOKENS 4
static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t b = 0; b < floats * (int64_t)sizeof(float); b += 64) __builtin_prefetch((const char *)row + b, 0, 3);
}

/* s[0..n) = exp(s - top), returns their sum. */
static inline float exp_sum(float *s, int64_t n, float top) {
    int64_t p = 0;
    float sum = 0.0f;
#ifdef VECTOR
    __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (; p + 8 <= n; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), shift));
        _mm256_storeu_ps(s + p, e);
        total = _mm256_add_ps(total, e);
    }
    sum = hsum(total);
#endif
    for (; p < n; p++) { s[p] = expf(s[p] - top); sum += s[p]; }
    return sum;
}

/* acc[0..n) += w * v[0..n) */
static inline void axpy(float *acc, float w, const float *v, int64_t n) {
    int64_t d = 0;
#ifdef VECTOR
    __m256 weight = _mm256_set1_ps(w);
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
#endif
    for (; d < n; d++) acc[d] += w * v[d];
}

typedef struct {
    const float *query, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    const int64_t *seqs, *rows;
    int64_t query_row_stride, table_stride, num_heads, num_kv_heads, head_dim, block_size, out_row_stride;
    float scale, softcap; /* softcap 0: none */
    int64_t window; /* 0: every cached token; else the last `window` tokens */
    float *out;
    int64_t begin, end; /* this worker's share: decodes begin..end-1 */
    int status;
} Work;

static void *attend_range(void *arg) {
    Work *w = arg;
    const int64_t num_heads = w->num_heads, head_dim = w->head_dim, block_size = w->block_size;
    const int64_t group = num_heads / w->num_kv_heads, token_stride = w->num_kv_heads * head_dim;
    int64_t max_len = 1;
    for (int64_t i = w->begin; i < w->end; i++) if (w->seq_lens[w->seqs[i]] > max_len) max_len = w->seq_lens[w->seqs[i]];
    float *scores = malloc(sizeof(float) * num_heads * max_len);
    if (!scores) { w->status = -1; return NULL; }
    float acc[MAX_HEADS * MAX_HEAD_DIM], inv_sum[MAX_HEADS];
    for (int64_t i = w->begin; i < w->end; i++) {
        const int64_t seq_len = w->seq_lens[w->seqs[i]];
        const int64_t first = w->window > 0 && seq_len > w->window ? seq_len - w->window : 0;
        const int64_t len = seq_len - first; /* keys first .. seq_len - 1; scores[hq * len + (p - first)] */
        const int32_t *table = w->block_tables + w->seqs[i] * w->table_stride;
        const float *q = w->query + w->rows[i] * w->query_row_stride;
        /* Keys, token by token (each token's row holds every KV head: read whole, in block order):
           score[hq][p] = q_hq . k_p[hq / group] * scale, so a KV head's key serves its whole group. */
        for (int64_t p = first; p < seq_len; p++) {
            const float *key = w->k_cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * token_stride;
            if (p + PREFETCH_TOKENS < seq_len)
                prefetch_row(w->k_cache + ((int64_t)table[(p + PREFETCH_TOKENS) / block_size] * block_size
                                           + (p + PREFETCH_TOKENS) % block_size) * token_stride, token_stride);
            for (int64_t hq = 0; hq < num_heads; hq++) {
                float s = dot(q + hq * head_dim, key + (hq / group) * head_dim, head_dim) * w->scale;
                if (w->softcap > 0.0f) s = w->softcap * tanhf(s / w->softcap);
                scores[hq * len + p - first] = s;
            }
        }
        /* Softmax over the whole sequence in fp32: subtract the max, exponentiate, normalise at the end. */
        for (int64_t hq = 0; hq < num_heads; hq++) {
            float *s = scores + hq * len, top = s[0];
            for (int64_t p = 1; p < len; p++) top = s[p] > top ? s[p] : top;
            inv_sum[hq] = 1.0f / exp_sum(s, len, top);
        }
        for (int64_t d = 0; d < num_heads * head_dim; d++) acc[d] = 0.0f;
        /* Values, token by token: acc[hq] += p[hq] * v_p[hq / group]. */
        for (int64_t p = first; p < seq_len; p++) {
            const float *value = w->v_cache + ((int64_t)table[p / block_size] * block_size + p % block_size) * token_stride;
            if (p + PREFETCH_TOKENS < seq_len)
                prefetch_row(w->v_cache + ((int64_t)table[(p + PREFETCH_TOKENS) / block_size] * block_size
                                           + (p + PREFETCH_TOKENS) % block_size) * token_stride, token_stride);
            for (int64_t hq = 0; hq < num_heads; hq++)
                axpy(acc + hq * head_dim, scores[hq * len + p - first], value + (hq / group) * head_dim, head_dim);
        }
        float *o = w->out + w->rows[i] * w->out_row_stride;
        for (int64_t hq = 0; hq < num_heads; hq++)
            for (int64_t d = 0; d < head_dim; d++) o[hq * head_dim + d] = acc[hq * head_dim + d] * inv_sum[hq];
    }
    free(scores);
    w->status = 0;
    return NULL;
}

int paged_decode_attention(
    const float *query, int64_t query_row_stride, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
    const int64_t *seqs, const int64_t *rows, int64_t count, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *out, int64_t out_row_stride, int64_t threads,
    int64_t window, float softcap)
{
    if (num_heads > MAX_HEADS || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return -2;
    Work base = {query, k_cache, v_cache, block_tables, seq_lens, seqs, rows, query_row_stride, table_stride,
                 num_heads, num_kv_heads, head_dim, block_size, out_row_stride, scale, softcap, window, out, 0, count, 0};
    int64_t total = 0;
    for (int64_t i = 0; i < count; i++) total += seq_lens[seqs[i]];
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > count) threads = count;
    if (threads < 2 || total < MIN_PARALLEL_TOKENS) { attend_range(&base); return base.status; }
    /* Contiguous shares of about total / threads cached tokens each; worker 0 is this thread. */
    Work parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, status = 0;
    int64_t next = 0, done = 0;
    for (int64_t t = 0; t < threads; t++) {
        parts[t] = base;
        parts[t].begin = next;
        const int64_t goal = total * (t + 1) / threads;
        while (next < count && (t == threads - 1 || next == parts[t].begin || done + seq_lens[seqs[next]] <= goal))
            done += seq_lens[seqs[next++]];
        parts[t].end = next;
    }
    for (int64_t t = 1; t < threads; t++) {
        started[t] = pthread_create(&ids[t], NULL, attend_range, &parts[t]) == 0;
        if (!started[t]) attend_range(&parts[t]);
    }
    attend_range(&parts[0]);
    for (int64_t t = 0; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        if (parts[t].status) status = parts[t].status;
    }
    return status;
}
"""

def native_builds(every_isa: bool) -> list[tuple[str, str, list[str]]]:
    """The kernel as native.prebuild compiles it."""
    return [("paged_decode", _SOURCE, [])]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where no C compiler works (logged once)."""
    lib = native.build(*native_builds(False)[0])
    if lib is None:
        logger.warning("CPU decode attention gathers KV blocks (torch SDPA path)")
        return None
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64,
                   i64, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer: fp32 on CPU, contiguous caches, shapes it holds."""
    heads, kv_heads, dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (query.device.type == "cpu" and query.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and heads % kv_heads == 0 and heads <= MAX_HEADS
            and dim <= MAX_HEAD_DIM and load() is not None)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, seqs: torch.Tensor, rows: torch.Tensor, scale: float,
                 out: torch.Tensor, threads: int = 1, window: int | None = None,
                 softcap: float | None = None) -> None:
    """out[rows[i]] = attention of query[rows[i]] over sequence seqs[i]'s first seq_lens[seqs[i]] cached
    tokens (the last `window` of them with a sliding window; scores soft-capped with softcap). query/out [T, heads, head_dim] fp32 with contiguous rows; block_tables int32 [S, width],
    seq_lens int32 [S], seqs/rows int64 [n]; all contiguous on the CPU (`supports` says when)."""
    lib = load()
    heads, dim = query.shape[1], query.shape[2]
    assert query.stride(2) == 1 and query.stride(1) == dim and out.stride(2) == 1 and out.stride(1) == dim
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32 and v_cache.is_contiguous()
    assert seqs.dtype == torch.int64 and rows.dtype == torch.int64 and block_tables.is_contiguous()
    with native.profiled("cpu_paged::decode_attention"):
        status = lib.paged_decode_attention(
            query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), seqs.data_ptr(), rows.data_ptr(), seqs.numel(), heads,
            k_cache.shape[2], dim, k_cache.shape[1], scale, out.data_ptr(), out.stride(0), threads, window or 0,
            softcap or 0.0)
    if status != 0:
        raise RuntimeError(f"paged_decode_attention failed with status {status}")
