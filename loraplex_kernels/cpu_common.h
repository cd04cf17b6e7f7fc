/* What the CPU loops (cpu_*.c, built together into one library by torch_ops.py) share: vector types, loads,
 * prefetch, bf16 conversions, and the thread fork. Arithmetic is fp32 throughout; tensors are fp32 or bf16. */
#ifndef LORAPLEX_CPU_COMMON_H
#define LORAPLEX_CPU_COMMON_H

#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* GCC/Clang vector extensions: 8 and 16 floats (one AVX or AVX-512 register where the CPU has them; the
 * compiler splits them into narrower registers where it does not). */
typedef float f8 __attribute__((vector_size(32)));
typedef float f16 __attribute__((vector_size(64)));

static inline f8 load8(const float *p) {
    f8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline f16 load16(const float *p) {
    f16 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f16 v) { __builtin_memcpy(p, &v, sizeof v); }

/* bf16 is the top half of an fp32: widening is a 16-bit shift on any CPU. Narrowing rounds to nearest even,
 * with the AVX-512 BF16 instruction where the build has it. */
typedef uint16_t bf16_t;
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline float bf16_to_float(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t float_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* (The compilers split __builtin_convertvector's widening into 128-bit pieces: one instruction where there is one.) */
static inline f8 load8_bf16(const bf16_t *p) {
#ifdef __AVX2__
    return (f8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    u16x8 h;
    __builtin_memcpy(&h, p, sizeof h);
    u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    f8 v;
    __builtin_memcpy(&v, &u, sizeof v);
    return v;
#endif
}

static inline f16 load16_bf16(const bf16_t *p) {
#ifdef __AVX512F__
    return (f16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    u16x16 h;
    __builtin_memcpy(&h, p, sizeof h);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16;
    f16 v;
    __builtin_memcpy(&v, &u, sizeof v);
    return v;
#endif
}

static inline void store16_bf16(bf16_t *p, f16 v) {
#ifdef __AVX512BF16__
    __m256bh h = _mm512_cvtneps_pbh((__m512)v);
    __builtin_memcpy(p, &h, sizeof h);
#else
    for (int i = 0; i < 16; ++i) p[i] = float_to_bf16(v[i]);
#endif
}

/* Floats from fp32 or bf16 memory (`bf16` a constant at every call site, so each loop is built twice). */
static inline __attribute__((always_inline)) f16 load16_as(const void *p, int64_t i, int bf16) {
    return bf16 ? load16_bf16((const bf16_t *)p + i) : load16((const float *)p + i);
}

static inline __attribute__((always_inline)) float load_as(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float hsum(f8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

static inline float hsum16(f16 v) {
    f8 lo, hi;
    __builtin_memcpy(&lo, &v, sizeof lo);
    __builtin_memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return hsum(lo + hi);
}

/* Runs work(args, tid, nthreads) on nthreads threads and waits for all. The threads are OpenMP's: built
 * with -fopenmp this library binds to the libgomp torch already loaded (same soname), so its workers
 * are torch's intra-op workers, still spinning from the op before ours, and take the work at once.
 * Threads of our own would fight those spinning workers for the cores (measured 1.6x slower on 2 cores). */
typedef void (*work_fn)(const void *args, int64_t tid, int64_t nthreads);

static inline void parallel(work_fn work, const void *args, int64_t nthreads) {
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        work(args, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    work(args, 0, 1);
}

#endif
