// The host's AVX2 FMA peak in GFLOP/s on 1 and 2 threads: each thread runs 12 independent
// chains of 8-float fused multiply-adds (enough to cover the FMA latency on both FMA ports).
// BENCHMARKS.md ("AVX2 against AVX2") divides a model's FLOPs by it.
//   cc -O3 -funroll-loops -mavx2 -mfma -fopenmp python/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

enum { CHAINS = 12, STEPS = 2000000 };

int main(void) {
  for (int threads = 1; threads <= 2; ++threads) {
    omp_set_num_threads(threads);
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      struct timespec t0, t1;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      float sink = 0;
#pragma omp parallel reduction(+ : sink)
      {
        __m256 acc[CHAINS];
        for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
        const __m256 a = _mm256_set1_ps(0.9999f), b = _mm256_set1_ps(1e-6f);
        for (long s = 0; s < STEPS; ++s)
          for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < CHAINS; ++i) sink += _mm256_cvtss_f32(acc[i]);
      }
      clock_gettime(CLOCK_MONOTONIC, &t1);
      double dt = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
      if (dt < best) best = dt;
      if (sink == 12345.f) printf(" ");  // keep the chains alive
    }
    double flops = (double)threads * STEPS * CHAINS * 8 * 2;
    printf("threads %d: %.0f GFLOP/s (AVX2 FMA)\n", threads, flops / best / 1e9);
  }
  return 0;
}
