// hgrt's oneDNN kernels: conv2d and dense with fused post-ops, weights packed once at build.
//
// A claimed op is called as `fn(x, blob, [residual,] out)`. The blob (a uint8 param) is
// self-describing: a 512-byte header (int64 slots, laid out in providers/onednn/blob.py:
// HEADER_SLOTS, read here through the generated onednn_blob.h), the weights already in the
// layout oneDNN chose at build (`format_tag::any`), then the fp32 bias. Activations are plain
// NCHW (N x C for dense) in and out; the kernel reorders them to and from the layout its
// primitive wants, in per-thread scratch buffers.
//
// Primitives are made on first call and cached per (blob address, thread count): oneDNN fixes
// its thread partition when a primitive is made. The header is compared on every lookup, so a
// new blob at a reused address never runs a stale primitive. Threads follow the calling
// thread's TVM pool (runtime.NumThreads), which hgrt's thread budget sets.
//
// This file: the state every kernel shares, the checks of arguments and headers, the conv2d /
// dense call, and the registration of the global functions (onednn_shim.h lists the others).
#include <omp.h>
#include <xmmintrin.h>
#include <oneapi/dnnl/dnnl_debug.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <cmath>
#include <optional>

#include "onednn_shim.h"

namespace hgrt_onednn {

int64_t DnnlVersion() {
  const dnnl_version_t* v = dnnl_version();
  return v->major * 10000 + v->minor * 100 + v->patch;
}

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& Stream() {
  thread_local dnnl::stream stream(Engine());
  return stream;
}

// Primitives are shared by every thread that calls them (cached per blob or per shapes), so
// none keeps a scratchpad of its own: each is made in user scratchpad mode and every call
// passes its thread's buffer. (In oneDNN's default mode a primitive owns one scratchpad: the
// concat kept its operands' pointers there, and two calls at once read each other's data.)
dnnl::primitive_attr UserScratchpad(dnnl::primitive_attr attr) {
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::reorder::primitive_desc ReorderDesc(const memory::desc& from, const memory::desc& to) {
  return dnnl::reorder::primitive_desc(Engine(), from, Engine(), to, UserScratchpad());
}

// ---- checks on arguments ------------------------------------------------------------------

void CheckTensor(const ffi::TensorView& t, const char* what, DLDataType dtype, int64_t numel) {
  if (t.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: " << what << " is not on a CPU";
  }
  if (t.dtype().code != dtype.code || t.dtype().bits != dtype.bits || !t.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: " << what << " must be contiguous "
                              << (dtype.code == kDLFloat ? "float32"
                                  : dtype.code == kDLInt ? "int8"
                                                         : "uint8");
  }
  if (numel >= 0 && t.numel() != numel) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: " << what << " has " << t.numel()
                              << " elements, expected " << numel;
  }
}

// What a header asks to compute, checked at pack and at run: known post-ops and algorithm,
// and a Winograd convolution Winograd can compute.
void CheckOps(const Header& h) {
  for (int k = 0; k < kMaxPostOps; ++k) {
    int64_t kind = h[kPost0 + 3 * k];
    if (kind < kNoPost || kind > kQuantU8) {
      TVM_FFI_THROW(ValueError) << "oneDNN: unknown post-op " << kind << " in the header";
    }
  }
  if (h[kAlgo] != kDirect && (h[kAlgo] != kWinograd || h[kKind] != kConv2d)) {
    TVM_FFI_THROW(ValueError) << "oneDNN: unknown convolution algorithm " << h[kAlgo]
                              << " in the header";
  }
  if (h.winograd() && h.has_eltwise()) {
    TVM_FFI_THROW(ValueError) << "oneDNN: a Winograd convolution takes relu, clip and sum "
                                 "post-ops only";
  }
  if (h[kSrcDT] != kFloat32 && h[kSrcDT] != kUint8) {
    TVM_FFI_THROW(ValueError) << "oneDNN: unknown input type " << h[kSrcDT] << " in the header";
  }
  double scale = AsDouble(h[kSrcScale]);
  if (h.int8() && (h.winograd() || h[kSrcZP] < 0 || h[kSrcZP] > 255 || !(scale > 0) ||
                   !std::isfinite(static_cast<float>(1.0 / scale)))) {
    TVM_FFI_THROW(ValueError) << "oneDNN: bad int8 grid in the header (scale " << scale
                              << ", zero point " << h[kSrcZP] << ", a direct algorithm)";
  }
  if (h.winograd() && WinogradProblem(h)) {
    TVM_FFI_THROW(ValueError) << "oneDNN: " << WinogradProblem(h);
  }
}

const Header& ReadHeader(const ffi::TensorView& blob) {
  CheckTensor(blob, "packed weights", kU8, -1);
  if (blob.numel() < kHeaderBytes) TVM_FFI_THROW(ValueError) << "oneDNN: packed weights too short";
  const Header& h = *static_cast<const Header*>(DataOf(blob));
  if (h[kMagicSlot] == 0) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the packed weights are zeros: load the params "
                                 "(load_params / share_params) before running";
  }
  if (h[kMagicSlot] == kMagic) CheckOps(h);  // (a foreign header: the version says so)
  if (h[kMagicSlot] != kMagic ||
      h[kVersionSlot] != h.version()) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the weights are not packed by this hgrt (header "
                                 "version mismatch); rebuild the model";
  }
  // each field within the blob before any sum (a damaged header must not wrap around)
  int64_t n = blob.numel();
  if (h[kOC] < 1 || h[kOC] > n / 4 || h[kWeiOffset] < kHeaderBytes || h[kWeiOffset] > n ||
      h[kWeiBytes] < 0 || h[kWeiBytes] > n || h[kBiasOffset] < 0 || h[kBiasOffset] > n ||
      h[kWeiOffset] + h[kWeiBytes] > h[kBiasOffset] || h[kBiasOffset] + h.tail_bytes() > n) {
    TVM_FFI_THROW(ValueError) << "oneDNN: packed weights truncated";
  }
  if (h.pooled() && (h[kKind] != kConv2d || h[kPoolKW] < 1 || h[kPoolSH] < 1 ||
                     h[kPoolSW] < 1 || h[kPoolOH] < 1 || h[kPoolOW] < 1 || h[kPoolPadT] < 0 ||
                     h[kPoolPadL] < 0 || h[kPoolPadB] < 0 || h[kPoolPadR] < 0)) {
    TVM_FFI_THROW(ValueError) << "oneDNN: bad max pool in the packed weights' header";
  }
  if (h[kDnnlVersion] != DnnlVersion()) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the weights were packed by oneDNN " << h[kDnnlVersion]
                              << ", this is " << DnnlVersion()
                              << "; rebuild the model here, or with kernels=\"tvm\"";
  }
  return h;
}

