/* The fingerprint's three lanes in one fused pass over a CPU tensor's bits.
 *
 * The definition is agent/fingerprint.py's (its module docstring); this file
 * computes exactly the same lanes, without the per-(dtype, shape) descriptor,
 * which Python adds. Writing v_i for element i sign-extended to 64 bits
 * (uint8 and bool zero-extended), P = 1024, b = i / P, j = i % P:
 *
 *   lane 0 = sum v_i
 *   lane 1 = sum (i + 1) v_i
 *   lane 2 = sum w(b) sq(u_i ^ T[j])      u_i = v_i, or v_i ^ (v_i >> 32) for 64-bit elements
 *
 * all mod 2**64. Per block the loop keeps three sums (s = sum v, c = sum
 * (j + 1) v, q = sum sq) and folds them in with the block's constants:
 * lane 1 += c + b P s, lane 2 += w(b) q. Every term is per element, so a
 * tensor may be fed in pieces at any element offset (``start``).
 *
 * The runs are vectorised by hand on x86-64 (AVX-512 or AVX2, picked at run
 * time by sdc_fp_init, so one build serves every machine of a cluster) and
 * plain C elsewhere; see the comment above the vector runs. Compilers did not
 * vectorise the plain loop well: they emulate a full 64 x 64 multiply where
 * two 32 x 32 -> 64 multiplies do.
 *
 * The same library holds the communication hook's bucket passes (at the end of
 * this file): the non-finite scan, and the sum of squares fused with the
 * division by the world size before the all-reduce or with the fingerprint
 * after it, so that each side of the all-reduce reads a bucket once; and the
 * product checks' pass over an operand (sdc_dual_matvec), their whole check
 * of one product by its row sums (sdc_row_check) and that check judged
 * against its bound (sdc_row_verdict, the last function).
 *
 * Pure C11 (plus x86 intrinsics), no Python or torch headers: the loader (agent/native.py) builds
 * it with the system C compiler and calls it through ctypes, which releases
 * the GIL for the call. Reentrant: the only shared state is the position
 * table and the CPU's instruction sets, filled once by sdc_fp_init() before
 * any other call.
 */

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define SDC_FP_ABI 9
#define BLOCK 1024

enum { KIND_I8 = 1, KIND_U8 = 2, KIND_I16 = 3, KIND_I32 = 4, KIND_I64 = 5 };

static uint64_t position[BLOCK];

static uint64_t mix64(uint64_t x)
{
    uint64_t z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t block_weight(uint64_t b) { return mix64(2 * b + 1) | 1; }

/* One block run, the plain way: elements x[0..m) at positions j0..j0+m of a
 * block (m <= BLOCK); the sums s, c, q are added to acc[0..3). Used on every
 * machine for the tail of a run, and for the whole run where no vector code
 * below applies. */
#define SCALAR_RUN(NAME, TYPE, WIDE)                                                           \
    static void NAME(const void *data, uint32_t m, uint32_t j0, uint64_t *acc)                 \
    {                                                                                          \
        const TYPE *x = (const TYPE *)data;                                                    \
        uint64_t s = 0, c = 0, q = 0;                                                          \
        for (uint32_t k = 0; k < m; k++) {                                                     \
            int64_t v = (int64_t)x[k];                                                         \
            uint64_t y = (uint64_t)v ^ position[j0 + k];                                       \
            if (WIDE)                                                                          \
                y ^= (uint64_t)(v >> 32);                                                      \
            s += (uint64_t)v;                                                                  \
            c += (uint64_t)(j0 + k + 1) * (uint64_t)v;                                         \
            q += y * y;                                                                        \
        }                                                                                      \
        acc[0] += s;                                                                           \
        acc[1] += c;                                                                           \
        acc[2] += q;                                                                           \
    }

SCALAR_RUN(scalar_i8, int8_t, 0)
SCALAR_RUN(scalar_u8, uint8_t, 0)
SCALAR_RUN(scalar_i16, int16_t, 0)
SCALAR_RUN(scalar_i32, int32_t, 0)
SCALAR_RUN(scalar_i64, int64_t, 1)

/* Vector runs (x86-64: AVX2 and AVX-512, chosen at run time). W lanes of 64
 * bits; lane l takes elements k = W t + l, t = 0..T-1. Per lane the loop keeps
 * S_l = sum_t v, F_l = sum_t (T - t) v (Fletcher's running sum of running
 * sums: one add, no multiply) and Q_l = sum_t sq(y). Then, with S = sum S_l
 * and F = sum F_l,
 *
 *   c = sum_k (j0 + k + 1) v_k = (j0 + 1) S + W (T S - F) + sum_l l S_l.
 *
 * The square mod 2**64 of y = hi 2**32 + lo is lo lo + (lo hi << 33): two
 * unsigned 32 x 32 -> 64 multiplies (vpmuludq). Elements left over after T W
 * go to the scalar run. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(SDC_FP_SCALAR_ONLY)
#include <immintrin.h>
#include <string.h>
#define SDC_FP_X86 1

static void fold(const uint64_t *lane_s, const uint64_t *lane_f, const uint64_t *lane_q, int w,
                 uint64_t t, uint32_t j0, uint64_t *acc)
{
    uint64_t s = 0, f = 0, q = 0, ls = 0;
    for (int l = 0; l < w; l++) {
        s += lane_s[l];
        f += lane_f[l];
        q += lane_q[l];
        ls += (uint64_t)l * lane_s[l];
    }
    acc[0] += s;
    acc[1] += ((uint64_t)j0 + 1) * s + (uint64_t)w * (t * s - f) + ls;
    acc[2] += q;
}

#define AVX2_RUN(NAME, TYPE, LOAD, WIDE)                                                       \
    __attribute__((target("avx2"))) static void NAME(const void *data, uint32_t m,            \
                                                     uint32_t j0, uint64_t *acc)               \
    {                                                                                          \
        const TYPE *x = (const TYPE *)data;                                                    \
        const uint32_t t_count = m / 4;                                                        \
        __m256i s = _mm256_setzero_si256(), f = s, q = s;                                      \
        for (uint32_t t = 0; t < t_count; t++) {                                               \
            const TYPE *p = x + 4 * t;                                                         \
            __m256i v = LOAD;                                                                  \
            s = _mm256_add_epi64(s, v);                                                        \
            f = _mm256_add_epi64(f, s);                                                        \
            __m256i y = _mm256_xor_si256(                                                      \
                v, _mm256_loadu_si256((const __m256i *)(position + j0 + 4 * t)));              \
            if (WIDE) {                                                                        \
                /* v >> 32, arithmetic: AVX2 has no 64-bit arithmetic shift. */                \
                __m256i sign = _mm256_shuffle_epi32(_mm256_srai_epi32(v, 31), 0xF5);           \
                __m256i high = _mm256_srli_epi64(v, 32);                                       \
                y = _mm256_xor_si256(                                                          \
                    y, _mm256_or_si256(high, _mm256_slli_epi64(sign, 32)));                    \
            }                                                                                  \
            __m256i cross = _mm256_mul_epu32(y, _mm256_srli_epi64(y, 32));                     \
            q = _mm256_add_epi64(q, _mm256_add_epi64(_mm256_mul_epu32(y, y),                   \
                                                     _mm256_slli_epi64(cross, 33)));           \
        }                                                                                      \
        uint64_t ls[4], lf[4], lq[4];                                                          \
        _mm256_storeu_si256((__m256i *)ls, s);                                                 \
        _mm256_storeu_si256((__m256i *)lf, f);                                                 \
        _mm256_storeu_si256((__m256i *)lq, q);                                                 \
        fold(ls, lf, lq, 4, t_count, j0, acc);                                                 \
    }

