// A Llama-family decoder forward for x86 CPUs with AVX-512 (bf16 weights need AVX512_BF16).
//
// Why it exists: transformers' CPU step spends most of its time in per-op overhead and in GEMM
// kernels that are far from the memory bandwidth for 1-9 rows; and those kernels give a row other
// bits depending on how many rows share the call, which breaks exact speculation.
//
// Exactness by construction: every output element (row r, feature o) is computed by the same
// instruction sequence whatever the number of rows in the call or the number of threads: GEMMs
// parallelise over output panels only and keep a fixed pair of accumulators per (row, panel);
// attention for a row at position p reads exactly keys [0, p] and nothing else.
//
// Token trees: a call may carry parents (row -> earlier row of the call, -1 for a child of the
// prefix, or -2 - s for a child of cache slot s written by an earlier call, whose own parent slot
// is slot_parents[s - base], -1 for the prefix). The prefix is [0, base) (base = start unless a
// tree grows over several calls). A row then sits at position base + depth and attends the prefix
// and its own ancestors in depth order, read in the same order and summed the same way as if its
// path alone had been fed as a chain: each row's result is bit-identical to decoding its path one
// by one. Its key and value are stored in slot start + row; the caller keeps one path by moving
// its slots down (KVBuffer.keep), so rolling back stays a length change.
//
// Batches: forward_batch runs the rows of several sequences (each with its own cache, start and
// optional tree) in one call. GEMMs do not look at which sequence a row belongs to, and attention
// reads only the row's own cache, so every row's result is bit-identical to running its sequence
// alone: batching across sessions keeps speculation exact.
//
// Layouts: weights are packed once into 16-output panels, [N/16][K/2][16][2] bf16 pairs (for
// vdpbf16ps), the same in int8 with a scale per output (weight-only quantization), or
// [N/16][K][16] fp32, or q8_0: [N/16][K/4][16][4] int8 quads (for vpdpbusd) with a scale per
// output and block of 32 inputs; activations between ops are fp32 [rows][features] (q8_0: each
// GEMM input quantized to int8 per row and block of 32, as llama.cpp's q8 blocks); the KV
// cache is the model dtype, [layers][2][capacity][kv_heads][head_dim].
//
// q8_0 exactness: a block's 32 products are summed in int32 (exact in any order), converted to
// float exactly (|sum| < 2^24) and added to the row's float accumulator block by block in input
// order, so a row's result still does not depend on the other rows or the threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;
constexpr int kMaxRows = 8;  // rows per register block of a GEMM
constexpr int kPrefetchBytes = 2048;  // how far ahead in a panel's weight stream to prefetch

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline __m512 load_bf16x16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// exp for x in [-87, 88] (clamped): Cody-Waite range reduction and Cephes' expf polynomial.
// Deterministic, lane by lane.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// A packed weight matrix and how to multiply rows by it.
enum class Kind { kBF16, kF32, kI8, kQ8, kQ4, kQ41 };
// What a Decoder's GEMM weights are: the model's dtype, int8 weight-only, q8_0 (int8 weights and
// activations in blocks of 32) or q4_0 (4-bit weights in blocks of 32, int8 activations).
enum class Quant : int64_t { kNone = 0, kInt8 = 1, kQ8 = 2, kQ4 = 3 };
constexpr int64_t kBlock = 32;  // q8_0: inputs per scale

struct Packed {
  torch::Tensor data;  // bf16 or int8 pairs, fp32 panels, or q8_0 quads
  torch::Tensor scale;  // int8: float32 per output (w = q * scale); q8_0: per panel, block and output
  torch::Tensor corr;  // q8_0: 128 * the sum of each block's weights, per panel, block and output (int32)
  torch::Tensor mins;  // q4_1: m per panel, block and output
  const void* ptr = nullptr;  // data's storage (read in hot loops; data_ptr<T>() checks cost there)
  const float* scale_ptr = nullptr;
  const int32_t* corr_ptr = nullptr;
  const float* min_ptr = nullptr;
  bool amx = false;  // bf16 on AMX tiles (tdpbf16ps) for every row count
  int64_t n = 0, k = 0, k2 = 0;  // outputs, inputs, inputs rounded up to even (q8_0: to a whole block)
  Kind kind = Kind::kBF16;
  int64_t panels() const { return (n + kLanes - 1) / kLanes; }
};

// Weight-only int8, symmetric per output row: q = round(w / s), s = max|w| / 127. The pairs layout
// is the bf16 one, so the GEMM widens a pair to bf16 (exact: |q| <= 127) and scales at the end.
Packed pack_int8(const torch::Tensor& weight) {
  Packed p;
  p.kind = Kind::kI8;
  p.n = weight.size(0);
  p.k = weight.size(1);
  p.k2 = (p.k + 1) / 2 * 2;
  auto w = weight.to(torch::kFloat32);
  auto scale = w.abs().amax({1}).clamp_min(1e-12) / 127.0;
  auto q = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch::kInt8).contiguous();
  p.data = torch::zeros({p.panels() * p.k2 * kLanes}, torch::kInt8);
  auto* dst = p.data.data_ptr<int8_t>();
  const auto* src = q.data_ptr<int8_t>();
  for (int64_t o = 0; o < p.n; ++o)
    for (int64_t i = 0; i < p.k; ++i)
      dst[((o / kLanes) * (p.k2 / 2) + i / 2) * 2 * kLanes + (o % kLanes) * 2 + (i % 2)] = src[o * p.k + i];
  p.scale = torch::zeros({p.panels() * kLanes}, torch::kFloat32);
  p.scale.narrow(0, 0, p.n).copy_(scale);
  p.ptr = p.data.data_ptr();
  p.scale_ptr = p.scale.data_ptr<float>();
  return p;
}

// Block formats (llama.cpp's, one scale d per output and block of 32 inputs), packed as 16-output
// panels for vpdpbusd, which multiplies unsigned by signed bytes: activations travel as x + 128
// and each block's sum is corrected by 128 * sum(q).
// - q8_0: q in [-127, 127], w = d q; quads [panels][k2/4][16][4] (quad j: inputs 4j..4j+3).
// - q4_0: w = d (u - 8), u a nibble; q4_1: w = d u + m. Nibbles as GGUF keeps them (byte j of a
//   block: input j in the low nibble, input j + 16 in the high), [panels][blocks][4][16][4]: so
//   vector v of a block holds quad v (low nibbles) and quad v + 4 (high), widened in registers.
void finish_blocks(Packed& p, const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m) {
  const int64_t blocks = p.k2 / kBlock, panels = p.panels();
  auto by_panel = [&](const torch::Tensor& t) {  // [outputs, blocks] -> [panels][blocks][16], padded
    auto padded = torch::zeros({panels * kLanes, blocks}, t.scalar_type());
    padded.narrow(0, 0, p.n).copy_(t);
    return padded.view({panels, kLanes, blocks}).permute({0, 2, 1}).contiguous().view({-1});
  };
  p.scale = by_panel(d.to(torch::kFloat32));
  p.corr = by_panel(q.to(torch::kInt32).sum(2).to(torch::kInt32) * 128);
  p.scale_ptr = p.scale.data_ptr<float>();
  p.corr_ptr = p.corr.data_ptr<int32_t>();
  if (m.defined()) {
    p.mins = by_panel(m.to(torch::kFloat32));
    p.min_ptr = p.mins.data_ptr<float>();
  }
  p.ptr = p.data.data_ptr();
}

