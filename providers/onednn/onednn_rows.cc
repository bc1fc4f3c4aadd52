// hgrt's oneDNN kernels over rows, weightless but for a layer norm's scale and shift: what a
// transformer computes between its dense layers (a layer norm, a softmax, the matmuls of two
// activations in attention). On oneDNN's OpenMP threads they keep the dense layers' team awake
// where TVM's kernels between them would switch thread pools (providers/onednn/auto_choice.py).
// Each is one primitive per shape and thread count (Cached), its arguments bound per thread.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>

#include "onednn_shim.h"

namespace hgrt_onednn {

namespace {

// The dims of `t` (0-d: one element).
memory::dims DimsOf(const ffi::TensorView& t) {
  memory::dims d(t.shape().begin(), t.shape().end());
  if (d.empty()) d.push_back(1);
  return d;
}

// rows x C of a tensor whose last axis is C (the axis a layer norm or softmax reduces).
std::pair<int64_t, int64_t> Rows(const ffi::TensorView& x, const char* what) {
  if (x.ndim() < 1 || x.shape()[x.ndim() - 1] < 1) {
    TVM_FFI_THROW(ValueError) << "oneDNN " << what << ": the input has no last axis to reduce";
  }
  int64_t c = x.shape()[x.ndim() - 1];
  return {x.numel() / c, c};
}

void CheckSameShape(const ffi::TensorView& x, const ffi::TensorView& out, const char* what) {
  if (out.ndim() != x.ndim() ||
      !std::equal(x.shape().begin(), x.shape().end(), out.shape().begin())) {
    TVM_FFI_THROW(ValueError) << "oneDNN " << what << ": expected input and output of one shape";
  }
}

// ONNX's softmax of a row of -inf only is NaN; the exporters' where(isnan(s), value, s) after
// it is the kernel's `nan_to`.
void ReplaceNan(float* y, int64_t n, float value, int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] != y[i] ? value : y[i];
}

}  // namespace

// x normalized over its last axis (C): (x - mean) / sqrt(var + epsilon) * scale + shift;
// params: scale (C), shift (C), epsilon.
void LayerNorm(const ffi::TensorView& x, const ffi::TensorView& params,
               const ffi::TensorView& out) {
  CheckTensor(x, "layer norm input", kF32, -1);
  CheckTensor(out, "layer norm output", kF32, x.numel());
  CheckSameShape(x, out, "layer norm");
  auto [rows, c] = Rows(x, "layer norm");
  CheckTensor(params, "layer norm parameters", kF32, 2 * c + 1);
  const float* p = static_cast<const float*>(DataOf(params));
  float eps = p[2 * c];
  if (!(eps >= 0.f) || !std::isfinite(eps)) {
    TVM_FFI_THROW(ValueError) << "oneDNN layer norm: bad epsilon " << eps;
  }
  if (rows == 0) return;
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  std::vector<int64_t> key{rows, c};
  PushBits(key, &eps, 1);
  key.push_back(threads);
  memory::desc md({rows, c}, memory::data_type::f32, Tag::ab);
  memory::desc per_channel({c}, memory::data_type::f32, Tag::a);
  auto prim = Cached<Shared>(key, [&] {
    auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    return MakeShared<dnnl::layer_normalization_forward>(
        dnnl::layer_normalization_forward::primitive_desc(
            Engine(), dnnl::prop_kind::forward_inference, md, md, eps, flags, UserScratchpad()));
  });
  Args& args = BoundArgs(prim)[0];
  args.Set(DNNL_ARG_SRC, md, DataOf(x));
  args.Set(DNNL_ARG_SCALE, per_channel, const_cast<float*>(p));
  args.Set(DNNL_ARG_SHIFT, per_channel, const_cast<float*>(p + c));
  args.Set(DNNL_ARG_DST, md, DataOf(out));
  prim->Run(args);
}

