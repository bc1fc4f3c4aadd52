// hgrt's CUDA kernels from the field's libraries: dense layers and matmuls through cuBLASLt
// (bias and ReLU as its epilogue), convolutions through cuDNN (bias, residual and activation
// fused or applied in place). providers/cudalibs/kernels.py compiles this file once per
// machine against the nvidia-cublas / nvidia-cudnn wheels and loads it.
//
// A graph node names its kernel and the kernel's attributes in one function name
// (providers/cudalibs/names.py writes it): "hgrt.cudalibs.conv2d_s1x1_p1x1_d1x1_g1_res_relu".
// hgrt.cudalibs.make(name) parses it once and returns the kernel, a closure over the parsed
// attributes; shapes come from the tensors of each call. Work runs on the device's current
// stream (TVMFFIEnvGetStream), on one cuBLASLt and one cuDNN handle per thread and device;
// descriptors and the algorithm chosen are made once per shape (a convolution's for the whole
// process, ConvKey; a matmul's per kernel). float32 throughout,
// TF32 off (CUBLAS_COMPUTE_32F, CUDNN_FMA_MATH), as PyTorch with allow_tf32=False.
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace hgrt_cudalibs {

namespace ffi = tvm::ffi;

constexpr size_t kMaxWorkspace = size_t(64) << 20;  // what an algorithm may ask for

[[noreturn]] void Fail(const std::string& what) { TVM_FFI_THROW(RuntimeError) << what; }

void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Fail(std::string(what) + ": " + cudaGetErrorString(e));
}
void CheckBlas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) Fail(std::string(what) + ": cuBLAS status " + std::to_string(s));
}
void CheckDnn(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) Fail(std::string(what) + ": " + cudnnGetErrorString(s));
}

// ---- what a function name says -------------------------------------------------------------

struct Attrs {
  std::string kind;  // "dense" | "matmul" | "conv2d"
  bool bias = false, residual = false, trans_b = false;
  std::string act = "none";  // none | relu | clip | silu | sigmoid | tanh
  double clip_hi = 0.0;
  int stride[2] = {1, 1}, pad[2] = {0, 0}, dilation[2] = {1, 1}, groups = 1;
};

bool Pair(const std::string& part, char tag, int* out) {  // "s2x2" -> 2, 2
  if (part.size() < 4 || part[0] != tag) return false;
  size_t x = part.find('x');
  if (x == std::string::npos) return false;
  out[0] = std::atoi(part.substr(1, x - 1).c_str());
  out[1] = std::atoi(part.substr(x + 1).c_str());
  return true;
}

Attrs Parse(const std::string& name) {
  const std::string prefix = "hgrt.cudalibs.";
  if (name.rfind(prefix, 0) != 0) Fail("not a cudalibs kernel: " + name);
  std::vector<std::string> parts;
  std::stringstream in(name.substr(prefix.size()));
  for (std::string p; std::getline(in, p, '_');) parts.push_back(p);
  Attrs a;
  a.kind = parts.empty() ? "" : parts[0];
  if (a.kind != "dense" && a.kind != "matmul" && a.kind != "conv2d")
    Fail("unknown cudalibs kernel " + name);
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    if (p == "bias") a.bias = true;
    else if (p == "res") a.residual = true;
    else if (p == "tb") a.trans_b = true;
    else if (p == "relu" || p == "silu" || p == "sigmoid" || p == "tanh") a.act = p;
    else if (p.rfind("clip", 0) == 0) {  // clip6p0: min(max(x, 0), 6.0)
      std::string v = p.substr(4);
      for (char& c : v) c = c == 'p' ? '.' : c;
      a.act = "clip";
      a.clip_hi = std::atof(v.c_str());
    } else if (Pair(p, 's', a.stride) || Pair(p, 'p', a.pad) || Pair(p, 'd', a.dilation)) {
    } else if (p.size() > 1 && p[0] == 'g') a.groups = std::atoi(p.c_str() + 1);
    else Fail("cudalibs kernel " + name + ": unknown attribute '" + p + "'");
  }
  if (a.kind != "conv2d" && a.act != "none" && a.act != "relu")
    Fail("cudalibs kernel " + name + ": a matmul's epilogue takes relu only");
  return a;
}

// ---- per thread and device: handles; per device: a workspace --------------------------------

