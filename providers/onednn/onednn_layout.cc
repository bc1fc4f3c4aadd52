// hgrt's oneDNN kernels without weights, on the NHWC tensors that providers/onednn/channels_last.py
// keeps between oneDNN kernels: concat, pooling, channel shuffle, LRN, the per-channel affine
// of claim_affine, and the reorder back to NCHW. No blob: the shapes are the tensors', the
// attributes a small tensor; a primitive per shapes, attributes and thread count (Cached).
#include "onednn_shim.h"

namespace hgrt_onednn {

// ---- concat of NHWC tensors along channels ------------------------------------------------

// `fn(x0, x1, ..., out)`: 4-D tensors N x H x W x C_i (NHWC, as channels_last keeps them),
// joined along C. No weights, so no blob: the shapes are the tensors'. A primitive per list of
// shapes and thread count.
memory::desc Nhwc(const ffi::TensorView& t) {
  const int64_t* s = t.shape().data();
  return memory::desc({s[0], s[3], s[1], s[2]}, memory::data_type::f32, Tag::nhwc);
}

void Concat(ffi::PackedArgs args) {
  if (args.size() < 2) TVM_FFI_THROW(TypeError) << "oneDNN concat: expected (x0, ..., out)";
  std::vector<ffi::TensorView> ts;
  for (int i = 0; i < args.size(); ++i) ts.push_back(args[i].cast<ffi::TensorView>());
  const ffi::TensorView& out = ts.back();
  std::vector<int64_t> key;
  int64_t channels = 0;
  for (const ffi::TensorView& t : ts) {
    CheckTensor(t, "concat operand", kF32, -1);
    if (t.ndim() != 4) TVM_FFI_THROW(ValueError) << "oneDNN concat: operands must be NHWC";
    for (int d = 0; d < 3; ++d) {
      if (t.shape()[d] != out.shape()[d]) {
        TVM_FFI_THROW(ValueError) << "oneDNN concat: operands differ in N, H or W";
      }
    }
    key.push_back(t.shape()[3]);
    if (&t != &out) channels += t.shape()[3];
  }
  if (channels != out.shape()[3]) {
    TVM_FFI_THROW(ValueError) << "oneDNN concat: output has " << out.shape()[3]
                              << " channels, the operands " << channels;
  }
  key.insert(key.end(), {out.shape()[0], out.shape()[1], out.shape()[2], UseBudgetThreads()});
  auto prim = Cached<Shared>(key, [&] {
    std::vector<memory::desc> srcs;
    for (size_t i = 0; i + 1 < ts.size(); ++i) srcs.push_back(Nhwc(ts[i]));
    return MakeShared<dnnl::concat>(
        dnnl::concat::primitive_desc(Engine(), Nhwc(out), 1, srcs, UserScratchpad()));
  });
  Args& a = BoundArgs(prim)[0];
  for (size_t i = 0; i + 1 < ts.size(); ++i) {
    a.Set(DNNL_ARG_MULTIPLE_SRC + static_cast<int>(i), Nhwc(ts[i]), DataOf(ts[i]));
  }
  a.Set(DNNL_ARG_DST, Nhwc(out), DataOf(out));
  prim->Run(a);
}

// ---- split of an NHWC tensor along channels ------------------------------------------------

// `fn(x, out0, out1, ...)`: x N x H x W x C (NHWC, as channels_last keeps it), each out_i N x H
// x W x C_i, the C_i adding up to C: per pixel, runs of channels copied, on the OpenMP team of
// the oneDNN kernels around it (a TVM kernel there switched thread pools twice a split).
void Split(ffi::PackedArgs args) {
  if (args.size() < 2) TVM_FFI_THROW(TypeError) << "oneDNN split: expected (x, out0, ...)";
  std::vector<ffi::TensorView> ts;
  for (int i = 0; i < args.size(); ++i) ts.push_back(args[i].cast<ffi::TensorView>());
  const ffi::TensorView& x = ts[0];
  CheckTensor(x, "split input", kF32, -1);
  if (x.ndim() != 4) TVM_FFI_THROW(ValueError) << "oneDNN split: the input must be NHWC";
  int64_t channels = 0;
  std::vector<int64_t> width;
  std::vector<float*> outs;
  for (size_t i = 1; i < ts.size(); ++i) {
    CheckTensor(ts[i], "split output", kF32, -1);
    if (ts[i].ndim() != 4 || ts[i].shape()[0] != x.shape()[0] ||
        ts[i].shape()[1] != x.shape()[1] || ts[i].shape()[2] != x.shape()[2]) {
      TVM_FFI_THROW(ValueError) << "oneDNN split: output " << i - 1
                                << " differs from the input in N, H or W";
    }
    width.push_back(ts[i].shape()[3]);
    outs.push_back(static_cast<float*>(DataOf(ts[i])));
    channels += ts[i].shape()[3];
  }
  if (channels != x.shape()[3]) {
    TVM_FFI_THROW(ValueError) << "oneDNN split: the outputs have " << channels
                              << " channels, the input " << x.shape()[3];
  }
  const float* src = static_cast<const float*>(DataOf(x));
  int64_t pixels = x.shape()[0] * x.shape()[1] * x.shape()[2];
  int threads = UseBudgetThreads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < pixels; ++p) {
    const float* in = src + p * channels;
    for (size_t i = 0; i < outs.size(); ++i) {
      std::memcpy(outs[i] + p * width[i], in, 4 * width[i]);
      in += width[i];
    }
  }
}

