#pragma once

// SpecDeck: a small-batch matrix product for F16 and BF16 weights on x86 (AVX2, F16C and FMA;
// every AVX-512 CPU has them). Written for SpecDeck and compiled into its llama.cpp build by
// packaging/llama_patch.py (ggml/src/ggml-cpu/specdeck-smallbatch.h).
//
// Why: speculative decoding verifies 2-12 rows at once, and a product of a few rows with a matrix
// is bound by reading the weights from memory, as one row is. llama.cpp's one-row path streams
// each weight row once, but from 2 rows on ggml hands the product to llamafile's tinyBLAS, whose
// tiles interleave four weight rows and wait on their loads: on a 2-core AMD EPYC Zen 4,
// SmolLM2-135M F16 verified 2 rows for 1.6-2.2x the time of one and 5 rows for 2.0-2.7x.
// This kernel reads the weights once, two rows at a time in order, widens them to float32 in
// registers and multiplies them with every activation row, which stays in L1: the weights cost
// what one row costs, the other rows only their multiply-adds (measured on the same VM, the
// model's products alone: 2 to 4 rows for the time of one, 5 rows for 1.15x).
//
// 256-bit vectors everywhere: on Zen 4, whose AVX-512 unit is 256 bits wide, a 512-bit version
// of this loop was no faster (one comparison, 5 rows: 1.74x a row against 1.37-1.65x), and the
// loop is bound by memory and multiply-adds, which both widths do at the same rate there.
//
// The activations are rounded to the weights' type first (float16 or bfloat16, then widened
// back), as ggml rounds them for its own F16/BF16 products, so a batched row differs from a
// one-row product only in the order of the additions.
//
// GGML_SPECDECK_SMALLBATCH=0 in the environment turns it off (read once per process).

#include "ggml.h"
#include "ggml-cpu-impl.h"
#include "simd-mappings.h"

#include <stdbool.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define SPECDECK_SB_ENABLED 1
#include <immintrin.h>
#else
#define SPECDECK_SB_ENABLED 0
#endif

// Most activation rows taken here: from about 12 on, tinyBLAS's tiles are as fast (Zen 4).
#ifndef SPECDECK_SB_MAX_ROWS
#define SPECDECK_SB_MAX_ROWS 12
#endif
// Activation rows multiplied per pass over two weight rows: 2 x GROUP accumulators, two weight
// vectors and one activation vector must fit the registers (16 with AVX2, 32 with AVX-512).
#if defined(__AVX512F__)
#define SPECDECK_SB_GROUP 8
#else
#define SPECDECK_SB_GROUP 6
#endif
// Weight bytes prefetched ahead of the two rows being read: several rows, more than a memory
// latency's worth (measured flat from 4 to 16 KiB on Zen 4, worse at 1 KiB).
#ifndef SPECDECK_SB_PREFETCH
#define SPECDECK_SB_PREFETCH 8192
#endif

// Whether the small-batch kernel takes this product: 2D F16/BF16 weights with contiguous rows,
// F32 activations with 2 to SPECDECK_SB_MAX_ROWS rows.
static bool specdeck_sb_applies(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
#if SPECDECK_SB_ENABLED
    static int on = -1;
    if (on < 0) {
        const char * env = getenv("GGML_SPECDECK_SMALLBATCH");
        on = !(env && env[0] == '0');
    }
    return on &&
           (src0->type == GGML_TYPE_F16 || src0->type == GGML_TYPE_BF16) &&
           src1->type == GGML_TYPE_F32 &&
           src1->ne[1] >= 2 && src1->ne[1] <= SPECDECK_SB_MAX_ROWS &&
           src0->ne[2] == 1 && src0->ne[3] == 1 && src1->ne[2] == 1 && src1->ne[3] == 1 &&
           src0->nb[0] == ggml_type_size(src0->type) && src1->nb[0] == sizeof(float);
#else
    (void) src0; (void) src1;
    return false;
#endif
}

// Work buffer the kernel needs: the rounded activations, [rows, K] float32.
static size_t specdeck_sb_wsize(const struct ggml_tensor * src1) {
    return (size_t) src1->ne[0] * (size_t) src1->ne[1] * sizeof(float) + 64;
}

#if SPECDECK_SB_ENABLED

#if defined(_MSC_VER)
#define SB_INLINE __forceinline
#else
#define SB_INLINE inline __attribute__((always_inline))
#endif

#define SB_EPR 8  // floats in a vector

static inline __m256 sb_load_w(const bool bf16, const void * w, const int i) {
    if (bf16) {  // bfloat16 is the top half of a float32
        const __m128i h = _mm_loadu_si128((const __m128i *) ((const ggml_bf16_t *) w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const ggml_fp16_t *) w + i)));
}

static inline float sb_w(const bool bf16, const void * w, const int i) {
    return bf16 ? GGML_BF16_TO_FP32(((const ggml_bf16_t *) w)[i]) : GGML_CPU_FP16_TO_FP32(((const ggml_fp16_t *) w)[i]);
}