/* AVX-512 takes 16 elements a step, as two sets of 8 lanes (lane l of the
 * second set is lane 8 + l of 16), which keeps both vector ports busy. */
#define AVX512_STEP(P, S, F, Q, OFFSET, LOAD, WIDE)                                            \
    do {                                                                                       \
        const void *at = (P);                                                                  \
        __m512i v = LOAD(at);                                                                  \
        S = _mm512_add_epi64(S, v);                                                            \
        F = _mm512_add_epi64(F, S);                                                            \
        __m512i y = _mm512_xor_si512(v, _mm512_loadu_si512(position + (OFFSET)));              \
        if (WIDE)                                                                              \
            y = _mm512_xor_si512(y, _mm512_srai_epi64(v, 32));                                 \
        __m512i cross = _mm512_mul_epu32(y, _mm512_srli_epi64(y, 32));                         \
        Q = _mm512_add_epi64(Q, _mm512_add_epi64(_mm512_mul_epu32(y, y),                       \
                                                 _mm512_slli_epi64(cross, 33)));               \
    } while (0)

#define AVX512_RUN(NAME, TYPE, LOAD, WIDE)                                                     \
    __attribute__((target("avx512f"))) static void NAME(const void *data, uint32_t m,         \
                                                        uint32_t j0, uint64_t *acc)            \
    {                                                                                          \
        const TYPE *x = (const TYPE *)data;                                                    \
        const uint32_t t_count = m / 16;                                                       \
        __m512i s0 = _mm512_setzero_si512(), f0 = s0, q0 = s0, s1 = s0, f1 = s0, q1 = s0;      \
        for (uint32_t t = 0; t < t_count; t++) {                                               \
            AVX512_STEP(x + 16 * t, s0, f0, q0, j0 + 16 * t, LOAD, WIDE);                      \
            AVX512_STEP(x + 16 * t + 8, s1, f1, q1, j0 + 16 * t + 8, LOAD, WIDE);              \
        }                                                                                      \
        uint64_t ls[16], lf[16], lq[16];                                                       \
        _mm512_storeu_si512(ls, s0);                                                           \
        _mm512_storeu_si512(ls + 8, s1);                                                       \
        _mm512_storeu_si512(lf, f0);                                                           \
        _mm512_storeu_si512(lf + 8, f1);                                                       \
        _mm512_storeu_si512(lq, q0);                                                           \
        _mm512_storeu_si512(lq + 8, q1);                                                       \
        fold(ls, lf, lq, 16, t_count, j0, acc);                                                \
    }

static inline int32_t load4(const void *p)
{
    int32_t w;
    memcpy(&w, p, 4);
    return w;
}

#define LOAD512_I8(p) _mm512_cvtepi8_epi64(_mm_loadl_epi64((const __m128i *)(p)))
#define LOAD512_U8(p) _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(p)))
#define LOAD512_I16(p) _mm512_cvtepi16_epi64(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD512_I32(p) _mm512_cvtepi32_epi64(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD512_I64(p) _mm512_loadu_si512(p)

AVX2_RUN(avx2_i8, int8_t, _mm256_cvtepi8_epi64(_mm_cvtsi32_si128(load4(p))), 0)
AVX2_RUN(avx2_u8, uint8_t, _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(load4(p))), 0)
AVX2_RUN(avx2_i16, int16_t, _mm256_cvtepi16_epi64(_mm_loadl_epi64((const __m128i *)p)), 0)
AVX2_RUN(avx2_i32, int32_t, _mm256_cvtepi32_epi64(_mm_loadu_si128((const __m128i *)p)), 0)
AVX2_RUN(avx2_i64, int64_t, _mm256_loadu_si256((const __m256i *)p), 1)
AVX512_RUN(avx512_i8, int8_t, LOAD512_I8, 0)
AVX512_RUN(avx512_u8, uint8_t, LOAD512_U8, 0)
AVX512_RUN(avx512_i16, int16_t, LOAD512_I16, 0)
AVX512_RUN(avx512_i32, int32_t, LOAD512_I32, 0)
AVX512_RUN(avx512_i64, int64_t, LOAD512_I64, 1)
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int best_isa = ISA_SCALAR;
#ifdef SDC_FP_X86
static int has_f16c = 0; /* fp16 conversion instructions (the AVX2 path's fp16 sums need them) */
#endif

typedef void (*run_fn)(const void *, uint32_t, uint32_t, uint64_t *);

/* The vector run for ``kind`` at instruction set ``isa`` and its lane count W;
 * none (W = 0) without one. */
static run_fn vector_run(int kind, int isa, uint32_t *w)
{
#ifdef SDC_FP_X86
    if (isa == ISA_AVX512) {
        *w = 16;
        switch (kind) {
        case KIND_I8: return avx512_i8;
        case KIND_U8: return avx512_u8;
        case KIND_I16: return avx512_i16;
        case KIND_I32: return avx512_i32;
        case KIND_I64: return avx512_i64;
        }
    }
    if (isa == ISA_AVX2) {
        *w = 4;
        switch (kind) {
        case KIND_I8: return avx2_i8;
        case KIND_U8: return avx2_u8;
        case KIND_I16: return avx2_i16;
        case KIND_I32: return avx2_i32;
        case KIND_I64: return avx2_i64;
        }
    }
#endif
    (void)kind;
    (void)isa;
    *w = 0;
    return 0;
}

static run_fn scalar_run(int kind)
{
    switch (kind) {
    case KIND_I8: return scalar_i8;
    case KIND_U8: return scalar_u8;
    case KIND_I16: return scalar_i16;
    case KIND_I32: return scalar_i32;
    case KIND_I64: return scalar_i64;
    default: return 0;
    }
}

/* Bytes per element of ``kind``, 0 for an unknown kind. */
static int element_size(int kind)
{
    switch (kind) {
    case KIND_I8:
    case KIND_U8: return 1;
    case KIND_I16: return 2;
    case KIND_I32: return 4;
    case KIND_I64: return 8;
    default: return 0;
    }
}

int sdc_fp_abi(void) { return SDC_FP_ABI; }

/* The element kind of ``size``-byte integers (``is_unsigned``: zero-extended
 * bytes), 0 when there is none: the loader asks, so the codes live here only. */
int sdc_fp_kind(int size, int is_unsigned)
{
    switch (size) {
    case 1: return is_unsigned ? KIND_U8 : KIND_I8;
    case 2: return KIND_I16;
    case 4: return KIND_I32;
    case 8: return KIND_I64;
    default: return 0;
    }
}

/* The widest instruction set this CPU has: 0 scalar, 1 AVX2, 2 AVX-512. */
int sdc_fp_best_isa(void) { return best_isa; }

/* Fills the position table and finds the CPU's instruction sets. Call once,
 * before any other call. */
