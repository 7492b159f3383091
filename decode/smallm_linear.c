/* y (M, N) = x (M, K) @ W (N, K)^T + b in float32, for the few rows a decode or verify step has (M <= 16).

Why it exists: a verify step is bandwidth-bound (every weight is read once whatever M is), but MKL's sgemm and
oneDNN read the weights 1.5-2x slower at 4-8 rows than at one on the AMX Xeons measured
(docs/results/2026-12-07-native-kernel.md): they are built for large M. Here each thread streams a contiguous band
of W's rows exactly once; RB rows of W are loaded per vector step (16 floats in AVX-512, 8 in AVX2) and multiplied
with every row of x (which stays in L1), and, where the caller asks for it, a software prefetch keeps the memory
requests ahead of the arithmetic. AVX-512 where the CPU has it, else AVX2 with FMA.

A second entry, smallm_linear_packed, reads W prepacked so that each thread's band is one sequential stream (the
packed layout below): on the Zen 4 EPYC measured, the band in W's own layout (RB interleaved row streams) read
21-27 GB/s at 1-2 rows, the same band packed 32-45 GB/s as the host's memory load varied
(docs/results/2026-12-08-packed-kernel.md).

Built by decode/native_linear.py with -march=native and linked against the OpenMP runtime torch itself loaded, so
the parallel region runs on torch's threads (torch.set_num_threads applies) instead of a second pool. */
#include <stddef.h>
#include <immintrin.h>
#include <omp.h>

/* One vector of W's floats and what is done with it, in AVX-512 (32 registers of 16 floats) or, on CPUs without
   it, AVX2 with FMA (16 registers of 8 floats: AMD before Zen 4, Intel client CPUs). */
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vsum _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#error "smallm_linear needs AVX-512F, or AVX2 with FMA"
#endif


/* Rows n0..n1 of y for MC rows of x, RB rows of W at a time: RB * MC accumulators and the RB loaded vectors of W
   stay in registers (x's vectors come from L1 as the FMAs' memory operands), so each vector of W read from memory
   is used MC times. */
#define KERNEL(MC, RB)                                                                                               \
static void rows_##MC(const float *restrict x, const float *restrict w, const float *restrict b,                     \
                      float *restrict y, int N, int K, int n0, int n1, int ahead) {                                  \
    int n = n0;                                                                                                      \
    for (; n + RB <= n1; n += RB) {                                                                                  \
        vec acc[RB][MC];                                                                                             \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) acc[r][m] = vzero();                                \
        const float *wr = w + (size_t)n * K;                                                                         \
        int k = 0;                                                                                                   \
        for (; k + LANES <= K; k += LANES) {                                                                         \
            vec wv[RB];                                                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                                                   \
                if (ahead) _mm_prefetch((const char *)(wr + (size_t)r * K + k + ahead), _MM_HINT_T0);                \
                wv[r] = vload(wr + (size_t)r * K + k);                                                               \
            }                                                                                                        \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) {                                                   \
                vec xv = vload(x + (size_t)m * K + k);                                                               \
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                 \
                    acc[r][m] = vfma(wv[r], xv, acc[r][m]);                                                          \
            }                                                                                                        \
        }                                                                                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                         \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) {                                                   \
                float s = vsum(acc[r][m]);                                                                           \
                for (int kk = k; kk < K; kk++) s += x[(size_t)m * K + kk] * wr[(size_t)r * K + kk];                  \
                y[(size_t)m * N + n + r] = s + (b ? b[n + r] : 0.f);                                                 \
            }                                                                                                        \
    }                                                                                                                \
    for (; n < n1; n++) /* the band's last rows when it is not a multiple of RB */                                   \
        for (int m = 0; m < MC; m++) {                                                                               \
            float s = 0.f;                                                                                           \
            for (int kk = 0; kk < K; kk++) s += x[(size_t)m * K + kk] * w[(size_t)n * K + kk];                       \
            y[(size_t)m * N + n] = s + (b ? b[n] : 0.f);                                                             \
        }                                                                                                            \
}

/* RB divides 4 (a thread's band is a multiple of 4 rows, so no row of W falls to the scalar tail loop) and
   RB * MC + RB fits the register file. */