// ---- pooling of NHWC tensors ----------------------------------------------------------------

// `fn(x, attrs, out)`: x and out NHWC (N x H x W x C); attrs int64: the algorithm (PoolAlgo),
// kernel h, w, strides h, w, pads top, left, bottom, right, dilations h, w. The bottom and
// right pads grow to what the output's size needs (TVM's ceil_mode).
enum PoolAlgo : int64_t { kPoolMax = 0, kPoolAvgIncludePad = 1, kPoolAvgExcludePad = 2 };
constexpr int kPoolAttrs = 11;

void Pool(const ffi::TensorView& x, const ffi::TensorView& attrs, const ffi::TensorView& out) {
  CheckTensor(x, "pool input", kF32, -1);
  CheckTensor(out, "pool output", kF32, -1);
  CheckTensor(attrs, "pool attributes", DLDataType{kDLInt, 64, 1}, kPoolAttrs);
  if (x.ndim() != 4 || out.ndim() != 4 || x.shape()[0] != out.shape()[0] ||
      x.shape()[3] != out.shape()[3]) {
    TVM_FFI_THROW(ValueError) << "oneDNN pool: expected NHWC input and output, same N and C";
  }
  const int64_t* a = static_cast<const int64_t*>(DataOf(attrs));
  if (a[0] < kPoolMax || a[0] > kPoolAvgExcludePad || a[1] < 1 || a[2] < 1 || a[3] < 1 ||
      a[4] < 1 || a[9] < 1 || a[10] < 1) {
    TVM_FFI_THROW(ValueError) << "oneDNN pool: bad attributes";
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  const int64_t* s = x.shape().data();
  const int64_t* o = out.shape().data();
  std::vector<int64_t> key(s, s + 4);
  key.insert(key.end(), o + 1, o + 3);
  key.insert(key.end(), a, a + kPoolAttrs);
  key.push_back(threads);
  memory::desc src = Nhwc(x), dst = Nhwc(out);
  auto entry = Cached<std::pair<dnnl::primitive, memory::desc>>(key, [&] {
    auto algo = a[0] == kPoolMax ? dnnl::algorithm::pooling_max
                : a[0] == kPoolAvgIncludePad ? dnnl::algorithm::pooling_avg_include_padding
                                             : dnnl::algorithm::pooling_avg_exclude_padding;
    auto pd = PoolDesc(algo, src, dst, {a[1], a[2]}, {a[3], a[4]}, {a[9] - 1, a[10] - 1},
                       {a[5], a[6]}, {a[7], a[8]});
    return std::make_pair(dnnl::primitive(dnnl::pooling_forward(pd)), pd.scratchpad_desc());
  });
  thread_local Buffer pad;
  Args& args = BoundArgs(entry)[0];
  args.Set(DNNL_ARG_SRC, src, DataOf(x));
  args.Set(DNNL_ARG_DST, dst, DataOf(out));
  args.Set(DNNL_ARG_SCRATCHPAD, entry->second, pad.get(entry->second.get_size() + 64));
  entry->first.execute(Stream(), args.map());
  Stream().wait();
}

// A squeeze-excite gate: NHWC x times a computed (N or 1) x C tensor g, broadcast over H and W
// (oneDNN's binary multiply, on its OpenMP team: as a TVM kernel between oneDNN kernels it ran
// on the calling thread alone).
void Gate(const ffi::TensorView& x, const ffi::TensorView& g, const ffi::TensorView& out) {
  CheckTensor(x, "gate input", kF32, -1);
  CheckTensor(g, "gate", kF32, -1);
  CheckTensor(out, "gate output", kF32, x.numel());
  if (x.ndim() != 4 || out.ndim() != 4 ||
      !std::equal(x.shape().begin(), x.shape().end(), out.shape().begin())) {
    TVM_FFI_THROW(ValueError) << "oneDNN gate: expected NHWC input and output of one shape";
  }
  const int64_t* s = x.shape().data();
  int64_t n = g.numel() / std::max<int64_t>(s[3], 1);
  if (g.numel() != n * s[3] || (n != 1 && n != s[0])) {
    TVM_FFI_THROW(ValueError) << "oneDNN gate: expected " << s[3] << " or " << s[0] * s[3]
                              << " gate values (N or 1 times C), got " << g.numel();
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  memory::desc src = Nhwc(x), dst = Nhwc(out);
  memory::desc per_channel({n, s[3], 1, 1}, memory::data_type::f32, Tag::nchw);
  auto prim = Cached<Shared>({s[0], s[1], s[2], s[3], n, threads}, [&] {
    return MakeShared<dnnl::binary>(dnnl::binary::primitive_desc(
        Engine(), dnnl::algorithm::binary_mul, src, per_channel, dst, UserScratchpad()));
  });
  Args& args = BoundArgs(prim)[0];
  args.Set(DNNL_ARG_SRC_0, src, DataOf(x));
  args.Set(DNNL_ARG_SRC_1, per_channel, DataOf(g));
  args.Set(DNNL_ARG_DST, dst, DataOf(out));
  prim->Run(args);
}

// ---- channel shuffle and LRN of NHWC tensors -----------------------------------------------

// The bit patterns of `n` floats appended to a primitive cache key (exact: no two values, NaNs
// included, share a key).
void PushBits(std::vector<int64_t>& key, const float* values, int n) {
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, 4);
    key.push_back(bits);
  }
}

