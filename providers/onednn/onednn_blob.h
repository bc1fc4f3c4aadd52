// The packed-weight blob's header, generated from providers/onednn/blob.py:
//   python -m hgrt.providers.onednn.blob > providers/onednn/onednn_blob.h
// Edit that file and generate this one; tests/runtime/test_blob_format.py compares.
#pragma once

#include <cstdint>

namespace hgrt_onednn {

constexpr int64_t kMagic = 0x4c4e4e4454524748;
constexpr int64_t kVersion = 4;
constexpr int64_t kVersionWinograd = 5;
constexpr int64_t kVersionEltwise = 6;
constexpr int64_t kVersionQuant = 7;
constexpr int64_t kVersionInt8 = 8;
constexpr int kSlots = 64;
constexpr int kMaxPostOps = 3;
constexpr int64_t kHeaderBytes = 8 * static_cast<int64_t>(kSlots);

enum Slot : int {
  kMagicSlot = 0,
  kVersionSlot = 1,
  kKind = 2,
  kN = 3,
  kIC = 4,
  kIH = 5,
  kIW = 6,
  kOC = 7,
  kOH = 8,
  kOW = 9,
  kKH = 10,
  kKW = 11,
  kSH = 12,
  kSW = 13,
  kPadT = 14,
  kPadL = 15,
  kPadB = 16,
  kPadR = 17,
  kDilH = 18,
  kDilW = 19,
  kGroups = 20,
  kPost0 = 21,
  kPost0Alpha = 22,
  kPost0Beta = 23,
  kPost1 = 24,
  kPost1Alpha = 25,
  kPost1Beta = 26,
  kPost2 = 27,
  kPost2Alpha = 28,
  kPost2Beta = 29,
  kWeiTag = 30,
  kWeiOffset = 31,
  kWeiBytes = 32,
  kBiasOffset = 33,
  kIsa = 34,
  kDnnlVersion = 35,
  kSrcTag = 36,
  kDstTag = 37,
  kResTag = 38,
  kChecksum = 39,
  kPoolKH = 40,
  kPoolKW = 41,
  kPoolSH = 42,
  kPoolSW = 43,
  kPoolPadT = 44,
  kPoolPadL = 45,
  kPoolPadB = 46,
  kPoolPadR = 47,
  kPoolOH = 48,
  kPoolOW = 49,
  kAlgo = 50,
  kSrcDT = 51,
  kSrcScale = 52,
  kSrcZP = 53,
  kUsedSlots = 54,
};

enum Kind : int64_t {
  kConv2d = 1,
  kDense = 2,
};

enum PostOp : int64_t {
  kNoPost = 0,
  kRelu = 1,
  kClip = 2,
  kSum = 3,
  kGeluErf = 4,
  kGeluTanh = 5,
  kSwish = 6,
  kHardswish = 7,
  kSigmoid = 8,
  kTanh = 9,
  kQuantS8 = 10,
  kQuantU8 = 11,
};

enum Algo : int64_t {
  kDirect = 0,
  kWinograd = 1,
};

enum SrcDt : int64_t {
  kFloat32 = 0,
  kUint8 = 1,
};

struct BlobFormatEntry {
  const char* name;
  int64_t value;
};

// every number of the format by name, as onednn_blob.blob_format() lists them
constexpr BlobFormatEntry kBlobFormat[] = {
    {"magic", kMagic},
    {"version", kVersion},
    {"version_winograd", kVersionWinograd},
    {"version_eltwise", kVersionEltwise},
    {"version_quant", kVersionQuant},
    {"version_int8", kVersionInt8},
    {"header_int64", kSlots},
    {"max_post_ops", kMaxPostOps},
    {"slot.magic", kMagicSlot},
    {"slot.version", kVersionSlot},
    {"slot.kind", kKind},
    {"slot.n", kN},
    {"slot.ic", kIC},
    {"slot.ih", kIH},
    {"slot.iw", kIW},
    {"slot.oc", kOC},
    {"slot.oh", kOH},
    {"slot.ow", kOW},
    {"slot.kh", kKH},
    {"slot.kw", kKW},
    {"slot.sh", kSH},
    {"slot.sw", kSW},
    {"slot.pad_t", kPadT},
    {"slot.pad_l", kPadL},
    {"slot.pad_b", kPadB},
    {"slot.pad_r", kPadR},
    {"slot.dil_h", kDilH},
    {"slot.dil_w", kDilW},
    {"slot.groups", kGroups},
    {"slot.post0", kPost0},
    {"slot.post0_alpha", kPost0Alpha},
    {"slot.post0_beta", kPost0Beta},
    {"slot.post1", kPost1},
    {"slot.post1_alpha", kPost1Alpha},
    {"slot.post1_beta", kPost1Beta},
    {"slot.post2", kPost2},
    {"slot.post2_alpha", kPost2Alpha},
    {"slot.post2_beta", kPost2Beta},
    {"slot.wei_tag", kWeiTag},
    {"slot.wei_offset", kWeiOffset},
    {"slot.wei_bytes", kWeiBytes},
    {"slot.bias_offset", kBiasOffset},
    {"slot.isa", kIsa},
    {"slot.dnnl_version", kDnnlVersion},
    {"slot.src_tag", kSrcTag},
    {"slot.dst_tag", kDstTag},
    {"slot.res_tag", kResTag},
    {"slot.checksum", kChecksum},
    {"slot.pool_kh", kPoolKH},
    {"slot.pool_kw", kPoolKW},
    {"slot.pool_sh", kPoolSH},
    {"slot.pool_sw", kPoolSW},
    {"slot.pool_pad_t", kPoolPadT},
    {"slot.pool_pad_l", kPoolPadL},
    {"slot.pool_pad_b", kPoolPadB},
    {"slot.pool_pad_r", kPoolPadR},
    {"slot.pool_oh", kPoolOH},
    {"slot.pool_ow", kPoolOW},
    {"slot.algo", kAlgo},
    {"slot.src_dt", kSrcDT},
    {"slot.src_scale", kSrcScale},
    {"slot.src_zp", kSrcZP},
    {"kind.conv2d", kConv2d},
    {"kind.dense", kDense},
    {"post_op.relu", kRelu},
    {"post_op.clip", kClip},
    {"post_op.sum", kSum},
    {"post_op.gelu_erf", kGeluErf},
    {"post_op.gelu_tanh", kGeluTanh},
    {"post_op.swish", kSwish},
    {"post_op.hardswish", kHardswish},
    {"post_op.sigmoid", kSigmoid},
    {"post_op.tanh", kTanh},
    {"post_op.quant_s8", kQuantS8},
    {"post_op.quant_u8", kQuantU8},
    {"algo.direct", kDirect},
    {"algo.winograd", kWinograd},
    {"src_dt.float32", kFloat32},
    {"src_dt.uint8", kUint8},
};

}  // namespace hgrt_onednn