struct Handles {
  cublasLtHandle_t lt = nullptr;
  cudnnHandle_t dnn = nullptr;
};

Handles& HandlesFor(int device) {
  thread_local std::map<int, Handles> handles;  // a handle is one thread's at a time
  Handles& h = handles[device];
  if (h.lt == nullptr) {
    CheckCuda(cudaSetDevice(device), "cudaSetDevice");
    CheckBlas(cublasLtCreate(&h.lt), "cublasLtCreate");
    CheckDnn(cudnnCreate(&h.dnn), "cudnnCreate");
  }
  return h;
}

struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};
std::mutex workspace_mutex;
std::map<int, Workspace> workspaces;

// a workspace of at least ``bytes`` on ``device``, grown (never shrunk) as kernels ask: kernels
// of one device share it, in stream order
void* WorkspaceFor(int device, size_t bytes) {
  if (bytes == 0) return nullptr;
  std::lock_guard<std::mutex> lock(workspace_mutex);
  Workspace& w = workspaces[device];
  if (w.bytes < bytes) {
    CheckCuda(cudaSetDevice(device), "cudaSetDevice");
    if (w.ptr != nullptr) {
      CheckCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      CheckCuda(cudaFree(w.ptr), "cudaFree");
    }
    w.ptr = nullptr;
    CheckCuda(cudaMalloc(&w.ptr, bytes), "cudaMalloc (cudalibs workspace)");
    w.bytes = bytes;
  }
  return w.ptr;
}

size_t WorkspaceBytes() {
  std::lock_guard<std::mutex> lock(workspace_mutex);
  size_t total = 0;
  for (auto& kv : workspaces) total += kv.second.bytes;
  return total;
}

void FreeWorkspaces() {
  std::lock_guard<std::mutex> lock(workspace_mutex);
  for (auto& kv : workspaces) {
    if (kv.second.ptr != nullptr) {
      cudaSetDevice(kv.first);
      cudaDeviceSynchronize();
      cudaFree(kv.second.ptr);
    }
  }
  workspaces.clear();
}

// ---- tensors --------------------------------------------------------------------------------

void* Data(const ffi::TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

std::vector<int64_t> Shape(const ffi::TensorView& t) {
  return std::vector<int64_t>(t.shape().begin(), t.shape().end());
}

void CheckTensor(const ffi::TensorView& t, const std::string& what, int device) {
  DLDevice d = t.device();
  if (d.device_type != kDLCUDA)
    Fail(what + " is not on a CUDA device (device type " + std::to_string(d.device_type) + ")");
  if (device >= 0 && d.device_id != device)
    Fail(what + " is on cuda:" + std::to_string(d.device_id) + ", the kernel's on cuda:" +
         std::to_string(device));
  DLDataType dt = t.dtype();
  if (dt.code != kDLFloat || dt.bits != 32 || dt.lanes != 1) Fail(what + " is not float32");
}

// a call's tensors, as many as ``names`` (the output last), each float32 and on the output's
// CUDA device; the error names the kernel kind and the tensor
std::vector<ffi::TensorView> Tensors(const ffi::PackedArgs& args, const std::string& kind,
                                     const std::vector<std::string>& names) {
  if (args.size() != static_cast<int>(names.size()))
    Fail(kind + ": " + std::to_string(args.size()) + " arguments, expected " +
         std::to_string(names.size()));
  std::vector<ffi::TensorView> t;
  for (int i = 0; i < args.size(); ++i) t.push_back(args[i].cast<ffi::TensorView>());
  CheckTensor(t.back(), kind + " " + names.back(), -1);
  int device = t.back().device().device_id;
  for (size_t i = 0; i + 1 < t.size(); ++i) CheckTensor(t[i], kind + " " + names[i], device);
  return t;
}

cudaStream_t StreamOf(int device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
}

std::string ShapeKey(std::initializer_list<std::vector<int64_t>> shapes) {
  std::string key;
  for (const auto& s : shapes) {
    for (int64_t d : s) key += std::to_string(d) + ",";
    key += ";";
  }
  return key;
}

// ---- cuBLASLt: dense (x [..., K] times a constant [K, N]) and matmul ([..., M, K] x
// [..., K, N] of equal batch, or [..., N, K] transposed) ---------------------------------------

struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  ~LtPlan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

cublasLtMatrixLayout_t Layout(uint64_t rows, uint64_t cols, int64_t ld, int64_t batch,
                              int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  CheckBlas(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, rows, cols, ld), "cublasLtMatrixLayoutCreate");
  if (batch > 1) {
    int32_t count = static_cast<int32_t>(batch);
    CheckBlas(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                               sizeof(count)), "batch count");
    CheckBlas(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                               &stride, sizeof(stride)), "batch stride");
  }
  return l;
}