// q [n, blocks, 32] int8, d [n, blocks].
Packed blocks_q8(const torch::Tensor& q, const torch::Tensor& d, int64_t k) {
  Packed p;
  p.kind = Kind::kQ8;
  p.n = q.size(0);
  p.k = k;
  p.k2 = q.size(1) * kBlock;
  TORCH_CHECK(q.size(2) == kBlock && p.k2 >= k && p.k2 - k < kBlock, "q8_0 blocks must be [n, ceil(k / 32), 32]");
  auto padded = torch::zeros({p.panels() * kLanes, p.k2}, torch::kInt8);
  padded.narrow(0, 0, p.n).copy_(q.reshape({p.n, p.k2}));
  p.data = padded.view({p.panels(), kLanes, p.k2 / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({-1});
  finish_blocks(p, q, d, torch::Tensor());
  return p;
}

// nibbles [n, blocks, 16] uint8 as GGUF stores them; d [n, blocks]; m [n, blocks] (q4_1) or undefined (q4_0).
Packed blocks_q4(const torch::Tensor& nibbles, const torch::Tensor& d, const torch::Tensor& m, int64_t k) {
  Packed p;
  p.kind = m.defined() ? Kind::kQ41 : Kind::kQ4;
  p.n = nibbles.size(0);
  p.k = k;
  const int64_t blocks = nibbles.size(1);
  p.k2 = blocks * kBlock;
  TORCH_CHECK(nibbles.size(2) == kBlock / 2 && p.k2 >= k && p.k2 - k < kBlock,
              "q4 blocks must be [n, ceil(k / 32), 16]");
  auto padded = torch::zeros({p.panels() * kLanes, blocks, kBlock / 2}, torch::kUInt8);
  if (!m.defined()) padded.fill_(0x88);  // padding outputs: nibbles 8 are zeros in q4_0
  padded.narrow(0, 0, p.n).copy_(nibbles);
  p.data = padded.view({p.panels(), kLanes, blocks, 4, 4}).permute({0, 2, 3, 1, 4}).contiguous().view({-1});
  auto u = nibbles.to(torch::kInt32);
  auto q = torch::cat({u.bitwise_and(15), u.bitwise_right_shift(4)}, 2);  // [n, blocks, 32]: inputs 0..15, 16..31
  finish_blocks(p, m.defined() ? q : q - 8, d, m);
  return p;
}

// Quantizes float weights [n, k] into one of the block formats.
Packed pack_blocks(const torch::Tensor& weight, Quant quant) {
  const int64_t n = weight.size(0), k = weight.size(1), k2 = (k + kBlock - 1) / kBlock * kBlock;
  auto w = torch::zeros({n, k2}, torch::kFloat32);
  w.narrow(1, 0, k).copy_(weight.to(torch::kFloat32));
  auto wb = w.view({n, k2 / kBlock, kBlock});
  if (quant == Quant::kQ8) {
    auto d = wb.abs().amax({2}) / 127.0;
    auto q = (wb / d.clamp_min(1e-30).unsqueeze(2)).round().clamp(-127, 127).to(torch::kInt8);
    return blocks_q8(q, d, k);
  }
  auto d = wb.gather(2, wb.abs().argmax(2, true)).squeeze(2) / -8.0;  // llama.cpp's Q4_0 rounding
  auto inv = torch::where(d == 0, torch::zeros_like(d), 1.0 / d);
  auto u = ((wb * inv.unsqueeze(2)).round().clamp(-8, 7) + 8).to(torch::kInt32);
  auto nibbles = (u.narrow(2, 0, kBlock / 2) + u.narrow(2, kBlock / 2, kBlock / 2) * 16).to(torch::kUInt8);
  return blocks_q4(nibbles, d, torch::Tensor(), k);
}

Packed pack(const torch::Tensor& weight, Quant quant = Quant::kNone) {
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D");
  if (quant == Quant::kInt8) return pack_int8(weight);
  if (quant == Quant::kQ8 || quant == Quant::kQ4) return pack_blocks(weight, quant);
  Packed p;
  p.n = weight.size(0);
  p.k = weight.size(1);
  const bool bf16 = weight.scalar_type() == torch::kBFloat16;
  p.kind = bf16 ? Kind::kBF16 : Kind::kF32;
  TORCH_CHECK(bf16 || weight.scalar_type() == torch::kFloat32, "weights must be bfloat16 or float32");
  auto w = weight.contiguous();
  const int64_t panels = p.panels();
  if (bf16) {
    p.k2 = (p.k + 1) / 2 * 2;
    p.data = torch::zeros({panels * p.k2 * kLanes}, torch::kInt16);
    auto* dst = reinterpret_cast<uint16_t*>(p.data.data_ptr<int16_t>());
    const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    for (int64_t o = 0; o < p.n; ++o)
      for (int64_t i = 0; i < p.k; ++i)
        dst[((o / kLanes) * (p.k2 / 2) + i / 2) * 2 * kLanes + (o % kLanes) * 2 + (i % 2)] = src[o * p.k + i];
  } else {
    p.k2 = p.k;
    p.data = torch::zeros({panels * p.k * kLanes}, torch::kFloat32);
    float* dst = p.data.data_ptr<float>();
    const float* src = w.data_ptr<float>();
    for (int64_t o = 0; o < p.n; ++o)
      for (int64_t i = 0; i < p.k; ++i) dst[((o / kLanes) * p.k + i) * kLanes + (o % kLanes)] = src[o * p.k + i];
  }
  p.ptr = p.data.data_ptr();
  return p;
}

constexpr int kTileRows = 16;  // AMX: rows of a tile

// Activation rows as the GEMM reads them: bf16 pairs, fp32, or q8 blocks (x + 128 as bytes and a
// scale per block), `stride` elements apart.
struct Rows {
  std::vector<uint16_t> h;
  std::vector<float> f;
  std::vector<uint8_t> q;
  std::vector<float> qs;  // q8: per row and block, x = (q - 128) * qs
  std::vector<float> qsum;  // q8: per row and block, qs * sum(q - 128): what q4_1's m multiplies
  int64_t stride = 0;
};

enum class Act { kF32, kBF16, kQ8 };

// One row quantized per block of 32: s = max|x| / 127, q = round-to-nearest-even(x / s) + 128.
void quantize_row_q8(const float* src, int64_t k, int64_t stride, uint8_t* dst, float* scales, float* sums) {
  alignas(64) float tmp[kBlock];
  for (int64_t b = 0; b * kBlock < stride; ++b) {
    const int64_t n = std::min<int64_t>(kBlock, std::max<int64_t>(0, k - b * kBlock));
    for (int64_t i = 0; i < kBlock; ++i) tmp[i] = i < n ? src[b * kBlock + i] : 0.0f;
    const __m512 lo = _mm512_load_ps(tmp), hi = _mm512_load_ps(tmp + kLanes);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.0f;
    scales[b] = s;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i off = _mm512_set1_epi32(128);
    const __m512i qlo = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), off);
    const __m512i qhi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * kBlock), _mm512_cvtusepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * kBlock + kLanes), _mm512_cvtusepi32_epi8(qhi));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)) - 128 * kBlock;  // exact
    sums[b] = s * static_cast<float>(total);
  }
}

// Sizes `out` for `rows` rows of k features (done once, before the rows are filled in parallel).
void shape_rows(int64_t rows, int64_t k, Act act, Rows& out) {
  if (act == Act::kQ8) {
    out.stride = (k + kBlock - 1) / kBlock * kBlock;
    out.q.resize(rows * out.stride);
    out.qs.resize(rows * out.stride / kBlock);
    out.qsum.resize(rows * out.stride / kBlock);
  } else if (act == Act::kF32) {
    out.stride = k;
    out.f.resize(rows * k);
  } else {
    out.stride = (k + 1) / 2 * 2;
    // Whole tiles of 16 rows for AMX (a tile row depends only on its own input row: padding is never read back).
    out.h.resize((rows + kTileRows - 1) / kTileRows * kTileRows * out.stride);
  }
}

// Row r of `out` (shaped for k features) from src.
void row_to(const float* src, int64_t r, int64_t k, Act act, Rows& out) {
  if (act == Act::kQ8) {
    const int64_t blocks = out.stride / kBlock;
    quantize_row_q8(src, k, out.stride, out.q.data() + r * out.stride, out.qs.data() + r * blocks,
                    out.qsum.data() + r * blocks);
    return;
  }
  if (act == Act::kF32) {
    std::memcpy(out.f.data() + r * k, src, k * 4);
    return;
  }
  uint16_t* dst = out.h.data() + r * out.stride;
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)  // round to nearest even, like f32_to_bf16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  for (; i < k; ++i) dst[i] = f32_to_bf16(src[i]);
  if (out.stride > k) dst[k] = 0;
}

void to_rows(const float* x, int64_t rows, int64_t k, Act act, Rows& out) {
  shape_rows(rows, k, act, out);
  for (int64_t r = 0; r < rows; ++r) row_to(x + r * k, r, k, act, out);
}

// 16 int8 pairs (32 bytes) widened to 32 bf16 in the same order.
inline __m512bh i8_pairs_to_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The weights of one input pair for a panel's 16 outputs, as bf16: loaded, or widened from int8.
template <bool I8>
inline __m512bh pair_weights(const char* panel, int64_t kp) {
  if constexpr (I8) return i8_pairs_to_bf16(reinterpret_cast<const int8_t*>(panel) + kp * 2 * kLanes);
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t*>(panel) + kp * 2 * kLanes);
}

// bf16 or int8 pairs. Two accumulators per row (even and odd input pairs), summed at the end:
// twice the independent dependency chains (vdpbf16ps has a latency of several cycles), the same
// order for every row count. int8 scales the sum per output.
template <int R, bool I8>
void panel_pairs(const Packed& w, int64_t panel, const uint16_t* x, int64_t stride, float* y, int64_t ldy) {
  constexpr int64_t kPairBytes = I8 ? 2 * kLanes : 4 * kLanes;  // one input pair of a panel
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const char* wp = static_cast<const char*>(w.ptr) + panel * (w.k2 / 2) * kPairBytes;
  const int64_t pairs = w.k2 / 2;
  int64_t kp = 0;
  for (; kp + 2 <= pairs; kp += 2) {
    const __m512bh w0 = pair_weights<I8>(wp, kp);
    const __m512bh w1 = pair_weights<I8>(wp, kp + 1);
    // Stream ahead: with several rows the panel's compute outlasts its load, and the hardware
    // prefetcher alone leaves DRAM idle meanwhile.
    _mm_prefetch(wp + kp * kPairBytes + kPrefetchBytes, _MM_HINT_T0);
    if constexpr (!I8) _mm_prefetch(wp + kp * kPairBytes + kPrefetchBytes + 64, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      int32_t p0, p1;
      std::memcpy(&p0, x + r * stride + 2 * kp, 4);
      std::memcpy(&p1, x + r * stride + 2 * kp + 2, 4);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(p0), w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32(p1), w1);
    }
  }
  if (kp < pairs) {
    const __m512bh w0 = pair_weights<I8>(wp, kp);
    for (int r = 0; r < R; ++r) {
      int32_t p0;
      std::memcpy(&p0, x + r * stride + 2 * kp, 4);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(p0), w0);
    }
  }
  const int64_t o = panel * kLanes;
  const __mmask16 m = (w.n - o >= kLanes) ? 0xffff : static_cast<__mmask16>((1u << (w.n - o)) - 1);
  const __m512 scale = I8 ? _mm512_loadu_ps(w.scale_ptr + o) : _mm512_set1_ps(1.0f);  // padded to whole panels
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(y + r * ldy + o, m, _mm512_mul_ps(_mm512_add_ps(acc[r][0], acc[r][1]), scale));
}

