// oneDNN's primitives timed alone, for the figures hgrt's oneDNN kernels cite (BENCHMARKS.md,
// "The corpus after int8, row kernels, hgrt's swish and blocked layouts"): int8 against float32
// convolutions, swish as a post-op, blocked against NHWC activations at batch 8, the matmul of
// two activations and softmax, a dense layer's rows all at once against 64 at a time
// (ONEDNN_MAX_CPU_ISA=AVX2 for the AVX2 kernels). Best of 7 blocks of 20 calls, after 5 warm-up calls; zeros or
// random normals as noted; denormals flushed (as hgrt's kernels run).
//
//   INC=$(python -c "from hgrt.providers.onednn import kernels as k; print(k._wheel_paths()[0])")
//   LIB=$(python -c "from hgrt.providers.onednn import kernels as k; print(k._wheel_paths()[1])")
//   g++ -O2 -std=c++17 python/bench_onednn_primitives.cc -I$INC -L$LIB -ldnnl \
//       -Wl,-rpath,$LIB -o /tmp/bench_onednn_primitives
//   OMP_NUM_THREADS=2 /tmp/bench_onednn_primitives          # every section
//   OMP_NUM_THREADS=2 ONEDNN_MAX_CPU_ISA=AVX2 /tmp/bench_onednn_primitives dense   # one of them
//   OMP_NUM_THREADS=2 /tmp/bench_onednn_primitives layout 64 256 56 1 1 0 1 8
//       (one convolution, IC OC HW K STRIDE PAD GROUPS BATCH, in NHWC and in hgrt's blocked
//       layout: nChw16c, nChw8c below AVX-512)
#include <oneapi/dnnl/dnnl.hpp>
#include <xmmintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <random>
#include <unordered_map>
#include <vector>
#include <algorithm>

using namespace dnnl;
using tag = memory::format_tag;
using dt = memory::data_type;

engine eng(engine::kind::cpu, 0);
stream strm(eng);

double Time(primitive& p, std::unordered_map<int, memory>& args) {
  for (int i = 0; i < 5; i++) p.execute(strm, args);
  strm.wait();
  double best = 1e9;
  for (int r = 0; r < 7; r++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20; i++) p.execute(strm, args);
    strm.wait();
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                    .count() / 20;
    if (us < best) best = us;
  }
  return best;
}

void Fill(memory& m, float scale) {
  std::mt19937 g(1);
  std::normal_distribution<float> d(0.f, scale);
  size_t n = m.get_desc().get_size();
  if (m.get_desc().get_data_type() != dt::f32) {
    std::memset(m.get_data_handle(), 1, n);
    return;
  }
  float* p = static_cast<float*>(m.get_data_handle());
  for (size_t i = 0; i < n / 4; i++) p[i] = d(g);
}

// A convolution: `int8` u8 input and s8 weights with a scale per output channel (else f32),
// `post` 1 swish, `t` the activations' layout.
double Conv(int n, int ic, int oc, int hw, int k, int s, int pad, int groups, tag t, bool int8,
            int post, const char** impl) {
  int oh = (hw + 2 * pad - k) / s + 1;
  memory::dims src{n, ic, hw, hw}, dst{n, oc, oh, oh}, b{oc};
  memory::dims wei = groups > 1 ? memory::dims{groups, oc / groups, ic / groups, k, k}
                                : memory::dims{oc, ic, k, k};
  memory::desc sd(src, int8 ? dt::u8 : dt::f32, t), wd(wei, int8 ? dt::s8 : dt::f32, tag::any),
      dd(dst, dt::f32, t), bd(b, dt::f32, tag::a);
  primitive_attr attr;
  post_ops po;
  if (post == 1) po.append_eltwise(algorithm::eltwise_swish, 1.f, 0.f);
  attr.set_post_ops(po);
  if (int8) attr.set_scales_mask(DNNL_ARG_WEIGHTS, groups > 1 ? 3 : 1);
  static convolution_forward::primitive_desc pd;
  pd = convolution_forward::primitive_desc(eng, prop_kind::forward_inference,
                                           algorithm::convolution_direct, sd, wd, bd, dd,
                                           {s, s}, {pad, pad}, {pad, pad}, attr);
  memory ms(pd.src_desc(), eng), mw(pd.weights_desc(), eng), md(pd.dst_desc(), eng), mb(bd, eng);
  Fill(ms, 1.f);
  Fill(mw, 0.3f);
  Fill(mb, 0.1f);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, ms}, {DNNL_ARG_WEIGHTS, mw},
                                       {DNNL_ARG_DST, md}, {DNNL_ARG_BIAS, mb}};
  memory sc({{oc}, dt::f32, tag::a}, eng);
  Fill(sc, 0.01f);
  if (int8) args[DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS] = sc;
  primitive p = convolution_forward(pd);
  *impl = pd.impl_info_str();
  return Time(p, args);
}