// Row-major Y[M, N] = X[M, K] W[K, N] is column-major Y^T = W^T X^T: cuBLASLt's A is the
// right operand (N x K column-major, leading dimension N, or transposed from K x N), its B
// the left one (K x M, leading dimension K), its C/D the output (N x M, leading dimension N).
std::unique_ptr<LtPlan> MakeLtPlan(const Attrs& at, Handles& h, int device, int64_t batch,
                                   int64_t M, int64_t K, int64_t N, bool bias) {
  auto p = std::make_unique<LtPlan>();
  CheckBlas(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  cublasOperation_t ta = at.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  CheckBlas(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
            "transa");
  CheckBlas(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
            "transb");
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  if (bias) epi = at.act == "relu" ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
  else if (at.act == "relu") epi = CUBLASLT_EPILOGUE_RELU;
  CheckBlas(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                           sizeof(epi)), "epilogue");
  // the right operand: [K, N] row-major, or [N, K] row-major read transposed
  p->a = at.trans_b ? Layout(K, N, K, batch, N * K) : Layout(N, K, N, batch, N * K);
  p->b = Layout(K, M, K, batch, M * K);
  p->c = Layout(N, M, N, batch, M * N);
  cublasLtMatmulPreference_t pref = nullptr;
  CheckBlas(cublasLtMatmulPreferenceCreate(&pref), "preference");
  size_t limit = kMaxWorkspace;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &limit,
                                       sizeof(limit));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(h.lt, p->op, p->a, p->b, p->c, p->c, pref, 1,
                                                    &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  CheckBlas(s, "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) Fail("cuBLASLt has no algorithm for this matmul");
  p->algo = result.algo;
  p->workspace = result.workspaceSize;
  return p;
}

class LtKernel {
 public:
  explicit LtKernel(Attrs a) : at_(std::move(a)) {}

  // dense: (x, w[, bias], out); matmul: (a, b, out)
  void operator()(ffi::PackedArgs args) {
    bool dense = at_.kind == "dense";
    std::vector<std::string> names = {"x", "w", "out"};
    if (!dense) names = {"a", "b", "out"};
    else if (at_.bias) names = {"x", "w", "bias", "out"};
    std::vector<ffi::TensorView> t = Tensors(args, at_.kind, names);
    const ffi::TensorView &x = t[0], &w = t[1], &out = t.back();
    int device = out.device().device_id;
    std::vector<int64_t> xs = Shape(x), ws = Shape(w), os = Shape(out);
    int64_t batch = 1, M, K, N;
    if (dense) {
      if (ws.size() != 2 || xs.size() < 2 || os.empty() || xs.back() != ws[0] ||
          os.back() != ws[1])
        Fail("dense: shapes do not match x [..., K], w [K, N], out [..., N]");
      K = ws[0];
      N = ws[1];
      M = 1;
      for (size_t i = 0; i + 1 < xs.size(); ++i) M *= xs[i];
      int64_t rows = 1;  // the output may group its rows otherwise (a reshape absorbed)
      for (size_t i = 0; i + 1 < os.size(); ++i) rows *= os[i];
      if (rows != M) Fail("dense: the output has " + std::to_string(rows) + " rows, x " +
                          std::to_string(M));
    } else {
      size_t r = xs.size();
      if (r < 2 || ws.size() != r || os.size() != r) Fail("matmul: operands of another rank");
      for (size_t i = 0; i + 2 < r; ++i) {
        if (xs[i] != ws[i] || xs[i] != os[i]) Fail("matmul: batch dimensions differ");
        batch *= xs[i];
      }
      M = xs[r - 2];
      K = xs[r - 1];
      N = at_.trans_b ? ws[r - 2] : ws[r - 1];
      if ((at_.trans_b ? ws[r - 1] : ws[r - 2]) != K || os[r - 2] != M || os[r - 1] != N)
        Fail("matmul: inner dimensions do not match");
    }
    const void* bias = nullptr;
    if (dense && at_.bias) {
      const ffi::TensorView& b = t[2];
      if (b.ndim() != 1 || b.shape()[0] != N) Fail("dense: bias is not [N]");
      bias = Data(b);
    }
    Handles& h = HandlesFor(device);
    LtPlan* plan;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::string key = std::to_string(device) + ":" + ShapeKey({xs, ws});
      auto& slot = plans_[key];
      if (!slot) slot = MakeLtPlan(at_, h, device, batch, M, K, N, bias != nullptr);
      plan = slot.get();
    }
    if (bias != nullptr)
      CheckBlas(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                               sizeof(bias)), "bias pointer");
    void* ws_ptr = WorkspaceFor(device, plan->workspace);
    float one = 1.0f, zero = 0.0f;
    CheckBlas(cublasLtMatmul(h.lt, plan->op, &one, Data(w), plan->a, Data(x), plan->b, &zero,
                             Data(out), plan->c, Data(out), plan->c, &plan->algo, ws_ptr,
                             plan->workspace, StreamOf(device)),
              "cublasLtMatmul");
  }

 private:
  Attrs at_;
  std::mutex mutex_;
  std::map<std::string, std::unique_ptr<LtPlan>> plans_;
};