void sdc_fp_init(void)
{
    for (uint32_t j = 0; j < BLOCK; j++)
        position[j] = mix64(2 * (uint64_t)j);
    best_isa = ISA_SCALAR;
#ifdef SDC_FP_X86
    __builtin_cpu_init();
    has_f16c = __builtin_cpu_supports("f16c");
    if (__builtin_cpu_supports("avx512f"))
        best_isa = ISA_AVX512;
    else if (__builtin_cpu_supports("avx2"))
        best_isa = ISA_AVX2;
#endif
}

/* Adds to out[0..3) the lanes of n elements at data, the first being element
 * ``start`` of the tensor, using instruction set ``isa`` (at most the best).
 * Returns 0, or -1 for an unknown kind. */
int sdc_fp_segment(const void *data, int64_t n, int kind, uint64_t start, int isa, uint64_t *out)
{
    int size = element_size(kind);
    if (size == 0)
        return -1;
    uint32_t w;
    run_fn vector = vector_run(kind, isa < best_isa ? isa : best_isa, &w), scalar = scalar_run(kind);
    const char *p = (const char *)data;
    uint64_t lane0 = 0, lane1 = 0, lane2 = 0;
    uint64_t i = start;
    while (n > 0) {
        uint64_t b = i / BLOCK;
        uint32_t j0 = (uint32_t)(i % BLOCK);
        uint32_t m = BLOCK - j0;
        if ((int64_t)m > n)
            m = (uint32_t)n;
        uint64_t acc[3] = {0, 0, 0};
        uint32_t done = 0;
        if (vector && m >= w) {
            done = m - m % w;
            vector(p, done, j0, acc);
        }
        if (done < m)
            scalar(p + (size_t)done * size, m - done, j0 + done, acc);
        lane0 += acc[0];
        lane1 += acc[1] + b * BLOCK * acc[0];
        lane2 += block_weight(b) * acc[2];
        p += (size_t)m * size;
        i += m;
        n -= m;
    }
    out[0] += lane0;
    out[1] += lane1;
    out[2] += lane2;
    return 0;
}

/* One thread's share of sdc_fp_segment_threads. */
struct piece {
    const char *data;
    int64_t n;
    int kind;
    uint64_t start;
    int isa;
    uint64_t out[3];
};

static void *run_piece(void *arg)
{
    struct piece *p = (struct piece *)arg;
    sdc_fp_segment(p->data, p->n, p->kind, p->start, p->isa, p->out);
    return 0;
}

#define MAX_THREADS 64

/* sdc_fp_segment on ``threads`` threads (at most 64): the elements are cut
 * into that many pieces, each piece's lanes computed at its own offset, and
 * the lanes added (they are sums). A thread that cannot be started is run on
 * the calling thread. The threads are this call's own: nothing is shared. */
int sdc_fp_segment_threads(const void *data, int64_t n, int kind, uint64_t start, int isa, int threads,
                           uint64_t *out)
{
    int size = element_size(kind);
    if (size == 0)
        return -1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads < 2 || n < 2 * BLOCK)
        return sdc_fp_segment(data, n, kind, start, isa, out);
    struct piece pieces[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t step = (n + threads - 1) / threads;
    for (int k = 0; k < threads; k++) {
        int64_t first = (int64_t)k * step;
        int64_t count = first >= n ? 0 : (n - first < step ? n - first : step);
        pieces[k] = (struct piece){(const char *)data + (size_t)first * size, count, kind,
                                   start + (uint64_t)first, isa, {0, 0, 0}};
    }
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&ids[k], 0, run_piece, &pieces[k]) == 0;
    run_piece(&pieces[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(ids[k], 0);
        else
            run_piece(&pieces[k]);
    }
    for (int k = 0; k < threads; k++) {
        out[0] += pieces[k].out[0];
        out[1] += pieces[k].out[1];
        out[2] += pieces[k].out[2];
    }
    return 0;
}

/* Lanes of ``count`` whole contiguous tensors: out[3 k .. 3 k + 3) for tensor
 * k, overwritten. Returns 0, or -1 (and stops) at an unknown kind. */
int sdc_fp_many(int64_t count, const void *const *data, const int64_t *n, const int32_t *kind,
                int isa, uint64_t *out)
{
    for (int64_t k = 0; k < count; k++) {
        out[3 * k] = out[3 * k + 1] = out[3 * k + 2] = 0;
        if (sdc_fp_segment(data[k], n[k], kind[k], 0, isa, out + 3 * k) != 0)
            return -1;
    }
    return 0;
}

/* Lanes of the concatenation of ``count`` contiguous pieces of one kind, as if
 * they were one tensor (piece k starts where piece k - 1 ends), added to
 * out[0..3). Returns 0, or -1 (and stops) at an unknown kind. */
int sdc_fp_concat(int64_t count, const void *const *data, const int64_t *n, int kind, int isa,
                  uint64_t *out)
{
    uint64_t start = 0;
    for (int64_t k = 0; k < count; k++) {
        if (sdc_fp_segment(data[k], n[k], kind, start, isa, out) != 0)
            return -1;
        start += (uint64_t)n[k];
    }
    return 0;
}

/* Detector 1's test, on the raw bits: 1 when any of the n floats at data is a
 * NaN or an infinity (its exponent bits all ones), else 0; -1 for an unknown
 * format (1 fp16, 2 bf16, 3 fp32, 4 fp64). Scans in blocks and stops at the
 * first block with a hit; the plain loop vectorises at any -O level >= 2. */
#define NONFINITE_SCAN(NAME, TYPE, MASK)                                                       \
    static int NAME(const TYPE *x, int64_t n)                                                  \
    {                                                                                          \
        for (int64_t start = 0; start < n; start += 4096) {                                    \
            int64_t end = start + 4096 < n ? start + 4096 : n;                                 \
            TYPE hit = 0;                                                                      \
            for (int64_t k = start; k < end; k++)                                              \
                hit |= (TYPE)((x[k] & (TYPE)(MASK)) == (TYPE)(MASK));                          \
            if (hit)                                                                           \
                return 1;                                                                      \
        }                                                                                      \
        return 0;                                                                              \
    }

NONFINITE_SCAN(nonfinite_f16, uint16_t, 0x7C00u)
NONFINITE_SCAN(nonfinite_bf16, uint16_t, 0x7F80u)
NONFINITE_SCAN(nonfinite_f32, uint32_t, 0x7F800000u)
NONFINITE_SCAN(nonfinite_f64, uint64_t, 0x7FF0000000000000ull)

int sdc_nonfinite(const void *data, int64_t n, int format)
{
    switch (format) {
    case 1: return nonfinite_f16((const uint16_t *)data, n);
    case 2: return nonfinite_bf16((const uint16_t *)data, n);
    case 3: return nonfinite_f32((const uint32_t *)data, n);
    case 4: return nonfinite_f64((const uint64_t *)data, n);
    default: return -1;
    }
}