// ---- threads and denormals ------------------------------------------------------------------

// Denormals flushed to zero, as TVM's thread pool does for its kernels: random-weight models
// make denormals, and without this a resnet50 conv on one thread took 5 s instead of 1 ms.
// The calling thread's mode is put back after the call; oneDNN's own OpenMP threads keep it.
constexpr unsigned kFlushDenormals = 0x8040;  // MXCSR: flush-to-zero | denormals-are-zero

FlushDenormals::FlushDenormals(int threads) : saved_(_mm_getcsr()) {
  _mm_setcsr(saved_ | kFlushDenormals);
  thread_local int team = 1;  // the OpenMP threads of this caller already flushing
  if (threads > team) {
#pragma omp parallel num_threads(threads)
    _mm_setcsr(_mm_getcsr() | kFlushDenormals);
    team = threads;
  }
}

FlushDenormals::~FlushDenormals() { _mm_setcsr(saved_); }

int BudgetThreads() {
  static std::optional<ffi::Function> num_threads = ffi::Function::GetGlobal("runtime.NumThreads");
  int n = num_threads ? (*num_threads)().cast<int>() : omp_get_max_threads();
  return n > 0 ? n : 1;
}

// The calling thread's budget, OpenMP set to it (oneDNN's choices depend on it): the threads.
int UseBudgetThreads() {
  int threads = BudgetThreads();
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
  return threads;
}

// ---- the conv2d / dense call ----------------------------------------------------------------

