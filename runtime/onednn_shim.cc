// hgrt's oneDNN kernels: conv2d and dense with fused post-ops, weights packed once at build.
//
// A claimed op is called as `fn(x, blob, [residual,] out)`. The blob (a uint8 param) is
// self-describing: a 512-byte header (int64 slots, laid out in relay_passes/claim_onednn.py:
// HEADER_SLOTS), the weights already in the layout oneDNN chose at build (`format_tag::any`),
// then the fp32 bias. Activations are plain NCHW (N x C for dense) in and out; the kernel
// reorders them to and from the layout its primitive wants, in per-thread scratch buffers.
//
// Primitives are made on first call and cached per (blob address, thread count): oneDNN fixes
// its thread partition when a primitive is made. The header is compared on every lookup, so a
// new blob at a reused address never runs a stale primitive. Threads follow the calling
// thread's TVM pool (runtime.NumThreads), which hgrt's thread budget sets.
#include <omp.h>
#include <xmmintrin.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_debug.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>
#include <utility>

namespace hgrt_onednn {

namespace ffi = tvm::ffi;
using dnnl::memory;
using Tag = memory::format_tag;

constexpr int64_t kMagic = 0x4c4e4e4454524748;  // "HGRTDNNL", little endian
// 4 and 5: the checksum covers the header too (2 and 3 summed the weights only, so a header
// edited to another layout of the same bytes ran with wrong numbers)
constexpr int64_t kVersion = 4;
constexpr int64_t kVersionWinograd = 5;  // a Winograd blob: an older shim refuses it
constexpr int64_t kHeaderBytes = 512;
constexpr int kSlots = kHeaderBytes / 8;
constexpr int kMaxPostOps = 3;

// Header slots; relay_passes/claim_onednn.py HEADER_SLOTS names the same positions.
enum Slot : int {
  kMagicSlot, kVersionSlot, kKind, kN, kIC, kIH, kIW, kOC, kOH, kOW, kKH, kKW, kSH, kSW,
  kPadT, kPadL, kPadB, kPadR, kDilH, kDilW, kGroups, kPost0,  // 3 slots per post-op
  kWeiTag = kPost0 + 3 * kMaxPostOps, kWeiOffset, kWeiBytes, kBiasOffset, kIsa, kDnnlVersion,
  kSrcTag, kDstTag, kResTag,  // activations: 0 plain NCHW, else a tag (NHWC)
  kChecksum,  // of the header (this slot as 0), packed weights and bias: new weights, new header
  // a max pool of the convolution's result (kPoolKH 0: none), and the pool's output H, W
  kPoolKH, kPoolKW, kPoolSH, kPoolSW, kPoolPadT, kPoolPadL, kPoolPadB, kPoolPadR, kPoolOH,
  kPoolOW,
  kAlgo,  // how a convolution computes: 0 directly (oneDNN's convolution), 1 Winograd
  kUsedSlots
};
static_assert(kUsedSlots <= kSlots, "header overflows its bytes");
enum Kind : int64_t { kConv2d = 1, kDense = 2 };
enum PostOp : int64_t { kNoPost = 0, kRelu = 1, kClip = 2, kSum = 3 };
enum Algo : int64_t { kDirect = 0, kWinograd = 1 };

struct Header {
  int64_t v[kSlots];
  int64_t operator[](int i) const { return v[i]; }
  int64_t& operator[](int i) { return v[i]; }
  bool pooled() const { return v[kPoolKH] > 0; }
  // F(4x4, 3x3) Winograd: a 3x3 stride-1 convolution of NHWC activations, its weights packed
  // as the 36 matrices (C x K) of the Winograd domain (see the Winograd section below)
  bool winograd() const { return v[kKind] == kConv2d && v[kAlgo] == kWinograd; }
  bool has_sum() const {
    for (int k = 0; k < kMaxPostOps; ++k) {
      if (v[kPost0 + 3 * k] == kSum) return true;
    }
    return false;
  }
};

int64_t Round64(int64_t n) { return (n + 63) / 64 * 64; }

double AsDouble(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

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
dnnl::primitive_attr UserScratchpad(dnnl::primitive_attr attr = dnnl::primitive_attr()) {
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

dnnl::reorder::primitive_desc ReorderDesc(const memory::desc& from, const memory::desc& to) {
  return dnnl::reorder::primitive_desc(Engine(), from, Engine(), to, UserScratchpad());
}

// ---- descriptors from a header ------------------------------------------------------------

memory::dims WeightDims(const Header& h) {
  if (h[kKind] == kDense) return {h[kOC], h[kIC]};
  if (h.winograd()) return {36, h[kIC], h[kOC]};
  if (h[kGroups] > 1) {
    int64_t g = h[kGroups];
    return {g, h[kOC] / g, h[kIC] / g, h[kKH], h[kKW]};
  }
  return {h[kOC], h[kIC], h[kKH], h[kKW]};
}

memory::desc PlainWeights(const Header& h) {
  Tag tag = h[kKind] == kDense ? Tag::ab
            : h.winograd()     ? Tag::abc
                               : (h[kGroups] > 1 ? Tag::goihw : Tag::oihw);
  return memory::desc(WeightDims(h), memory::data_type::f32, tag);
}

memory::dims SrcDims(const Header& h) {
  if (h[kKind] == kDense) return {h[kN], h[kIC]};
  return {h[kN], h[kIC], h[kIH], h[kIW]};
}

memory::dims DstDims(const Header& h) {
  if (h[kKind] == kDense) return {h[kN], h[kOC]};
  return {h[kN], h[kOC], h[kOH], h[kOW]};
}

// What the kernel writes: the convolution's result, or the max pool's of it.
memory::dims OutDims(const Header& h) {
  if (!h.pooled()) return DstDims(h);
  return {h[kN], h[kOC], h[kPoolOH], h[kPoolOW]};
}

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

memory::desc WithTag(const memory::dims& dims, int64_t tag) {
  dnnl_memory_desc_t md = nullptr;
  dnnl_status_t st = dnnl_memory_desc_create_with_tag(
      &md, static_cast<int>(dims.size()), dims.data(), dnnl_f32,
      static_cast<dnnl_format_tag_t>(tag));
  if (st != dnnl_success) {
    TVM_FFI_THROW(RuntimeError) << "oneDNN: layout " << tag << " does not fit a tensor of "
                                << dims.size() << " dimensions";
  }
  return memory::desc(md);
}

memory::desc WeightsWithTag(const Header& h, int64_t tag) { return WithTag(WeightDims(h), tag); }

// An activation as the graph holds it: plain NCHW (N x C for dense), or a blocked layout that
// a oneDNN kernel hands the next one (tag > 0).
memory::desc Activation(const memory::dims& dims, int64_t tag) {
  if (tag > 0) return WithTag(dims, tag);
  return memory::desc(dims, memory::data_type::f32, dims.size() == 2 ? Tag::ab : Tag::nchw);
}

// The residual of a convolution whose output layout is fixed (NHWC between oneDNN kernels) and
// arrives in it is read by a binary-add post-op, in place; else it is first put into the output
// buffer, where a sum post-op adds to it. (That copy, one thread, cost resnet50's 64->256
// 1x1 convolutions 2x: 660 vs 363 us, AVX-512, 2 threads.)
bool BinaryResidual(const Header& h) {
  return h[kKind] == kConv2d && h[kSrcTag] > 0 && h[kDstTag] > 0 && h[kResTag] == h[kDstTag];
}

// `in_place`: the output buffer holds the residual already (the memory plan put the output
// in the residual's bytes), so a sum post-op adds into it, whatever the layout.
dnnl::primitive_attr Attributes(const Header& h, bool in_place = false) {
  dnnl::post_ops ops;
  for (int k = 0; k < kMaxPostOps; ++k) {
    int64_t kind = h[kPost0 + 3 * k];
    float alpha = static_cast<float>(AsDouble(h[kPost0 + 3 * k + 1]));
    float beta = static_cast<float>(AsDouble(h[kPost0 + 3 * k + 2]));
    if (kind == kRelu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    if (kind == kClip) ops.append_eltwise(dnnl::algorithm::eltwise_clip, alpha, beta);
    if (kind == kSum && BinaryResidual(h) && !in_place) {
      ops.append_binary(dnnl::algorithm::binary_add, WithTag(DstDims(h), h[kDstTag]));
    } else if (kind == kSum) {
      ops.append_sum(1.f);
    }
  }
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// oneDNN's inference pooling of `src` into `dst` (which may be `any`); dilations oneDNN's (0:
// none). The bottom and right pads grow to what the output's size needs (TVM's ceil_mode);
// the scratchpad is the caller's.
dnnl::pooling_forward::primitive_desc PoolDesc(dnnl::algorithm algo, const memory::desc& src,
                                               const memory::desc& dst,
                                               const memory::dims& kernel,
                                               const memory::dims& strides,
                                               const memory::dims& dil, const memory::dims& left,
                                               memory::dims right) {
  memory::dims in = src.get_dims(), out = dst.get_dims();
  for (int d = 0; d < 2; ++d) {
    int64_t need = (out[2 + d] - 1) * strides[d] + (kernel[d] - 1) * (dil[d] + 1) + 1 -
                   in[2 + d] - left[d];
    right[d] = std::max(right[d], need);
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return dnnl::pooling_forward::primitive_desc(Engine(), dnnl::prop_kind::forward_inference, algo,
                                               src, dst, strides, kernel, dil, left, right, attr);
}

// The primitive for `h` with weights `wei` (format_tag::any at build, the packed tag at run).
// Activations the graph holds in a layout (tag > 0: NHWC between oneDNN kernels and the TVM
// ops that have an NHWC form) are read and written in it; plain ones are left to oneDNN (`any`)
// and the kernel reorders them: forcing plain NCHW makes oneDNN fall back to im2col (gemm:jit).
// A plain input leaves the output's layout to oneDNN too (then reordered to the graph's): the
// first convolution of a model (3 channels) took 443 us writing NHWC, 240 us this way.
dnnl::primitive_desc MakeDesc(const Header& h, const memory::desc& wei, bool in_place = false) {
  auto any = [](memory::dims d) { return memory::desc(d, memory::data_type::f32, Tag::any); };
  auto conv_io = [&](memory::dims d, int64_t tag) { return tag > 0 ? WithTag(d, tag) : any(d); };
  memory::desc bias({h[kOC]}, memory::data_type::f32, Tag::a);
  auto kind = dnnl::prop_kind::forward_inference;
  if (h.winograd()) {  // the 36 products of the Winograd domain, one batched matmul
    int64_t tiles = WinogradRows(h);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return dnnl::matmul::primitive_desc(
        Engine(), memory::desc({36, tiles, h[kIC]}, memory::data_type::f32, Tag::abc), wei,
        memory::desc({36, tiles, h[kOC]}, memory::data_type::f32, Tag::abc), attr);
  }
  if (h[kKind] == kDense) {
    return dnnl::inner_product_forward::primitive_desc(Engine(), kind, any(SrcDims(h)), wei, bias,
                                                       any(DstDims(h)), Attributes(h, in_place));
  }
  if (h[kKind] != kConv2d) TVM_FFI_THROW(RuntimeError) << "oneDNN: unknown op kind " << h[kKind];
  return dnnl::convolution_forward::primitive_desc(
      Engine(), kind, dnnl::algorithm::convolution_direct, conv_io(SrcDims(h), h[kSrcTag]), wei,
      bias, conv_io(DstDims(h), h[kSrcTag] > 0 ? h[kDstTag] : 0), {h[kSH], h[kSW]},
      {h[kDilH] - 1, h[kDilW] - 1}, {h[kPadT], h[kPadL]}, {h[kPadB], h[kPadR]},
      Attributes(h, in_place));
}

// The format tag whose layout is exactly `md` (0: none is). Stored in the header, so the run
// time rebuilds the packed layout without serializing a memory descriptor.
int64_t FindTag(const memory::desc& md) {
  memory::dims dims = md.get_dims();
  for (int t = static_cast<int>(dnnl_a); t < static_cast<int>(dnnl_format_tag_last); ++t) {
    dnnl_memory_desc_t c = nullptr;
    if (dnnl_memory_desc_create_with_tag(&c, static_cast<int>(dims.size()), dims.data(), dnnl_f32,
                                         static_cast<dnnl_format_tag_t>(t)) != dnnl_success) {
      continue;
    }
    bool same = dnnl_memory_desc_equal(c, md.get()) != 0;
    dnnl_memory_desc_destroy(c);
    if (same) return t;
  }
  return 0;
}

// ---- checks on arguments ------------------------------------------------------------------

void* DataOf(const ffi::TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

void CheckTensor(const ffi::TensorView& t, const char* what, DLDataType dtype, int64_t numel) {
  if (t.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: " << what << " is not on a CPU";
  }
  if (t.dtype().code != dtype.code || t.dtype().bits != dtype.bits || !t.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: " << what << " must be contiguous "
                              << (dtype.code == kDLFloat ? "float32" : "uint8");
  }
  if (numel >= 0 && t.numel() != numel) {
    TVM_FFI_THROW(ValueError) << "oneDNN kernel: " << what << " has " << t.numel()
                              << " elements, expected " << numel;
  }
}

const DLDataType kF32{kDLFloat, 32, 1};
const DLDataType kU8{kDLUInt, 8, 1};

// What a header asks to compute, checked at pack and at run: known post-ops and algorithm,
// and a Winograd convolution Winograd can compute.
void CheckOps(const Header& h) {
  for (int k = 0; k < kMaxPostOps; ++k) {
    int64_t kind = h[kPost0 + 3 * k];
    if (kind != kNoPost && kind != kRelu && kind != kClip && kind != kSum) {
      TVM_FFI_THROW(ValueError) << "oneDNN: unknown post-op " << kind << " in the header";
    }
  }
  if (h[kAlgo] != kDirect && (h[kAlgo] != kWinograd || h[kKind] != kConv2d)) {
    TVM_FFI_THROW(ValueError) << "oneDNN: unknown convolution algorithm " << h[kAlgo]
                              << " in the header";
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
      h[kVersionSlot] != (h[kAlgo] == kWinograd ? kVersionWinograd : kVersion)) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the weights are not packed by this hgrt (header "
                                 "version mismatch); rebuild the model";
  }
  // each field within the blob before any sum (a damaged header must not wrap around)
  int64_t n = blob.numel();
  if (h[kOC] < 1 || h[kOC] > n / 4 || h[kWeiOffset] < kHeaderBytes || h[kWeiOffset] > n ||
      h[kWeiBytes] < 0 || h[kWeiBytes] > n || h[kBiasOffset] < 0 || h[kBiasOffset] > n ||
      h[kWeiOffset] + h[kWeiBytes] > h[kBiasOffset] || h[kBiasOffset] + 4 * h[kOC] > n) {
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

}  // namespace hgrt_onednn

namespace hgrt_onednn {

// ---- packing: at build, and again on another CPU ------------------------------------------

Header ReadPlainHeader(const ffi::TensorView& header) {
  CheckTensor(header, "header", DLDataType{kDLInt, 64, 1}, kSlots);
  Header h;
  std::memcpy(&h, DataOf(header), sizeof(Header));
  CheckOps(h);
  return h;
}

// Fills the header's layout slots (tag, offsets, ISA) for this machine.
Header Layout(Header h) {
  memory::desc any(WeightDims(h), memory::data_type::f32, Tag::any);
  dnnl::primitive_desc pd = MakeDesc(h, any);
  memory::desc chosen = pd.weights_desc();
  int64_t tag = FindTag(chosen);
  memory::desc plain = PlainWeights(h);
  // Winograd's matmul on AVX-512 pads its weights' output channels to 64 (densenet121's 32:
  // twice the bytes); plain weights ran as fast there (brg:avx512_core either way, 2 threads:
  // [36, 182 tiles, 128] x [36, 128, 32] 245 vs 248 us, 64 -> 16 37 vs 37, 64 -> 96 35 vs 38)
  // and keep their bytes. (Where nothing is padded the chosen layout stays: 512 -> 512 on 4
  // tiles ran 1656 us blocked, 2987 plain.)
  bool padded = h.winograd() && chosen.get_size() > plain.get_size();
  if (tag == 0 || padded) {  // no tag names the layout: plain weights (correct, maybe slower)
    tag = FindTag(plain);
    chosen = MakeDesc(h, plain).weights_desc();
  }
  h[kWeiTag] = tag;
  h[kVersionSlot] = h.winograd() ? kVersionWinograd : kVersion;
  h[kWeiOffset] = kHeaderBytes;
  h[kWeiBytes] = static_cast<int64_t>(chosen.get_size());
  h[kBiasOffset] = kHeaderBytes + Round64(h[kWeiBytes]);
  h[kIsa] = static_cast<int64_t>(dnnl::get_effective_cpu_isa());
  h[kDnnlVersion] = DnnlVersion();
  return h;
}

// Weights packed in another layout than the one oneDNN picks here (another ISA; or another
// thread count: brgconv_1x1 blocks by it) are re-packed once into that layout, in memory of
// their own: the params stay as shipped. (Forcing the packed layout instead can leave only
// oneDNN's reference kernel: 5 s for a resnet50 1x1 conv.) The header carries a checksum of
// the packed bytes, so new weights at the same address (load_params) make another header and
// are re-packed again, never misread.
struct Repacked {
  Header layout;  // the blob's header, with this CPU's weight layout and offsets
  std::unique_ptr<char[]> storage;
  char* base = nullptr;  // layout[kWeiOffset] and layout[kBiasOffset] count from here
};

std::shared_ptr<Repacked> Repack(const char* blob, const Header& layout) {
  const Header& h = *reinterpret_cast<const Header*>(blob);
  auto r = std::make_shared<Repacked>();
  r->layout = layout;
  size_t bytes = static_cast<size_t>(r->layout[kBiasOffset] + 4 * h[kOC]);
  r->storage.reset(new char[bytes + 64]);
  r->base = r->storage.get() + (64 - reinterpret_cast<uintptr_t>(r->storage.get()) % 64) % 64;
  memory src(WeightsWithTag(h, h[kWeiTag]), Engine(), const_cast<char*>(blob) + h[kWeiOffset]);
  memory dst(WeightsWithTag(r->layout, r->layout[kWeiTag]), Engine(),
             r->base + r->layout[kWeiOffset]);
  dnnl::reorder(src, dst).execute(Stream(), src, dst);
  Stream().wait();
  std::memcpy(r->base + r->layout[kBiasOffset], blob + h[kBiasOffset],
              static_cast<size_t>(h[kOC]) * 4);
  return r;
}

uint64_t Checksum(const char* data, size_t n, uint64_t hash = 1469598103934665603ull) {
  // FNV-1a, 8 bytes at a time
  size_t words = n / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, data + 8 * i, 8);
    hash = (hash ^ w) * 1099511628211ull;
  }
  for (size_t i = 8 * words; i < n; ++i) {
    hash = (hash ^ static_cast<uint8_t>(data[i])) * 1099511628211ull;
  }
  return hash;
}

// The checksum of a blob: its header (with the checksum slot as 0), then the `bytes` after it.
int64_t BlobChecksum(const char* blob, size_t bytes) {
  Header h;
  std::memcpy(&h, blob, sizeof(Header));
  h[kChecksum] = 0;
  uint64_t head = Checksum(reinterpret_cast<const char*>(&h), sizeof(Header));
  return static_cast<int64_t>(Checksum(blob + kHeaderBytes, bytes, head));
}

// ---- primitives made once per call site ---------------------------------------------------

struct Entry {
  Header header;  // the blob's, as found: compared on every call
  Header layout;  // what the weights behind `weights` follow (the header, or a re-pack's)
  std::shared_ptr<Repacked> repacked;  // weights packed for another CPU, re-packed here
  dnnl::primitive prim;
  memory::desc src, dst, wei, bias, scratch, src_user, dst_user, res_user;
  bool reorder_src = false, reorder_dst = false, reorder_res = false;
  int residual_arg = 0;  // the binary post-op's argument that reads the residual (else 0)
  // the same convolution with a sum post-op, for calls whose output buffer is the residual's
  // (made at the first such call; `has_in_place` false: none fits, the residual is copied)
  std::once_flag in_place_once;
  bool has_in_place = false;
  dnnl::primitive in_place;
  memory::desc in_place_scratch;
  // a pooled kernel: conv -> dst (oneDNN's layout) -> pool -> pooled -> reorder -> the output
  dnnl::primitive pool;
  memory::desc pooled, pool_scratch;
  dnnl::reorder to_src, from_dst, residual_to_dst;
  memory::desc to_src_pad, from_dst_pad, residual_pad;  // their scratchpads (the caller's)
};

// The primitive for a packed blob. Asked with `any` weights first: passing the packed layout
// itself can make oneDNN skip the implementation that chose it (brgconv_1x1 with 16 output
// channels falls to ref:any). Another layout than the packed one (another CPU, another thread
// count) gets the primitive that takes the packed layout, if any does.
dnnl::primitive_desc RunDesc(const Header& h) {
  memory::desc packed = WeightsWithTag(h, h[kWeiTag]);
  dnnl::primitive_desc pd = MakeDesc(h, memory::desc(WeightDims(h), memory::data_type::f32,
                                                     Tag::any));
  if (pd.weights_desc() == packed) return pd;
  try {
    return MakeDesc(h, packed);
  } catch (const dnnl::error&) {
    TVM_FFI_THROW(RuntimeError)
        << "oneDNN: the weights were packed for another CPU (ISA code " << h[kIsa]
        << ", this CPU " << static_cast<int>(dnnl::get_effective_cpu_isa())
        << ") and no oneDNN kernel here takes that layout; rebuild the model on this machine, "
           "or with kernels=\"tvm\"";
  }
  __builtin_unreachable();
}

std::shared_ptr<Entry> MakeEntry(const char* blob, std::shared_ptr<Repacked> repacked) {
  auto e = std::make_shared<Entry>();
  std::memcpy(&e->header, blob, sizeof(Header));
  e->repacked = std::move(repacked);
  e->layout = e->repacked ? e->repacked->layout : e->header;
  const Header& h = e->layout;
  e->wei = WeightsWithTag(h, h[kWeiTag]);
  if (!e->repacked && static_cast<int64_t>(e->wei.get_size()) > h[kWeiBytes]) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the packed weights' layout needs "
                              << e->wei.get_size() << " bytes, the blob holds " << h[kWeiBytes];
  }
  dnnl::primitive_desc pd = RunDesc(h);
  e->prim = dnnl::primitive(pd);
  e->src = pd.src_desc();
  e->dst = pd.dst_desc();
  e->bias = memory::desc({h[kOC]}, memory::data_type::f32, Tag::a);
  e->scratch = pd.scratchpad_desc();
  e->src_user = Activation(SrcDims(h), h[kSrcTag]);
  e->dst_user = Activation(OutDims(h), h[kDstTag]);
  e->res_user = Activation(DstDims(h), h[kResTag]);
  if (h.winograd()) return e;  // the transforms read and write the activations as they are
  e->reorder_src = e->src != e->src_user;
  e->reorder_dst = e->dst != e->dst_user;
  if (h.pooled()) {  // the pool runs in the layout oneDNN chose for the convolution's result
    auto ppd = PoolDesc(dnnl::algorithm::pooling_max, e->dst,
                        memory::desc(OutDims(h), memory::data_type::f32, Tag::any),
                        {h[kPoolKH], h[kPoolKW]}, {h[kPoolSH], h[kPoolSW]}, {0, 0},
                        {h[kPoolPadT], h[kPoolPadL]}, {h[kPoolPadB], h[kPoolPadR]});
    e->pool = dnnl::pooling_forward(ppd);
    e->pooled = ppd.dst_desc();
    e->pool_scratch = ppd.scratchpad_desc();
    e->reorder_dst = e->pooled != e->dst_user;
  }
  // the residual is read by a binary post-op, or put where a sum post-op adds into: the dst
  // buffer, in the dst layout
  if (h.has_sum() && BinaryResidual(h)) {
    for (int k = 0, index = 0; k < kMaxPostOps; ++k) {  // index: among the appended ones
      int64_t kind = h[kPost0 + 3 * k];
      if (kind == kSum) e->residual_arg = DNNL_ARG_ATTR_MULTIPLE_POST_OP(index) | DNNL_ARG_SRC_1;
      if (kind != kNoPost) ++index;
    }
  }
  e->reorder_res = h.has_sum() && !e->residual_arg && e->res_user != e->dst;
  auto reorder = [](dnnl::reorder& prim, memory::desc& pad, const memory::desc& a,
                    const memory::desc& b) {
    auto pd = ReorderDesc(a, b);
    prim = dnnl::reorder(pd);
    pad = pd.scratchpad_desc();
  };
  if (e->reorder_src) reorder(e->to_src, e->to_src_pad, e->src_user, e->src);
  if (e->reorder_dst) {
    reorder(e->from_dst, e->from_dst_pad, h.pooled() ? e->pooled : e->dst, e->dst_user);
  }
  if (e->reorder_res) reorder(e->residual_to_dst, e->residual_pad, e->res_user, e->dst);
  return e;
}

// The entry of a call site: per (blob address, thread count), remade when the blob's header
// changed; a re-pack is shared by the thread counts that pick the same layout. Called with the
// caller's OpenMP thread count set: oneDNN's choices depend on it. A module's pools drop their
// blobs' entries when they are freed (`Forget`); past a bound both caches start over (entries
// in use live on, shared).
constexpr size_t kMaxEntries = 4096, kMaxRepacks = 512;

struct EntryCache {
  std::mutex mu;
  std::map<std::pair<const void*, int>, std::shared_ptr<Entry>> entries;
  std::map<std::pair<const void*, int64_t>, std::shared_ptr<Repacked>> repacks;
};

EntryCache& Entries() {
  static EntryCache* cache = new EntryCache();  // never destroyed: used until the process ends
  return *cache;
}

std::shared_ptr<Entry> GetEntry(const char* blob, int threads) {
  EntryCache& c = Entries();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.entries.size() >= kMaxEntries) c.entries.clear();
  if (c.repacks.size() >= kMaxRepacks) c.repacks.clear();
  auto& slot = c.entries[{blob, threads}];
  if (slot && std::memcmp(&slot->header, blob, sizeof(Header)) == 0) return slot;
  const Header& h = *reinterpret_cast<const Header*>(blob);
  // the packed layout fits the bytes the header gives it (a re-pack reads them all)
  if (static_cast<int64_t>(WeightsWithTag(h, h[kWeiTag]).get_size()) > h[kWeiBytes]) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the packed weights' layout needs "
                              << WeightsWithTag(h, h[kWeiTag]).get_size()
                              << " bytes, the blob holds " << h[kWeiBytes];
  }
  // the weights are the ones packed: once per blob and header, one pass over its bytes
  size_t bytes = static_cast<size_t>(h[kBiasOffset] + 4 * h[kOC] - kHeaderBytes);
  if (BlobChecksum(blob, bytes) != h[kChecksum]) {
    TVM_FFI_THROW(ValueError) << "oneDNN: the packed weights or their header do not match the "
                                 "header's checksum (a damaged params file?); load the params "
                                 "again, or rebuild the model";
  }
  Header layout = Layout(h);  // what oneDNN picks here, now
  std::shared_ptr<Repacked> repacked;
  if (layout[kWeiTag] != h[kWeiTag]) {
    auto& r = c.repacks[{blob, layout[kWeiTag]}];
    if (!r || std::memcmp(&r->layout, &layout, sizeof(Header)) != 0) r = Repack(blob, layout);
    repacked = r;
  }
  slot = MakeEntry(blob, repacked);
  return slot;
}

// Drops what the caches hold for blobs in [begin, end): memory freed by a module (its weight
// pool), called when it goes. A module made later at those addresses would find its header
// differs and make its own entries anyway; this frees the dropped one's (re-packed weights:
// a model's size each) now rather than never.
int64_t Forget(int64_t begin, int64_t end) {
  EntryCache& c = Entries();
  std::lock_guard<std::mutex> lock(c.mu);
  int64_t dropped = 0;
  auto inside = [&](const void* p) {
    auto a = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    return begin <= a && a < end;
  };
  for (auto it = c.entries.begin(); it != c.entries.end();) {
    bool gone = inside(it->first.first);
    dropped += gone;
    it = gone ? c.entries.erase(it) : std::next(it);
  }
  for (auto it = c.repacks.begin(); it != c.repacks.end();) {
    it = inside(it->first.first) ? c.repacks.erase(it) : std::next(it);
  }
  return dropped;
}

// Per-thread buffers for the reordered activations and oneDNN's scratchpad.
struct Buffer {
  void* ptr = nullptr;
  size_t size = 0;
  void* get(size_t want) {
    if (want > size) {
      std::free(ptr);
      size = 0;  // (a failed allocation leaves none: a smaller request must not get nullptr)
      auto rounded = static_cast<size_t>(Round64(static_cast<int64_t>(want)));
      ptr = std::aligned_alloc(64, rounded);
      if (ptr == nullptr) TVM_FFI_THROW(RuntimeError) << "oneDNN: out of memory";
      size = rounded;
    }
    return ptr;
  }
  ~Buffer() { std::free(ptr); }
};

struct Scratch {
  Buffer src, dst, pad, res, pooled, pool_pad, reorder_pad;
};


// Denormals flushed to zero, as TVM's thread pool does for its kernels: random-weight models
// make denormals, and without this a resnet50 conv on one thread took 5 s instead of 1 ms.
// The calling thread's mode is put back after the call; oneDNN's own OpenMP threads keep it.
constexpr unsigned kFlushDenormals = 0x8040;  // MXCSR: flush-to-zero | denormals-are-zero

class FlushDenormals {
 public:
  explicit FlushDenormals(int threads) : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | kFlushDenormals);
    thread_local int team = 1;  // the OpenMP threads of this caller already flushing
    if (threads > team) {
#pragma omp parallel num_threads(threads)
      _mm_setcsr(_mm_getcsr() | kFlushDenormals);
      team = threads;
    }
  }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

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

// The primitive of a weightless kernel (concat, pool, reorder) for `key` (its shapes,
// attributes and thread count), made by `make` once; one cache per call site, bounded as
// GetEntry's.
template <typename T, typename Make>
std::shared_ptr<T> Cached(const std::vector<int64_t>& key, Make make) {
  static std::mutex mu;
  static std::map<std::vector<int64_t>, std::shared_ptr<T>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= kMaxEntries) cache.clear();
  auto& slot = cache[key];
  if (!slot) slot = std::make_shared<T>(make());
  return slot;
}

// oneDNN memory handles and argument maps, per thread and primitive: made on a primitive's
// first call on a thread, pointed at each call's buffers with set_data_handle after. Making
// them per call cost ~0.5 us a handle (a convolution's six and its map ~3 us, as much as a
// small convolution computes). Keyed by the owner's address; a freed owner's slot is found
// expired and remade. Freed owners' slots are dropped when the cache has doubled since the
// last sweep (a live owner's slots never are: the caller holds a reference into them).
class Args {
 public:
  // the handle for `arg`, made on first use with `md`, pointed at `data`
  memory& Set(int arg, const memory::desc& md, void* data) {
    auto it = map_.find(arg);
    if (it == map_.end()) return map_.emplace(arg, memory(md, Engine(), data)).first->second;
    if (it->second.get_data_handle() != data) it->second.set_data_handle(data);
    return it->second;
  }
  const std::unordered_map<int, memory>& map() const { return map_; }

 private:
  std::unordered_map<int, memory> map_;
};

// the stages of a convolution kernel, each with its own arguments (other kernels use one)
enum Stage : int { kToSrc, kConv, kConvInPlace, kResidual, kPool, kFromDst, kStages };
using StageArgs = std::array<Args, kStages>;

// The argument maps of `owner`'s stages on this thread: one lookup per call.
template <typename Owner>
StageArgs& BoundArgs(const std::shared_ptr<Owner>& owner) {
  thread_local std::unordered_map<const void*, std::pair<std::weak_ptr<const void>, StageArgs>>
      bound;
  thread_local size_t sweep_at = kMaxEntries;
  if (bound.size() >= sweep_at) {
    for (auto it = bound.begin(); it != bound.end();) {
      it = it->second.first.expired() ? bound.erase(it) : std::next(it);
    }
    sweep_at = std::max(kMaxEntries, 2 * bound.size());
  }
  auto& slot = bound[owner.get()];
  if (slot.first.expired()) slot = {std::weak_ptr<const void>(owner), StageArgs()};
  return slot.second;
}

struct Shared {
  dnnl::primitive prim;
  memory::desc scratch;
  // run with `args` (the scratchpad added: this thread's) and wait for it
  void Run(Args& args) const {
    thread_local Buffer pad;
    if (scratch.get_size() > 0) {
      args.Set(DNNL_ARG_SCRATCHPAD, scratch, pad.get(scratch.get_size() + 64));
    }
    prim.execute(Stream(), args.map());
    Stream().wait();
  }
};

template <typename Prim, typename Desc>
Shared MakeShared(const Desc& pd) {
  return Shared{Prim(pd), pd.scratchpad_desc()};
}

// ---- Winograd F(4x4, 3x3) ---------------------------------------------------------------------

// Lavin and Gray's minimal filtering: a 3x3 filter g and a 6x6 input tile d make the 4x4 output
// tile A^T [(G g G^T) . (B^T d B)] A, 36 multiplies per input and output channel where the
// direct convolution spends 144. The weights' transform U = G g G^T is made once, at pack (36
// matrices C x K, packed in the layout oneDNN's matmul picks); per call every tile's input
// transform V = B^T d B (36 matrices tiles x C), oneDNN's batched matmul M = V U (36 x tiles x
// K), and the output transform A^T M A, which adds the bias and the post-ops as it writes the
// NHWC output. (oneDNN 3.2 has no fp32 Winograd of its own: algorithm::convolution_winograd
// finds no implementation, on AVX2 or AVX-512.) Measured against oneDNN's direct convolution
// (2 threads, AVX-512 and AVX2; relay_passes/claim_onednn.py says where it is chosen): resnet50's
// 64 -> 64 3x3 on 56x56 1013 -> 522 us, 256 -> 256 on 14x14 940 -> 469 us; on 7x7 (4 tiles)
// the matmul reads 4x the weights for little work: 894 -> 973 us.
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

// The sum-post-op twin of a convolution that reads its residual with a binary add: same
// source, destination and packed weights, or none (then the caller copies the residual away).
bool InPlaceTwin(Entry& e) {
  std::call_once(e.in_place_once, [&e] {
    const Header& h = e.layout;
    try {
      dnnl::primitive_desc pd = MakeDesc(
          h, memory::desc(WeightDims(h), memory::data_type::f32, Tag::any), true);
      if (pd.weights_desc() != e.wei) pd = MakeDesc(h, e.wei, true);
      std::string impl = pd.impl_info_str();
      if (pd.src_desc() != e.src || pd.dst_desc() != e.dst || impl.rfind("ref", 0) == 0) return;
      e.in_place = dnnl::primitive(pd);
      e.in_place_scratch = pd.scratchpad_desc();
      e.has_in_place = true;
    } catch (const dnnl::error&) {
    }
  });
  return e.has_in_place;
}

// A Winograd convolution (the section above): input transform, the matmul, output transform.
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
  conv.Set(DNNL_ARG_SRC, e->src, src);
  conv.Set(DNNL_ARG_WEIGHTS, e->wei, weights + e->layout[kWeiOffset]);
  conv.Set(DNNL_ARG_BIAS, e->bias, weights + e->layout[kBiasOffset]);
  conv.Set(DNNL_ARG_DST, e->dst, dst);
  const memory::desc& pad = twin ? e->in_place_scratch : e->scratch;
  conv.Set(DNNL_ARG_SCRATCHPAD, pad, s.pad.get(pad.get_size() + 64));
  (twin ? e->in_place : e->prim).execute(stream, conv.map());
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
// folded at build (relay_passes/claim_affine.py): oneDNN's binary multiply with a binary add
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

// ---- packing at build ---------------------------------------------------------------------

int64_t PackedBytes(const ffi::TensorView& header) {
  Header h = Layout(ReadPlainHeader(header));
  return h[kBiasOffset] + 4 * h[kOC];
}

void Pack(const ffi::TensorView& header, const ffi::TensorView& weight,
          const ffi::TensorView& bias, const ffi::TensorView& blob) {
  Header h = Layout(ReadPlainHeader(header));
  memory::desc plain = PlainWeights(h);
  std::vector<float> transformed;  // Winograd's weights, from the OIHW ones
  void* plain_data = DataOf(weight);
  if (h.winograd()) {
    CheckTensor(weight, "weight", kF32, h[kOC] * h[kIC] * 9);
    transformed.resize(plain.get_size() / 4);
    WinogradWeights(h, static_cast<const float*>(plain_data), transformed.data());
    plain_data = transformed.data();
  } else {
    CheckTensor(weight, "weight", kF32, static_cast<int64_t>(plain.get_size() / 4));
  }
  CheckTensor(bias, "bias", kF32, h[kOC]);
  CheckTensor(blob, "packed weights", kU8, h[kBiasOffset] + 4 * h[kOC]);
  char* base = static_cast<char*>(DataOf(blob));
  std::memset(base, 0, static_cast<size_t>(blob.numel()));
  std::memcpy(base, &h, sizeof(Header));
  memory src(plain, Engine(), plain_data);
  memory dst(WeightsWithTag(h, h[kWeiTag]), Engine(), base + h[kWeiOffset]);
  dnnl::reorder(src, dst).execute(Stream(), src, dst);
  Stream().wait();
  std::memcpy(base + h[kBiasOffset], DataOf(bias), static_cast<size_t>(h[kOC]) * 4);
  h[kChecksum] = 0;
  std::memcpy(base, &h, sizeof(Header));
  h[kChecksum] = BlobChecksum(base, static_cast<size_t>(blob.numel() - kHeaderBytes));
  std::memcpy(base, &h, sizeof(Header));
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
  return (h.winograd() ? "winograd_4x4_3x3+" : "") + std::string(RunDesc(h).impl_info_str());
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
      .def("hgrt.onednn.to_nchw",
           [](ffi::TensorView x, ffi::TensorView out) { Catch([&] { ToNchw(x, out); }); })
      .def_packed("hgrt.onednn.concat",
                  [](ffi::PackedArgs args, ffi::Any*) { Catch([&] { Concat(args); }); })
      .def("hgrt.onednn.forget", Forget)
      .def("hgrt.onednn.cached_entries",  // (entries, re-packs) held: what a soak test watches
           []() {
             EntryCache& c = Entries();
             std::lock_guard<std::mutex> lock(c.mu);
             return static_cast<int64_t>(c.entries.size() * 1000000 + c.repacks.size());
           })
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
      .def("hgrt.onednn.nhwc_tag", []() { return static_cast<int64_t>(dnnl_nhwc); })
      .def("hgrt.onednn.layout_name", [](int64_t tag) {
        return ffi::String(dnnl_fmt_tag2str(static_cast<dnnl_format_tag_t>(tag)));
      });
}