/* The bucket passes of the communication hook.
 *
 * The sum of squares of a bucket of floats (1 fp16, 2 bf16, 3 fp32), in an
 * order fixed by its definition so that every instruction set here and the
 * torch version in agent/grad_norm.py give the same bits:
 *
 *   the elements are cut into chunks of SQ_CHUNK = 4096 = 256 rows of 16
 *   (the last chunk padded with zeros); each element is squared in fp64; in a
 *   chunk, rows are added pairwise (row 2i + row 2i+1, level by level) down
 *   to one row, whose lanes are folded (lane l + lane l+8, then l+4, l+2,
 *   l+1); the chunks' values are added in order, starting from +0.
 *
 * Every step is an elementwise IEEE operation, so vectorising changes
 * nothing. The square of a half or single float is exact in fp64, so a fused
 * multiply-add could not change it either; and finite squares cannot
 * overflow the sum, so the sum is finite exactly when every element is: the
 * non-finite flag comes with it. Zero padding adds exact zeros (every partial
 * sum is +0 or more). A NaN's payload is left to the caller, which makes it
 * canonical. */
#define SQ_ROW 16
#define SQ_ROWS 256
#define SQ_CHUNK (SQ_ROW * SQ_ROWS)

enum { FMT_F16 = 1, FMT_BF16 = 2, FMT_F32 = 3 };

/* An fp16's value as a double, exactly (infinities and NaNs included). */
static inline double f16_value(uint16_t h)
{
    uint64_t sign = (uint64_t)(h >> 15) << 63;
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    double v;
    uint64_t bits;
    if (e == 0) {
        v = (double)m * 0x1p-24; /* zero or subnormal: m 2**-24 */
        memcpy(&bits, &v, 8);
        bits |= sign;
    } else {
        bits = sign | (uint64_t)(e == 31 ? 2047 : e - 15 + 1023) << 52 | (uint64_t)m << 42;
    }
    memcpy(&v, &bits, 8);
    return v;
}

static inline double bf16_value(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return (double)f;
}

static inline double f32_value(float f) { return (double)f; }

/* One chunk (m <= SQ_CHUNK elements at x) by the definition above, for any m:
 * a binary counter keeps one pending row per level of the pairwise tree, and
 * at the end the complete subtrees are added smallest first, which is how
 * zero padding would pair them. Used for a bucket's last, partial chunk. */
#define SQ_PARTIAL_RUN(NAME, TYPE, VALUE)                                                      \
    static double NAME(const void *data, int64_t m)                                            \
    {                                                                                          \
        const TYPE *x = (const TYPE *)data;                                                    \
        double stack[9][SQ_ROW], cur[SQ_ROW];                                                  \
        int64_t rows = (m + SQ_ROW - 1) / SQ_ROW;                                              \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            int64_t count = m - r * SQ_ROW;                                                    \
            for (int l = 0; l < SQ_ROW; l++) {                                                 \
                double v = l < count ? VALUE(x[r * SQ_ROW + l]) : 0.0;                         \
                cur[l] = v * v;                                                                \
            }                                                                                  \
            int level = 0;                                                                     \
            for (; (r >> level) & 1; level++)                                                  \
                for (int l = 0; l < SQ_ROW; l++)                                               \
                    cur[l] = stack[level][l] + cur[l];                                         \
            memcpy(stack[level], cur, sizeof cur);                                             \
        }                                                                                      \
        int have = 0;                                                                          \
        for (int level = 0; level <= 8; level++) {                                             \
            if (!((rows >> level) & 1))                                                        \
                continue;                                                                      \
            for (int l = 0; l < SQ_ROW; l++)                                                   \
                cur[l] = have ? stack[level][l] + cur[l] : stack[level][l];                    \
            have = 1;                                                                          \
        }                                                                                      \
        if (!have)                                                                             \
            return 0.0;                                                                        \
        for (int w = SQ_ROW / 2; w > 0; w /= 2)                                                \
            for (int l = 0; l < w; l++)                                                        \
                cur[l] = cur[l] + cur[l + w];                                                  \
        return cur[0];                                                                         \
    }

/* A whole chunk (SQ_CHUNK elements): the same tree with a fixed shape, as
 * plain loops that the compiler vectorises, compiled once per instruction
 * set: groups of 8 rows reduced in registers, then the 32 group rows halved. */
#define SQ_CHUNK_RUN(NAME, TYPE, VALUE, ATTR)                                                  \
    ATTR static double NAME(const void *data)                                                  \
    {                                                                                          \
        const TYPE *x = (const TYPE *)data;                                                    \
        double group[SQ_ROWS / 8][SQ_ROW];                                                     \
        for (int g = 0; g < SQ_ROWS / 8; g++) {                                                \
            double t[8][SQ_ROW];                                                               \
            for (int k = 0; k < 8; k++)                                                        \
                for (int l = 0; l < SQ_ROW; l++) {                                             \
                    double v = VALUE(x[(g * 8 + k) * SQ_ROW + l]);                             \
                    t[k][l] = v * v;                                                           \
                }                                                                              \
            for (int w = 4; w > 0; w /= 2)                                                     \
                for (int k = 0; k < w; k++)                                                    \
                    for (int l = 0; l < SQ_ROW; l++)                                           \
                        t[k][l] = t[2 * k][l] + t[2 * k + 1][l];                               \
            memcpy(group[g], t[0], sizeof t[0]);                                               \
        }                                                                                      \
        for (int w = SQ_ROWS / 16; w > 0; w /= 2)                                              \
            for (int k = 0; k < w; k++)                                                        \
                for (int l = 0; l < SQ_ROW; l++)                                               \
                    group[k][l] = group[2 * k][l] + group[2 * k + 1][l];                       \
        for (int w = SQ_ROW / 2; w > 0; w /= 2)                                                \
            for (int l = 0; l < w; l++)                                                        \
                group[0][l] = group[0][l] + group[0][l + w];                                   \
        return group[0][0];                                                                    \
    }

/* x[0..m) /= w in place (fp32; IEEE division, as torch's div_ by a number). When
 * w is a power of two its reciprocal r is exact, and x r is the same real
 * number as x / w, rounded the same way: the same bits, at a fraction of the
 * cost of a division. */
#define DIVIDE_RUN(NAME, ATTR)                                                                 \
    ATTR static void NAME(float *x, int64_t m, float w, int exact_reciprocal)                  \
    {                                                                                          \
        if (exact_reciprocal) {                                                                \
            const float r = 1.0f / w;                                                          \
            for (int64_t k = 0; k < m; k++)                                                    \
                x[k] = x[k] * r;                                                               \
        } else {                                                                               \
            for (int64_t k = 0; k < m; k++)                                                    \
                x[k] = x[k] / w;                                                               \
        }                                                                                      \
    }

#define NO_TARGET
SQ_PARTIAL_RUN(sq_f16_partial, uint16_t, f16_value)
SQ_PARTIAL_RUN(sq_bf16_partial, uint16_t, bf16_value)
SQ_PARTIAL_RUN(sq_f32_partial, float, f32_value)
SQ_CHUNK_RUN(sq_f16_scalar, uint16_t, f16_value, NO_TARGET)
SQ_CHUNK_RUN(sq_bf16_scalar, uint16_t, bf16_value, NO_TARGET)
SQ_CHUNK_RUN(sq_f32_scalar, float, f32_value, NO_TARGET)
DIVIDE_RUN(divide_scalar, NO_TARGET)
#ifdef SDC_FP_X86
SQ_CHUNK_RUN(sq_bf16_avx2, uint16_t, bf16_value, __attribute__((target("avx2"))))
SQ_CHUNK_RUN(sq_f32_avx2, float, f32_value, __attribute__((target("avx2"))))
DIVIDE_RUN(divide_avx2, __attribute__((target("avx2"))))
/* AVX-512 by hand: the compiler's version of the loops above spent a third of
 * its shuffle port on splitting 16-float loads; here each half-row of 8 is
 * converted straight from memory. Lanes 0-7 of a row in one register, 8-15 in
 * another: the same tree. */