// A dense layer's rows in chunks (Entry::row_chunk), each chunk's rows of the input and the
// output (which holds the residual already, for a sum post-op) read and written in place.
void RunChunks(Entry& e, StageArgs& args, Scratch& s, dnnl::stream& stream, char* src, char* dst,
               char* weights) {
  const Header& h = e.layout;
  int64_t rows = h[kN], in_row = 4 * h[kIC], out_row = 4 * h[kOC];
  void* pad = s.pad.get(e.chunk_pad.get_size() + 64);
  for (int64_t m = 0; m < rows; m += e.row_chunk) {
    bool rest = rows - m < e.row_chunk;
    Args& a = args[rest ? kRest : kConv];
    a.Set(DNNL_ARG_SRC, rest ? e.rest_src : e.chunk_src, src + m * in_row);
    a.Set(DNNL_ARG_WEIGHTS, e.wei, weights + h[kWeiOffset]);
    a.Set(DNNL_ARG_BIAS, e.bias, weights + h[kBiasOffset]);
    a.Set(DNNL_ARG_DST, rest ? e.rest_dst : e.chunk_dst, dst + m * out_row);
    a.Set(DNNL_ARG_SCRATCHPAD, e.chunk_pad, pad);
    (rest ? e.rest_prim : e.chunk_prim).execute(stream, a.map());
  }
}

void Run(const ffi::TensorView& x, const ffi::TensorView& blob,
         const ffi::TensorView* residual, const ffi::TensorView& out) {
  const Header& h = ReadHeader(blob);
  if (h.has_sum() != (residual != nullptr)) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: the residual operand "
                              << (residual ? "is not expected" : "is missing");
  }
  int threads = UseBudgetThreads();
  FlushDenormals flush(threads);
  char* base = static_cast<char*>(DataOf(blob));
  std::shared_ptr<Entry> e = GetEntry(base, threads);
  CheckTensor(x, "input", kF32, static_cast<int64_t>(e->src_user.get_size() / 4));
  CheckTensor(out, "output", kF32, static_cast<int64_t>(e->dst_user.get_size() / 4));
  if (residual) {
    CheckTensor(*residual, "residual", kF32, static_cast<int64_t>(e->res_user.get_size() / 4));
  }
  thread_local Scratch s;
  dnnl::stream& stream = Stream();
  StageArgs& args = BoundArgs(e);
  if (h.winograd()) {
    RunWinograd(*e, args[kConv], s, x, residual, out, base, threads);
    return;
  }
  void* src = e->reorder_src ? s.src.get(e->src.get_size()) : DataOf(x);
  void* dst = e->reorder_dst || h.pooled() ? s.dst.get(e->dst.get_size()) : DataOf(out);
  if (e->reorder_src) {
    Args& a = args[kToSrc];
    a.Set(DNNL_ARG_FROM, e->src_user, DataOf(x));
    a.Set(DNNL_ARG_TO, e->src, src);
    a.Set(DNNL_ARG_SCRATCHPAD, e->to_src_pad, s.reorder_pad.get(e->to_src_pad.get_size() + 64));
    if (h.int8()) {  // onto the input's grid
      a.Set(DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, e->scale_1, &e->src_scale);
      a.Set(DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST, e->zp_1, &e->src_zp);
    }
    e->to_src.execute(stream, a.map());
  }
  // the output's buffer may hold the residual (the plan wrote the output over it, node attr
  // `inplace`): a sum post-op adds into it; else a residual there is copied out first
  bool twin = residual && DataOf(*residual) == dst && e->residual_arg && InPlaceTwin(*e);
  Args& conv = args[twin ? kConvInPlace : kConv];
  auto copied_out = [&](void* res) {
    return res == dst ? std::memcpy(s.res.get(e->res_user.get_size()), res, e->res_user.get_size())
                      : res;
  };
  if (e->residual_arg && !twin) {  // read by the binary post-op
    conv.Set(e->residual_arg, e->res_user, copied_out(DataOf(*residual)));
  } else if (e->reorder_res) {
    Args& a = args[kResidual];
    a.Set(DNNL_ARG_FROM, e->res_user, copied_out(DataOf(*residual)));
    a.Set(DNNL_ARG_TO, e->dst, dst);
    a.Set(DNNL_ARG_SCRATCHPAD, e->residual_pad,
          s.reorder_pad.get(e->residual_pad.get_size() + 64));
    e->residual_to_dst.execute(stream, a.map());
  } else if (residual && DataOf(*residual) != dst) {  // same layout: copy
    std::memcpy(dst, DataOf(*residual), e->dst.get_size());
  }
  char* weights = e->repacked ? e->repacked->base : base;
  if (e->row_chunk > 0) {
    RunChunks(*e, args, s, stream, static_cast<char*>(src), static_cast<char*>(dst), weights);
  } else {
    conv.Set(DNNL_ARG_SRC, e->src, src);
    conv.Set(DNNL_ARG_WEIGHTS, e->wei, weights + e->layout[kWeiOffset]);
    conv.Set(DNNL_ARG_BIAS, e->bias, weights + e->layout[kBiasOffset]);
    conv.Set(DNNL_ARG_DST, e->dst, dst);
    if (h.int8()) {  // the weights' scales follow the bias
      conv.Set(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, e->wei_scales,
               weights + e->layout[kBiasOffset] + 4 * h[kOC]);
    }
    const memory::desc& pad = twin ? e->in_place_scratch : e->scratch;
    conv.Set(DNNL_ARG_SCRATCHPAD, pad, s.pad.get(pad.get_size() + 64));
    (twin ? e->in_place : e->prim).execute(stream, conv.map());
  }
  if (e->own_act != kNoPost) {  // the last post-op, in place, before any pool or reorder
    stream.wait();
    OwnActivation(e->own_act, static_cast<float*>(dst), static_cast<int64_t>(e->dst.get_size() / 4),
                  threads);
  }
  if (h.pooled()) {
    void* pooled = e->reorder_dst ? s.pooled.get(e->pooled.get_size()) : DataOf(out);
    Args& a = args[kPool];
    a.Set(DNNL_ARG_SRC, e->dst, dst);
    a.Set(DNNL_ARG_DST, e->pooled, pooled);
    a.Set(DNNL_ARG_SCRATCHPAD, e->pool_scratch,
          s.pool_pad.get(e->pool_scratch.get_size() + 64));
    e->pool.execute(stream, a.map());
    dst = pooled;
  }
  if (e->reorder_dst) {
    Args& a = args[kFromDst];
    a.Set(DNNL_ARG_FROM, h.pooled() ? e->pooled : e->dst, dst);
    a.Set(DNNL_ARG_TO, e->dst_user, DataOf(out));
    a.Set(DNNL_ARG_SCRATCHPAD, e->from_dst_pad,
          s.reorder_pad.get(e->from_dst_pad.get_size() + 64));
    e->from_dst.execute(stream, a.map());
  }
  stream.wait();
}