#if LANES == 16
KERNEL(1, 4) KERNEL(2, 4) KERNEL(3, 4) KERNEL(4, 4) KERNEL(5, 4) KERNEL(6, 4) KERNEL(7, 2) KERNEL(8, 2)
#else
KERNEL(1, 4) KERNEL(2, 4) KERNEL(3, 4) KERNEL(4, 2) KERNEL(5, 2) KERNEL(6, 2) KERNEL(7, 1) KERNEL(8, 1)
#endif

/* The OpenMP runtime this library's parallel regions call into: decode/native_linear.py checks that it is torch's. */
void *smallm_openmp(void) { return (void *)omp_get_num_threads; }

typedef void (*rows_fn)(const float *, const float *, const float *, float *, int, int, int, int, int);
static const rows_fn ROWS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

/* ahead: how many floats ahead of each row being read to prefetch, 0 for none (leaving the streaming to the
   hardware prefetcher). Which is faster depends on the CPU and the row count: on the AMX Xeon the software
   prefetch (256 floats, best of 64-1024) was what made the kernel fast; on the Zen 4 EPYC it slowed 1-4 rows.
   The kernel plan times both (decode/linear_kernels.py: `native`, `nativehw`). */
void smallm_linear(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int threads,
                   int ahead) {
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num();
        int team = omp_get_num_threads();
        int per = ((N + team - 1) / team + 3) & ~3;  /* a band of W's rows per thread, a multiple of 4 */
        int n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        /* More than 8 rows of x: each group of 8 reads the same 32 rows of W, the later groups from cache. */
        for (int n = n0; n < n1; n += 32) {
            int n_end = n + 32 < n1 ? n + 32 : n1;
            for (int m0 = 0; m0 < M; m0 += 8) {
                int mc = M - m0 < 8 ? M - m0 : 8;
                ROWS[mc](x + (size_t)m0 * K, w, b, y + (size_t)m0 * N, N, K, n, n_end, ahead);
            }
        }
    }
}


/* The packed layout: W's rows in groups of PACK, each group stored one vector of LANES floats of each of its rows
   after another, k-step by k-step: [ceil(N/PACK)][ceil(K/LANES)][PACK][LANES], zero-padded to whole groups and
   vectors (decode/native_linear.py: pack). A group's PACK vectors of a k-step are then adjacent, and a thread's band
   of groups is one contiguous stream, which the hardware prefetcher follows at full speed. */
#define PACK 4
#if LANES == 16
#define PACKED_MC 6 /* PACK * MC accumulators + PACK vectors of W + one of x fit 32 registers */
#else
#define PACKED_MC 3 /* 16 registers: x's vector comes from L1 as the FMAs' memory operand */
#endif

int smallm_lanes(void) { return LANES; }
int smallm_pack_rows(void) { return PACK; }

/* The sums of four accumulators at once, [sum(a0), sum(a1), sum(a2), sum(a3)]: a transposing tree of shuffles
   instead of four separate horizontal sums (at 4-8 rows of x those were a visible share of the work). */
#if LANES == 16
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)); /* a0 a0 a1 a1 per lane */
    __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE)); /* a0 a1 a2 a3 */
    u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0x4E)); /* then the four 128-bit lanes added */
    u = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, 0xB1));
    return _mm512_castps512_ps128(u);
}
#else
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* a0 a1 a2 a3 per 128-bit lane */
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

/* One k-step of a group: its PACK vectors of W at q, times each row's vector of x at X(m). */
#define PACKED_STEP(MC, X)                                                                                           \
    do {                                                                                                             \
        vec wv[PACK];                                                                                                \
        if (ahead) /* the step's PACK vectors are PACK * LANES * 4 bytes: one prefetch per 64-byte line */          \
            _Pragma("GCC unroll 8") for (int l = 0; l < PACK * LANES; l += 16)                                       \
                _mm_prefetch((const char *)(q + ahead + l), _MM_HINT_T0);                                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < PACK; r++) wv[r] = vload(q + r * LANES);                         \
        _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) {                                                       \
            vec xv = vload(X);                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < PACK; r++) acc[r][m] = vfma(wv[r], xv, acc[r][m]);           \
        }                                                                                                            \
        q += PACK * LANES;                                                                                           \
    } while (0)

