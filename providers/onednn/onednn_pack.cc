// hgrt's oneDNN kernels: weights packed at build into a blob (header, weights in the layout
// oneDNN picks, bias), re-packed once where another CPU picks another layout, and the
// checksum that ties a blob's header to its bytes.
#include "onednn_shim.h"

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
  memory::desc any(WeightDims(h), WeiDt(h), Tag::any);
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
  h[kVersionSlot] = h.version();
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
std::shared_ptr<Repacked> Repack(const char* blob, const Header& layout) {
  const Header& h = *reinterpret_cast<const Header*>(blob);
  auto r = std::make_shared<Repacked>();
  r->layout = layout;
  size_t bytes = static_cast<size_t>(r->layout[kBiasOffset] + h.tail_bytes());
  r->storage.reset(new char[bytes + 64]);
  r->base = r->storage.get() + (64 - reinterpret_cast<uintptr_t>(r->storage.get()) % 64) % 64;
  memory src(WeightsWithTag(h, h[kWeiTag]), Engine(), const_cast<char*>(blob) + h[kWeiOffset]);
  memory dst(WeightsWithTag(r->layout, r->layout[kWeiTag]), Engine(),
             r->base + r->layout[kWeiOffset]);
  dnnl::reorder(src, dst).execute(Stream(), src, dst);
  Stream().wait();
  std::memcpy(r->base + r->layout[kBiasOffset], blob + h[kBiasOffset],
              static_cast<size_t>(h.tail_bytes()));
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

// ---- packing at build ---------------------------------------------------------------------

int64_t PackedBytes(const ffi::TensorView& header) {
  Header h = Layout(ReadPlainHeader(header));
  return h[kBiasOffset] + h.tail_bytes();
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
    int64_t bytes = h.int8() ? 1 : 4;
    CheckTensor(weight, "weight", h.int8() ? kS8 : kF32,
                static_cast<int64_t>(plain.get_size()) / bytes);
  }
  // the bias, then an int8 kernel's weight scales
  CheckTensor(bias, "bias", kF32, h.tail_bytes() / 4);
  CheckTensor(blob, "packed weights", kU8, h[kBiasOffset] + h.tail_bytes());
  char* base = static_cast<char*>(DataOf(blob));
  std::memset(base, 0, static_cast<size_t>(blob.numel()));
  std::memcpy(base, &h, sizeof(Header));
  memory src(plain, Engine(), plain_data);
  memory dst(WeightsWithTag(h, h[kWeiTag]), Engine(), base + h[kWeiOffset]);
  dnnl::reorder(src, dst).execute(Stream(), src, dst);
  Stream().wait();
  std::memcpy(base + h[kBiasOffset], DataOf(bias), static_cast<size_t>(h.tail_bytes()));
  h[kChecksum] = 0;
  std::memcpy(base, &h, sizeof(Header));
  h[kChecksum] = BlobChecksum(base, static_cast<size_t>(blob.numel() - kHeaderBytes));
  std::memcpy(base, &h, sizeof(Header));
}

}  // namespace hgrt_onednn