// ---- cuDNN: conv2d (NCHW x OIHW) + bias [+ residual] [+ activation] -------------------------

struct ConvPlan {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  cudnnActivationDescriptor_t act = nullptr;
  cudnnConvolutionFwdAlgo_t algo = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
  size_t workspace = 0;
  bool fused = false;  // cudnnConvolutionBiasActivationForward (ReLU)
  ~ConvPlan() {
    if (act) cudnnDestroyActivationDescriptor(act);
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (bias) cudnnDestroyTensorDescriptor(bias);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
};

cudnnTensorDescriptor_t Nchw(const std::vector<int64_t>& s) {
  cudnnTensorDescriptor_t d = nullptr;
  CheckDnn(cudnnCreateTensorDescriptor(&d), "tensor descriptor");
  CheckDnn(cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, int(s[0]),
                                      int(s[1]), int(s[2]), int(s[3])), "NCHW descriptor");
  return d;
}

std::unique_ptr<ConvPlan> MakeConvPlan(const Attrs& at, Handles& h, const ffi::TensorView& x,
                                       const ffi::TensorView& w, const ffi::TensorView& y) {
  auto p = std::make_unique<ConvPlan>();
  std::vector<int64_t> xs = Shape(x), ws = Shape(w), ys = Shape(y);
  p->x = Nchw(xs);
  p->y = Nchw(ys);
  p->bias = Nchw({1, ys[1], 1, 1});
  CheckDnn(cudnnCreateFilterDescriptor(&p->w), "filter descriptor");
  CheckDnn(cudnnSetFilter4dDescriptor(p->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, int(ws[0]),
                                      int(ws[1]), int(ws[2]), int(ws[3])), "filter");
  CheckDnn(cudnnCreateConvolutionDescriptor(&p->conv), "convolution descriptor");
  CheckDnn(cudnnSetConvolution2dDescriptor(p->conv, at.pad[0], at.pad[1], at.stride[0],
                                           at.stride[1], at.dilation[0], at.dilation[1],
                                           CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
           "convolution");
  CheckDnn(cudnnSetConvolutionGroupCount(p->conv, at.groups), "groups");
  CheckDnn(cudnnSetConvolutionMathType(p->conv, CUDNN_FMA_MATH), "math type");  // no TF32
  int n, c, hh, ww;
  CheckDnn(cudnnGetConvolution2dForwardOutputDim(p->conv, p->x, p->w, &n, &c, &hh, &ww),
           "output shape");
  if (n != ys[0] || c != ys[1] || hh != ys[2] || ww != ys[3])
    Fail("conv2d: the output's shape is not the convolution's");
  p->fused = at.act == "relu";
  if (at.act != "none") {
    cudnnActivationMode_t mode = CUDNN_ACTIVATION_RELU;
    double coef = 0.0;
    if (at.act == "clip") mode = CUDNN_ACTIVATION_CLIPPED_RELU, coef = at.clip_hi;
    else if (at.act == "silu") mode = CUDNN_ACTIVATION_SWISH, coef = 1.0;
    else if (at.act == "sigmoid") mode = CUDNN_ACTIVATION_SIGMOID;
    else if (at.act == "tanh") mode = CUDNN_ACTIVATION_TANH;
    CheckDnn(cudnnCreateActivationDescriptor(&p->act), "activation descriptor");
    CheckDnn(cudnnSetActivationDescriptor(p->act, mode, CUDNN_NOT_PROPAGATE_NAN, coef),
             "activation");
    if (at.act == "silu") CheckDnn(cudnnSetActivationDescriptorSwishBeta(p->act, 1.0), "swish");
  }
  // the fastest algorithm, timed once on these shapes (PyTorch's cudnn.benchmark), among those
  // that need no more than kMaxWorkspace and are numerically plain float32 (FMA math)
  int device = y.device().device_id;
  void* ws_ptr = WorkspaceFor(device, kMaxWorkspace);
  constexpr int kAlgos = 8;
  cudnnConvolutionFwdAlgoPerf_t perf[kAlgos];
  int found = 0;
  CheckDnn(cudnnFindConvolutionForwardAlgorithmEx(h.dnn, p->x, Data(x), p->w, Data(w), p->conv,
                                                  p->y, Data(y), kAlgos, &found, perf, ws_ptr,
                                                  kMaxWorkspace),
           "cudnnFindConvolutionForwardAlgorithmEx");
  bool chosen = false;
  for (int i = 0; i < found && !chosen; ++i) {
    if (perf[i].status == CUDNN_STATUS_SUCCESS && perf[i].memory <= kMaxWorkspace &&
        perf[i].mathType != CUDNN_TENSOR_OP_MATH) {
      p->algo = perf[i].algo;
      p->workspace = perf[i].memory;
      chosen = true;
    }
  }
  if (!chosen) Fail("conv2d: cuDNN found no float32 algorithm for these shapes");
  return p;
}

// Plans by device, attributes and shapes, shared by every kernel of the process: the
// algorithm cuDNN's search picks for a convolution is the same for every module that has it
// (two modules of one graph had searched apart), and searched once. A plan is read only once
// made; each thread calls it with its own handle.
std::mutex conv_plans_mutex;
std::map<std::string, std::shared_ptr<ConvPlan>> conv_plans;

std::string ConvKey(const Attrs& a, int device, const ffi::TensorView& x,
                    const ffi::TensorView& w) {
  std::ostringstream o;
  o << device << ":" << a.stride[0] << "," << a.stride[1] << "," << a.pad[0] << "," << a.pad[1]
    << "," << a.dilation[0] << "," << a.dilation[1] << "," << a.groups << "," << a.act << ","
    << a.clip_hi << ":" << ShapeKey({Shape(x), Shape(w)});
  return o.str();
}

class ConvKernel {
 public:
  explicit ConvKernel(Attrs a) : at_(std::move(a)) {}

  // (x, w, bias[, residual], out)
  void operator()(ffi::PackedArgs args) {
    std::vector<std::string> names = {"x", "weight", "bias", "out"};
    if (at_.residual) names = {"x", "weight", "bias", "residual", "out"};
    std::vector<ffi::TensorView> t = Tensors(args, "conv2d", names);
    const ffi::TensorView &x = t[0], &w = t[1], &b = t[2], &y = t.back();
    int device = y.device().device_id;
    if (x.ndim() != 4 || w.ndim() != 4 || y.ndim() != 4) Fail("conv2d: tensors are not 4-D");
    if (b.ndim() != 1 || b.shape()[0] != y.shape()[1]) Fail("conv2d: bias is not [C_out]");
    const void* res = nullptr;
    if (at_.residual) {
      const ffi::TensorView& r = t[3];
      if (Shape(r) != Shape(y)) Fail("conv2d: the residual's shape is not the output's");
      res = Data(r);
    }
    Handles& h = HandlesFor(device);
    CheckDnn(cudnnSetStream(h.dnn, StreamOf(device)), "cudnnSetStream");
    ConvPlan* p;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::string key = std::to_string(device) + ":" + ShapeKey({Shape(x), Shape(w)});
      auto& slot = plans_[key];
      if (!slot) {
        std::lock_guard<std::mutex> shared(conv_plans_mutex);
        auto& plan = conv_plans[ConvKey(at_, device, x, w)];
        if (!plan) plan = MakeConvPlan(at_, h, x, w, y);
        slot = plan;
      }
      p = slot.get();
    }
    void* ws_ptr = WorkspaceFor(device, p->workspace);
    float one = 1.0f, zero = 0.0f;
    if (p->fused) {  // y = relu(conv(x) + residual + bias) in one call
      CheckDnn(cudnnConvolutionBiasActivationForward(
                   h.dnn, &one, p->x, Data(x), p->w, Data(w), p->conv, p->algo, ws_ptr,
                   p->workspace, res != nullptr ? &one : &zero, p->y,
                   res != nullptr ? const_cast<void*>(res) : Data(y), p->bias, Data(b), p->act,
                   p->y, Data(y)),
               "cudnnConvolutionBiasActivationForward");
      return;
    }
    CheckDnn(cudnnConvolutionForward(h.dnn, &one, p->x, Data(x), p->w, Data(w), p->conv, p->algo,
                                     ws_ptr, p->workspace, &zero, p->y, Data(y)),
             "cudnnConvolutionForward");
    CheckDnn(cudnnAddTensor(h.dnn, &one, p->bias, Data(b), &one, p->y, Data(y)), "bias");
    if (res != nullptr)
      CheckDnn(cudnnAddTensor(h.dnn, &one, p->y, res, &one, p->y, Data(y)), "residual");
    if (p->act != nullptr)
      CheckDnn(cudnnActivationForward(h.dnn, p->act, &one, p->y, Data(y), &zero, p->y, Data(y)),
               "activation");
  }

 private:
  Attrs at_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<ConvPlan>> plans_;
};