#define PACKED_KERNEL(MC)                                                                                            \
static void packed_##MC(const float *restrict x, const float *restrict p, const float *restrict b,                   \
                        float *restrict y, int N, int K, int g0, int g1, int ahead) {                                \
    int full = K / LANES, kv = (K + LANES - 1) / LANES; /* whole vectors of x; vectors per row of p */              \
    float tail[MC][LANES]; /* x's last partial vector, zero-padded (p's padding is zero too) */                      \
    for (int m = 0; m < MC; m++)                                                                                     \
        for (int l = 0; l < LANES; l++)                                                                              \
            tail[m][l] = full * LANES + l < K ? x[(size_t)m * K + full * LANES + l] : 0.f;                          \
    for (int g = g0; g < g1; g++) {                                                                                  \
        vec acc[PACK][MC];                                                                                           \
        _Pragma("GCC unroll 8") for (int r = 0; r < PACK; r++)                                                       \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) acc[r][m] = vzero();                                \
        const float *q = p + (size_t)g * kv * PACK * LANES;                                                          \
        for (int v = 0; v < full; v++) PACKED_STEP(MC, x + (size_t)m * K + (size_t)v * LANES);                        \
        if (kv > full) PACKED_STEP(MC, tail[m]);                                                                     \
        _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) {                                                       \
            int n = g * PACK;                                                                                        \
            __m128 s = sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]); /* the group's 4 outputs for row m */       \
            if (n + PACK <= N) {                                                                                     \
                if (b) s = _mm_add_ps(s, _mm_loadu_ps(b + n));                                                       \
                _mm_storeu_ps(y + (size_t)m * N + n, s);                                                             \
            } else { /* the last group of a W whose rows are not a multiple of 4: its padding is not written */      \
                float o[PACK];                                                                                       \
                _mm_storeu_ps(o, s);                                                                                 \
                for (int r = 0; n + r < N; r++) y[(size_t)m * N + n + r] = o[r] + (b ? b[n + r] : 0.f);             \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
}

typedef void (*packed_fn)(const float *, const float *, const float *, float *, int, int, int, int, int);
PACKED_KERNEL(1) PACKED_KERNEL(2) PACKED_KERNEL(3)
#if PACKED_MC == 6
PACKED_KERNEL(4) PACKED_KERNEL(5) PACKED_KERNEL(6)
static const packed_fn PACKED[PACKED_MC + 1] = {0, packed_1, packed_2, packed_3, packed_4, packed_5, packed_6};
#else
static const packed_fn PACKED[PACKED_MC + 1] = {0, packed_1, packed_2, packed_3};
#endif

/* y (M, N) = x (M, K) @ W.T + b, W packed as above. Up to PACKED_MC rows of x in one pass over a thread's band;
   more: the band goes in chunks of 8 groups, each read from memory by the first PACKED_MC rows and from cache by
   the next ones. ahead: floats to prefetch ahead of the stream, 0 for none (the hardware prefetcher alone fell
   behind from 5 rows on the Zen 4 EPYC, where the arithmetic per byte grows). */
void smallm_linear_packed(const float *x, const float *p, const float *b, float *y, int M, int N, int K,
                          int threads, int ahead) {
    int groups = (N + PACK - 1) / PACK;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num();
        int team = omp_get_num_threads();
        int per = (groups + team - 1) / team;
        int g0 = t * per, g1 = g0 + per < groups ? g0 + per : groups;
        if (M <= PACKED_MC) {
            if (g0 < g1) PACKED[M](x, p, b, y, N, K, g0, g1, ahead);
        } else {
            for (int g = g0; g < g1; g += 8) {
                int g_end = g + 8 < g1 ? g + 8 : g1;
                for (int m0 = 0; m0 < M; m0 += PACKED_MC) {
                    int mc = M - m0 < PACKED_MC ? M - m0 : PACKED_MC;
                    PACKED[mc](x + (size_t)m0 * K, p, b, y + (size_t)m0 * N, N, K, g, g_end, ahead);
                }
            }
        }
    }
}