std::string IsaName(int64_t isa) {
  switch (static_cast<dnnl::cpu_isa>(isa)) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2_vnni_2: return "avx2_vnni_2";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_fp16: return "avx512_core_fp16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
    default: return "isa_" + std::to_string(isa);
  }
}

// Which implementation oneDNN runs for a packed blob (e.g. "brg:avx512_core"), for reports.
std::string Implementation(const ffi::TensorView& blob) {
  const Header& h = ReadHeader(blob);
  int64_t chunk = RowChunk(h), own = OwnActivation(h);
  return (h.winograd() ? "winograd_4x4_3x3+" : "") + std::string(RunDesc(h).impl_info_str()) +
         (chunk > 0 ? "+rows_of_" + std::to_string(chunk) : "") +
         (own == kSwish ? "+hgrt_swish" : own == kGeluTanh ? "+hgrt_gelu_tanh" : "");
}

// The format of the blob header this library was built with, a `name=value` line per number
// (providers/onednn/blob.py's blob_format(): the test of the format compares the two).
std::string BlobFormat() {
  std::string out;
  for (const BlobFormatEntry& e : kBlobFormat) {
    out += std::string(e.name) + "=" + std::to_string(e.value) + "\n";
  }
  return out;
}

template <typename F>
auto Catch(F f) -> decltype(f()) {
  try {
    return f();
  } catch (const dnnl::error& e) {
    TVM_FFI_THROW(RuntimeError) << "oneDNN: " << e.what();
  }
  __builtin_unreachable();
}