#define SQ512_RUN(NAME, LOAD8)                                                                 \
    __attribute__((target("avx512f"))) static double NAME(const void *data)                    \
    {                                                                                          \
        __m512d group[SQ_ROWS / 8][2];                                                         \
        for (int g = 0; g < SQ_ROWS / 8; g++) {                                                \
            __m512d r[8][2];                                                                   \
            for (int k = 0; k < 8; k++) {                                                      \
                __m512d lo = LOAD8(data, (g * 8 + k) * SQ_ROW);                                \
                __m512d hi = LOAD8(data, (g * 8 + k) * SQ_ROW + 8);                            \
                r[k][0] = _mm512_mul_pd(lo, lo);                                               \
                r[k][1] = _mm512_mul_pd(hi, hi);                                               \
            }                                                                                  \
            for (int w = 4; w > 0; w /= 2)                                                     \
                for (int k = 0; k < w; k++) {                                                  \
                    r[k][0] = _mm512_add_pd(r[2 * k][0], r[2 * k + 1][0]);                     \
                    r[k][1] = _mm512_add_pd(r[2 * k][1], r[2 * k + 1][1]);                     \
                }                                                                              \
            group[g][0] = r[0][0];                                                             \
            group[g][1] = r[0][1];                                                             \
        }                                                                                      \
        for (int w = SQ_ROWS / 16; w > 0; w /= 2)                                              \
            for (int k = 0; k < w; k++) {                                                      \
                group[k][0] = _mm512_add_pd(group[2 * k][0], group[2 * k + 1][0]);             \
                group[k][1] = _mm512_add_pd(group[2 * k][1], group[2 * k + 1][1]);             \
            }                                                                                  \
        double lanes[SQ_ROW];                                                                  \
        _mm512_storeu_pd(lanes, group[0][0]);                                                  \
        _mm512_storeu_pd(lanes + 8, group[0][1]);                                              \
        for (int w = SQ_ROW / 2; w > 0; w /= 2)                                                \
            for (int l = 0; l < w; l++)                                                        \
                lanes[l] = lanes[l] + lanes[l + w];                                            \
        return lanes[0];                                                                       \
    }

#define LOAD8_F32(data, i) _mm512_cvtps_pd(_mm256_loadu_ps((const float *)(data) + (i)))
#define LOAD8_BF16(data, i)                                                                    \
    _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(                                     \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(data) + (i)))), 16)))
SQ512_RUN(sq_bf16_avx512, LOAD8_BF16)
SQ512_RUN(sq_f32_avx512, LOAD8_F32)
DIVIDE_RUN(divide_avx512, __attribute__((target("avx512f"))))

/* fp16 on a vector unit: the chunk converted to fp32 (exactly, by the CPU's
 * conversion instruction) in cache, then summed as fp32: the same values. */
__attribute__((target("avx2,f16c"))) static double sq_f16_avx2(const void *data)
{
    float f[SQ_CHUNK];
    for (int k = 0; k < SQ_CHUNK; k += 8)
        _mm256_storeu_ps(f + k, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)data + k))));
    return sq_f32_avx2(f);
}

__attribute__((target("avx512f"))) static double sq_f16_avx512(const void *data)
{
    float f[SQ_CHUNK];
    for (int k = 0; k < SQ_CHUNK; k += 16)
        _mm512_storeu_ps(f + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)data + k))));
    return sq_f32_avx512(f);
}
#endif

typedef double (*sq_fn)(const void *);
typedef void (*divide_fn)(float *, int64_t, float, int);

/* Bytes per element of a float format, 0 for an unknown one. */
static int float_size(int format)
{
    return format == FMT_F16 || format == FMT_BF16 ? 2 : format == FMT_F32 ? 4 : 0;
}

static sq_fn sq_whole(int format, int isa)
{
    if (isa > best_isa)
        isa = best_isa;
#ifdef SDC_FP_X86
    if (isa == ISA_AVX512)
        return format == FMT_F16 ? sq_f16_avx512 : format == FMT_BF16 ? sq_bf16_avx512 : sq_f32_avx512;
    if (isa == ISA_AVX2 && (format != FMT_F16 || has_f16c))
        return format == FMT_F16 ? sq_f16_avx2 : format == FMT_BF16 ? sq_bf16_avx2 : sq_f32_avx2;
#endif
    return format == FMT_F16 ? sq_f16_scalar : format == FMT_BF16 ? sq_bf16_scalar : sq_f32_scalar;
}

/* One chunk of m <= SQ_CHUNK elements: the fast whole-chunk run, or the partial one. */
static double sq_chunk(sq_fn whole, int format, const void *data, int64_t m)
{
    if (m == SQ_CHUNK)
        return whole(data);
    return format == FMT_F16 ? sq_f16_partial(data, m) : format == FMT_BF16 ? sq_bf16_partial(data, m)
                                                                            : sq_f32_partial(data, m);
}

static divide_fn divide_run(int isa)
{
    if (isa > best_isa)
        isa = best_isa;
#ifdef SDC_FP_X86
    if (isa == ISA_AVX512)
        return divide_avx512;
    if (isa == ISA_AVX2)
        return divide_avx2;
#endif
    return divide_scalar;
}

/* The sum of squares of n floats of ``format`` at data into *out. Returns 0,
 * or -1 for an unknown format. */
int sdc_sumsq(const void *data, int64_t n, int format, int isa, double *out)
{
    int size = float_size(format);
    if (size == 0)
        return -1;
    sq_fn whole = sq_whole(format, isa);
    const char *p = (const char *)data;
    double total = 0.0;
    for (int64_t start = 0; start < n; start += SQ_CHUNK) {
        int64_t m = n - start < SQ_CHUNK ? n - start : SQ_CHUNK;
        total += sq_chunk(whole, format, p + (size_t)start * size, m);
    }
    *out = total;
    return 0;
}

/* Before the all-reduce: the sum of squares of n fp32 at data into *out, and
 * each element divided by ``divisor`` (the world size, as a float) in place,
 * chunk by chunk while it is in cache. Returns 0, or -1 for a format other
 * than fp32 (3): halves are divided by torch, which rounds through fp32. */
int sdc_sumsq_divide(void *data, int64_t n, int format, int64_t divisor, int isa, double *out)
{
    if (format != FMT_F32)
        return -1;
    sq_fn whole = sq_whole(format, isa);
    divide_fn divide = divide_run(isa);
    float w = (float)divisor;
    int exact_reciprocal = divisor > 0 && (divisor & (divisor - 1)) == 0;
    float *p = (float *)data;
    double total = 0.0;
    for (int64_t start = 0; start < n; start += SQ_CHUNK) {
        int64_t m = n - start < SQ_CHUNK ? n - start : SQ_CHUNK;
        total += sq_chunk(whole, format, p + start, m);
        divide(p + start, m, w, exact_reciprocal);
    }
    *out = total;
    return 0;
}

