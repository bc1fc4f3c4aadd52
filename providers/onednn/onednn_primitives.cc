// hgrt's oneDNN kernels: what a blob header asks of oneDNN (memory descriptors, post-ops, the
// primitive descriptor), and the primitives made once per packed blob and thread count.
#include "onednn_shim.h"

namespace hgrt_onednn {

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

// int8 weights for an int8 kernel, else float32
memory::data_type WeiDt(const Header& h) {
  return h.int8() ? memory::data_type::s8 : memory::data_type::f32;
}

// what the primitive reads: the input quantized to uint8 for int8 weights, else float32
memory::data_type SrcDt(const Header& h) {
  return h.int8() ? memory::data_type::u8 : memory::data_type::f32;
}

memory::desc PlainWeights(const Header& h) {
  Tag tag = h[kKind] == kDense ? Tag::ab
            : h.winograd()     ? Tag::abc
                               : (h[kGroups] > 1 ? Tag::goihw : Tag::oihw);
  return memory::desc(WeightDims(h), WeiDt(h), tag);
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

memory::desc WithTag(const memory::dims& dims, int64_t tag, memory::data_type dt) {
  dnnl_memory_desc_t md = nullptr;
  dnnl_status_t st = dnnl_memory_desc_create_with_tag(
      &md, static_cast<int>(dims.size()), dims.data(), static_cast<dnnl_data_type_t>(dt),
      static_cast<dnnl_format_tag_t>(tag));
  if (st != dnnl_success) {
    TVM_FFI_THROW(RuntimeError) << "oneDNN: layout " << tag << " does not fit a tensor of "
                                << dims.size() << " dimensions";
  }
  return memory::desc(md);
}

memory::desc WeightsWithTag(const Header& h, int64_t tag) {
  return WithTag(WeightDims(h), tag, WeiDt(h));
}

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
  return h[kKind] == kConv2d && h[kSrcTag] > 0 && h[kDstTag] == h[kSrcTag] &&
         h[kResTag] == h[kDstTag];
}

// The output layout a convolution is asked for where the graph holds its input in a layout:
// the input's, reordered after where the graph holds the output in another (a blocked input and
// an NHWC output, or the other way round, leave oneDNN only its reference kernel: 3.5 s for
// mobilenet_v2's last 1x1 at batch 8); a plain output leaves it to oneDNN.
int64_t DstTag(const Header& h) { return h[kSrcTag] > 0 && h[kDstTag] > 0 ? h[kSrcTag] : 0; }

// ONNX's QuantizeLinear then DequantizeLinear (scale `s`, zero point `z`, an int8 or uint8
// grid) as kQuantizeOps eltwise post-ops: clip(round(x / s) + z, lo, hi) - z is
// clip(round(x / s), lo - z, hi - z) for an integer z, then times s. Rounding is oneDNN's, to
// nearest even as ONNX's; x / s is x * (1 / s), which may differ in the last bit (a value
// exactly between two steps of the grid may land on the other one).
constexpr int kQuantizeOps = 4;  // the oneDNN post-ops of one quantize-dequantize

// how many of oneDNN's post-ops a header's post-op `kind` appends (a binary post-op's argument
// is numbered among them)
int DnnlPostOps(int64_t kind) {
  return kind == kNoPost ? 0 : (kind == kQuantS8 || kind == kQuantU8) ? kQuantizeOps : 1;
}

void AppendQuantize(dnnl::post_ops& ops, bool is_signed, float s, float z) {
  float lo = is_signed ? -128.f : 0.f, hi = is_signed ? 127.f : 255.f;
  ops.append_eltwise(dnnl::algorithm::eltwise_linear, 1.f / s, 0.f);
  ops.append_eltwise(dnnl::algorithm::eltwise_round, 0.f, 0.f);
  ops.append_eltwise(dnnl::algorithm::eltwise_clip, lo - z, hi - z);
  ops.append_eltwise(dnnl::algorithm::eltwise_linear, s, 0.f);
}

int64_t OwnActivation(const Header& h) {
  if (SwishLevel() == 0 || h.winograd()) return kNoPost;
  int last = -1;
  for (int k = 0; k < kMaxPostOps; ++k) {
    if (h[kPost0 + 3 * k] != kNoPost) last = k;
  }
  if (last < 0) return kNoPost;
  int64_t kind = h[kPost0 + 3 * last];
  if (kind == kSwish && AsDouble(h[kPost0 + 3 * last + 1]) == 1.0) return kSwish;
  // GELU's tanh form on AVX2 only: oneDNN's AVX-512 post-op costs what the pass costs (GPT-2's
  // 128 x 768 x 3072 dense layer 1.30 ms with it, 1.32 with the pass; EPYC, 2 threads)
  const char* flag = std::getenv("HGRT_ONEDNN_OWN_GELU");  // "0": oneDNN's (to time the two)
  bool off = flag != nullptr && std::string(flag) == "0";
  return kind == kGeluTanh && SwishLevel() == 1 && !off ? kGeluTanh : kNoPost;
}

// `in_place`: the output buffer holds the residual already (the memory plan put the output
// in the residual's bytes), so a sum post-op adds into it, whatever the layout.
dnnl::primitive_attr Attributes(const Header& h, bool in_place = false) {
  dnnl::post_ops ops;
  int64_t own = OwnActivation(h);
  for (int k = 0; k < kMaxPostOps; ++k) {
    int64_t kind = h[kPost0 + 3 * k];
    if (own != kNoPost && kind == own) break;  // (the last: hgrt's pass after the primitive)
    float alpha = static_cast<float>(AsDouble(h[kPost0 + 3 * k + 1]));
    float beta = static_cast<float>(AsDouble(h[kPost0 + 3 * k + 2]));
    if (kind == kRelu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    if (kind == kClip) ops.append_eltwise(dnnl::algorithm::eltwise_clip, alpha, beta);
    if (kind == kGeluErf) ops.append_eltwise(dnnl::algorithm::eltwise_gelu_erf, 0.f, 0.f);
    if (kind == kGeluTanh) ops.append_eltwise(dnnl::algorithm::eltwise_gelu_tanh, 0.f, 0.f);
    if (kind == kSwish) ops.append_eltwise(dnnl::algorithm::eltwise_swish, alpha, 0.f);
    if (kind == kHardswish) ops.append_eltwise(dnnl::algorithm::eltwise_hardswish, alpha, beta);
    if (kind == kSigmoid) ops.append_eltwise(dnnl::algorithm::eltwise_logistic, 0.f, 0.f);
    if (kind == kTanh) ops.append_eltwise(dnnl::algorithm::eltwise_tanh, 0.f, 0.f);
    if (kind == kQuantS8 || kind == kQuantU8) AppendQuantize(ops, kind == kQuantS8, alpha, beta);
    if (kind == kSum && BinaryResidual(h) && !in_place) {
      ops.append_binary(dnnl::algorithm::binary_add, WithTag(DstDims(h), h[kDstTag]));
    } else if (kind == kSum) {
      ops.append_sum(1.f);
    }
  }
  dnnl::primitive_attr attr;
  attr.set_post_ops(ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  // int8: the accumulated products times a scale per output channel (the input's scale times
  // the weights'), then the bias; the output stays float32
  if (h.int8()) attr.set_scales_mask(DNNL_ARG_WEIGHTS, h[kGroups] > 1 ? 3 : 1);
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
dnnl::primitive_desc MakeDesc(const Header& h, const memory::desc& wei, bool in_place) {
  auto any = [](memory::dims d, memory::data_type dt = memory::data_type::f32) {
    return memory::desc(d, dt, Tag::any);
  };
  auto conv_io = [&](memory::dims d, int64_t tag, memory::data_type dt = memory::data_type::f32) {
    return tag > 0 ? WithTag(d, tag, dt) : any(d, dt);
  };
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
    return dnnl::inner_product_forward::primitive_desc(Engine(), kind, any(SrcDims(h), SrcDt(h)),
                                                       wei, bias,
                                                       any(DstDims(h)), Attributes(h, in_place));
  }
  if (h[kKind] != kConv2d) TVM_FFI_THROW(RuntimeError) << "oneDNN: unknown op kind " << h[kKind];
  return dnnl::convolution_forward::primitive_desc(
      Engine(), kind, dnnl::algorithm::convolution_direct,
      conv_io(SrcDims(h), h[kSrcTag], SrcDt(h)), wei,
      bias, conv_io(DstDims(h), DstTag(h)), {h[kSH], h[kSW]},
      {h[kDilH] - 1, h[kDilW] - 1}, {h[kPadT], h[kPadL]}, {h[kPadB], h[kPadR]},
      Attributes(h, in_place));
}

// The format tag whose layout is exactly `md` (0: none is). Stored in the header, so the run
// time rebuilds the packed layout without serializing a memory descriptor.
int64_t FindTag(const memory::desc& md) {
  memory::dims dims = md.get_dims();
  for (int t = static_cast<int>(dnnl_a); t < static_cast<int>(dnnl_format_tag_last); ++t) {
    dnnl_memory_desc_t c = nullptr;
    if (dnnl_memory_desc_create_with_tag(&c, static_cast<int>(dims.size()), dims.data(),
                                         static_cast<dnnl_data_type_t>(md.get_data_type()),
                                         static_cast<dnnl_format_tag_t>(t)) != dnnl_success) {
      continue;
    }
    bool same = dnnl_memory_desc_equal(c, md.get()) != 0;
    dnnl_memory_desc_destroy(c);
    if (same) return t;
  }
  return 0;
}

// ---- primitives made once per call site ---------------------------------------------------

// How many rows of a dense layer one call of oneDNN's kernel takes (0: all of them), on AVX2
// (oneDNN 3.2's brgemm:avx2 inner product; on AVX-512 all rows at once is best). Its rate on
// some row counts falls by a fifth: a count that 64 does not divide runs as its whole 64s in
// one call and the rest in another (197 x 768 x 3072 191 -> 239 GFLOP/s, 197 x 3072 x 768 184
// -> 230; python/bench_onednn_primitives.cc dense, AMD EPYC, 2 threads; vit 196.3 -> 157.5
// ms in turns); and in the models a multiple of 64 up to 512 rows of a depth up to 2048 ran
// mostly faster 64 at a time (gpt2 157.9 -> 153.2 ms, distilbert 53.2 -> 49.0 in turns, though
// single runs of either read up to 7 % the other way; alone in the loop above the two were
// within 8 %, and at a depth of 3072 chunks of 64 slowed it, 239 -> 202).
// HGRT_ONEDNN_ROW_CHUNK=0: all rows at once (to time the difference).
constexpr int64_t kRowChunk = 64, kRowChunkMaxDepth = 2048, kRowChunkMaxRows = 512;

int64_t RowChunk(const Header& h) {
  const char* flag = std::getenv("HGRT_ONEDNN_ROW_CHUNK");  // (read as each entry is made)
  bool off = flag != nullptr && std::string(flag) == "0";
  bool avx2 = HasIsa(dnnl::cpu_isa::avx2) && !HasIsa(dnnl::cpu_isa::avx512_core);
  int64_t rows = h[kN];
  if (off || !avx2 || h[kKind] != kDense || h.int8() || rows <= kRowChunk) return 0;
  if (rows % kRowChunk != 0) return rows / kRowChunk * kRowChunk;
  return rows <= kRowChunkMaxRows && h[kIC] <= kRowChunkMaxDepth ? kRowChunk : 0;
}

// The chunk primitives of a dense layer whose rows run in chunks (RowChunk): made where the
// input, output and residual are plain rows read in place and oneDNN takes the packed weights
// for a chunk's rows with a kernel of its own (else the entry keeps all rows at once).
void ChunkRows(Entry& e) {
  const Header& h = e.layout;
  int64_t chunk = RowChunk(h);
  if (chunk == 0 || e.reorder_src || e.reorder_dst || e.reorder_res || h.pooled()) return;
  size_t pad = 0;
  auto make = [&](int64_t rows, dnnl::primitive& prim, memory::desc& src, memory::desc& dst) {
    Header c = h;
    c[kN] = rows;
    dnnl::primitive_desc pd = MakeDesc(c, memory::desc(WeightDims(c), WeiDt(c), Tag::any));
    if (pd.weights_desc() != e.wei) pd = MakeDesc(c, e.wei);
    std::string impl = pd.impl_info_str();
    if (pd.src_desc() != Activation(SrcDims(c), 0) || pd.dst_desc() != Activation(DstDims(c), 0) ||
        impl.rfind("ref", 0) == 0) {
      return false;
    }
    prim = dnnl::primitive(pd);
    src = pd.src_desc();
    dst = pd.dst_desc();
    pad = std::max(pad, pd.scratchpad_desc().get_size());
    return true;
  };
  try {
    int64_t rest = h[kN] % chunk;
    if (!make(chunk, e.chunk_prim, e.chunk_src, e.chunk_dst) ||
        (rest > 0 && !make(rest, e.rest_prim, e.rest_src, e.rest_dst))) {
      return;
    }
  } catch (const dnnl::error&) {
    return;
  }
  e.chunk_pad = memory::desc({static_cast<int64_t>(pad)}, memory::data_type::u8, Tag::a);
  e.row_chunk = chunk;
}

// The primitive for a packed blob. Asked with `any` weights first: passing the packed layout
// itself can make oneDNN skip the implementation that chose it (brgconv_1x1 with 16 output
// channels falls to ref:any). Another layout than the packed one (another CPU, another thread
// count) gets the primitive that takes the packed layout, if any does.
dnnl::primitive_desc RunDesc(const Header& h) {
  memory::desc packed = WeightsWithTag(h, h[kWeiTag]);
  dnnl::primitive_desc pd = MakeDesc(h, memory::desc(WeightDims(h), WeiDt(h), Tag::any));
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
    for (int k = 0, index = 0; k < kMaxPostOps; ++k) {  // index: among oneDNN's post-ops
      int64_t kind = h[kPost0 + 3 * k];
      if (kind == kSum) e->residual_arg = DNNL_ARG_ATTR_MULTIPLE_POST_OP(index) | DNNL_ARG_SRC_1;
      index += DnnlPostOps(kind);
    }
  }
  e->reorder_res = h.has_sum() && !e->residual_arg && e->res_user != e->dst;
  e->own_act = OwnActivation(h);
  auto reorder = [](dnnl::reorder& prim, memory::desc& pad, const memory::desc& a,
                    const memory::desc& b) {
    auto pd = ReorderDesc(a, b);
    prim = dnnl::reorder(pd);
    pad = pd.scratchpad_desc();
  };
  if (h.int8()) {  // the input quantized onto its grid: x / scale + zero point, rounded
    e->src_scale = static_cast<float>(AsDouble(h[kSrcScale]));
    e->src_zp = static_cast<int32_t>(h[kSrcZP]);
    e->scale_1 = memory::desc({1}, memory::data_type::f32, Tag::a);
    e->zp_1 = memory::desc({1}, memory::data_type::s32, Tag::a);
    e->wei_scales = memory::desc({h[kOC]}, memory::data_type::f32, Tag::a);
    dnnl::primitive_attr attr = UserScratchpad();
    attr.set_scales_mask(DNNL_ARG_DST, 0);
    attr.set_zero_points_mask(DNNL_ARG_DST, 0);
    auto pd = dnnl::reorder::primitive_desc(Engine(), e->src_user, Engine(), e->src, attr);
    e->to_src = dnnl::reorder(pd);
    e->to_src_pad = pd.scratchpad_desc();
  } else if (e->reorder_src) {
    reorder(e->to_src, e->to_src_pad, e->src_user, e->src);
  }
  if (e->reorder_dst) {
    reorder(e->from_dst, e->from_dst_pad, h.pooled() ? e->pooled : e->dst, e->dst_user);
  }
  if (e->reorder_res) reorder(e->residual_to_dst, e->residual_pad, e->res_user, e->dst);
  if (h[kKind] == kDense) ChunkRows(*e);
  return e;
}

// The entry of a call site: per (blob address, thread count), remade when the blob's header
// changed; a re-pack is shared by the thread counts that pick the same layout. Called with the
// caller's OpenMP thread count set: oneDNN's choices depend on it. A module's pools drop their
// blobs' entries when they are freed (`Forget`); past a bound both caches start over (entries
// in use live on, shared; the bounds kMaxEntries and kMaxRepacks).
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
  size_t bytes = static_cast<size_t>(h[kBiasOffset] + h.tail_bytes() - kHeaderBytes);
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

// The sum-post-op twin of a convolution that reads its residual with a binary add: same
// source, destination and packed weights, or none (then the caller copies the residual away).
bool InPlaceTwin(Entry& e) {
  std::call_once(e.in_place_once, [&e] {
    const Header& h = e.layout;
    try {
      dnnl::primitive_desc pd = MakeDesc(
          h, memory::desc(WeightDims(h), WeiDt(h), Tag::any), true);
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

int64_t CachedEntries() {  // (entries, re-packs) held: what a soak test watches
  EntryCache& c = Entries();
  std::lock_guard<std::mutex> lock(c.mu);
  return static_cast<int64_t>(c.entries.size() * 1000000 + c.repacks.size());
}

}  // namespace hgrt_onednn