// softmax over the last axis; params: (has_nan_to, nan_to): NaNs of the result become nan_to
// where has_nan_to is 1.
void Softmax(const ffi::TensorView& x, const ffi::TensorView& params,
             const ffi::TensorView& out) {
  CheckTensor(x, "softmax input", kF32, -1);
  CheckTensor(out, "softmax output", kF32, x.numel());
  CheckSameShape(x, out, "softmax");
  CheckTensor(params, "softmax parameters", kF32, 2);
  const float* p = static_cast<const float*>(DataOf(params));
  if (p[0] != 0.f && p[0] != 1.f) {
    TVM_FFI_THROW(ValueError) << "oneDNN softmax: bad parameters (" << p[0] << ", " << p[1] << ")";
  }
  auto [rows, c] = Rows(x, "softmax");
  if (rows == 0) return;
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  memory::desc md({rows, c}, memory::data_type::f32, Tag::ab);
  auto prim = Cached<Shared>({rows, c, threads}, [&] {
    return MakeShared<dnnl::softmax_forward>(dnnl::softmax_forward::primitive_desc(
        Engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::softmax_accurate, md, md,
        1, UserScratchpad()));
  });
  Args& args = BoundArgs(prim)[0];
  args.Set(DNNL_ARG_SRC, md, DataOf(x));
  args.Set(DNNL_ARG_DST, md, DataOf(out));
  prim->Run(args);
  if (p[0] == 1.f) ReplaceNan(static_cast<float*>(DataOf(out)), x.numel(), p[1], threads);
}