// A primitive that maps one NHWC tensor to another of its shape (shuffle, LRN): made once per
// key by `make(desc)`, run on (x, out).
template <typename Make>
void RunSameShape(const ffi::TensorView& x, const ffi::TensorView& out, const char* what,
                  std::vector<int64_t> key, Make make) {
  CheckTensor(x, what, kF32, -1);
  CheckTensor(out, what, kF32, -1);
  if (x.ndim() != 4 || out.ndim() != 4 ||
      !std::equal(x.shape().begin(), x.shape().end(), out.shape().begin())) {
    TVM_FFI_THROW(ValueError) << "oneDNN " << what
                              << ": expected NHWC input and output of one shape";
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  key.insert(key.end(), x.shape().begin(), x.shape().end());
  key.push_back(threads);
  memory::desc md = Nhwc(x);
  auto prim = Cached<Shared>(key, [&] { return make(md); });
  Args& args = BoundArgs(prim)[0];
  args.Set(DNNL_ARG_SRC, md, DataOf(x));
  args.Set(DNNL_ARG_DST, md, DataOf(out));
  prim->Run(args);
}

// `fn(x, attrs, out)`: ShuffleNet's channel shuffle with `groups` = attrs[0] (int64): the C
// channels seen as groups x C/groups, transposed (ONNX: reshape, transpose, reshape).
void Shuffle(const ffi::TensorView& x, const ffi::TensorView& attrs, const ffi::TensorView& out) {
  CheckTensor(attrs, "shuffle attributes", DLDataType{kDLInt, 64, 1}, 1);
  int64_t groups = *static_cast<const int64_t*>(DataOf(attrs));
  int64_t channels = x.ndim() == 4 ? x.shape()[3] : 0;
  if (groups < 1 || channels % groups != 0) {
    TVM_FFI_THROW(ValueError) << "oneDNN shuffle: " << groups << " groups do not divide "
                              << channels << " channels";
  }
  RunSameShape(x, out, "shuffle", {0, groups}, [&](const memory::desc& md) {
    // oneDNN's group_size G sees the axis as C/G x G and transposes it: G = C / groups
    return MakeShared<dnnl::shuffle_forward>(dnnl::shuffle_forward::primitive_desc(
        Engine(), dnnl::prop_kind::forward_inference, md, md, 1,
        static_cast<int>(channels / groups), UserScratchpad()));
  });
}

// `fn(x, attrs, out)`: local response normalization across channels, attrs float32 (size,
// alpha, beta, bias): out = x / (bias + alpha / size * sum of x^2 over `size` channels)^beta,
// the window centred (odd sizes), as ONNX's LRN.
void Lrn(const ffi::TensorView& x, const ffi::TensorView& attrs, const ffi::TensorView& out) {
  CheckTensor(attrs, "LRN attributes", DLDataType{kDLFloat, 32, 1}, 4);
  const float* a = static_cast<const float*>(DataOf(attrs));
  int64_t size = a[0] >= 1 && a[0] < 1e6f ? static_cast<int64_t>(a[0]) : 0;  // NaN: 0
  if (static_cast<float>(size) != a[0] || size < 1 || size % 2 == 0) {
    TVM_FFI_THROW(ValueError) << "oneDNN LRN: size must be an odd positive integer, got " << a[0];
  }
  std::vector<int64_t> key{1, size};
  PushBits(key, a + 1, 3);
  RunSameShape(x, out, "LRN", key, [&](const memory::desc& md) {
    return MakeShared<dnnl::lrn_forward>(dnnl::lrn_forward::primitive_desc(
        Engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::lrn_across_channels, md,
        md, size, a[1], a[2], a[3], UserScratchpad()));
  });
}

// ---- per-channel affine + activation of channels-last tensors ------------------------------

// `fn(x, params, out)`: out = act(x * scale + shift), scale and shift one number per channel,
// the LAST axis of x (NHWC as channels_last keeps it; any rank >= 1, the leading axes seen as
// rows). params float32 [3 + 2C]: the activation (0 none, 1 ReLU, 2 clip), its alpha and beta
// (clip's lower and upper bound), scale[C], shift[C]. A chain of batch norms and scale layers
// folded at build (providers/onednn/claim_affine.py): oneDNN's binary multiply with a binary add
// and an eltwise post-op, on its OpenMP threads (a lone TVM kernel between oneDNN kernels runs
// on one thread: threads.solo). x and out may be one buffer.
enum AffineAct : int64_t { kActNone = 0, kActRelu = 1, kActClip = 2 };
constexpr int kAffineHead = 3;

void Affine(const ffi::TensorView& x, const ffi::TensorView& params, const ffi::TensorView& out) {
  CheckTensor(x, "affine input", kF32, -1);
  CheckTensor(out, "affine output", kF32, x.numel());
  if (x.ndim() < 1) {
    TVM_FFI_THROW(ValueError) << "oneDNN affine: the input has no channel axis (0-d)";
  }
  if (out.ndim() != x.ndim() ||
      !std::equal(x.shape().begin(), x.shape().end(), out.shape().begin())) {
    TVM_FFI_THROW(ValueError) << "oneDNN affine: expected input and output of one shape";
  }
  int64_t channels = x.shape()[x.ndim() - 1];
  CheckTensor(params, "affine parameters", kF32, kAffineHead + 2 * channels);
  const float* a = static_cast<const float*>(DataOf(params));
  int64_t act = a[0] == 0.f ? kActNone : a[0] == 1.f ? kActRelu : a[0] == 2.f ? kActClip : -1;
  if (act < 0 || (act == kActClip && !(a[1] <= a[2]))) {
    TVM_FFI_THROW(ValueError) << "oneDNN affine: bad activation (" << a[0] << ", " << a[1]
                              << ", " << a[2] << ")";
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  int64_t rows = channels > 0 ? x.numel() / channels : 0;
  if (rows == 0) return;
  std::vector<int64_t> key{rows, channels, act};
  const float bounds[2] = {act == kActClip ? a[1] : 0.f, act == kActClip ? a[2] : 0.f};
  PushBits(key, bounds, 2);  // (only clip reads them: one primitive per ReLU shape)
  key.push_back(threads);
  // rows x C as oneDNN's N=1, C, H=rows, W=1 in NHWC: the per-channel broadcast its jit
  // binary kernels take (a 2-D or plain 4-D view of the same bytes ran its reference code)
  memory::desc md({1, channels, rows, 1}, memory::data_type::f32, Tag::nhwc);
  memory::desc per_channel({1, channels, 1, 1}, memory::data_type::f32, Tag::nchw);
  auto prim = Cached<Shared>(key, [&] {
    dnnl::post_ops ops;
    ops.append_binary(dnnl::algorithm::binary_add, per_channel);
    if (act == kActRelu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    if (act == kActClip) ops.append_eltwise(dnnl::algorithm::eltwise_clip, a[1], a[2]);
    dnnl::primitive_attr attr;
    attr.set_post_ops(ops);
    return MakeShared<dnnl::binary>(dnnl::binary::primitive_desc(
        Engine(), dnnl::algorithm::binary_mul, md, per_channel, md, UserScratchpad(attr)));
  });
  float* scale = const_cast<float*>(a + kAffineHead);
  Args& args = BoundArgs(prim)[0];
  args.Set(DNNL_ARG_SRC_0, md, DataOf(x));
  args.Set(DNNL_ARG_SRC_1, per_channel, scale);
  args.Set(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, per_channel, scale + channels);
  args.Set(DNNL_ARG_DST, md, DataOf(out));
  prim->Run(args);
}

// ---- NHWC back to NCHW ----------------------------------------------------------------------

// `fn(x, out)`: x N x H x W x C (NHWC, as channels_last keeps it), out N x C x H x W: the
// reorder where an NHWC tensor meets a reader that wants NCHW, a node of its own in the graph.
void ToNchw(const ffi::TensorView& x, const ffi::TensorView& out) {
  CheckTensor(x, "reorder input", kF32, -1);
  CheckTensor(out, "reorder output", kF32, -1);
  const int64_t* s = x.shape().data();
  const int64_t* o = out.shape().data();
  if (x.ndim() != 4 || out.ndim() != 4 || o[0] != s[0] || o[1] != s[3] || o[2] != s[1] ||
      o[3] != s[2]) {
    TVM_FFI_THROW(ValueError) << "oneDNN reorder: expected N x H x W x C in, N x C x H x W out";
  }
  memory::dims dims{o[0], o[1], o[2], o[3]};
  memory::desc from(dims, memory::data_type::f32, Tag::nhwc);
  memory::desc to(dims, memory::data_type::f32, Tag::nchw);
  auto prim = Cached<Shared>({o[0], o[1], o[2], o[3], UseBudgetThreads()}, [&] {
    return MakeShared<dnnl::reorder>(ReorderDesc(from, to));
  });
  Args& args = BoundArgs(prim)[0];
  args.Set(DNNL_ARG_FROM, from, DataOf(x));
  args.Set(DNNL_ARG_TO, to, DataOf(out));
  prim->Run(args);
}

}  // namespace hgrt_onednn
