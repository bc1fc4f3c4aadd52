// hgrt's oneDNN kernels: a hand-written Winograd F(4x4, 3x3) convolution around oneDNN's
// batched matmul.
//
// Lavin and Gray's minimal filtering: a 3x3 filter g and a 6x6 input tile d make the 4x4 output
// tile A^T [(G g G^T) . (B^T d B)] A, 36 multiplies per input and output channel where the
// direct convolution spends 144. The weights' transform U = G g G^T is made once, at pack (36
// matrices C x K, packed in the layout oneDNN's matmul picks); per call every tile's input
// transform V = B^T d B (36 matrices tiles x C), oneDNN's batched matmul M = V U (36 x tiles x
// K), and the output transform A^T M A, which adds the bias and the post-ops as it writes the
// NHWC output. (oneDNN 3.2 has no fp32 Winograd of its own: algorithm::convolution_winograd
// finds no implementation, on AVX2 or AVX-512.) Measured against oneDNN's direct convolution
// (2 threads, AVX-512 and AVX2; providers/onednn/policy.py says where it is chosen):
// resnet50's 64 -> 64 3x3 on 56x56 1013 -> 522 us, 256 -> 256 on 14x14 940 -> 469 us; on 7x7
// (4 tiles) the matmul reads 4x the weights for little work: 894 -> 973 us.
#include <omp.h>

#include "onednn_shim.h"

