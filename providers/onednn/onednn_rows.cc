// hgrt's oneDNN kernels over rows, weightless but for a layer norm's scale and shift: what a
// transformer computes between its dense layers (a layer norm, a softmax, the matmuls of two
// activations in attention). On oneDNN's OpenMP threads they keep the dense layers' team awake
// where TVM's kernels between them would switch thread pools (providers/onednn/auto_choice.py).
// Each is one primitive per shape and thread count (Cached), its arguments bound per thread.
#include <cmath>
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
void Matmul(ffi::PackedArgs args) {
  if (args.size() != 3 && args.size() != 4) {
    TVM_FFI_THROW(TypeError) << "oneDNN matmul: expected (a, b, [addend,] out), got "
                             << args.size() << " arguments";
  }
  ffi::TensorView a = args[0].cast<ffi::TensorView>(), b = args[1].cast<ffi::TensorView>();
  ffi::TensorView out = args[args.size() - 1].cast<ffi::TensorView>();
  CheckTensor(a, "matmul operand a", kF32, -1);
  CheckTensor(b, "matmul operand b", kF32, -1);
  CheckTensor(out, "matmul output", kF32, -1);
  std::optional<ffi::TensorView> addend;
  if (args.size() == 4) {
    addend = args[2].cast<ffi::TensorView>();
    CheckTensor(*addend, "matmul addend", kF32, -1);
  }
  int rank = static_cast<int>(out.ndim());
  // `t`'s dims with leading 1s up to the output's rank (an operand has at least 2)
  auto padded = [&](const ffi::TensorView& t, const char* what, size_t least) {
    memory::dims d = DimsOf(t);
    if (static_cast<int>(d.size()) > rank || rank < 2 || d.size() < least) {
      TVM_FFI_THROW(ValueError) << "oneDNN matmul: " << what << " of rank " << d.size()
                                << " does not fit an output of rank " << rank;
    }
    d.insert(d.begin(), rank - d.size(), 1);
    return d;
  };
  memory::dims da = padded(a, "a", 2), db = padded(b, "b", 2), dc = DimsOf(out);
  bool fits = da[rank - 1] == db[rank - 2] && dc[rank - 2] == da[rank - 2] &&
              dc[rank - 1] == db[rank - 1];
  for (int i = 0; i + 2 < rank && fits; ++i) {  // batch dims: equal, or 1 broadcast
    fits = (da[i] == dc[i] || da[i] == 1) && (db[i] == dc[i] || db[i] == 1);
  }
  memory::dims dd = addend ? padded(*addend, "the addend", 1) : memory::dims();
  for (int i = 0; addend && i < rank && fits; ++i) fits = dd[i] == dc[i] || dd[i] == 1;
  if (!fits || rank > DNNL_MAX_NDIMS) {
    TVM_FFI_THROW(ValueError) << "oneDNN matmul: the shapes of a, b"
                              << (addend ? ", the addend" : "") << " and the output do not fit";
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  std::vector<int64_t> key(da);
  key.insert(key.end(), db.begin(), db.end());
  key.insert(key.end(), dd.begin(), dd.end());
  key.push_back(addend.has_value());
  key.push_back(threads);
  auto row_major = [](const memory::dims& d) {
    memory::dims strides(d.size(), 1);
    for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) {
      strides[i] = strides[i + 1] * d[i + 1];
    }
    return memory::desc(d, memory::data_type::f32, strides);
  };
  memory::desc ma = row_major(da), mb = row_major(db), mc = row_major(dc);
  memory::desc md = addend ? row_major(dd) : memory::desc();
  auto prim = Cached<Shared>(key, [&] {
    dnnl::primitive_attr attr;
    if (addend) {
      dnnl::post_ops ops;
      ops.append_binary(dnnl::algorithm::binary_add, md);
      attr.set_post_ops(ops);
    }
    return MakeShared<dnnl::matmul>(
        dnnl::matmul::primitive_desc(Engine(), ma, mb, mc, UserScratchpad(attr)));
  });
  Args& bound = BoundArgs(prim)[0];
  bound.Set(DNNL_ARG_SRC, ma, DataOf(a));
  bound.Set(DNNL_ARG_WEIGHTS, mb, DataOf(b));
  bound.Set(DNNL_ARG_DST, mc, DataOf(out));
  if (addend) {
    bound.Set(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, md, DataOf(*addend));
  }
  prim->Run(bound);
}

}  // namespace hgrt_onednn
