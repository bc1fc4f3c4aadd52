// The host's FMA peak in GFLOP/s on 1 and 2 threads: each thread runs 12 independent chains of
// vector fused multiply-adds (enough to cover the FMA latency on both FMA ports), 8 floats
// wide, or 16 where it is built with -mavx512f. BENCHMARKS.md ("AVX2 against AVX2") divides a
// model's FLOPs by the AVX2 figure.
//   cc -O3 -funroll-loops -mavx2 -mfma -fopenmp python/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
//   cc -O3 -funroll-loops -mavx512f -mfma -fopenmp python/fma_peak.c -o /tmp/fma_peak512 && \
//     /tmp/fma_peak512
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define ISA "AVX-512"
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define FIRST _mm512_cvtss_f32
#else
typedef __m256 vec;
#define LANES 8
#define ISA "AVX2"
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define FIRST _mm256_cvtss_f32
#endif

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
        vec acc[CHAINS];
        for (int i = 0; i < CHAINS; ++i) acc[i] = SET1(0.001f * i);
        const vec a = SET1(0.9999f), b = SET1(1e-6f);
        for (long s = 0; s < STEPS; ++s)
          for (int i = 0; i < CHAINS; ++i) acc[i] = FMADD(acc[i], a, b);
        for (int i = 0; i < CHAINS; ++i) sink += FIRST(acc[i]);
      }
      clock_gettime(CLOCK_MONOTONIC, &t1);
      double dt = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
      if (dt < best) best = dt;
      if (sink == 12345.f) printf(" ");  // keep the chains alive
    }
    double flops = (double)threads * STEPS * CHAINS * LANES * 2;
    printf("threads %d: %.0f GFLOP/s (%s FMA)\n", threads, flops / best / 1e9, ISA);
  }
  return 0;
}
