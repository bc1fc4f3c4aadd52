// hgrt's swish, x * sigmoid(x), and GELU's tanh form, x * sigmoid(2 sqrt(2/pi) (x + 0.044715
// x^3)) (= 0.5 x (1 + tanh(...))), over a kernel's float32 result in place, on the caller's
// OpenMP team: what a convolution or dense layer whose last post-op is one of them runs after
// oneDNN's primitive instead of oneDNN's eltwise post-op. oneDNN 3.2's swish divides by
// 1 + exp(-x) (vdivps) and costs more than the convolution it follows: EfficientNet's 1x1
// 16 -> 96 convolution at 112x112 197 us alone, 441-525 us with the post-op; a depthwise 3x3 on
// 32 channels at 112x112 54 -> 165 us (EPYC, AVX-512, 2 threads;
// python/bench_onednn_primitives.cc). With this pass efficientnet's 33 convolutions with swish
// took 3.87 ms against 5.33 (hgrt profile). exp(-x) is 2^n * p(f) (p of degree 6 on [-1/2,
// 1/2]), 1 / (1 + e) a reciprocal estimate refined by one Newton step: within 2e-7 of the exact
// swish relative to max(1, |y|). oneDNN 3.2's tanh GELU post-op on AVX2: GPT-2's 128 x 768 x
// 3072 dense layer 2.95 ms a call with it, 2.52 with this pass (hgrt profile; its erf form cost
// 0.15 ms there, and on AVX-512 the tanh form what the pass costs: they stay oneDNN's).
#include <immintrin.h>

#include <cmath>

#include "onednn_shim.h"

namespace hgrt_onednn {

namespace {

// exp of each lane, its argument clamped to where float32's exp is normal
constexpr float kExpHi = 88.0f, kExpLo = -87.33654f, kLog2e = 1.44269504088896341f;
constexpr float kP[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                        5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                        1.0f};

__attribute__((target("avx512f"))) inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHi)), _mm512_set1_ps(kExpLo));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n), p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kP[i]));
  return _mm512_scalef_ps(p, n);
}

// GELU's tanh form as x * sigmoid(z): z = x (kGelu1 + kGelu3 x^2)
constexpr float kGelu1 = 1.5957691216057308f, kGelu3 = kGelu1 * 0.044715f;

// v * sigmoid(z)
__attribute__((target("avx512f"))) inline __m512 TimesSigmoid16(__m512 v, __m512 z) {
  __m512 d = _mm512_add_ps(Exp16(_mm512_sub_ps(_mm512_setzero_ps(), z)), _mm512_set1_ps(1.f));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(v, r);
}

template <bool kGelu>
__attribute__((target("avx512f"))) inline __m512 Act16(__m512 v) {
  if (!kGelu) return TimesSigmoid16(v, v);
  __m512 z = _mm512_fmadd_ps(_mm512_mul_ps(v, v), _mm512_set1_ps(kGelu3), _mm512_set1_ps(kGelu1));
  return TimesSigmoid16(v, _mm512_mul_ps(v, z));
}

template <bool kGelu>
__attribute__((target("avx512f"))) void Act512(float* y, int64_t n, int threads) {
  int64_t whole = n / 16 * 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < whole; i += 16) {
    _mm512_storeu_ps(y + i, Act16<kGelu>(_mm512_loadu_ps(y + i)));
  }
  if (whole < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - whole)) - 1);
    _mm512_mask_storeu_ps(y + whole, m, Act16<kGelu>(_mm512_maskz_loadu_ps(m, y + whole)));
  }
}

__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHi)), _mm256_set1_ps(kExpLo));
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(t, n), p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kP[i]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                23);  // 2^n, n in [-126, 127]
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) inline __m256 TimesSigmoid8(__m256 v, __m256 z) {
  __m256 d = _mm256_add_ps(Exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)), _mm256_set1_ps(1.f));
  __m256 r = _mm256_rcp_ps(d);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
  return _mm256_mul_ps(v, r);
}

template <bool kGelu>
__attribute__((target("avx2,fma"))) inline __m256 Act8(__m256 v) {
  if (!kGelu) return TimesSigmoid8(v, v);
  __m256 z = _mm256_fmadd_ps(_mm256_mul_ps(v, v), _mm256_set1_ps(kGelu3), _mm256_set1_ps(kGelu1));
  return TimesSigmoid8(v, _mm256_mul_ps(v, z));
}

template <bool kGelu>
__attribute__((target("avx2,fma"))) void Act256(float* y, int64_t n, int threads) {
  int64_t whole = n / 8 * 8;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < whole; i += 8) {
    _mm256_storeu_ps(y + i, Act8<kGelu>(_mm256_loadu_ps(y + i)));
  }
  for (int64_t i = whole; i < n; ++i) {
    float z = kGelu ? y[i] * (kGelu1 + kGelu3 * y[i] * y[i]) : y[i];
    y[i] = y[i] / (1.f + std::exp(-z));
  }
}

}  // namespace

bool HasIsa(dnnl::cpu_isa want) {
  auto a = static_cast<unsigned>(dnnl::get_effective_cpu_isa()), w = static_cast<unsigned>(want);
  return (a & w) == w;  // (oneDNN's ISAs are masks, each holding the ones below it)
}

// 2: AVX-512, 1: AVX2, 0: neither (oneDNN's post-op then), as far as oneDNN may go here
// (ONEDNN_MAX_CPU_ISA caps an AVX2 build's kernels, this pass with them)
int SwishLevel() {
  static const int level = [] {
    if (HasIsa(dnnl::cpu_isa::avx512_core) && __builtin_cpu_supports("avx512f")) return 2;
    if (HasIsa(dnnl::cpu_isa::avx2) && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma")) {
      return 1;
    }
    return 0;
  }();
  return level;
}

void OwnActivation(int64_t kind, float* y, int64_t n, int threads) {
  bool gelu = kind == kGeluTanh, wide = SwishLevel() == 2;
  if (gelu) {
    wide ? Act512<true>(y, n, threads) : Act256<true>(y, n, threads);
  } else {
    wide ? Act512<false>(y, n, threads) : Act256<false>(y, n, threads);
  }
}

}  // namespace hgrt_onednn