// a kernel of type K over ``a`` as a function the executor calls (it owns the kernel)
template <typename K>
ffi::Function Bind(Attrs a) {
  auto k = std::make_shared<K>(std::move(a));
  return ffi::Function::FromPacked([k](ffi::PackedArgs args, ffi::Any* rv) { (*k)(args); });
}

ffi::Function Make(const std::string& name) {
  Attrs a = Parse(name);
  return a.kind == "conv2d" ? Bind<ConvKernel>(std::move(a)) : Bind<LtKernel>(std::move(a));
}

std::string Versions() {
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  return "cublasLt " + std::to_string(cublasLtGetVersion()) + ", cudnn " +
         std::to_string(cudnnGetVersion()) + ", cudart " + std::to_string(rt);
}

// pins ``bytes`` of host memory at ``address`` (a CPU pool that copies to or from a GPU read
// or write it by DMA); unpin undoes it
void Pin(int64_t address, int64_t bytes) {
  CheckCuda(cudaHostRegister(reinterpret_cast<void*>(address), size_t(bytes),
                             cudaHostRegisterDefault), "cudaHostRegister");
}
void Unpin(int64_t address) {
  CheckCuda(cudaHostUnregister(reinterpret_cast<void*>(address)), "cudaHostUnregister");
}

}  // namespace hgrt_cudalibs

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using namespace hgrt_cudalibs;
  refl::GlobalDef()
      .def("hgrt.cudalibs.make", [](ffi::String name) { return Make(std::string(name)); })
      .def("hgrt.cudalibs.parse",
           [](ffi::String name) {
             Attrs a = Parse(std::string(name));
             std::ostringstream o;
             o << a.kind << " bias=" << a.bias << " residual=" << a.residual
               << " trans_b=" << a.trans_b << " act=" << a.act << " clip_hi=" << a.clip_hi
               << " stride=" << a.stride[0] << "x" << a.stride[1] << " pad=" << a.pad[0] << "x"
               << a.pad[1] << " dilation=" << a.dilation[0] << "x" << a.dilation[1]
               << " groups=" << a.groups;
             return ffi::String(o.str());
           })
      .def("hgrt.cudalibs.versions", []() { return ffi::String(Versions()); })
      .def("hgrt.cudalibs.workspace_bytes", []() { return int64_t(WorkspaceBytes()); })
      .def("hgrt.cudalibs.conv_plans",
           []() {
             std::lock_guard<std::mutex> lock(conv_plans_mutex);
             return int64_t(conv_plans.size());
           })
      .def("hgrt.cudalibs.free_workspaces", []() { FreeWorkspaces(); })
      .def("hgrt.cudalibs.pin", Pin)
      .def("hgrt.cudalibs.unpin", Unpin);
}
