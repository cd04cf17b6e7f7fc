/* What the CPU loops (cpu_*.c, built together into one library by torch_ops.py) share: vector types, loads,
 * prefetch, and the thread fork. fp32 throughout. */
#ifndef LORAPLEX_CPU_COMMON_H
#define LORAPLEX_CPU_COMMON_H

#include <stdint.h>
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
