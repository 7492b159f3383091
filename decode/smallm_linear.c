/* y (M, N) = x (M, K) @ W (N, K)^T + b in float32, for the few rows a decode or verify step has (M <= 16).

Why it exists: a verify step is bandwidth-bound (every weight is read once whatever M is), but MKL's sgemm and
oneDNN read the weights 1.5-2x slower at 4-8 rows than at one on the AMX Xeons measured
(docs/results/2026-12-07-native-kernel.md): they are built for large M. Here each thread streams a contiguous band
of W's rows exactly once; RB rows of W are loaded per 16-float step and multiplied with every row of x (which
stays in L1), and a software prefetch keeps the memory requests ahead of the arithmetic.

Built by decode/native_linear.py with -march=native and linked against the OpenMP runtime torch itself loaded, so
the parallel region runs on torch's threads (torch.set_num_threads applies) instead of a second pool. */
#include <stddef.h>
#include <immintrin.h>
#include <omp.h>

#ifndef __AVX512F__
#error "smallm_linear needs AVX-512F"
#endif

#define PREFETCH_FLOATS 256 /* 1 KiB ahead of each row being read; measured best of 64/256/512/1024 */

/* Rows n0..n1 of y for MC rows of x, RB rows of W at a time: RB * MC accumulators stay in registers
   (AVX-512 has 32), so each loaded vector of W is used MC times. */
#define KERNEL(MC, RB)                                                                                          \
static void rows_##MC(const float *restrict x, const float *restrict w, const float *restrict b,                \
                      float *restrict y, int N, int K, int n0, int n1) {                                        \
    int n = n0;                                                                                                  \
    for (; n + RB <= n1; n += RB) {                                                                              \
        __m512 acc[RB][MC];                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                     \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) acc[r][m] = _mm512_setzero_ps();                \
        const float *wr = w + (size_t)n * K;                                                                     \
        int k = 0;                                                                                               \
        for (; k + 16 <= K; k += 16) {                                                                           \
            __m512 wv[RB];                                                                                       \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                                               \
                _mm_prefetch((const char *)(wr + (size_t)r * K + k + PREFETCH_FLOATS), _MM_HINT_T0);             \
                wv[r] = _mm512_loadu_ps(wr + (size_t)r * K + k);                                                 \
            }                                                                                                    \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) {                                               \
                __m512 xv = _mm512_loadu_ps(x + (size_t)m * K + k);                                              \
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                             \
                    acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);                                           \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                                     \
            _Pragma("GCC unroll 8") for (int m = 0; m < MC; m++) {                                               \
                float s = _mm512_reduce_add_ps(acc[r][m]);                                                       \
                for (int kk = k; kk < K; kk++) s += x[(size_t)m * K + kk] * wr[(size_t)r * K + kk];              \
                y[(size_t)m * N + n + r] = s + (b ? b[n + r] : 0.f);                                             \
            }                                                                                                    \
    }                                                                                                            \
    for (; n < n1; n++) /* the band's last rows when it is not a multiple of RB */                               \
        for (int m = 0; m < MC; m++) {                                                                           \
            float s = 0.f;                                                                                       \
            for (int kk = 0; kk < K; kk++) s += x[(size_t)m * K + kk] * w[(size_t)n * K + kk];                   \
            y[(size_t)m * N + n] = s + (b ? b[n] : 0.f);                                                         \
        }                                                                                                        \
}

KERNEL(1, 4) KERNEL(2, 4) KERNEL(3, 4) KERNEL(4, 4) KERNEL(5, 4) KERNEL(6, 4) KERNEL(7, 2) KERNEL(8, 2)

typedef void (*rows_fn)(const float *, const float *, const float *, float *, int, int, int, int);
static const rows_fn ROWS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

void smallm_linear(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int threads) {
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
                ROWS[mc](x + (size_t)m0 * K, w, b, y + (size_t)m0 * N, N, K, n, n_end);
            }
        }
    }
}