template <int R>
void panel_f32(const Packed& w, int64_t panel, const float* x, int64_t stride, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const float* wp = static_cast<const float*>(w.ptr) + panel * w.k * kLanes;
  for (int64_t i = 0; i < w.k; ++i) {
    __m512 wv = _mm512_loadu_ps(wp + i * kLanes);
    _mm_prefetch(reinterpret_cast<const char*>(wp + i * kLanes) + 2 * kPrefetchBytes, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * stride + i]), wv, acc[r]);
  }
  const int64_t o = panel * kLanes;
  const __mmask16 m = (w.n - o >= kLanes) ? 0xffff : static_cast<__mmask16>((1u << (w.n - o)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + o, m, acc[r]);
}

// q8_0 weights by q8 activations: per block, two int32 chains of vpdpbusd (even and odd quads),
// summed, corrected for the +128 offset, converted to float and scaled into the row's float
// accumulator, block after block in input order (the same for every row count).
// FMT: 0 q8_0, 1 q4_0, 2 q4_1 (q4_1 adds m * qs * sum(q) per block, after the block's product).
template <int R, int FMT>
void panel_q8(const Packed& w, int64_t panel, const uint8_t* x, const float* xs, const float* xsum, int64_t stride,
              float* y, int64_t ldy) {
  constexpr bool Q4 = FMT > 0;
  const int64_t blocks = w.k2 / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t kBlockBytes = Q4 ? kBlock * kLanes / 2 : kBlock * kLanes;  // 256 or 512 bytes a block
  const int8_t* wp = static_cast<const int8_t*>(w.ptr) + panel * blocks * kBlockBytes;
  const float* sp = w.scale_ptr + panel * blocks * kLanes;
  const int32_t* cp = w.corr_ptr + panel * blocks * kLanes;
  const float* mp = FMT == 2 ? w.min_ptr + panel * blocks * kLanes : nullptr;
  constexpr int kQuads = kBlock / 4;  // 8 quads of 16 outputs
  const __m512i nibble = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(FMT == 1 ? 8 : 0);
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = wp + b * kBlockBytes;
    __m512i wq[kQuads];
    if constexpr (Q4) {
      for (int v = 0; v < kQuads / 2; ++v) {
        const __m512i packed = _mm512_loadu_si512(wb + v * 4 * kLanes);
        _mm_prefetch(reinterpret_cast<const char*>(wb + v * 4 * kLanes) + kPrefetchBytes, _MM_HINT_T0);
        wq[v] = _mm512_sub_epi8(_mm512_and_si512(packed, nibble), eight);
        wq[v + kQuads / 2] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble), eight);
      }
    } else {
      for (int j = 0; j < kQuads; ++j) {
        wq[j] = _mm512_loadu_si512(wb + j * 4 * kLanes);
        _mm_prefetch(reinterpret_cast<const char*>(wb + j * 4 * kLanes) + kPrefetchBytes, _MM_HINT_T0);
      }
    }
    const __m512 ws = _mm512_loadu_ps(sp + b * kLanes);
    const __m512i corr = _mm512_loadu_si512(cp + b * kLanes);
    for (int r = 0; r < R; ++r) {
      const uint8_t* xb = x + r * stride + b * kBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < kQuads; j += 2) {
        int32_t q0, q1;
        std::memcpy(&q0, xb + 4 * j, 4);
        std::memcpy(&q1, xb + 4 * j + 4, 4);
        s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(q0), wq[j]);
        s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(q1), wq[j + 1]);
      }
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), corr);
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(xs[r * (stride / kBlock) + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
      if constexpr (FMT == 2)
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(mp + b * kLanes), _mm512_set1_ps(xsum[r * (stride / kBlock) + b]),
                                 acc[r]);
    }
  }
  const int64_t o = panel * kLanes;
  const __mmask16 m = (w.n - o >= kLanes) ? 0xffff : static_cast<__mmask16>((1u << (w.n - o)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + o, m, acc[r]);
}

template <int R, int FMT>
void panel_q(const Packed& w, int64_t panel, const Rows& x, int64_t row, float* y, int64_t ldy) {
  const int64_t blocks = x.stride / kBlock;
  panel_q8<R, FMT>(w, panel, x.q.data() + row * x.stride, x.qs.data() + row * blocks, x.qsum.data() + row * blocks,
                   x.stride, y + row * ldy, ldy);
}