namespace hgrt_onednn {

// Winograd's output tiles (4 x 4 pixels each) over the batch.
int64_t WinogradTiles(const Header& h) {
  return h[kN] * ((h[kOH] + 3) / 4) * ((h[kOW] + 3) / 4);
}

// The tiles a call transforms and multiplies at once (the rows of its matmul): all of them, or
// as many as keep the two transformed blocks (36 x tiles x (C + K) floats, per calling thread)
// within HGRT_WINO_BUDGET bytes (default 4 MiB; at least 16 tiles), the blocks made even. The
// last block's rows past the tiles are zeros, computed and dropped. (vgg19's 64 -> 64 on
// 224x224 would hold 2 x 29 MB in one block; 1, 2, 4, 8 MiB and no bound measured alike on
// resnet50 and vgg19 within this host's noise, 1 MiB a little slower.)
size_t WinogradBudget() {
  static size_t budget = [] {
    const char* env = std::getenv("HGRT_WINO_BUDGET");
    return env ? static_cast<size_t>(std::atoll(env)) : size_t{4} << 20;
  }();
  return budget;
}

int64_t WinogradRows(const Header& h) {
  int64_t tiles = WinogradTiles(h);
  int64_t fit = static_cast<int64_t>(WinogradBudget()) / (36 * 4 * (h[kIC] + h[kOC]));
  fit = std::max<int64_t>(fit, 16);
  int64_t blocks = (tiles + fit - 1) / fit;
  return (tiles + blocks - 1) / blocks;
}

// Why a header cannot run as Winograd (nullptr: it can): a 3x3 stride-1 undilated ungrouped
// convolution, NHWC in and out (and the residual), no pool, padding that keeps the 3x3 window.
const char* WinogradProblem(const Header& h) {
  if (h[kKH] != 3 || h[kKW] != 3 || h[kSH] != 1 || h[kSW] != 1 || h[kDilH] != 1 ||
      h[kDilW] != 1 || h[kGroups] != 1) {
    return "Winograd needs a 3x3 stride-1 undilated ungrouped convolution";
  }
  if (h.pooled()) return "Winograd does not fuse a pool";
  if (h[kSrcTag] != dnnl_nhwc || h[kDstTag] != dnnl_nhwc ||
      (h.has_sum() && h[kResTag] != dnnl_nhwc)) {
    return "Winograd reads and writes NHWC activations only";
  }
  if (h[kN] < 1 || h[kIC] < 1 || h[kOC] < 1 || h[kIH] < 1 || h[kIW] < 1 || h[kOH] < 1 ||
      h[kOW] < 1 || h[kPadT] < 0 ||
      h[kPadL] < 0 || h[kOH] != h[kIH] + h[kPadT] + h[kPadB] - 2 ||
      h[kOW] != h[kIW] + h[kPadL] + h[kPadR] - 2) {
    return "Winograd: the output size does not follow from the input and padding";
  }
  return nullptr;
}

constexpr int kWinoBlock = 64;  // channels per pass over a tile: the stack holds 36 x 64 floats

struct WinoShape {
  int64_t n, h, w, c, k, oh, ow, tiles_h, tiles_w, pad_t, pad_l, tiles;
};

WinoShape WinoShapeOf(const Header& h) {
  return {h[kN], h[kIH], h[kIW], h[kIC], h[kOC], h[kOH], h[kOW], (h[kOH] + 3) / 4,
          (h[kOW] + 3) / 4, h[kPadT], h[kPadL], WinogradTiles(h)};
}

struct WinoPost {  // what the output transform adds: the bias, then the post-ops in order
  const float* bias;
  const float* residual;  // NHWC, the output's shape (a sum post-op), or nullptr
  int64_t kind[kMaxPostOps];
  float alpha[kMaxPostOps], beta[kMaxPostOps];
};

// o[i] = sum_j B^T[i][j] d[j], on n channels of each
inline __attribute__((always_inline)) void WinoInputRows(const float* const d[6],
                                                         float* const o[6], int n) {
  const float *d0 = d[0], *d1 = d[1], *d2 = d[2], *d3 = d[3], *d4 = d[4], *d5 = d[5];
  float *o0 = o[0], *o1 = o[1], *o2 = o[2], *o3 = o[3], *o4 = o[4], *o5 = o[5];
#pragma omp simd
  for (int c = 0; c < n; ++c) {
    float a1 = d1[c], a2 = d2[c], a3 = d3[c], a4 = d4[c];
    o0[c] = 4.f * d0[c] - 5.f * a2 + a4;
    o1[c] = -4.f * (a1 + a2) + a3 + a4;
    o2[c] = 4.f * (a1 - a2) - a3 + a4;
    o3[c] = 2.f * (a3 - a1) - a2 + a4;
    o4[c] = 2.f * (a1 - a3) - a2 + a4;
    o5[c] = 4.f * a1 - 5.f * a3 + d5[c];
  }
}

// o[i] = sum_j A^T[i][j] m[j], on n channels of each
inline __attribute__((always_inline)) void WinoOutputRows(const float* const m[6],
                                                          float* const o[4], int n) {
  const float *m0 = m[0], *m1 = m[1], *m2 = m[2], *m3 = m[3], *m4 = m[4], *m5 = m[5];
  float *o0 = o[0], *o1 = o[1], *o2 = o[2], *o3 = o[3];
#pragma omp simd
  for (int c = 0; c < n; ++c) {
    float s12 = m1[c] + m2[c], d12 = m1[c] - m2[c], s34 = m3[c] + m4[c], d34 = m3[c] - m4[c];
    o0[c] = m0[c] + s12 + s34;
    o1[c] = d12 + 2.f * d34;
    o2[c] = s12 + 4.f * s34;
    o3[c] = d12 + 8.f * d34 + m5[c];
  }
}

// V for tiles [t0, t1): rows of 6 then columns of 6, the padding read as zeros
inline __attribute__((always_inline)) void WinoInputBody(const WinoShape& s, const float* x,
                                                         float* v, int64_t rows, int64_t base,
                                                         int64_t t0, int64_t t1) {
  alignas(64) static const float zeros[kWinoBlock] = {};
  alignas(64) float tmp[6][6][kWinoBlock];
  const int64_t per_image = s.tiles_h * s.tiles_w;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t img = t / per_image, r = t % per_image;
    int64_t y0 = r / s.tiles_w * 4 - s.pad_t, x0 = r % s.tiles_w * 4 - s.pad_l;
    for (int64_t c0 = 0; c0 < s.c; c0 += kWinoBlock) {
      int n = static_cast<int>(std::min<int64_t>(kWinoBlock, s.c - c0));
      for (int i = 0; i < 6; ++i) {
        const float* d[6];
        float* o[6];
        int64_t y = y0 + i;
        for (int j = 0; j < 6; ++j) {
          int64_t xj = x0 + j;
          bool inside = y >= 0 && y < s.h && xj >= 0 && xj < s.w;
          d[j] = inside ? x + ((img * s.h + y) * s.w + xj) * s.c + c0 : zeros;
          o[j] = tmp[i][j];
        }
        WinoInputRows(d, o, n);
      }
      for (int j = 0; j < 6; ++j) {
        const float* d[6];
        float* o[6];
        for (int i = 0; i < 6; ++i) {
          d[i] = tmp[i][j];
          o[i] = v + ((i * 6 + j) * rows + t - base) * s.c + c0;
        }
        WinoInputRows(d, o, n);
      }
    }
  }
}