void RunPacked(ffi::PackedArgs args, ffi::Any* rv) {
  Catch([&] {
    if (args.size() == 3) {
      Run(args[0].cast<ffi::TensorView>(), args[1].cast<ffi::TensorView>(), nullptr,
          args[2].cast<ffi::TensorView>());
    } else if (args.size() == 4) {
      ffi::TensorView residual = args[2].cast<ffi::TensorView>();
      Run(args[0].cast<ffi::TensorView>(), args[1].cast<ffi::TensorView>(), &residual,
          args[3].cast<ffi::TensorView>());
    } else {
      TVM_FFI_THROW(TypeError) << "oneDNN kernel: expected (x, packed, [residual,] out), got "
                               << args.size() << " arguments";
    }
  });
}

}  // namespace hgrt_onednn

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  using namespace hgrt_onednn;
  refl::GlobalDef()
      .def_packed("hgrt.onednn.conv2d", RunPacked)
      .def_packed("hgrt.onednn.dense", RunPacked)
      .def("hgrt.onednn.pool",
           [](ffi::TensorView x, ffi::TensorView attrs, ffi::TensorView out) {
             Catch([&] { Pool(x, attrs, out); });
           })
      .def("hgrt.onednn.shuffle",
           [](ffi::TensorView x, ffi::TensorView attrs, ffi::TensorView out) {
             Catch([&] { Shuffle(x, attrs, out); });
           })
      .def("hgrt.onednn.lrn",
           [](ffi::TensorView x, ffi::TensorView attrs, ffi::TensorView out) {
             Catch([&] { Lrn(x, attrs, out); });
           })
      .def("hgrt.onednn.affine",
           [](ffi::TensorView x, ffi::TensorView params, ffi::TensorView out) {
             Catch([&] { Affine(x, params, out); });
           })
      .def("hgrt.onednn.gate",
           [](ffi::TensorView x, ffi::TensorView g, ffi::TensorView out) {
             Catch([&] { Gate(x, g, out); });
           })
      .def("hgrt.onednn.layer_norm",
           [](ffi::TensorView x, ffi::TensorView params, ffi::TensorView out) {
             Catch([&] { LayerNorm(x, params, out); });
           })
      .def("hgrt.onednn.softmax",
           [](ffi::TensorView x, ffi::TensorView params, ffi::TensorView out) {
             Catch([&] { Softmax(x, params, out); });
           })
      .def_packed("hgrt.onednn.matmul",
                  [](ffi::PackedArgs args, ffi::Any*) { Catch([&] { Matmul(args); }); })
      .def("hgrt.onednn.to_nchw",
           [](ffi::TensorView x, ffi::TensorView out) { Catch([&] { ToNchw(x, out); }); })
      .def_packed("hgrt.onednn.concat",
                  [](ffi::PackedArgs args, ffi::Any*) { Catch([&] { Concat(args); }); })
      .def_packed("hgrt.onednn.split",
                  [](ffi::PackedArgs args, ffi::Any*) { Catch([&] { Split(args); }); })
      .def("hgrt.onednn.forget", Forget)
      .def("hgrt.onednn.cached_entries", CachedEntries)
      .def("hgrt.onednn.packed_bytes",
           [](ffi::TensorView h) { return Catch([&] { return PackedBytes(h); }); })
      .def("hgrt.onednn.pack",
           [](ffi::TensorView h, ffi::TensorView w, ffi::TensorView b, ffi::TensorView out) {
             Catch([&] { Pack(h, w, b, out); });
           })
      .def("hgrt.onednn.implementation", [](ffi::TensorView b) {
        return Catch([&] { return ffi::String(Implementation(b)); });
      })
      .def("hgrt.onednn.isa", []() {
        return ffi::String(IsaName(static_cast<int64_t>(dnnl::get_effective_cpu_isa())));
      })
      .def("hgrt.onednn.version", []() { return DnnlVersion(); })
      .def("hgrt.onednn.blob_format", []() { return ffi::String(BlobFormat()); })
      .def("hgrt.onednn.nhwc_tag", []() { return static_cast<int64_t>(dnnl_nhwc); })
      .def("hgrt.onednn.blocked_tag", []() {  // "block tag": what this CPU's oneDNN may use
        int64_t block = HasIsa(dnnl::cpu_isa::avx512_core) ? 16
                        : HasIsa(dnnl::cpu_isa::avx2)      ? 8
                                                           : 0;
        int64_t tag = block == 16 ? dnnl_nChw16c : block == 8 ? dnnl_nChw8c : 0;
        return ffi::String(std::to_string(block) + " " + std::to_string(tag));
      })
      .def("hgrt.onednn.layout_name", [](int64_t tag) {
        return ffi::String(dnnl_fmt_tag2str(static_cast<dnnl_format_tag_t>(tag)));
      });
}