double Matmul(memory::dims a, memory::dims b, memory::dims c) {
  auto plain = [](memory::dims d) {
    return memory::desc(d, dt::f32, d.size() == 3 ? tag::abc : tag::ab);
  };
  auto pd = matmul::primitive_desc(eng, plain(a), plain(b), plain(c));
  memory A(plain(a), eng), B(plain(b), eng), C(plain(c), eng);
  Fill(A, 1.f);
  Fill(B, 1.f);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B},
                                       {DNNL_ARG_DST, C}};
  primitive p = matmul(pd);
  return Time(p, args);
}

// A dense layer (inner product) of `rows` x `depth` -> `outs`, its rows `chunk` at a time (0: all
// at once; -64: the whole multiples of 64 at once, then the rest), over 8 copies of its packed weights in turn (more than the caches hold, as in a
// model whose layers each bring their own); GFLOP/s.
double Dense(int rows, int depth, int outs, int chunk) {
  int step = chunk > 0 ? chunk : chunk < 0 ? rows / -chunk * -chunk : rows, copies = 8;
  if (step == 0) step = rows;
  auto pd_of = [&](int m) {
    return inner_product_forward::primitive_desc(
        eng, prop_kind::forward_inference, memory::desc({m, depth}, dt::f32, tag::ab),
        memory::desc({outs, depth}, dt::f32, tag::any), memory::desc({outs}, dt::f32, tag::a),
        memory::desc({m, outs}, dt::f32, tag::ab));
  };
  auto pd = pd_of(step);
  auto rest_pd = pd_of(rows % step > 0 ? rows % step : step);
  primitive p = inner_product_forward(pd), rest = inner_product_forward(rest_pd);
  memory src({{rows, depth}, dt::f32, tag::ab}, eng), dst({{rows, outs}, dt::f32, tag::ab}, eng),
      bias({{outs}, dt::f32, tag::a}, eng);
  Fill(src, 1.f);
  Fill(bias, 0.1f);
  std::vector<memory> weights;
  for (int c = 0; c < copies; c++) {
    weights.emplace_back(pd.weights_desc(), eng);  // (written: never the zero page)
    Fill(weights.back(), 0.05f);
  }
  auto call = [&](int c) {
    for (int m = 0; m < rows; m += step) {
      int n = std::min(step, rows - m);
      auto& prim = n == step ? p : rest;
      auto& d = n == step ? pd : rest_pd;
      memory s(d.src_desc(), eng, static_cast<float*>(src.get_data_handle()) + m * depth);
      memory o(d.dst_desc(), eng, static_cast<float*>(dst.get_data_handle()) + m * outs);
      prim.execute(strm, {{DNNL_ARG_SRC, s}, {DNNL_ARG_WEIGHTS, weights[c]},
                          {DNNL_ARG_BIAS, bias}, {DNNL_ARG_DST, o}});
    }
  };
  for (int c = 0; c < copies; c++) call(c);
  strm.wait();
  double best = 1e9;
  for (int r = 0; r < 7; r++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 4 * copies; i++) call(i % copies);
    strm.wait();
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                    .count() / (4 * copies);
    if (us < best) best = us;
  }
  return 2.0 * rows * depth * outs / best / 1e3;
}

int DenseRows() {
  std::printf("-- a dense layer's rows: all at once against 64 at a time (GFLOP/s; isa %d)\n",
              static_cast<int>(get_effective_cpu_isa()));
  int dense[][3] = {{197, 768, 3072}, {128, 768, 3072}, {197, 1024, 1024}, {512, 768, 3072},
                    {512, 512, 1024}, {128, 3072, 768}, {1024, 768, 768}, {197, 3072, 768},
                    {200, 768, 768}, {50, 768, 3072}, {300, 768, 3072}};
  for (auto& q : dense) {
    std::printf("%d x %d x %d: %.0f, in chunks %.0f, multiples of 64 then the rest %.0f\n", q[0],
                q[1], q[2], Dense(q[0], q[1], q[2], 0), Dense(q[0], q[1], q[2], 64),
                Dense(q[0], q[1], q[2], -64));
  }
  return 0;
}