// the output pixels of tiles [t0, t1) from M: columns of 6 to 4, rows of 6 to 4, then the
// bias and the post-ops (the residual read where it is written: it may be the output's bytes)
inline __attribute__((always_inline)) void WinoOutputBody(const WinoShape& s, const float* m,
                                                          int64_t rows, int64_t base,
                                                          const WinoPost& post, float* out,
                                                          int64_t t0, int64_t t1) {
  alignas(64) float tmp[4][6][kWinoBlock];
  alignas(64) float row[4][kWinoBlock];
  const int64_t per_image = s.tiles_h * s.tiles_w;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t img = t / per_image, r = t % per_image;
    int64_t y0 = r / s.tiles_w * 4, x0 = r % s.tiles_w * 4;
    for (int64_t k0 = 0; k0 < s.k; k0 += kWinoBlock) {
      int n = static_cast<int>(std::min<int64_t>(kWinoBlock, s.k - k0));
      for (int j = 0; j < 6; ++j) {
        const float* mm[6];
        float* o[4];
        for (int i = 0; i < 6; ++i) mm[i] = m + ((i * 6 + j) * rows + t - base) * s.k + k0;
        for (int i = 0; i < 4; ++i) o[i] = tmp[i][j];
        WinoOutputRows(mm, o, n);
      }
      for (int i = 0; i < 4 && y0 + i < s.oh; ++i) {
        const float* mm[6];
        float* o[4];
        for (int j = 0; j < 6; ++j) mm[j] = tmp[i][j];
        for (int j = 0; j < 4; ++j) o[j] = row[j];
        WinoOutputRows(mm, o, n);
        for (int j = 0; j < 4 && x0 + j < s.ow; ++j) {
          int64_t at = ((img * s.oh + y0 + i) * s.ow + x0 + j) * s.k + k0;
          float* dst = out + at;
          const float* bias = post.bias + k0;
          const float* res = post.residual ? post.residual + at : nullptr;
          float* val = row[j];
#pragma omp simd
          for (int c = 0; c < n; ++c) val[c] += bias[c];
          for (int p = 0; p < kMaxPostOps; ++p) {
            float lo = post.alpha[p], hi = post.beta[p];
            if (post.kind[p] == kRelu) {
#pragma omp simd
              for (int c = 0; c < n; ++c) val[c] = std::max(val[c], 0.f);
            } else if (post.kind[p] == kClip) {
#pragma omp simd
              for (int c = 0; c < n; ++c) val[c] = std::min(std::max(val[c], lo), hi);
            } else if (post.kind[p] == kSum) {
#pragma omp simd
              for (int c = 0; c < n; ++c) val[c] += res[c];
            }
          }
#pragma omp simd
          for (int c = 0; c < n; ++c) dst[c] = val[c];
        }
      }
    }
  }
}

// The transforms built for each vector ISA oneDNN may run at (its effective ISA, capped by
// ONEDNN_MAX_CPU_ISA as its own kernels are): the same code, vectorized by the compiler.
#define HGRT_WINO_KERNELS(suffix, target)                                                      \
  target void WinoInput##suffix(const WinoShape& s, const float* x, float* v, int64_t rows,   \
                                int64_t base, int64_t t0, int64_t t1) {                        \
    WinoInputBody(s, x, v, rows, base, t0, t1);                                                \
  }                                                                                            \
  target void WinoOutput##suffix(const WinoShape& s, const float* m, int64_t rows,            \
                                 int64_t base, const WinoPost& post, float* out, int64_t t0,  \
                                 int64_t t1) {                                                 \
    WinoOutputBody(s, m, rows, base, post, out, t0, t1);                                       \
  }
HGRT_WINO_KERNELS(Avx512, __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,"
                                                "prefer-vector-width=512"))))
HGRT_WINO_KERNELS(Avx2, __attribute__((target("avx2,fma"))))
HGRT_WINO_KERNELS(Sse, )
#undef HGRT_WINO_KERNELS

using WinoInputFn = void (*)(const WinoShape&, const float*, float*, int64_t, int64_t, int64_t,
                             int64_t);
using WinoOutputFn = void (*)(const WinoShape&, const float*, int64_t, int64_t, const WinoPost&,
                              float*, int64_t, int64_t);

std::pair<WinoInputFn, WinoOutputFn> PickWinoKernels() {
  auto isa = static_cast<int64_t>(dnnl::get_effective_cpu_isa());
  auto has = [isa](dnnl::cpu_isa want) {
    return (isa & static_cast<int64_t>(want)) == static_cast<int64_t>(want);
  };
  if (has(dnnl::cpu_isa::avx512_core)) return {WinoInputAvx512, WinoOutputAvx512};
  if (has(dnnl::cpu_isa::avx2)) return {WinoInputAvx2, WinoOutputAvx2};
  return {WinoInputSse, WinoOutputSse};
}

// (oneDNN fixes its effective ISA at its first use: looked up once)
std::pair<WinoInputFn, WinoOutputFn> WinoKernels() {
  static const std::pair<WinoInputFn, WinoOutputFn> kernels = PickWinoKernels();
  return kernels;
}