static inline float sb_sum(const __m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// out[h + j * os] = w_h . y[j * ys] for h < nw weight rows (1 or 2; row 1 starts wstride bytes
// after row 0) and j < g activation rows, over k elements. nw, g and bf16 are constants at every
// call site, so the loops unroll and the accumulators stay in registers; two weight rows a pass
// halve the activation loads.
static SB_INLINE void specdeck_sb_rows(
        const int nw, const int g, const bool bf16, const int k, const void * w, const size_t wstride,
        const float * y, const size_t ys, float * out, const size_t os) {
    __m256 acc[2][SPECDECK_SB_GROUP];
    for (int h = 0; h < nw; h++) {
        for (int j = 0; j < g; j++) {
            acc[h][j] = _mm256_setzero_ps();
        }
    }
    const char * w1 = (const char *) w + wstride;
    const int kv = k - k % SB_EPR;
    for (int i = 0; i < kv; i += SB_EPR) {
        // the rows ahead (weight rows are contiguous in practice; a prefetch never faults)
        _mm_prefetch((const char *) w + SPECDECK_SB_PREFETCH + (size_t) i * nw * 2, _MM_HINT_T0);
        const __m256 w0v = sb_load_w(bf16, w, i);
        const __m256 w1v = nw > 1 ? sb_load_w(bf16, w1, i) : w0v;
        for (int j = 0; j < g; j++) {
            const __m256 yv = _mm256_loadu_ps(y + j * ys + i);
            acc[0][j] = _mm256_fmadd_ps(w0v, yv, acc[0][j]);
            if (nw > 1) {
                acc[1][j] = _mm256_fmadd_ps(w1v, yv, acc[1][j]);
            }
        }
    }
    for (int h = 0; h < nw; h++) {
        const void * wh = h ? (const void *) w1 : w;
        for (int j = 0; j < g; j++) {
            float s = sb_sum(acc[h][j]);
            for (int i = kv; i < k; i++) {
                s += sb_w(bf16, wh, i) * y[j * ys + i];
            }
            out[h + j * os] = s;
        }
    }
}

#define SB_CASE(G, B) case G: { \
        if (nw > 1) { specdeck_sb_rows(2, G, B, k, w, wstride, y, ys, out, os); } \
        else { specdeck_sb_rows(1, G, B, k, w, wstride, y, ys, out, os); } \
    } break;
#if SPECDECK_SB_GROUP > 6
#define SB_CASES(B) switch (g) { SB_CASE(1, B) SB_CASE(2, B) SB_CASE(3, B) SB_CASE(4, B) SB_CASE(5, B) \
        SB_CASE(6, B) SB_CASE(7, B) SB_CASE(8, B) default: GGML_ABORT("specdeck small batch: bad group"); }
#else
#define SB_CASES(B) switch (g) { SB_CASE(1, B) SB_CASE(2, B) SB_CASE(3, B) SB_CASE(4, B) SB_CASE(5, B) \
        SB_CASE(6, B) default: GGML_ABORT("specdeck small batch: bad group"); }
#endif

// specdeck_sb_rows with nw and g known only at run time.
static void specdeck_sb_rows_any(int nw, int g, bool bf16, int k, const void * w, size_t wstride,
                                 const float * y, size_t ys, float * out, size_t os) {
    if (bf16) {
        SB_CASES(true)
    } else {
        SB_CASES(false)
    }
}
#undef SB_CASES
#undef SB_CASE

// Rounds n floats through the weights' type and back (what ggml's own dot products see).
static void specdeck_sb_round(bool bf16, const float * x, float * y, int64_t n) {
    enum { CHUNK = 256 };
    union { ggml_fp16_t h[CHUNK]; ggml_bf16_t b[CHUNK]; } tmp;
    for (int64_t i = 0; i < n; i += CHUNK) {
        const int64_t m = n - i < CHUNK ? n - i : CHUNK;
        if (bf16) {
            ggml_cpu_fp32_to_bf16(x + i, tmp.b, m);
            ggml_cpu_bf16_to_fp32(tmp.b, y + i, m);
        } else {
            ggml_cpu_fp32_to_fp16(x + i, tmp.h, m);
            ggml_cpu_fp16_to_fp32(tmp.h, y + i, m);
        }
    }
}

// The product, for ggml_compute_forward_mul_mat: the threads round their share of the
// activations into the work buffer, wait for each other, then take a contiguous range of
// weight rows each.
static void specdeck_sb_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    const bool bf16 = src0->type == GGML_TYPE_BF16;
    const int ith = params->ith;
    const int nth = params->nth;
    const int64_t k = src0->ne[0];
    const int64_t m = src0->ne[1];
    const int64_t n = src1->ne[1];
    float * y = (float *) params->wdata;  // [n, k]
    GGML_ASSERT(params->wsize >= (size_t) (n * k) * sizeof(float));

    for (int64_t j = 0; j < n; j++) {
        const int64_t i0 = k * ith / nth;
        const int64_t i1 = k * (ith + 1) / nth;
        specdeck_sb_round(bf16, (const float *) ((const char *) src1->data + j * src1->nb[1]) + i0, y + j * k + i0, i1 - i0);
    }
    ggml_barrier(params->threadpool);

    const int64_t r0 = m * ith / nth;
    const int64_t r1 = m * (ith + 1) / nth;
    const size_t os = dst->nb[1] / sizeof(float);
    for (int64_t r = r0; r < r1; r += 2) {
        const int nw = r + 1 < r1 ? 2 : 1;
        const void * w = (const char *) src0->data + r * src0->nb[1];
        float * out = (float *) dst->data + r;
        for (int64_t j = 0; j < n; j += SPECDECK_SB_GROUP) {
            const int g = (int) (n - j < SPECDECK_SB_GROUP ? n - j : SPECDECK_SB_GROUP);
            specdeck_sb_rows_any(nw, g, bf16, (int) k, w, src0->nb[1], y + j * k, (size_t) k, out + j * os, os);
        }
    }
}

#else

static void specdeck_sb_mul_mat(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    (void) params; (void) dst;
    GGML_ABORT("specdeck small batch: not built for this CPU");
}

#endif // SPECDECK_SB_ENABLED