/* After the all-reduce: the fingerprint lanes of n floats of ``format`` (read
 * as 16- or 32-bit integers, as sdc_fp_segment with start 0) added to
 * lanes[0..3), and their sum of squares into *out, chunk by chunk while it is
 * in cache. Returns 0, or -1 for an unknown format. */
int sdc_fp_sumsq(const void *data, int64_t n, int format, int isa, uint64_t *lanes, double *out)
{
    int size = float_size(format);
    if (size == 0)
        return -1;
    int kind = size == 2 ? KIND_I16 : KIND_I32;
    sq_fn whole = sq_whole(format, isa);
    const char *p = (const char *)data;
    double total = 0.0;
    for (int64_t start = 0; start < n; start += SQ_CHUNK) {
        int64_t m = n - start < SQ_CHUNK ? n - start : SQ_CHUNK;
        const char *at = p + (size_t)start * size;
        sdc_fp_segment(at, m, kind, (uint64_t)start, isa, lanes);
        total += sq_chunk(whole, format, at, m);
    }
    *out = total;
    return 0;
}

/* The product checks' pass over one operand (sdcguard.agent.product_checks).
 *
 * For ``batch`` matrices of r x p fp32 (matrix n at a + n * batch_stride,
 * element (i, k) at i * row_stride + k * col_stride, one of the two strides
 * 1) and vectors s, t of p fp32 per matrix (vec_stride apart; 0 to share
 * them), in one read of a:
 *
 *   e[n][i] = sum_k a_ik s_k        b[n][i] = sum_k |a_ik| t_k
 *
 * into e and b (batch x r, contiguous). The checks' bound holds for any
 * order of the additions, so rows keep vector-wide partial sums and columns
 * add whole columns in turn (which compilers vectorise as written). A
 * NaN or an infinity in a or in the vectors carries into its sums. Returns
 * 0, or -1 when neither stride is 1. */

#include <math.h>

#define DUAL_LANES 16

#define DUAL_ROWS(NAME, ATTR)                                                                       \
    ATTR static void NAME(const float *restrict a, int64_t r, int64_t p, int64_t ld,              \
                          const float *restrict s, const float *restrict t, float *restrict e,     \
                          float *restrict b)                                                       \
    {                                                                                              \
        for (int64_t i = 0; i < r; i++) {                                                          \
            const float *row = a + i * ld;                                                         \
            float pe[DUAL_LANES] = {0}, pb[DUAL_LANES] = {0};                                      \
            int64_t k = 0;                                                                         \
            for (; k + DUAL_LANES <= p; k += DUAL_LANES)                                           \
                for (int l = 0; l < DUAL_LANES; l++) {                                             \
                    float x = row[k + l];                                                          \
                    pe[l] += x * s[k + l];                                                         \
                    pb[l] += fabsf(x) * t[k + l];                                                  \
                }                                                                                  \
            float te = 0.0f, tb = 0.0f;                                                            \
            for (; k < p; k++) {                                                                   \
                te += row[k] * s[k];                                                               \
                tb += fabsf(row[k]) * t[k];                                                        \
            }                                                                                      \
            for (int l = 0; l < DUAL_LANES; l++) {                                                 \
                te += pe[l];                                                                       \
                tb += pb[l];                                                                       \
            }                                                                                      \
            e[i] = te;                                                                             \
            b[i] = tb;                                                                             \
        }                                                                                          \
    }

#define DUAL_COLS(NAME, ATTR)                                                                       \
    ATTR static void NAME(const float *restrict a, int64_t r, int64_t p, int64_t ld,              \
                          const float *restrict s, const float *restrict t, float *restrict e,     \
                          float *restrict b)                                                       \
    {                                                                                              \
        for (int64_t i = 0; i < r; i++) {                                                          \
            e[i] = 0.0f;                                                                           \
            b[i] = 0.0f;                                                                           \
        }                                                                                          \
        for (int64_t k = 0; k < p; k++) {                                                          \
            const float *col = a + k * ld;                                                         \
            float sk = s[k], tk = t[k];                                                            \
            for (int64_t i = 0; i < r; i++) {                                                      \
                e[i] += col[i] * sk;                                                               \
                b[i] += fabsf(col[i]) * tk;                                                        \
            }                                                                                      \
        }                                                                                          \
    }

typedef void (*dual_fn)(const float *, int64_t, int64_t, int64_t, const float *, const float *, float *,
                        float *);

DUAL_ROWS(dual_rows_scalar, )
DUAL_COLS(dual_cols_scalar, )
#ifdef SDC_FP_X86
/* Rows by hand: compilers kept the 16 partial sums above in scalar registers. Two accumulators per sum
 * cover the fused multiply-add's latency; the tail and the final lane sums are plain C. */
__attribute__((target("avx2,fma"))) static float hsum_avx2(__m256 v)
{
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

__attribute__((target("avx2,fma"))) static void dual_rows_avx2(const float *restrict a, int64_t r, int64_t p,
                                                               int64_t ld, const float *restrict s,
                                                               const float *restrict t, float *restrict e,
                                                               float *restrict b)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < r; i++) {
        const float *row = a + i * ld;
        __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(),
               b1 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= p; k += 16) {
            __m256 x0 = _mm256_loadu_ps(row + k), x1 = _mm256_loadu_ps(row + k + 8);
            e0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s + k), e0);
            e1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + k + 8), e1);
            b0 = _mm256_fmadd_ps(_mm256_and_ps(x0, magnitude), _mm256_loadu_ps(t + k), b0);
            b1 = _mm256_fmadd_ps(_mm256_and_ps(x1, magnitude), _mm256_loadu_ps(t + k + 8), b1);
        }
        float te = hsum_avx2(_mm256_add_ps(e0, e1)), tb = hsum_avx2(_mm256_add_ps(b0, b1));
        for (; k < p; k++) {
            te += row[k] * s[k];
            tb += fabsf(row[k]) * t[k];
        }
        e[i] = te;
        b[i] = tb;
    }
}

__attribute__((target("avx512f"))) static void dual_rows_avx512(const float *restrict a, int64_t r, int64_t p,
                                                                int64_t ld, const float *restrict s,
                                                                const float *restrict t, float *restrict e,
                                                                float *restrict b)
{
    for (int64_t i = 0; i < r; i++) {
        const float *row = a + i * ld;
        __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(),
               b1 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= p; k += 32) {
            __m512 x0 = _mm512_loadu_ps(row + k), x1 = _mm512_loadu_ps(row + k + 16);
            e0 = _mm512_fmadd_ps(x0, _mm512_loadu_ps(s + k), e0);
            e1 = _mm512_fmadd_ps(x1, _mm512_loadu_ps(s + k + 16), e1);
            b0 = _mm512_fmadd_ps(_mm512_abs_ps(x0), _mm512_loadu_ps(t + k), b0);
            b1 = _mm512_fmadd_ps(_mm512_abs_ps(x1), _mm512_loadu_ps(t + k + 16), b1);
        }
        float te = _mm512_reduce_add_ps(_mm512_add_ps(e0, e1)), tb = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
        for (; k < p; k++) {
            te += row[k] * s[k];
            tb += fabsf(row[k]) * t[k];
        }
        e[i] = te;
        b[i] = tb;
    }
}

