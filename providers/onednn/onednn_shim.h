// hgrt's oneDNN kernels: what the sources of the one library share. providers/onednn/kernels.py compiles
//   onednn_shim.cc        the conv2d / dense call, the state every kernel shares (engine,
//                         stream, threads, denormals), argument and header checks, and the
//                         registration of the global functions
//   onednn_primitives.cc  a header's oneDNN descriptors, and the primitives made once per blob
//   onednn_pack.cc        weights packed at build, re-packed for another CPU, checksums
//   onednn_winograd.cc    the hand-written Winograd F(4x4, 3x3) convolution
//   onednn_layout.cc      the weightless NHWC kernels: concat, pool, shuffle, LRN, affine and
//                         the reorder back to NCHW
//   onednn_swish.cc       swish after a kernel, in place (faster than oneDNN's post-op)
//   onednn_rows.cc        a transformer's kernels between its dense layers: layer norm,
//                         softmax, the matmul of two activations
// into one library. The blob header's slots and codes come from onednn_blob.h, generated from
// providers/onednn/blob.py.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "onednn_blob.h"

namespace hgrt_onednn {

namespace ffi = tvm::ffi;
using dnnl::memory;
using Tag = memory::format_tag;

// what the code below takes for granted of the generated format
static_assert(kUsedSlots <= kSlots, "header overflows its bytes");
static_assert(kPost0Alpha == kPost0 + 1 && kPost0Beta == kPost0 + 2 && kPost1 == kPost0 + 3,
              "a post-op is 3 slots in a row: op, alpha, beta");

struct Header {
  int64_t v[kSlots];
  int64_t operator[](int i) const { return v[i]; }
  int64_t& operator[](int i) { return v[i]; }
  bool pooled() const { return v[kPoolKH] > 0; }
  // F(4x4, 3x3) Winograd: a 3x3 stride-1 convolution of NHWC activations, its weights packed
  // as the 36 matrices (C x K) of the Winograd domain (see onednn_winograd.cc)
  bool winograd() const { return v[kKind] == kConv2d && v[kAlgo] == kWinograd; }
  // whether a post-op of kind lo..hi is in the header
  bool has_post(int64_t lo, int64_t hi) const {
    for (int k = 0; k < kMaxPostOps; ++k) {
      if (v[kPost0 + 3 * k] >= lo && v[kPost0 + 3 * k] <= hi) return true;
    }
    return false;
  }
  bool has_sum() const { return has_post(kSum, kSum); }
  // a post-op past relu, clip and sum (GELU, swish, ...): a blob of its own version
  bool has_eltwise() const { return has_post(kGeluErf, kQuantU8); }
  // a quantize-dequantize post-op (a QDQ model's grid): a blob of its own version
  bool has_quant() const { return has_post(kQuantS8, kQuantU8); }
  // int8 weights, the input quantized to uint8 by the kernel (the grid: src_scale, src_zp)
  bool int8() const { return v[kSrcDT] == kUint8; }
  // the bytes after the weights: the float32 bias, then (int8) the weights' scales per channel
  int64_t tail_bytes() const { return 4 * v[kOC] * (int8() ? 2 : 1); }
  // the version a blob of this header carries: an older shim refuses what it cannot compute
  int64_t version() const {
    return int8()          ? kVersionInt8
           : winograd()    ? kVersionWinograd
           : has_quant()   ? kVersionQuant
           : has_eltwise() ? kVersionEltwise
                           : kVersion;
  }
};

inline int64_t Round64(int64_t n) { return (n + 63) / 64 * 64; }

inline double AsDouble(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

// ---- onednn_shim.cc: what every kernel shares ---------------------------------------------

int64_t DnnlVersion();
dnnl::engine& Engine();
dnnl::stream& Stream();  // the calling thread's
dnnl::primitive_attr UserScratchpad(dnnl::primitive_attr attr = dnnl::primitive_attr());
dnnl::reorder::primitive_desc ReorderDesc(const memory::desc& from, const memory::desc& to);

inline void* DataOf(const ffi::TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

const DLDataType kF32{kDLFloat, 32, 1};
const DLDataType kU8{kDLUInt, 8, 1};
const DLDataType kS8{kDLInt, 8, 1};

void CheckTensor(const ffi::TensorView& t, const char* what, DLDataType dtype, int64_t numel);
void CheckOps(const Header& h);
const Header& ReadHeader(const ffi::TensorView& blob);

// Denormals flushed to zero for the life of one kernel call (see onednn_shim.cc).
class FlushDenormals {
 public:
  explicit FlushDenormals(int threads);
  ~FlushDenormals();

 private:
  unsigned saved_;
};

// The calling thread's budget, OpenMP set to it (oneDNN's choices depend on it): the threads.
int UseBudgetThreads();

// ---- per-thread buffers, cached primitives and their arguments ----------------------------

// Bounds of the primitive caches (entries in use live on, shared).
constexpr size_t kMaxEntries = 4096, kMaxRepacks = 512;

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
enum Stage : int { kToSrc, kConv, kConvInPlace, kResidual, kPool, kFromDst, kRest, kStages };
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

// ---- onednn_primitives.cc: descriptors from a header, primitives per blob ------------------

memory::dims WeightDims(const Header& h);
memory::desc PlainWeights(const Header& h);
memory::dims SrcDims(const Header& h);
memory::dims DstDims(const Header& h);
memory::dims OutDims(const Header& h);
memory::desc WithTag(const memory::dims& dims, int64_t tag,
                     memory::data_type dt = memory::data_type::f32);
memory::data_type WeiDt(const Header& h);
memory::desc WeightsWithTag(const Header& h, int64_t tag);
dnnl::pooling_forward::primitive_desc PoolDesc(dnnl::algorithm algo, const memory::desc& src,
                                               const memory::desc& dst,
                                               const memory::dims& kernel,
                                               const memory::dims& strides,
                                               const memory::dims& dil, const memory::dims& left,
                                               memory::dims right);
dnnl::primitive_desc MakeDesc(const Header& h, const memory::desc& wei, bool in_place = false);
int64_t FindTag(const memory::desc& md);
int64_t RowChunk(const Header& h);
dnnl::primitive_desc RunDesc(const Header& h);

// Weights packed for another CPU, re-packed here once (onednn_pack.cc).
struct Repacked {
  Header layout;  // the blob's header, with this CPU's weight layout and offsets
  std::unique_ptr<char[]> storage;
  char* base = nullptr;  // layout[kWeiOffset] and layout[kBiasOffset] count from here
};

// The primitives of one packed blob, made once per (blob address, thread count).
struct Entry {
  Header header;  // the blob's, as found: compared on every call
  Header layout;  // what the weights behind `weights` follow (the header, or a re-pack's)
  std::shared_ptr<Repacked> repacked;  // weights packed for another CPU, re-packed here
  dnnl::primitive prim;
  memory::desc src, dst, wei, bias, scratch, src_user, dst_user, res_user;
  bool reorder_src = false, reorder_dst = false, reorder_res = false;
  int residual_arg = 0;  // the binary post-op's argument that reads the residual (else 0)
  int64_t own_act = kNoPost;  // the last post-op (swish, tanh GELU) as hgrt's pass after it
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
  // an int8 kernel: the input's grid (to_src quantizes by it) and the weights' scales
  float src_scale = 1.f;
  int32_t src_zp = 0;
  memory::desc scale_1, zp_1, wei_scales;
  memory::desc to_src_pad, from_dst_pad, residual_pad;  // their scratchpads (the caller's)
  // a dense layer whose rows run in chunks of `row_chunk` (RowChunk; 0: all at once): the
  // primitive of a chunk, and of the rows left after the whole chunks (if any), both on the
  // packed weights, reading and writing plain rows in place; one scratchpad serves both
  int64_t row_chunk = 0;
  dnnl::primitive chunk_prim, rest_prim;
  memory::desc chunk_src, chunk_dst, rest_src, rest_dst, chunk_pad;
};

std::shared_ptr<Entry> GetEntry(const char* blob, int threads);
bool InPlaceTwin(Entry& e);
int64_t Forget(int64_t begin, int64_t end);
int64_t CachedEntries();

// ---- onednn_pack.cc ------------------------------------------------------------------------

Header Layout(Header h);
std::shared_ptr<Repacked> Repack(const char* blob, const Header& layout);
int64_t BlobChecksum(const char* blob, size_t bytes);
int64_t PackedBytes(const ffi::TensorView& header);
void Pack(const ffi::TensorView& header, const ffi::TensorView& weight,
          const ffi::TensorView& bias, const ffi::TensorView& blob);

// ---- onednn_winograd.cc --------------------------------------------------------------------

int64_t WinogradRows(const Header& h);
const char* WinogradProblem(const Header& h);
void WinogradWeights(const Header& h, const float* g, float* u);
void RunWinograd(Entry& e, Args& mm, Scratch& s, const ffi::TensorView& x,
                 const ffi::TensorView* residual, const ffi::TensorView& out, char* base,
                 int threads);

// ---- onednn_layout.cc ----------------------------------------------------------------------

void Concat(ffi::PackedArgs args);
void Split(ffi::PackedArgs args);
void Pool(const ffi::TensorView& x, const ffi::TensorView& attrs, const ffi::TensorView& out);
void Shuffle(const ffi::TensorView& x, const ffi::TensorView& attrs, const ffi::TensorView& out);
void Lrn(const ffi::TensorView& x, const ffi::TensorView& attrs, const ffi::TensorView& out);
void Affine(const ffi::TensorView& x, const ffi::TensorView& params, const ffi::TensorView& out);
void Gate(const ffi::TensorView& x, const ffi::TensorView& g, const ffi::TensorView& out);
void ToNchw(const ffi::TensorView& x, const ffi::TensorView& out);
void PushBits(std::vector<int64_t>& key, const float* values, int n);

// ---- onednn_swish.cc -----------------------------------------------------------------------

// whether oneDNN may use `want` here (ONEDNN_MAX_CPU_ISA caps it)
bool HasIsa(dnnl::cpu_isa want);
int SwishLevel();
// swish (kind kSwish) or GELU's tanh form (kGeluTanh) over `y` in place
void OwnActivation(int64_t kind, float* y, int64_t n, int threads);
// the last post-op of a header where it is swish of alpha 1 or GELU's tanh form, on a CPU where
// hgrt's own pass computes it (kNoPost: none): the primitive leaves it out, and the kernel runs
// OwnActivation over its result (HGRT_ONEDNN_OWN_GELU=0: the tanh GELU stays oneDNN's)
int64_t OwnActivation(const Header& h);

// ---- onednn_rows.cc ------------------------------------------------------------------------

void LayerNorm(const ffi::TensorView& x, const ffi::TensorView& params,
               const ffi::TensorView& out);
void Softmax(const ffi::TensorView& x, const ffi::TensorView& params, const ffi::TensorView& out);
void Matmul(ffi::PackedArgs args);

}  // namespace hgrt_onednn