// f(begin, end) over [0, n) split evenly over `threads` OpenMP threads
template <typename F>
void SplitTiles(int threads, int64_t n, const F& f) {
#pragma omp parallel num_threads(threads)
  {
    int64_t parts = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t begin = n * id / parts, end = n * (id + 1) / parts;
    if (begin < end) f(begin, end);
  }
}

// U = G g G^T of OIHW weights (K x C x 3 x 3) into 36 matrices C x K (row-major), in double
void WinogradWeights(const Header& h, const float* g, float* u) {
  static const double G[6][3] = {{1. / 4, 0, 0},           {-1. / 6, -1. / 6, -1. / 6},
                                 {-1. / 6, 1. / 6, -1. / 6}, {1. / 24, 1. / 12, 1. / 6},
                                 {1. / 24, -1. / 12, 1. / 6}, {0, 0, 1}};
  const int64_t c_n = h[kIC], k_n = h[kOC];
  for (int64_t k = 0; k < k_n; ++k) {
    for (int64_t c = 0; c < c_n; ++c) {
      const float* f = g + (k * c_n + c) * 9;
      double half[6][3];  // G g
      for (int i = 0; i < 6; ++i) {
        for (int j = 0; j < 3; ++j) {
          half[i][j] = G[i][0] * f[j] + G[i][1] * f[3 + j] + G[i][2] * f[6 + j];
        }
      }
      for (int i = 0; i < 6; ++i) {
        for (int j = 0; j < 6; ++j) {
          double value = half[i][0] * G[j][0] + half[i][1] * G[j][1] + half[i][2] * G[j][2];
          u[((i * 6 + j) * c_n + c) * k_n + k] = static_cast<float>(value);
        }
      }
    }
  }
}

// A Winograd convolution (this file): input transform, the matmul, output transform.
void RunWinograd(Entry& e, Args& mm, Scratch& s, const ffi::TensorView& x,
                 const ffi::TensorView* residual, const ffi::TensorView& out, char* base,
                 int threads) {
  const Header& h = e.layout;
  WinoShape shape = WinoShapeOf(h);
  auto [input, output] = WinoKernels();
  float* v = static_cast<float*>(s.src.get(e.src.get_size()));
  float* m = static_cast<float*>(s.dst.get(e.dst.get_size()));
  const float* src = static_cast<const float*>(DataOf(x));
  char* weights = e.repacked ? e.repacked->base : base;
  mm.Set(DNNL_ARG_SRC, e.src, v);
  mm.Set(DNNL_ARG_WEIGHTS, e.wei, weights + h[kWeiOffset]);
  mm.Set(DNNL_ARG_DST, e.dst, m);
  mm.Set(DNNL_ARG_SCRATCHPAD, e.scratch, s.pad.get(e.scratch.get_size() + 64));
  WinoPost post{reinterpret_cast<const float*>(weights + h[kBiasOffset]),
                residual ? static_cast<const float*>(DataOf(*residual)) : nullptr, {}, {}, {}};
  for (int k = 0; k < kMaxPostOps; ++k) {
    post.kind[k] = h[kPost0 + 3 * k];
    post.alpha[k] = static_cast<float>(AsDouble(h[kPost0 + 3 * k + 1]));
    post.beta[k] = static_cast<float>(AsDouble(h[kPost0 + 3 * k + 2]));
  }
  float* dst = static_cast<float*>(DataOf(out));
  const int64_t rows = e.src.get_dims()[1];
  size_t in_bytes = x.numel() * sizeof(float), out_bytes = out.numel() * sizeof(float);
  if (rows < shape.tiles && reinterpret_cast<const char*>(src) < reinterpret_cast<char*>(dst) +
      out_bytes && reinterpret_cast<char*>(dst) < reinterpret_cast<const char*>(src) + in_bytes) {
    // the output in the input's bytes (its residual too: the plan put it there) and more
    // than one block: a block's output would overwrite what the next one reads
    src = static_cast<const float*>(std::memcpy(s.res.get(in_bytes), src, in_bytes));
  }
  for (int64_t t0 = 0; t0 < shape.tiles; t0 += rows) {
    int64_t n = std::min(rows, shape.tiles - t0);
    SplitTiles(threads, n, [&](int64_t a, int64_t b) {
      input(shape, src, v, rows, t0, t0 + a, t0 + b);
    });
    if (n < rows) {  // the last block's spare rows: zeros (their products are dropped)
      for (int p = 0; p < 36; ++p) {
        std::memset(v + (p * rows + n) * shape.c, 0, (rows - n) * shape.c * sizeof(float));
      }
    }
    e.prim.execute(Stream(), mm.map());
    Stream().wait();
    SplitTiles(threads, n, [&](int64_t a, int64_t b) {
      output(shape, m, rows, t0, post, dst, t0 + a, t0 + b);
    });
  }
}

}  // namespace hgrt_onednn