/* Columns by hand: the macro loads and stores e and b once per column, which on a weight or a transposed
 * gradient costs more than reading the column. Here a block of rows keeps its sums in registers while every
 * column passes; the rows past the last whole block go to the macro's loop, built for the same instructions. */
DUAL_COLS(dual_cols_rest_avx2, __attribute__((target("avx2,fma"))))
DUAL_COLS(dual_cols_rest_avx512, __attribute__((target("avx512f"))))

__attribute__((target("avx2,fma"))) static void dual_cols_avx2(const float *restrict a, int64_t r, int64_t p,
                                                               int64_t ld, const float *restrict s,
                                                               const float *restrict t, float *restrict e,
                                                               float *restrict b)
{
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t i = 0;
    for (; i + 32 <= r; i += 32) {
        __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps(), e2 = _mm256_setzero_ps(),
               e3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
               b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        for (int64_t k = 0; k < p; k++) {
            const float *col = a + k * ld + i;
            __m256 sk = _mm256_set1_ps(s[k]), tk = _mm256_set1_ps(t[k]);
            __m256 x0 = _mm256_loadu_ps(col), x1 = _mm256_loadu_ps(col + 8), x2 = _mm256_loadu_ps(col + 16),
                   x3 = _mm256_loadu_ps(col + 24);
            e0 = _mm256_fmadd_ps(x0, sk, e0);
            e1 = _mm256_fmadd_ps(x1, sk, e1);
            e2 = _mm256_fmadd_ps(x2, sk, e2);
            e3 = _mm256_fmadd_ps(x3, sk, e3);
            b0 = _mm256_fmadd_ps(_mm256_and_ps(x0, magnitude), tk, b0);
            b1 = _mm256_fmadd_ps(_mm256_and_ps(x1, magnitude), tk, b1);
            b2 = _mm256_fmadd_ps(_mm256_and_ps(x2, magnitude), tk, b2);
            b3 = _mm256_fmadd_ps(_mm256_and_ps(x3, magnitude), tk, b3);
        }
        _mm256_storeu_ps(e + i, e0);
        _mm256_storeu_ps(e + i + 8, e1);
        _mm256_storeu_ps(e + i + 16, e2);
        _mm256_storeu_ps(e + i + 24, e3);
        _mm256_storeu_ps(b + i, b0);
        _mm256_storeu_ps(b + i + 8, b1);
        _mm256_storeu_ps(b + i + 16, b2);
        _mm256_storeu_ps(b + i + 24, b3);
    }
    if (i < r)
        dual_cols_rest_avx2(a + i, r - i, p, ld, s, t, e + i, b + i);
}

__attribute__((target("avx512f"))) static void dual_cols_avx512(const float *restrict a, int64_t r, int64_t p,
                                                                int64_t ld, const float *restrict s,
                                                                const float *restrict t, float *restrict e,
                                                                float *restrict b)
{
    int64_t i = 0;
    for (; i + 64 <= r; i += 64) {
        __m512 e0 = _mm512_setzero_ps(), e1 = _mm512_setzero_ps(), e2 = _mm512_setzero_ps(),
               e3 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(),
               b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < p; k++) {
            const float *col = a + k * ld + i;
            __m512 sk = _mm512_set1_ps(s[k]), tk = _mm512_set1_ps(t[k]);
            __m512 x0 = _mm512_loadu_ps(col), x1 = _mm512_loadu_ps(col + 16), x2 = _mm512_loadu_ps(col + 32),
                   x3 = _mm512_loadu_ps(col + 48);
            e0 = _mm512_fmadd_ps(x0, sk, e0);
            e1 = _mm512_fmadd_ps(x1, sk, e1);
            e2 = _mm512_fmadd_ps(x2, sk, e2);
            e3 = _mm512_fmadd_ps(x3, sk, e3);
            b0 = _mm512_fmadd_ps(_mm512_abs_ps(x0), tk, b0);
            b1 = _mm512_fmadd_ps(_mm512_abs_ps(x1), tk, b1);
            b2 = _mm512_fmadd_ps(_mm512_abs_ps(x2), tk, b2);
            b3 = _mm512_fmadd_ps(_mm512_abs_ps(x3), tk, b3);
        }
        _mm512_storeu_ps(e + i, e0);
        _mm512_storeu_ps(e + i + 16, e1);
        _mm512_storeu_ps(e + i + 32, e2);
        _mm512_storeu_ps(e + i + 48, e3);
        _mm512_storeu_ps(b + i, b0);
        _mm512_storeu_ps(b + i + 16, b1);
        _mm512_storeu_ps(b + i + 32, b2);
        _mm512_storeu_ps(b + i + 48, b3);
    }
    for (; i + 16 <= r; i += 16) {
        __m512 e0 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps();
        for (int64_t k = 0; k < p; k++) {
            __m512 x0 = _mm512_loadu_ps(a + k * ld + i);
            e0 = _mm512_fmadd_ps(x0, _mm512_set1_ps(s[k]), e0);
            b0 = _mm512_fmadd_ps(_mm512_abs_ps(x0), _mm512_set1_ps(t[k]), b0);
        }
        _mm512_storeu_ps(e + i, e0);
        _mm512_storeu_ps(b + i, b0);
    }
    if (i < r)
        dual_cols_rest_avx512(a + i, r - i, p, ld, s, t, e + i, b + i);
}
#endif

int sdc_dual_matvec(const float *a, int64_t batch, int64_t r, int64_t p, int64_t batch_stride, int64_t row_stride,
                    int64_t col_stride, const float *s, const float *t, int64_t vec_stride, int isa, float *e,
                    float *b)
{
    int by_rows = col_stride == 1;
    if (!by_rows && row_stride != 1)
        return -1;
    if (isa > best_isa)
        isa = best_isa;
    dual_fn run = by_rows ? dual_rows_scalar : dual_cols_scalar;
#ifdef SDC_FP_X86
    if (isa == ISA_AVX512)
        run = by_rows ? dual_rows_avx512 : dual_cols_avx512;
    else if (isa == ISA_AVX2)
        run = by_rows ? dual_rows_avx2 : dual_cols_avx2;
#endif
    for (int64_t n = 0; n < batch; n++)
        run(a + n * batch_stride, r, p, by_rows ? row_stride : col_stride, s + n * vec_stride, t + n * vec_stride,
            e + n * r, b + n * r);
    return 0;
}

/* The product checks' whole check of one product C = alpha A B (+ a shift) by its row sums, in one call: the
 * pass over A above gives e = A s and b = |A| t (s = B 1 and t = |B| 1, from the caller), one read of C gives its
 * row sums o, and per row i of each of the batch's matrices (C's rows at c + n * c_batch + i * c_row, n elements
 * each, with the row or the column stride 1):
 *
 *   difference[i] = |o_i - (alpha e_i + beta S)|        bound[i] = |alpha| b_i + |beta| T
 *
 * in fp32, which is what the torch form computes one operation at a time, where S and T are the sums of a bias
 * row and of its absolute values: n floats at bias, bias_stride apart (0: one value broadcast; bias NULL: no
 * bias). work holds r floats (C by columns adds into it). A NaN or an infinity carries into the difference or
 * the bound. Returns 0, or -1 when A or C has neither stride 1. */