int main(int argc, char** argv) {
  _mm_setcsr(_mm_getcsr() | 0x8040);
  if (argc > 1 && std::strcmp(argv[1], "dense") == 0) return DenseRows();
  const char* impl = "";
  if (argc > 1 && std::strcmp(argv[1], "layout") == 0) {  // layout IC OC HW K S PAD GROUPS N
    int q[8];
    for (int i = 0; i < 8; i++) q[i] = argc > 2 + i ? std::atoi(argv[2 + i]) : 0;
    double a = Conv(q[7], q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nhwc, false, 0, &impl);
    std::string ia = impl;
    bool avx512 = get_effective_cpu_isa() >= cpu_isa::avx512_core;  // hgrt's blocked layout
    double b = Conv(q[7], q[0], q[1], q[2], q[3], q[4], q[5], q[6],
                    avx512 ? tag::nChw16c : tag::nChw8c, false, 0, &impl);
    std::printf("batch %d, %dx%d %d -> %d at %dx%d stride %d (groups %d): NHWC %.1f (%s), "
                "%s %.1f (%s)\n", q[7], q[3], q[3], q[0], q[1], q[2], q[2], q[4], q[6], a,
                ia.c_str(), avx512 ? "nChw16c" : "nChw8c", b, impl);
    return 0;
  }
  std::printf("isa %d\n", static_cast<int>(get_effective_cpu_isa()));
  std::printf("-- int8 against float32, batch 1, NHWC (us)\n");
  int convs[][7] = {{64, 64, 56, 3, 1, 1, 1}, {256, 64, 56, 1, 1, 0, 1}, {64, 256, 56, 1, 1, 0, 1},
                    {128, 128, 28, 3, 1, 1, 1}, {512, 2048, 7, 1, 1, 0, 1}};
  for (auto& q : convs) {
    double f = Conv(1, q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nhwc, false, 0, &impl);
    double i = Conv(1, q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nhwc, true, 0, &impl);
    std::printf("%dx%d %d -> %d at %dx%d: float32 %.1f, int8 %.1f (%s)\n", q[3], q[3], q[0], q[1],
                q[2], q[2], f, i, impl);
  }
  std::printf("-- swish as oneDNN's post-op, batch 1, NHWC (us)\n");
  int sw[][7] = {{16, 96, 112, 1, 1, 0, 1}, {32, 32, 112, 3, 1, 1, 32},
                 {144, 144, 56, 3, 1, 1, 144}};
  for (auto& q : sw) {
    double plain = Conv(1, q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nhwc, false, 0, &impl);
    double with = Conv(1, q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nhwc, false, 1, &impl);
    std::printf("%dx%d %d -> %d at %dx%d (groups %d): %.1f, with swish %.1f (%s)\n", q[3], q[3],
                q[0], q[1], q[2], q[2], q[6], plain, with, impl);
  }
  std::printf("-- NHWC against nChw16c, batch 8 and 1 (us)\n");
  int bl[][7] = {{144, 144, 56, 3, 1, 1, 144}, {16, 96, 112, 1, 1, 0, 1}, {32, 16, 112, 1, 1, 0, 1},
                 {24, 144, 56, 1, 1, 0, 1}};
  for (int n : {8, 1}) {
    for (auto& q : bl) {
      double a = Conv(n, q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nhwc, false, 0, &impl);
      std::string ia = impl;
      double b = Conv(n, q[0], q[1], q[2], q[3], q[4], q[5], q[6], tag::nChw16c, false, 0, &impl);
      std::printf("batch %d, %dx%d %d -> %d at %dx%d (groups %d): NHWC %.1f (%s), nChw16c %.1f "
                  "(%s)\n", n, q[3], q[3], q[0], q[1], q[2], q[2], q[6], a, ia.c_str(), b, impl);
    }
  }
  std::printf("-- two activations (us)\n");
  std::printf("(12, 197, 64) x (12, 64, 197): %.1f\n", Matmul({12, 197, 64}, {12, 64, 197},
                                                             {12, 197, 197}));
  std::printf("(12, 197, 197) x (12, 197, 64): %.1f\n", Matmul({12, 197, 197}, {12, 197, 64},
                                                              {12, 197, 64}));
  return DenseRows();
}