template <int R>
void panel_any(const Packed& w, int64_t panel, const Rows& x, int64_t row, float* y, int64_t ldy) {
  switch (w.kind) {
    case Kind::kQ8: panel_q<R, 0>(w, panel, x, row, y, ldy); break;
    case Kind::kQ4: panel_q<R, 1>(w, panel, x, row, y, ldy); break;
    case Kind::kQ41: panel_q<R, 2>(w, panel, x, row, y, ldy); break;
    case Kind::kBF16: panel_pairs<R, false>(w, panel, x.h.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
    case Kind::kI8: panel_pairs<R, true>(w, panel, x.h.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
    case Kind::kF32: panel_f32<R>(w, panel, x.f.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
  }
}

// AMX, bf16 weights: tiles 0 (C, 16 rows x 16 fp32), 1 (A, 16 rows x 32 bf16), 2 (B, 16 input
// pairs x 16 outputs: 16 consecutive pairs of a panel, the bf16 layout as packed). A row's output
// is the tdpbf16ps sums over the input in chunk order, whatever the other rows of the tile: as
// exact by construction as the vdpbf16ps path, with other bits, so a model uses one or the other
// for every row count (Packed::amx, chosen at load).
// GCC's tile intrinsics are asm statements that do not tell the compiler they read or write memory:
// without these barriers it may sink (or drop) our stores to a buffer past the tileloadd that reads it,
// or read a buffer before the tilestored that fills it (seen: NaN attention once the code around moved).
#define TILE_LOAD(t, base, stride)   \
  do {                               \
    asm volatile("" : : : "memory"); \
    _tile_loadd(t, base, stride);    \
  } while (0)
#define TILE_STORE(t, base, stride)  \
  do {                               \
    _tile_stored(t, base, stride);   \
    asm volatile("" : : : "memory"); \
  } while (0)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux hands out the tile state on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

__attribute__((target("amx-tile,amx-bf16")))
void configure_tiles() {  // per thread and call: other code (oneDNN) may configure tiles on the same threads
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = 64;
  }
  // GCC 12 does not see that ldtilecfg reads its operand and drops the stores above without this.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// r[i][j] <- r[j][i] for a 16 x 16 block of 32-bit elements.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// Two rows of 16 bf16 (as 16-bit lanes) interleaved into 16 pairs: lo in the low half of each dword.
inline __m512i pair16(__m256i lo, __m256i hi) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

// NR row tiles by NP panels (tiles 0-3 accumulate, 4-5 rows, 6-7 weights): each operand tile
// loaded once serves two products. `rows` valid rows from x (whole tiles are always there).
template <int NR, int NP>
__attribute__((target("amx-tile,amx-bf16")))
void panels_amx(const Packed& w, int64_t panel, const uint16_t* x, int64_t stride, int64_t rows, float* y,
                int64_t ldy) {
  alignas(64) float c[kTileRows * kLanes];
  const int64_t pbytes = (w.k2 / 2) * 4 * kLanes;  // one panel's weights
  const char* wp = static_cast<const char*>(w.ptr) + panel * pbytes;
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NR > 1) _tile_zero(2);
  if constexpr (NR > 1 && NP > 1) _tile_zero(3);
  for (int64_t kc = 0; kc < w.k2 / 32; ++kc) {
    TILE_LOAD(4, x + kc * 32, stride * 2);
    TILE_LOAD(6, wp + kc * 16 * 4 * kLanes, 4 * kLanes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP > 1) {
      TILE_LOAD(7, wp + pbytes + kc * 16 * 4 * kLanes, 4 * kLanes);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NR > 1) {
      TILE_LOAD(5, x + kTileRows * stride + kc * 32, stride * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  auto put = [&](int64_t p, int64_t r0) {  // c -> y for tile (row tile r0, panel p)
    const int64_t o = p * kLanes;
    const __mmask16 m = (w.n - o >= kLanes) ? 0xffff : static_cast<__mmask16>((1u << (w.n - o)) - 1);
    for (int64_t r = r0; r < std::min<int64_t>(rows, r0 + kTileRows); ++r)
      _mm512_mask_storeu_ps(y + r * ldy + o, m, _mm512_load_ps(c + (r - r0) * kLanes));
  };
  TILE_STORE(0, c, 4 * kLanes);
  put(panel, 0);
  if constexpr (NP > 1) {
    TILE_STORE(1, c, 4 * kLanes);
    put(panel + 1, 0);
  }
  if constexpr (NR > 1) {
    TILE_STORE(2, c, 4 * kLanes);
    put(panel, kTileRows);
    if constexpr (NP > 1) {
      TILE_STORE(3, c, 4 * kLanes);
      put(panel + 1, kTileRows);
    }
  }
}

// AMX GEMM for one thread's share of the panels: blocks of panels that stay in L2 while every
// 32 rows of x pass by (rows are read once per block, the weights once).
void gemm_amx(const Packed& w, const Rows& x, int64_t rows, float* y, int64_t p0, int64_t p1) {
  constexpr int64_t kL2Bytes = 512 << 10;
  const int64_t pbytes = (w.k2 / 2) * 4 * kLanes;
  const int64_t block = std::max<int64_t>(2, kL2Bytes / pbytes / 2 * 2);
  for (int64_t pb = p0; pb < p1; pb += block) {
    const int64_t pe = std::min(p1, pb + block);
    for (int64_t r = 0; r < rows; r += 2 * kTileRows) {
      const int64_t rr = std::min<int64_t>(2 * kTileRows, rows - r);
      const uint16_t* xr = x.h.data() + r * x.stride;
      float* yr = y + r * w.n;
      for (int64_t p = pb; p < pe; p += 2) {
        const bool two = p + 1 < pe;
        if (rr > kTileRows)
          two ? panels_amx<2, 2>(w, p, xr, x.stride, rr, yr, w.n) : panels_amx<2, 1>(w, p, xr, x.stride, rr, yr, w.n);
        else
          two ? panels_amx<1, 2>(w, p, xr, x.stride, rr, yr, w.n) : panels_amx<1, 1>(w, p, xr, x.stride, rr, yr, w.n);
      }
    }
  }
}

using PanelFn = void (*)(const Packed&, int64_t, const Rows&, int64_t, float*, int64_t);
constexpr PanelFn kPanel[kMaxRows + 1] = {nullptr, panel_any<1>, panel_any<2>, panel_any<3>, panel_any<4>,
                                          panel_any<5>, panel_any<6>, panel_any<7>, panel_any<8>};

// y[rows][w.n] = x @ W^T. Called by every thread of an OpenMP team: the output panels are shared
// out in contiguous chunks (each thread streams its part of the weights), barrier at the end.
void gemm_team(const Packed& w, const Rows& x, int64_t rows, float* y) {
  const int64_t panels = w.panels();
  if (w.amx) {  // contiguous shares of the panels, as schedule(static) would give
    configure_tiles();
    const int64_t tid = omp_get_thread_num(), team = omp_get_num_threads();
    gemm_amx(w, x, rows, y, panels * tid / team, panels * (tid + 1) / team);
#pragma omp barrier
    return;
  }
#pragma omp for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int64_t block = std::min<int64_t>(kMaxRows, rows - r);
      kPanel[block](w, p, x, r, y, w.n);
    }
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t width, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    __m512 acc = _mm512_setzero_ps();  // the same lanes and order for every row
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) {
      const __m512 v = _mm512_loadu_ps(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (; i < width; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (i = 0; i + kLanes <= width; i += kLanes)
      _mm512_storeu_ps(y + r * width + i,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), vinv), _mm512_loadu_ps(weight + i)));
    for (; i < width; ++i) y[r * width + i] = xr[i] * inv * weight[i];
  }
}

struct Layer {
  Packed qkv, o, gate_up, down;
  torch::Tensor qkv_bias, norm_in, norm_post;  // fp32
};

// A packed GEMM weight, as Python builds it: from a float tensor (optionally quantized) or from a
// block format's own blocks (a GGUF file's, served as shipped).
struct Weight {
  Packed p;
  // amx: bf16 weights whose inputs are whole chunks of 32 run on AMX tiles (others never do).
  static Weight dense(const torch::Tensor& w, int64_t quant, bool amx) {
    TORCH_CHECK(quant >= 0 && quant <= 3, "quant must be 0 (none), 1 (int8), 2 (q8_0) or 3 (q4_0)");
    Weight out{pack(w, static_cast<Quant>(quant))};
    out.p.amx = amx && out.p.kind == Kind::kBF16 && out.p.k2 % 32 == 0;
    TORCH_CHECK(!out.p.amx || amx_permitted(), "the kernel did not grant this process AMX tile state");
    return out;
  }
  bool on_amx() const { return p.amx; }
  static Weight q8_0(const torch::Tensor& q, const torch::Tensor& d, int64_t k) { return Weight{blocks_q8(q, d, k)}; }
  static Weight q4_0(const torch::Tensor& nibbles, const torch::Tensor& d, int64_t k) {
    return Weight{blocks_q4(nibbles, d, torch::Tensor(), k)};
  }
  static Weight q4_1(const torch::Tensor& nibbles, const torch::Tensor& d, const torch::Tensor& m, int64_t k) {
    return Weight{blocks_q4(nibbles, d, m, k)};
  }
  int64_t outputs() const { return p.n; }
  int64_t inputs() const { return p.k; }
};

Act act_of(Kind kind) {
  switch (kind) {
    case Kind::kQ8: case Kind::kQ4: case Kind::kQ41: return Act::kQ8;
    case Kind::kF32: return Act::kF32;
    default: return Act::kBF16;
  }
}

class Decoder {
 public:
  // Every GEMM weight (head included) comes packed (Weight); its kind decides the GEMM inputs: the
  // block formats read int8 rows (q8), int8 weight-only and bf16 read bf16 rows, fp32 reads fp32.
  // amx: attention on AMX tiles (bf16 caches only; see attend_amx), for every row count.
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor embed, torch::Tensor cos,
          torch::Tensor sin, torch::Tensor norm, const Weight& head, bool amx)
      : heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(static_cast<float>(eps)),
        embed_(embed.contiguous()), cos_(cos.to(torch::kFloat32).contiguous()),
        sin_(sin.to(torch::kFloat32).contiguous()), norm_(norm.to(torch::kFloat32).contiguous()) {
    hidden_ = embed_.size(1);  // embed may have no rows (a draft head is fed rows, not ids)
    bf16_ = embed_.scalar_type() == torch::kBFloat16;
    act_ = act_of(head.p.kind);
    TORCH_CHECK(act_ != Act::kBF16 || bf16_ || head.p.kind != Kind::kI8, "int8 weights need a bfloat16 model");
    head_ = head.p;
    attn_amx_ = amx && bf16_;
    TORCH_CHECK(!attn_amx_ || amx_permitted(), "the kernel did not grant this process AMX tile state");
  }

  // gate_up: gate and up interleaved by panel (panel 2j holds gate outputs 16j.., panel 2j+1 the up
  // ones), so one GEMM yields both and SiLU(gate) * up pairs up panel by panel.
  void add_layer(const Weight& qkv, torch::Tensor qkv_bias, const Weight& o, const Weight& gate_up, const Weight& down,
                 torch::Tensor norm_in, torch::Tensor norm_post) {
    for (const Weight* w : {&qkv, &o, &gate_up, &down})
      TORCH_CHECK(act_of(w->p.kind) == act_, "every weight of a model must read the same kind of input rows");
    TORCH_CHECK(gate_up.p.n % (2 * kLanes) == 0, "intermediate size must be a multiple of 16");
    Layer l;
    l.qkv = qkv.p;
    l.o = o.p;
    l.gate_up = gate_up.p;
    l.down = down.p;
    l.qkv_bias = qkv_bias.defined() && qkv_bias.numel() ? qkv_bias.to(torch::kFloat32).contiguous() : torch::Tensor();
    l.norm_in = norm_in.to(torch::kFloat32).contiguous();
    l.norm_post = norm_post.to(torch::kFloat32).contiguous();
    layers_.push_back(std::move(l));
  }

  // ids [n] at positions [start, start + n); cache [layers, 2, capacity, kv_heads, head_dim].
  // head: 0 none, 1 last row, 2 every row. parents: empty (a chain) or [n] int64, a tree (see the
  // top of this file). Returns (logits fp32 or empty, hidden in model dtype).
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor cache, int64_t start, int64_t head,
                                     torch::Tensor parents, int64_t base, torch::Tensor slot_parents) {
    std::vector<float> x = embed(ids);
    Scratch s;
    add_segment(s, cache, ids.size(0), start, head, parents, base, slot_parents);
    return run(x, s);
  }

  // As forward, from input rows [n, hidden] (float32) instead of token ids: a draft head whose
  // input is a projection of the target's features.
  std::vector<torch::Tensor> forward_rows(torch::Tensor rows, torch::Tensor cache, int64_t start, int64_t head,
                                          torch::Tensor parents, int64_t base, torch::Tensor slot_parents) {
    TORCH_CHECK(rows.dim() == 2 && rows.size(1) == hidden_, "rows must be [n, hidden]");
    auto r = rows.to(torch::kFloat32).contiguous();
    std::vector<float> x(r.data_ptr<float>(), r.data_ptr<float>() + r.numel());
    Scratch s;
    add_segment(s, cache, rows.size(0), start, head, parents, base, slot_parents);
    return run(x, s);
  }

  // Several sequences in one forward: sequence i feeds counts[i] consecutive rows at positions
  // [starts[i], starts[i] + counts[i]) of caches[i], with heads[i] as in forward, trees[i] (empty:
  // a chain) and, for a tree grown over calls, bases[i] and slot_parents[i] as in forward. The rows
  // are token ids, or input rows [n, hidden] (float32) when ids is empty (a draft head). Returns
  // (the logits of every sequence's head rows in order, hidden [n]).
  std::vector<torch::Tensor> forward_batch(torch::Tensor ids, torch::Tensor rows, std::vector<torch::Tensor> caches,
                                           std::vector<int64_t> starts, std::vector<int64_t> counts,
                                           std::vector<int64_t> heads, std::vector<torch::Tensor> trees,
                                           std::vector<int64_t> bases, std::vector<torch::Tensor> slot_parents) {
    const size_t m = caches.size();
    TORCH_CHECK(starts.size() == m && counts.size() == m && heads.size() == m && trees.size() == m &&
                    bases.size() == m && slot_parents.size() == m,
                "one start, count, head, tree, base and slot_parents per cache");
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    std::vector<float> x;
    if (ids.numel() > 0) {
      TORCH_CHECK(total == ids.size(0), "counts must add up to the number of ids");
      x = embed(ids);
    } else {
      TORCH_CHECK(rows.dim() == 2 && rows.size(0) == total && rows.size(1) == hidden_,
                  "without ids, rows must be [sum of counts, hidden]");
      auto r = rows.to(torch::kFloat32).contiguous();
      x.assign(r.data_ptr<float>(), r.data_ptr<float>() + r.numel());
    }
    Scratch s;
    for (size_t i = 0; i < m; ++i)
      add_segment(s, caches[i], counts[i], starts[i], heads[i], trees[i], bases[i], slot_parents[i]);
    return run(x, s);
  }

 private:
  // One sequence's part of a call: its cache and where its rows sit.
  struct Segment {
    std::vector<char*> kv;  // per layer: [2, capacity, kv_heads, head_dim]
    int64_t cap = 0, start = 0, base = 0;
  };

  // Activations between the ops of a layer, shared by the team, and what each row is.
  struct Scratch {
    std::vector<float> a, qkv, att, y, gu, h;
    Rows in, in_att, in_mlp;  // GEMM inputs of hidden, heads * head_dim and intermediate features
    std::vector<Segment> segs;
    std::vector<int64_t> seg_of;  // row -> its segment
    // Per row: the cache slots at and after its segment's base it attends, in depth order
    // (ancestors, then its own), so that it sits at position base + path.size() - 1.
    std::vector<std::vector<int64_t>> path;
    std::vector<int64_t> head_rows;  // the rows whose logits are returned, in order
    // AMX attention: runs of consecutive rows of one segment, each the child of the one before (a
    // chain, or a chain inside a tree): every row's key list is a prefix of the run's last row's.
    std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
    std::vector<std::pair<int64_t, int64_t>> tasks;  // (run, the run after it or -1)

    int64_t rows() const { return static_cast<int64_t>(seg_of.size()); }
    int64_t keys(int64_t r) const { return segs[seg_of[r]].base + static_cast<int64_t>(path[r].size()); }
  };

  std::vector<float> embed(const torch::Tensor& ids) const {
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "ids must be int64 [n]");
    const int64_t n = ids.size(0), width = hidden_;
    std::vector<float> x(n * width);
    const auto* id = ids.data_ptr<int64_t>();
    const void* table = embed_.data_ptr();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(id[r] >= 0 && id[r] < embed_.size(0), "token id out of range");
      for (int64_t i = 0; i < width; ++i)
        x[r * width + i] = bf16_ ? bf16_to_f32(static_cast<const uint16_t*>(table)[id[r] * width + i])
                                 : static_cast<const float*>(table)[id[r] * width + i];
    }
    return x;
  }

  void add_segment(Scratch& s, const torch::Tensor& cache, int64_t n, int64_t start, int64_t head,
                   const torch::Tensor& parents, int64_t base, const torch::Tensor& slot_parents) const {
    TORCH_CHECK(cache.size(0) == static_cast<int64_t>(layers_.size()), "cache has the wrong number of layers");
    TORCH_CHECK(cache.scalar_type() == embed_.scalar_type(), "cache must be in the model dtype");
    TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
    TORCH_CHECK(n >= 1 && start >= 0 && start + n <= cache.size(2), "cache too small");
    TORCH_CHECK(start + n <= cos_.size(0), "positions beyond the rotary table");
    TORCH_CHECK(head >= 0 && head <= 2, "head must be 0, 1 or 2");
    Segment seg;
    seg.cap = cache.size(2);
    seg.start = start;
    seg.base = base;
    for (int64_t li = 0; li < cache.size(0); ++li) seg.kv.push_back(static_cast<char*>(cache[li].data_ptr()));
    const int64_t index = static_cast<int64_t>(s.segs.size()), row0 = s.rows();
    s.segs.push_back(std::move(seg));
    const bool tree = parents.defined() && parents.numel() > 0;
    TORCH_CHECK(!tree || (parents.numel() == n && parents.scalar_type() == torch::kInt64),
                "parents must be int64 with one entry per row");
    TORCH_CHECK(0 <= base && base <= start, "base must be in [0, start]");
    TORCH_CHECK(tree || base == start, "a chain's prefix is everything before start");
    const auto pc = tree ? parents.contiguous() : parents;
    const int64_t* p = tree ? pc.data_ptr<int64_t>() : nullptr;
    const auto sc = slot_parents.defined() && slot_parents.numel() ? slot_parents.contiguous() : torch::Tensor();
    TORCH_CHECK(!sc.defined() || (sc.scalar_type() == torch::kInt64 && sc.numel() == start - base),
                "slot_parents must be int64 with one entry per slot in [base, start)");
    const int64_t* sp = sc.defined() ? sc.data_ptr<int64_t>() : nullptr;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t parent = tree ? p[r] : r - 1;
      TORCH_CHECK(parent >= -2 - (start - 1) && parent < r, "a row's parent must be an earlier row, -1, or -2 - slot");
      std::vector<int64_t> path;
      if (parent >= 0) {
        path = s.path[row0 + parent];
      } else if (parent <= -2) {  // a slot from an earlier call: its ancestry from slot_parents
        int64_t slot = -2 - parent;
        TORCH_CHECK(slot >= base && slot < start && sp, "a parent slot must be in [base, start) with slot_parents");
        for (int64_t hops = 0; slot >= 0; ++hops) {
          TORCH_CHECK(slot >= base && slot < start && hops < start - base, "slot_parents do not form a tree");
          path.push_back(slot);
          slot = sp[slot - base];
        }
        std::reverse(path.begin(), path.end());
      }
      path.push_back(start + r);
      s.path.push_back(std::move(path));
      s.seg_of.push_back(index);
    }
    if (head == 1) s.head_rows.push_back(row0 + n - 1);
    if (head == 2)
      for (int64_t r = 0; r < n; ++r) s.head_rows.push_back(row0 + r);
  }

  // The layers, the final norm (none when the norm weight is empty) and the output head, in one
  // OpenMP parallel region: the GEMMs and attention are shared out, the small row-wise steps run on
  // one thread between barriers (a barrier costs far less than a fork/join per op).
  std::vector<torch::Tensor> run(std::vector<float>& x, Scratch& s) {
    const int64_t width = hidden_, n = s.rows();
    TORCH_CHECK(d_ % kLanes == 0 && d_ <= 256, "head_dim must be a multiple of 16, at most 256");
    const int64_t inter = layers_.empty() ? 0 : layers_[0].gate_up.n / 2;
    const int64_t qkv_n = layers_.empty() ? 0 : layers_[0].qkv.n;
    s.a.resize(n * width);
    s.qkv.resize(n * qkv_n);
    s.att.resize(n * heads_ * d_);
    s.y.resize(n * width);
    s.gu.resize(n * 2 * inter);
    s.h.resize(n * inter);
    shape_rows(n, width, act_, s.in);
    shape_rows(n, heads_ * d_, act_, s.in_att);
    shape_rows(n, inter, act_, s.in_mlp);
    const int64_t rows = static_cast<int64_t>(s.head_rows.size());
    const bool head = rows > 0;
    torch::Tensor logits = head ? torch::empty({rows, head_.n}, torch::kFloat32) : torch::Tensor();
    float* out = head ? logits.data_ptr<float>() : nullptr;
    const bool norm = norm_.numel() > 0;
    const float* norm_w = norm ? norm_.data_ptr<float>() : nullptr;
    std::vector<float> picked;
    plan_runs(s);
#pragma omp parallel num_threads(at::get_num_threads())
    {
      for (size_t li = 0; li < layers_.size(); ++li) layer_team(layers_[li], li, x.data(), s);
#pragma omp single
      {
        if (norm)
          rms_norm(x.data(), norm_w, n, width, eps_, s.a.data());
        else
          s.a = x;
        if (head) {
          picked.resize(rows * width);
          for (int64_t i = 0; i < rows; ++i)
            std::memcpy(picked.data() + i * width, s.a.data() + s.head_rows[i] * width, width * 4);
          to_rows(picked.data(), rows, width, act_, s.in);
        }
      }
      if (head) gemm_team(head_, s.in, rows, out);
    }
    auto hidden = torch::from_blob(s.a.data(), {n, width}, torch::kFloat32).to(embed_.scalar_type(), false, true);
    return {logits, hidden};
  }

  // One layer, called by every thread of the team: GEMMs and attention shared out as they say,
  // the row-wise steps shared out by rows (each row's arithmetic is the same on any thread).
  void layer_team(const Layer& l, size_t li, float* x, Scratch& s) {
    const int64_t n = s.rows(), width = hidden_, qw = heads_ * d_, kw = kv_heads_ * d_, ld = l.qkv.n;
    const int64_t inter = l.gate_up.n / 2;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      rms_norm(x + r * width, l.norm_in.data_ptr<float>(), 1, width, eps_, s.a.data() + r * width);
      row_to(s.a.data() + r * width, r, width, act_, s.in);
    }
    gemm_team(l.qkv, s.in, n, s.qkv.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* row = s.qkv.data() + r * ld;
      if (l.qkv_bias.defined()) {
        const float* b = l.qkv_bias.data_ptr<float>();
        for (int64_t i = 0; i < ld; ++i) row[i] += b[i];
      }
      const Segment& seg = s.segs[s.seg_of[r]];
      rope(row, heads_ + kv_heads_, seg.base + static_cast<int64_t>(s.path[r].size()) - 1);
      store_kv(seg.kv[li], seg.cap, row + qw, row + qw + kw, s.path[r].back());
    }
    if (attn_amx_)
      attend_amx_team(li, s.qkv.data(), ld, s, s.att.data());
    else
      attend_team(li, s.qkv.data(), ld, s, s.att.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) row_to(s.att.data() + r * qw, r, qw, act_, s.in_att);
    gemm_team(l.o, s.in_att, n, s.y.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* xr = x + r * width;
      for (int64_t i = 0; i < width; ++i) xr[i] += s.y[r * width + i];
      rms_norm(xr, l.norm_post.data_ptr<float>(), 1, width, eps_, s.a.data() + r * width);
      row_to(s.a.data() + r * width, r, width, act_, s.in);
    }
    gemm_team(l.gate_up, s.in, n, s.gu.data());
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < inter; j += kLanes) {  // SiLU(gate) * up, 16 features at a time
        const float* pair = s.gu.data() + r * 2 * inter + 2 * j;
        const __m512 g = _mm512_loadu_ps(pair), u = _mm512_loadu_ps(pair + kLanes);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(s.h.data() + r * inter + j, _mm512_mul_ps(silu, u));
      }
      row_to(s.h.data() + r * inter, r, inter, act_, s.in_mlp);
    }
    gemm_team(l.down, s.in_mlp, n, s.y.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < width; ++i) x[r * width + i] += s.y[r * width + i];
  }

  // Rotary embedding of `count` heads of one row (rotate-half convention, transformers' tables).
  void rope(float* v, int64_t count, int64_t pos) const {
    const float* c = cos_.data_ptr<float>() + pos * d_;
    const float* s = sin_.data_ptr<float>() + pos * d_;
    const int64_t half = d_ / 2;
    for (int64_t h = 0; h < count; ++h) {
      float* q = v + h * d_;
      for (int64_t i = 0; i < half; ++i) {
        const float lo = q[i], hi = q[i + half];
        q[i] = lo * c[i] - hi * s[i];
        q[i + half] = hi * c[i + half] + lo * s[i + half];
      }
    }
  }

  // kv: one layer's [2, capacity, kv_heads, head_dim] block in the model dtype.
  void store_kv(char* kv, int64_t cap, const float* k, const float* v, int64_t pos) const {
    const int64_t kw = kv_heads_ * d_;
    if (bf16_) {
      auto* base = reinterpret_cast<uint16_t*>(kv);
      for (int64_t i = 0; i < kw; ++i) {
        base[pos * kw + i] = f32_to_bf16(k[i]);
        base[(cap + pos) * kw + i] = f32_to_bf16(v[i]);
      }
    } else {
      float* base = reinterpret_cast<float*>(kv);
      std::memcpy(base + pos * kw, k, kw * 4);
      std::memcpy(base + (cap + pos) * kw, v, kw * 4);
    }
  }

  // One task per (row, head): the row attends keys [0, base) of its own sequence's cache and then
  // the slots of its path, exactly (a chain's row r: keys [0, start + r]). Called by every thread of
  // the team; barrier at the end.
  // Attention on AVX-512 (any cache dtype), for every row count. A task: one KV head and one run
  // of chained rows (plan_runs), its query vectors (rows x heads of the group, up to 16) against
  // the run's key list. Scores 16 keys at a time: the block's keys transposed to [dim][key] in
  // fp32, and each query's lane sums its products in dim order (one FMA chain per query). Softmax
  // down each query's own keys: exp in 16-key lanes, summed lane-wise in key order, then across
  // lanes. Out = P V: each (query, dim) accumulates its keys' weighted values in key order, four
  // queries at a time sharing the value loads, each over its own keys only. Exact by construction:
  // a query's result depends on its own vector and keys alone, in one fixed order, whatever run,
  // chunk or thread computes it.
  // Scores of V queries against a transposed key block [dim][key]: one FMA chain per query, in dim order.
  template <int V>
  inline void qk_lanes(const float* const* q, const float* kt, __m512* acc) const {
    for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d_; ++i) {
      const __m512 k = _mm512_load_ps(kt + i * kLanes);
      for (int v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v][i]), k, acc[v]);
    }
  }

  inline void qk(int64_t m, const float* const* q, const float* kt, __m512* acc) const {
    switch (m) {
      case 1: qk_lanes<1>(q, kt, acc); break;
      case 2: qk_lanes<2>(q, kt, acc); break;
      case 3: qk_lanes<3>(q, kt, acc); break;
      case 4: qk_lanes<4>(q, kt, acc); break;
      case 5: qk_lanes<5>(q, kt, acc); break;
      case 6: qk_lanes<6>(q, kt, acc); break;
      case 7: qk_lanes<7>(q, kt, acc); break;
      default: qk_lanes<8>(q, kt, acc); break;
    }
  }

  // Keys j0..j0+15 of KV head g as fp32 [dim][key] (keys past len: zero).
  inline void key_block(const void* base, int64_t prefix, const int64_t* path, int64_t j0, int64_t len, int64_t g,
                        int64_t kw, float* kt) const {
    for (int64_t c = 0; c < d_; c += kLanes) {
      __m512i r[16];
      for (int64_t t = 0; t < kLanes; ++t) {
        const int64_t j = j0 + t;
        r[t] = j < len ? _mm512_castps_si512(key(base, j < prefix ? j : path[j - prefix], g, c, kw, 0))
                       : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t t = 0; t < kLanes; ++t) _mm512_store_si512(kt + (c + t) * kLanes, r[t]);
    }
  }

  template <int U, int C>
  inline void pv_lanes(const float* const* p, const void* base, int64_t vplane, int64_t prefix, const int64_t* path,
                       int64_t j0, int64_t j1, int64_t g, int64_t kw, int64_t c0, __m512 (*acc)[4]) const {
    __m512 a[U][C];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) a[u][c] = acc[u][c];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t at = j < prefix ? j : path[j - prefix];
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = key(base, at, g, (c0 + c) * kLanes, kw, vplane);
      for (int u = 0; u < U; ++u) {
        const __m512 w = _mm512_set1_ps(p[u][j]);
        for (int c = 0; c < C; ++c) a[u][c] = _mm512_fmadd_ps(w, vv[c], a[u][c]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) acc[u][c] = a[u][c];
  }

  template <int C>
  inline void pv_chunks(int64_t u, const float* const* p, const void* base, int64_t vplane, int64_t prefix,
                        const int64_t* path, int64_t j0, int64_t j1, int64_t g, int64_t kw, int64_t c0,
                        __m512 (*acc)[4]) const {
    switch (u) {
      case 1: pv_lanes<1, C>(p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
      case 2: pv_lanes<2, C>(p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
      case 3: pv_lanes<3, C>(p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
      default: pv_lanes<4, C>(p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
    }
  }

  // Out += P V over keys j0..j1 for u queries (1-4) and nc 16-dim chunks (1-4) from chunk c0.
  inline void pv(int64_t u, int64_t nc, const float* const* p, const void* base, int64_t vplane, int64_t prefix,
                 const int64_t* path, int64_t j0, int64_t j1, int64_t g, int64_t kw, int64_t c0, __m512 (*acc)[4]) const {
    switch (nc) {
      case 1: pv_chunks<1>(u, p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
      case 2: pv_chunks<2>(u, p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
      case 3: pv_chunks<3>(u, p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
      default: pv_chunks<4>(u, p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc); break;
    }
  }

  void attend_team(size_t li, const float* qkv, int64_t ld, const Scratch& s, float* out) const {
    const int64_t group = heads_ / kv_heads_, qc = group_heads(), kw = kv_heads_ * d_;
    const int64_t hchunks = (group + qc - 1) / qc, chunks = d_ / kLanes;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    int64_t longest = 0;
    for (const auto& [first, count] : s.runs) longest = std::max(longest, s.keys(first + count - 1));
    const int64_t room = (longest + kLanes - 1) / kLanes * kLanes;
    std::vector<float> scores(kTileRows * room);  // this thread's: [query][key]
    std::vector<float> kt(d_ * kLanes + kLanes);   // a key block as [dim][key]

    float* ktp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(kt.data()) + 63) & ~uintptr_t(63));
    const int64_t tasks = static_cast<int64_t>(s.runs.size()) * kv_heads_ * hchunks;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const auto [row0, rows] = s.runs[task / (kv_heads_ * hchunks)];
      const int64_t g = (task / hchunks) % kv_heads_, h0 = g * group + (task % hchunks) * qc;
      const int64_t hc = std::min<int64_t>(qc, (g + 1) * group - h0), nq = rows * hc;
      const int64_t last = row0 + rows - 1;
      const Segment& seg = s.segs[s.seg_of[last]];
      const std::vector<int64_t>& path = s.path[last];
      const int64_t prefix = seg.base, len = s.keys(last);
      const void* base = seg.kv[li];
      const float* q[kTileRows];
      int64_t lens[kTileRows];
      float* p[kTileRows];
      for (int64_t v = 0; v < nq; ++v) {
        q[v] = qkv + (row0 + v / hc) * ld + (h0 + v % hc) * d_;
        lens[v] = s.keys(row0 + v / hc);
        p[v] = scores.data() + v * room;
      }
      // Scores, and each query's max over its own keys.
      __m512 best[kTileRows];
      for (int64_t v = 0; v < nq; ++v) best[v] = _mm512_set1_ps(-INFINITY);
      for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
        key_block(base, prefix, path.data(), j0, len, g, kw, ktp);
        for (int64_t v0 = 0; v0 < nq; v0 += 8) {
          __m512 acc[8];
          const int64_t m = std::min<int64_t>(8, nq - v0);
          qk(m, q + v0, ktp, acc);
          for (int64_t u = 0; u < m; ++u) {
            const int64_t v = v0 + u;
            const __m512 sc = _mm512_mul_ps(acc[u], _mm512_set1_ps(scale));
            _mm512_storeu_ps(p[v] + j0, sc);
            const int64_t valid = std::min<int64_t>(kLanes, lens[v] - j0);
            if (valid > 0)
              best[v] = _mm512_mask_max_ps(best[v], static_cast<__mmask16>((1u << valid) - 1), best[v], sc);
          }
        }
      }
      // Weights: exp of each query's own keys, summed lane-wise in key order, then across lanes.
      float inv[kTileRows];
      for (int64_t v = 0; v < nq; ++v) {
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[v]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < lens[v]; j0 += kLanes) {
          const int64_t valid = std::min<int64_t>(kLanes, lens[v] - j0);
          const __mmask16 m = valid == kLanes ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
          const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p[v] + j0), top)));
          _mm512_storeu_ps(p[v] + j0, e);
          total = _mm512_add_ps(total, e);
        }
        inv[v] = 1.0f / _mm512_reduce_add_ps(total);
      }
      // Out = P V, four queries and up to 64 dims at a time; keys every query has together, then
      // each query's own rest.
      for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        const int64_t nc = std::min<int64_t>(4, chunks - c0);
        for (int64_t v0 = 0; v0 < nq; v0 += 4) {
          const int64_t m = std::min<int64_t>(4, nq - v0);
          int64_t common = len;
          for (int64_t u = 0; u < m; ++u) common = std::min(common, lens[v0 + u]);
          __m512 acc[4][4];
          for (int64_t u = 0; u < 4; ++u)
            for (int64_t c = 0; c < 4; ++c) acc[u][c] = _mm512_setzero_ps();
          pv(m, nc, p + v0, base, seg.cap, prefix, path.data(), 0, common, g, kw, c0, acc);
          for (int64_t u = 0; u < m; ++u) {
            pv(1, nc, p + v0 + u, base, seg.cap, prefix, path.data(), common, lens[v0 + u], g, kw, c0, acc + u);
            const int64_t v = v0 + u;
            float* o = out + (row0 + v / hc) * heads_ * d_ + (h0 + v % hc) * d_;
            for (int64_t c = 0; c < nc; ++c)
              _mm512_storeu_ps(o + (c0 + c) * kLanes, _mm512_mul_ps(acc[u][c], _mm512_set1_ps(inv[v])));
          }
        }
      }
    }
  }

  // Query vectors per AMX attention task: all the heads of a KV group for as many rows as fit 16.
  int64_t group_heads() const { return std::min<int64_t>(heads_ / kv_heads_, kTileRows); }

  // Rows r and r + 1 chain: same segment, and r + 1 is r's child (its key list is r's plus one).
  static bool chained(const Scratch& s, int64_t r) {
    const auto &a = s.path[r], &b = s.path[r + 1];
    return s.seg_of[r] == s.seg_of[r + 1] && b.size() == a.size() + 1 && b[a.size() - 1] == a.back();
  }

  // Runs of chained rows, up to 16 query vectors each, paired into tasks where the second run
  // continues the first (so both read a prefix of the second's key list).
  void plan_runs(Scratch& s) const {
    const int64_t most = std::max<int64_t>(1, kTileRows / group_heads());
    s.runs.clear();
    for (int64_t r = 0; r < s.rows(); ++r) {
      if (!s.runs.empty()) {
        auto& [first, count] = s.runs.back();
        if (count < most && first + count == r && chained(s, r - 1)) {
          ++count;
          continue;
        }
      }
      s.runs.emplace_back(r, 1);
    }
    s.tasks.clear();
    for (size_t i = 0; i < s.runs.size(); ++i) {
      const auto [first, count] = s.runs[i];
      const bool pair = i + 1 < s.runs.size() && chained(s, first + count - 1);
      s.tasks.emplace_back(static_cast<int64_t>(i), pair ? static_cast<int64_t>(i + 1) : -1);
      if (pair) ++i;
    }
  }

  // Attention on AMX tiles (bf16 cache). A task: one KV head and one or two runs of rows, each run
  // up to 16 query vectors (row, head of the group) in the lanes of its own tiles; the second run
  // shares the first's key and value tiles (half the cache traffic). Scores S^T = K Q^T (keys
  // straight from the cache as A tiles, the queries rounded to bf16 and paired as B tiles), kept
  // key-major [key][query]; softmax down each lane (max, then exp and the sum in key order); out =
  // P V with P in bf16 (A tiles) and pairs of value rows (B tile), 32 dims at a time, key blocks of
  // 32 in order. Exact by construction: a query's lane reads its own keys only (the others are
  // masked to zero weight, and adding zero products leaves a sum as it was), in key-list order, so
  // its result is the same in a run of any length, beside any other queries, chunked or not, on
  // any thread.
  __attribute__((target("amx-tile,amx-bf16")))
  void attend_amx_team(size_t li, const float* qkv, int64_t ld, const Scratch& s, float* out) const {
    const int64_t group = heads_ / kv_heads_, qc = group_heads(), kw = kv_heads_ * d_;
    const int64_t hchunks = (group + qc - 1) / qc, chunks = (d_ + 31) / 32;
    const bool direct = d_ % 32 == 0;  // key blocks load straight from the cache (else padded copies)
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    int64_t longest = 0;
    for (const auto& [first, count] : s.runs) longest = std::max(longest, s.keys(first + count - 1));
    const int64_t room = (longest + 31) / 32 * 32 * kLanes;
    std::vector<float> scores(2 * room);  // this thread's, per run: [key][query]
    const int64_t pstride = room / 2;  // P of one run: room / 16 keys in blocks of 32, 256 dwords a block
    std::vector<uint32_t> pblocks(2 * pstride);  // P per run: [block][query][key pair]
    alignas(64) uint32_t qt[2][8][16][16];  // queries per run: [32-dim chunk][dim pair][query]
    alignas(64) uint16_t kb[16][256];       // a gathered key block, zero-padded to whole chunks
    alignas(64) uint16_t vb[32][256];       // a gathered value block
    alignas(64) uint32_t vp[16][16];        // V: [key pair][dim], 16 dims
    alignas(64) float ob[16][16];
    alignas(64) int32_t lens[2][16];
    alignas(64) float total[2][16];
    configure_tiles();
    const int64_t tasks = static_cast<int64_t>(s.tasks.size()) * kv_heads_ * hchunks;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const auto [ra, rb] = s.tasks[task / (kv_heads_ * hchunks)];
      const int64_t g = (task / hchunks) % kv_heads_, h0 = g * group + (task % hchunks) * qc;
      const int64_t hc = std::min<int64_t>(qc, (g + 1) * group - h0);
      const bool two = rb >= 0;
      const std::pair<int64_t, int64_t> run[2] = {s.runs[ra], two ? s.runs[rb] : s.runs[ra]};
      const int64_t last = run[two ? 1 : 0].first + run[two ? 1 : 0].second - 1;
      const Segment& seg = s.segs[s.seg_of[last]];
      const std::vector<int64_t>& path = s.path[last];
      const int64_t prefix = seg.base, len = s.keys(last);
      auto slot = [&](int64_t j) { return j < prefix ? j : path[j - prefix]; };
      const uint16_t* kv = static_cast<const uint16_t*>(static_cast<const void*>(seg.kv[li]));
      const uint16_t* kplane = kv + g * d_;  // slot j's key: kplane + j * kw
      const uint16_t* vplane = kv + seg.cap * kw + g * d_;
      std::memset(qt, 0, sizeof(qt));
      for (int u = 0; u < 2; ++u) {
        const auto [row0, rows] = run[u];
        const int64_t queries = (u == 0 || two) ? rows * hc : 0;
        for (int64_t q = 0; q < kLanes; ++q) lens[u][q] = q < queries ? static_cast<int32_t>(s.keys(row0 + q / hc)) : 0;
        for (int64_t q = 0; q < queries; ++q) {
          const float* qv = qkv + (row0 + q / hc) * ld + (h0 + q % hc) * d_;
          for (int64_t i = 0; i < d_; i += 2)
            qt[u][i / 32][(i % 32) / 2][q] = f32_to_bf16(qv[i]) | (static_cast<uint32_t>(f32_to_bf16(qv[i + 1])) << 16);
        }
      }
      // Scores, 16 keys at a time, scaled, each lane's max over its own keys as they come.
      __m512 best[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
      const __m512i vlens[2] = {_mm512_load_si512(lens[0]), _mm512_load_si512(lens[1])};
      for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
        const uint16_t* kp = kplane + slot(j0) * kw;
        int64_t stride = kw * 2;
        if (!direct || j0 + kLanes > len || slot(j0 + kLanes - 1) - slot(j0) != kLanes - 1) {
          std::memset(kb, 0, sizeof(kb));
          for (int64_t i = 0; i < kLanes && j0 + i < len; ++i) std::memcpy(kb[i], kplane + slot(j0 + i) * kw, d_ * 2);
          kp = kb[0];
          stride = sizeof(kb[0]);
        }
        _tile_zero(0);
        if (two) _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
          TILE_LOAD(1, kp + c * 32, stride);
          TILE_LOAD(2, qt[0][c], 64);
          _tile_dpbf16ps(0, 1, 2);
          if (two) {
            TILE_LOAD(4, qt[1][c], 64);
            _tile_dpbf16ps(3, 1, 4);
          }
        }
        for (int u = 0; u < (two ? 2 : 1); ++u) {
          float* sc = scores.data() + u * room + j0 * kLanes;
          if (u == 0) TILE_STORE(0, sc, 64);
          else TILE_STORE(3, sc, 64);
          for (int64_t j = j0; j < std::min(len, j0 + kLanes); ++j) {
            const __mmask16 valid = _mm512_cmpgt_epi32_mask(vlens[u], _mm512_set1_epi32(static_cast<int32_t>(j)));
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc + (j - j0) * kLanes), _mm512_set1_ps(scale));
            _mm512_storeu_ps(sc + (j - j0) * kLanes, v);
            best[u] = _mm512_mask_max_ps(best[u], valid, best[u], v);
          }
        }
      }
      // Weights: exp down each lane, summed in key order, and P in bf16 as A tiles, [block][query][key pair].
      const int64_t padded = (len + 31) / 32 * 32;
      for (int u = 0; u < (two ? 2 : 1); ++u) {
        const float* sc = scores.data() + u * room;
        uint32_t* pu = pblocks.data() + u * pstride;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < padded; j0 += 32) {
          __m512i w[16];
          __m512 e[2];
          for (int t = 0; t < 16; ++t) {
            for (int h = 0; h < 2; ++h) {
              const int64_t j = j0 + 2 * t + h;
              const __mmask16 valid = _mm512_cmpgt_epi32_mask(vlens[u], _mm512_set1_epi32(static_cast<int32_t>(j)));
              e[h] = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + j * kLanes), best[u])));
              sum = _mm512_add_ps(sum, e[h]);
            }
            w[t] = pair16((__m256i)_mm512_cvtneps_pbh(e[0]), (__m256i)_mm512_cvtneps_pbh(e[1]));
          }
          transpose16(w);
          for (int q = 0; q < 16; ++q) _mm512_storeu_si512(pu + j0 / 32 * 256 + q * 16, w[q]);
        }
        _mm512_store_ps(total[u], sum);
      }
      for (int64_t d0 = 0; d0 < d_; d0 += 32) {  // two 16-dim accumulators per run at a time
        const int64_t nc = std::min<int64_t>(2, (d_ - d0) / kLanes);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t j0 = 0; j0 < padded; j0 += 32) {
          TILE_LOAD(1, pblocks.data() + j0 / 32 * 256, 64);
          if (two) TILE_LOAD(3, pblocks.data() + pstride + j0 / 32 * 256, 64);
          // Values in pairs of rows: from the cache, or gathered (a tree's path, or the last
          // block's tail with zeros past the keys).
          const bool contiguous = j0 + 32 <= len && slot(j0 + 31) - slot(j0) == 31;
          const uint16_t* vrow = vplane + slot(j0) * kw;
          int64_t vstride = kw;
          if (!contiguous) {
            std::memset(vb, 0, sizeof(vb));
            for (int64_t i = 0; i < 32 && j0 + i < len; ++i) std::memcpy(vb[i], vplane + slot(j0 + i) * kw, d_ * 2);
            vrow = vb[0];
            vstride = 256;
          }
          for (int64_t c = 0; c < nc; ++c) {
            const uint16_t* v = vrow + d0 + c * kLanes;
            for (int t = 0; t < 16; ++t)
              _mm512_store_si512(vp[t], pair16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 2 * t * vstride)),
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (2 * t + 1) * vstride))));
            TILE_LOAD(2, vp, 64);
            if (c == 0) {
              _tile_dpbf16ps(4, 1, 2);
              if (two) _tile_dpbf16ps(6, 3, 2);
            } else {
              _tile_dpbf16ps(5, 1, 2);
              if (two) _tile_dpbf16ps(7, 3, 2);
            }
          }
        }
        for (int u = 0; u < (two ? 2 : 1); ++u)
          for (int64_t c = 0; c < nc; ++c) {
            if (u == 0 && c == 0) TILE_STORE(4, ob, 64);
            if (u == 0 && c == 1) TILE_STORE(5, ob, 64);
            if (u == 1 && c == 0) TILE_STORE(6, ob, 64);
            if (u == 1 && c == 1) TILE_STORE(7, ob, 64);
            const auto [row0, rows] = run[u];
            for (int64_t q = 0; q < rows * hc; ++q) {
              float* o = out + (row0 + q / hc) * heads_ * d_ + (h0 + q % hc) * d_ + d0 + c * kLanes;
              _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_load_ps(ob[q]), _mm512_set1_ps(1.0f / total[u][q])));
            }
          }
      }
    }
  }

  // 16 elements of the key (plane 0) or value (plane offset cap) at position j, KV head g.
  inline __m512 key(const void* base, int64_t j, int64_t g, int64_t i, int64_t kw, int64_t plane) const {
    const int64_t off = (plane + j) * kw + g * d_ + i;
    if (bf16_) return load_bf16x16(static_cast<const uint16_t*>(base) + off);
    return _mm512_loadu_ps(static_cast<const float*>(base) + off);
  }

  int64_t heads_, kv_heads_, d_, hidden_ = 0;
  float eps_;
  bool bf16_ = true, attn_amx_ = false;
  Act act_ = Act::kBF16;
  torch::Tensor embed_, cos_, sin_, norm_;
  Packed head_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_permitted", &amx_permitted);
  pybind11::class_<Weight>(m, "Weight")
      .def_static("dense", &Weight::dense)
      .def_static("q8_0", &Weight::q8_0)
      .def_static("q4_0", &Weight::q4_0)
      .def_static("q4_1", &Weight::q4_1)
      .def_property_readonly("outputs", &Weight::outputs)
      .def_property_readonly("amx", &Weight::on_amx)
      .def_property_readonly("inputs", &Weight::inputs);
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, const Weight&, bool>())
      .def("add_layer", &Decoder::add_layer)
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_rows", &Decoder::forward_rows, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_batch", &Decoder::forward_batch, pybind11::call_guard<pybind11::gil_scoped_release>());
}