#define ROW_SUMS(NAME, ATTR)                                                                        \
    ATTR static float NAME(const float *restrict row, int64_t n)                                   \
    {                                                                                              \
        float lanes[DUAL_LANES] = {0};                                                             \
        int64_t j = 0;                                                                             \
        for (; j + DUAL_LANES <= n; j += DUAL_LANES)                                               \
            for (int l = 0; l < DUAL_LANES; l++)                                                   \
                lanes[l] += row[j + l];                                                            \
        float total = 0.0f;                                                                        \
        for (; j < n; j++)                                                                         \
            total += row[j];                                                                       \
        for (int l = 0; l < DUAL_LANES; l++)                                                       \
            total += lanes[l];                                                                     \
        return total;                                                                              \
    }

#define COL_SUMS(NAME, ATTR)                                                                        \
    ATTR static void NAME(const float *restrict c, int64_t r, int64_t n, int64_t ld, float *restrict o) \
    {                                                                                              \
        for (int64_t i = 0; i < r; i++)                                                            \
            o[i] = 0.0f;                                                                           \
        for (int64_t j = 0; j < n; j++) {                                                          \
            const float *col = c + j * ld;                                                         \
            for (int64_t i = 0; i < r; i++)                                                        \
                o[i] += col[i];                                                                    \
        }                                                                                          \
    }

typedef float (*row_sum_fn)(const float *, int64_t);
typedef void (*col_sums_fn)(const float *, int64_t, int64_t, int64_t, float *);

ROW_SUMS(row_sum_scalar, )
COL_SUMS(col_sums_scalar, )
#ifdef SDC_FP_X86
/* Rows by hand, as the pass over A: the macro's 16 partial sums end in 16 dependent scalar additions per row,
 * which on short rows (attention's 32 and 64 wide) cost more than reading the row. */
__attribute__((target("avx2,fma"))) static float row_sum_avx2(const float *restrict row, int64_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(row + j));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(row + j + 8));
    }
    if (j + 8 <= n) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(row + j));
        j += 8;
    }
    float total = hsum_avx2(_mm256_add_ps(s0, s1));
    for (; j < n; j++)
        total += row[j];
    return total;
}

__attribute__((target("avx512f"))) static float row_sum_avx512(const float *restrict row, int64_t n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(row + j));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(row + j + 16));
    }
    if (j + 16 <= n) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(row + j));
        j += 16;
    }
    float total = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    for (; j < n; j++)
        total += row[j];
    return total;
}
COL_SUMS(col_sums_avx2, __attribute__((target("avx2,fma"))))
COL_SUMS(col_sums_avx512, __attribute__((target("avx512f"))))
#endif

int sdc_row_check(const float *a, int64_t batch, int64_t r, int64_t p, int64_t a_batch, int64_t a_row,
                  int64_t a_col, const float *s, const float *t, int64_t vec_stride, const float *c, int64_t n,
                  int64_t c_batch, int64_t c_row, int64_t c_col, float alpha, const float *bias,
                  int64_t bias_stride, float beta, int isa, float *work, float *difference, float *bound)
{
    int c_by_rows = c_col == 1;
    if (!c_by_rows && c_row != 1)
        return -1;
    if (sdc_dual_matvec(a, batch, r, p, a_batch, a_row, a_col, s, t, vec_stride, isa, difference, bound) != 0)
        return -1;
    if (isa > best_isa)
        isa = best_isa;
    row_sum_fn row_sum = row_sum_scalar;
    col_sums_fn col_sums = col_sums_scalar;
#ifdef SDC_FP_X86
    if (isa == ISA_AVX512) {
        row_sum = row_sum_avx512;
        col_sums = col_sums_avx512;
    } else if (isa == ISA_AVX2) {
        row_sum = row_sum_avx2;
        col_sums = col_sums_avx2;
    }
#endif
    float scale = fabsf(alpha), shift = 0.0f, shift_abs = 0.0f;
    if (bias != NULL) {
        float total = 0.0f, magnitude = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            total += bias[j * bias_stride];
            magnitude += fabsf(bias[j * bias_stride]);
        }
        shift = beta * total;
        shift_abs = fabsf(beta) * magnitude;
    }
    for (int64_t m = 0; m < batch; m++) {
        const float *cm = c + m * c_batch;
        float *d = difference + m * r, *bd = bound + m * r;
        if (!c_by_rows)
            col_sums(cm, r, n, c_col, work);
        for (int64_t i = 0; i < r; i++) {
            float observed = c_by_rows ? row_sum(cm + i * c_row, n) : work[i];
            d[i] = fabsf(observed - (alpha * d[i] + shift));
            bd[i] = scale * bd[i] + shift_abs;
        }
    }
    return 0;
}

/* sdc_row_check judged: each row's difference against its bound, |observed - expected| <= coefficient bound +
 * absolute (false for a NaN), where the bound is below limit (a bound past it allows a legitimate overflow);
 * *failed gains one when a row fails, and 0 is returned (-1 for strides with no unit row or column stride). The
 * test is the torch form's, in double (ProductChecks._judge_pending). s and t are B 1 and |B| 1, given, or, where
 * b is not NULL, computed here from B ((batch x) p x n at b, batch stride b_batch, 0 for one B shared; ones: n
 * floats of 1). work: r + 2 batch r floats, and 2 batch p more where b is given. */
int sdc_row_verdict(const float *a, int64_t batch, int64_t r, int64_t p, int64_t a_batch, int64_t a_row,
                    int64_t a_col, const float *b, int64_t b_batch, int64_t b_row, int64_t b_col, const float *ones,
                    const float *s, const float *t, int64_t vec_stride, const float *c, int64_t n, int64_t c_batch,
                    int64_t c_row, int64_t c_col, float alpha, const float *bias, int64_t bias_stride, float beta,
                    int isa, float *work, double coefficient, double absolute, double limit, int64_t *failed)
{
    float *difference = work + r, *bound = difference + batch * r;
    if (b != NULL) {
        int64_t matrices = b_batch != 0 ? batch : 1;
        float *sums = bound + batch * r, *magnitudes = sums + matrices * p;
        if (sdc_dual_matvec(b, matrices, p, n, b_batch, b_row, b_col, ones, ones, 0, isa, sums, magnitudes) != 0)
            return -1;
        s = sums;
        t = magnitudes;
        vec_stride = b_batch != 0 ? p : 0;
    }
    if (sdc_row_check(a, batch, r, p, a_batch, a_row, a_col, s, t, vec_stride, c, n, c_batch, c_row, c_col, alpha,
                      bias, bias_stride, beta, isa, work, difference, bound) != 0)
        return -1;
    for (int64_t i = 0; i < batch * r; i++) {
        double allowed = absolute + (double)bound[i] * coefficient;
        if ((double)bound[i] < limit && !((double)difference[i] <= allowed)) {
            *failed += 1;
            break;
        }
    }
    return 0;
}