// out = a @ b (+ addend), numpy's matmul of two activations: a (..., M, K), b (..., K, N), out
// (..., M, N), the batch dims broadcast (a lower rank has leading 1s); an addend of out's rank
// or lower broadcasts onto out (oneDNN's binary-add post-op).
//
// `views` (int64, optional): the operands and the product as strided views of the tensors
// given, so that transposes and reshapes around the product (attention's heads split off and
// merged back) are read and written in place rather than by kernels of their own: for a, b
// and the product in turn, its R dims then its R strides in elements of the tensor given,
// then the float32 bits of a scale the product is multiplied by (before the addend). The
// product's view must cover the output tensor once; an operand's must stay inside its tensor.
void Matmul(ffi::PackedArgs args) {
  int n = args.size();
  std::optional<ffi::TensorView> views;
  if (n >= 4) {
    ffi::TensorView t = args[n - 2].cast<ffi::TensorView>();
    if (t.dtype().code == kDLInt && t.dtype().bits == 64) {
      views = t;
      --n;
    }
  }
  if (n != 3 && n != 4) {
    TVM_FFI_THROW(TypeError) << "oneDNN matmul: expected (a, b, [addend,] [views,] out), got "
                             << args.size() << " arguments";
  }
  ffi::TensorView a = args[0].cast<ffi::TensorView>(), b = args[1].cast<ffi::TensorView>();
  ffi::TensorView out = args[args.size() - 1].cast<ffi::TensorView>();
  CheckTensor(a, "matmul operand a", kF32, -1);
  CheckTensor(b, "matmul operand b", kF32, -1);
  CheckTensor(out, "matmul output", kF32, -1);
  std::optional<ffi::TensorView> addend;
  if (n == 4) {
    addend = args[2].cast<ffi::TensorView>();
    CheckTensor(*addend, "matmul addend", kF32, -1);
  }
  int rank = static_cast<int>(out.ndim());
  const int64_t* v = nullptr;
  float scale = 1.f;
  if (views) {
    int64_t len = views->numel();
    if (views->ndim() != 1 || len < 13 || (len - 1) % 6 != 0) {
      TVM_FFI_THROW(ValueError) << "oneDNN matmul: views has " << len << " elements, not 6 x "
                                << "a rank of 2 or more, plus 1";
    }
    CheckTensor(*views, "matmul views", DLDataType{kDLInt, 64, 1}, len);
    v = static_cast<const int64_t*>(DataOf(*views));
    rank = static_cast<int>((len - 1) / 6);
    uint32_t bits = static_cast<uint32_t>(v[6 * rank]);
    std::memcpy(&scale, &bits, sizeof scale);
    if (!std::isfinite(scale)) {
      TVM_FFI_THROW(ValueError) << "oneDNN matmul: the views' scale is " << scale;
    }
  }
  // `t` as the product reads it (view k of `views`, else its dims and row-major strides),
  // with leading 1s up to the product's rank (an operand has at least 2 dims)
  auto seen_as = [&](const ffi::TensorView& t, const char* what, size_t least, int k) {
    memory::dims d, st;
    if (v && k >= 0) {
      d.assign(v + 2 * k * rank, v + (2 * k + 1) * rank);
      st.assign(v + (2 * k + 1) * rank, v + (2 * k + 2) * rank);
      int64_t last = 0;  // the farthest element the view reads
      for (int i = 0; i < rank; ++i) {
        if (d[i] < 1 || st[i] < 0) {
          TVM_FFI_THROW(ValueError) << "oneDNN matmul: the view of " << what << " has a dim "
                                    << d[i] << " or stride " << st[i];
        }
        last += (d[i] - 1) * st[i];
      }
      if (last >= t.numel()) {
        TVM_FFI_THROW(ValueError) << "oneDNN matmul: the view of " << what << " reads past its "
                                  << t.numel() << " elements";
      }
      return std::make_pair(d, st);
    }
    d = DimsOf(t);
    st.assign(d.size(), 1);
    for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * d[i + 1];
    if (static_cast<int>(d.size()) > rank || rank < 2 || d.size() < least) {
      TVM_FFI_THROW(ValueError) << "oneDNN matmul: " << what << " of rank " << d.size()
                                << " does not fit an output of rank " << rank;
    }
    st.insert(st.begin(), rank - d.size(), st[0] * d[0]);
    d.insert(d.begin(), rank - d.size(), 1);
    return std::make_pair(d, st);
  };
  auto [da, sa] = seen_as(a, "a", 2, 0);
  auto [db, sb] = seen_as(b, "b", 2, 1);
  auto [dc, sc] = seen_as(out, "the output", 2, 2);
  if (v) {  // the product's view covers the output once: its strides a row-major order's
    std::vector<int> order(rank);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int x, int y) { return sc[x] < sc[y]; });
    int64_t step = 1;
    for (int i : order) {
      if (dc[i] == 1) continue;
      if (sc[i] != step) {
        TVM_FFI_THROW(ValueError) << "oneDNN matmul: the view of the output does not cover it "
                                  << "once";
      }
      step *= dc[i];
    }
    if (step != out.numel()) {
      TVM_FFI_THROW(ValueError) << "oneDNN matmul: the view of the output covers " << step
                                << " of its " << out.numel() << " elements";
    }
  }
  bool fits = da[rank - 1] == db[rank - 2] && dc[rank - 2] == da[rank - 2] &&
              dc[rank - 1] == db[rank - 1];
  for (int i = 0; i + 2 < rank && fits; ++i) {  // batch dims: equal, or 1 broadcast
    fits = (da[i] == dc[i] || da[i] == 1) && (db[i] == dc[i] || db[i] == 1);
  }
  memory::dims dd, sd;
  if (addend) std::tie(dd, sd) = seen_as(*addend, "the addend", 1, -1);
  for (int i = 0; addend && i < rank && fits; ++i) fits = dd[i] == dc[i] || dd[i] == 1;
  if (!fits || rank > DNNL_MAX_NDIMS) {
    TVM_FFI_THROW(ValueError) << "oneDNN matmul: the shapes of a, b"
                              << (addend ? ", the addend" : "") << " and the output do not fit";
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  std::vector<int64_t> key;
  for (const memory::dims* d : {&da, &sa, &db, &sb, &dc, &sc, &dd}) {
    key.insert(key.end(), d->begin(), d->end());
  }
  key.push_back(addend.has_value());
  key.push_back(threads);
  int32_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof scale);
  key.push_back(scale_bits);
  memory::desc ma(da, memory::data_type::f32, sa), mb(db, memory::data_type::f32, sb);
  memory::desc mc(dc, memory::data_type::f32, sc);
  memory::desc md = addend ? memory::desc(dd, memory::data_type::f32, sd) : memory::desc();
  auto prim = Cached<Shared>(key, [&] {
    dnnl::primitive_attr attr;
    dnnl::post_ops ops;
    if (scale != 1.f) ops.append_eltwise(dnnl::algorithm::eltwise_linear, scale, 0.f);
    if (addend) ops.append_binary(dnnl::algorithm::binary_add, md);
    attr.set_post_ops(ops);
    return MakeShared<dnnl::matmul>(
        dnnl::matmul::primitive_desc(Engine(), ma, mb, mc, UserScratchpad(attr)));
  });
  Args& bound = BoundArgs(prim)[0];
  bound.Set(DNNL_ARG_SRC, ma, DataOf(a));
  bound.Set(DNNL_ARG_WEIGHTS, mb, DataOf(b));
  bound.Set(DNNL_ARG_DST, mc, DataOf(out));
  if (addend) {
    int at = scale != 1.f ? 1 : 0;  // (after the scale's post-op)
    bound.Set(DNNL_ARG_ATTR_MULTIPLE_POST_OP(at) | DNNL_ARG_SRC_1, md, DataOf(*addend));
  }
  prim->Run(bound);
}

}  // namespace hgrt_onednn
