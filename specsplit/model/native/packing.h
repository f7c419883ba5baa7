// Part of decoder.cpp (included once, inside its anonymous namespace): packed weights.
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
#pragma once

// The tensors a Packed's pointers read, by the pointer's name, kept alive as long as any copy of it.
struct Held {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
};

// t, kept alive with p as what its pointer `name` reads; returns its storage.
void* hold(Packed& p, const char* name, const torch::Tensor& t) {
  if (!p.keep) p.keep = std::make_shared<Held>();
  static_cast<Held*>(p.keep.get())->tensors.emplace_back(name, t);
  return t.data_ptr();
}

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
  auto data = torch::zeros({p.panels() * p.k2 * kLanes}, torch::kInt8);
  auto* dst = data.data_ptr<int8_t>();
  const auto* src = q.data_ptr<int8_t>();
  for (int64_t o = 0; o < p.n; ++o)
    for (int64_t i = 0; i < p.k; ++i)
      dst[((o / kLanes) * (p.k2 / 2) + i / 2) * 2 * kLanes + (o % kLanes) * 2 + (i % 2)] = src[o * p.k + i];
  auto scales = torch::zeros({p.panels() * kLanes}, torch::kFloat32);
  scales.narrow(0, 0, p.n).copy_(scale);
  p.ptr = hold(p, "ptr", data);
  p.scale_ptr = static_cast<const float*>(hold(p, "scale_ptr", scales));
  return p;
}

// Block formats (llama.cpp's, one scale d per output and block of 32 inputs), packed as 16-output
// panels for vpdpbusd, which multiplies unsigned by signed bytes: the weights are stored unsigned
// and the activations signed, and the GEMM takes the weights' offset out through the activations'
// integer sums (gemm.h), so nothing per weight but its scale (and q4_1's m) travels beside it.
// - q8_0: q in [-127, 127], w = d q, stored as q + 128; quads [panels][k2/4][16][4] (quad j: inputs 4j..4j+3).
// - q4_0: w = d (u - 8), u a nibble; q4_1: w = d u + m. Nibbles as GGUF keeps them (byte j of a
//   block: input j in the low nibble, input j + 16 in the high), [panels][blocks][4][16][4]: so
//   vector v of a block holds quad v (low nibbles) and quad v + 4 (high), widened in registers.
// - q8_h: q8_0's quads with a scale per 16 inputs and optionally q4_1's m per block: GGUF's Q6_K
//   (6-bit values, a scale per 16), and any mix of block formats stacked in one matrix (q, k, v).
// - q6_h: q8_h whose values all fit 6 bits (q in [-32, 31]: Q6_K, and Q4_K stacked with it), 384
//   bytes a block of 16 outputs instead of 512: u = q + 32, its low nibbles as q4's (vector v:
//   quads v and v + 4), then two vectors of high bit pairs (vector t, bits 2s..2s+1: quad 4t + s).
//   The GEMM rebuilds u in registers and takes 32 out, where q8_h stores q + 128 and takes 128 out:
//   the same int32 block sums, so the same bits as q8_h.
// Scales and mins are float16 when every one of them is exactly a float16 (GGUF's own d and m;
// re-quantized blocks round d to float16 as llama.cpp does), factored where they come so (Q4_K's
// d * sc and dmin * min, Q6_K's d * sc), else float32.
torch::Tensor as_half(const torch::Tensor& t) {  // float32, rounded through float16
  return t.to(torch::kFloat32).to(torch::kHalf).to(torch::kFloat32);
}

// d and m: float scales and mins [n, blocks (x parts)], or with d_base (and m_base) defined their
// int8 factors, the bases float16 [n, blocks / 8].
// data: the packed values.
void finish_blocks(Packed& p, const torch::Tensor& data, const torch::Tensor& d, const torch::Tensor& m,
                   const torch::Tensor& d_base = torch::Tensor(), const torch::Tensor& m_base = torch::Tensor()) {
  const int64_t panels = p.panels();
  // [outputs, blocks (x parts)] -> [panels][blocks * parts][16], padded; parts: values a block (q8_h scales: 2)
  auto by_panel = [&](const torch::Tensor& t) {
    const int64_t cols = t.numel() / p.n;
    auto padded = torch::zeros({panels * kLanes, cols}, t.scalar_type());
    padded.narrow(0, 0, p.n).copy_(t.reshape({p.n, cols}));
    return padded.view({panels, kLanes, cols}).permute({0, 2, 1}).contiguous().view({-1});
  };
  p.ptr = hold(p, "ptr", data);
  if (d_base.defined()) {
    const int64_t blocks = p.k2 / kBlock;
    TORCH_CHECK(blocks % kSuperBlocks == 0 && d_base.numel() == p.n * blocks / kSuperBlocks &&
                    m.defined() == m_base.defined() && (!m_base.defined() || m_base.sizes() == d_base.sizes()),
                "factored scales need whole super-blocks of 256 inputs and a float16 base per super-block");
    TORCH_CHECK(d.scalar_type() == torch::kInt8 && (!m.defined() || m.scalar_type() == torch::kInt8),
                "factored scales and mins are int8");
    p.meta = Meta::kFactored;
    p.block_scale = hold(p, "block_scale", by_panel(d));
    p.scale_base_ptr = static_cast<const uint16_t*>(hold(p, "scale_base_ptr", by_panel(d_base.to(torch::kHalf))));
    if (m.defined()) {
      p.block_min = hold(p, "block_min", by_panel(m));
      p.min_base_ptr = static_cast<const uint16_t*>(hold(p, "min_base_ptr", by_panel(m_base.to(torch::kHalf))));
    }
    return;
  }
  auto exact_half = [](const torch::Tensor& t) { return torch::equal(as_half(t), t.to(torch::kFloat32)); };
  p.meta = exact_half(d) && (!m.defined() || exact_half(m)) ? Meta::kF16 : Meta::kF32;
  const auto type = p.meta == Meta::kF16 ? torch::kHalf : torch::kFloat32;
  p.block_scale = hold(p, "block_scale", by_panel(d.to(torch::kFloat32).to(type)));
  if (m.defined()) p.block_min = hold(p, "block_min", by_panel(m.to(torch::kFloat32).to(type)));
}

// q [n, blocks, 32] int8, d [n, blocks] (q8_0) or [n, blocks, 2] (q8_h: a scale per 16 inputs, and
// m [n, blocks] or undefined; as q6_h where the values fit 6 bits, unless `narrow` is false).
Packed blocks_q8(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m, int64_t k,
                 const torch::Tensor& d_base = torch::Tensor(), const torch::Tensor& m_base = torch::Tensor(),
                 bool narrow = true) {
  Packed p;
  p.kind = d.dim() == 3 ? Kind::kQ8H : Kind::kQ8;
  TORCH_CHECK(d.dim() == 2 || d.size(2) == 2, "q8_h scales must be [n, blocks, 2]");
  TORCH_CHECK(!m.defined() || d.dim() == 3, "only q8_h blocks take mins");
  p.n = q.size(0);
  p.k = k;
  p.k2 = q.size(1) * kBlock;
  TORCH_CHECK(q.size(2) == kBlock && p.k2 >= k && p.k2 - k < kBlock, "q8_0 blocks must be [n, ceil(k / 32), 32]");
  if (p.kind == Kind::kQ8H && narrow && q.min().item<int8_t>() >= -32 && q.max().item<int8_t>() <= 31) {
    p.kind = Kind::kQ6H;
    const int64_t blocks = q.size(1);
    auto u = torch::full({p.panels() * kLanes, blocks, kBlock}, 32, torch::kUInt8);
    u.narrow(0, 0, p.n).copy_((q.to(torch::kInt16) + 32).to(torch::kUInt8));
    auto low = torch::bitwise_and(u, 15), high = torch::bitwise_right_shift(u, 4);  // [outputs, blocks, 32]
    auto nibbles = torch::bitwise_or(low.narrow(2, 0, kBlock / 2), torch::bitwise_left_shift(low.narrow(2, kBlock / 2, kBlock / 2), 4));
    auto lo = nibbles.view({p.panels(), kLanes, blocks, 4, 4}).permute({0, 2, 3, 1, 4});  // [panels][blocks][v][16][4]
    auto pairs = high.view({p.panels() * kLanes, blocks, 2, 4, 4});  // [.., t, s, byte]: quad 4t + s
    auto hi = pairs.select(3, 0);
    for (int s = 1; s < 4; ++s) hi = torch::bitwise_or(hi, torch::bitwise_left_shift(pairs.select(3, s), 2 * s));
    auto his = hi.view({p.panels(), kLanes, blocks, 2, 4}).permute({0, 2, 3, 1, 4});  // [panels][blocks][t][16][4]
    auto data = torch::cat({lo.reshape({p.panels(), blocks, 4 * kLanes * 4}),
                            his.reshape({p.panels(), blocks, 2 * kLanes * 4})}, 2).contiguous().view({-1});
    finish_blocks(p, data, d, m, d_base, m_base);
    return p;
  }
  auto padded = torch::full({p.panels() * kLanes, p.k2}, 128, torch::kUInt8);
  padded.narrow(0, 0, p.n).copy_((q.reshape({p.n, p.k2}).to(torch::kInt16) + 128).to(torch::kUInt8));
  finish_blocks(p, padded.view({p.panels(), kLanes, p.k2 / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({-1}), d, m,
                d_base, m_base);
  return p;
}

// nibbles [n, blocks, 16] uint8 as GGUF stores them; d [n, blocks]; m [n, blocks] (q4_1) or undefined (q4_0).
Packed blocks_q4(const torch::Tensor& nibbles, const torch::Tensor& d, const torch::Tensor& m, int64_t k,
                 const torch::Tensor& d_base = torch::Tensor(), const torch::Tensor& m_base = torch::Tensor()) {
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
  finish_blocks(p, padded.view({p.panels(), kLanes, blocks, 4, 4}).permute({0, 2, 3, 1, 4}).contiguous().view({-1}), d,
                m, d_base, m_base);
  return p;
}

// Quantizes float weights [n, k] into one of the block formats.
Packed pack_blocks(const torch::Tensor& weight, Quant quant) {
  const int64_t n = weight.size(0), k = weight.size(1), k2 = (k + kBlock - 1) / kBlock * kBlock;
  auto w = torch::zeros({n, k2}, torch::kFloat32);
  w.narrow(1, 0, k).copy_(weight.to(torch::kFloat32));
  auto wb = w.view({n, k2 / kBlock, kBlock});
  // As llama.cpp quantizes: the values from d, and d kept as float16 (as_half).
  if (quant == Quant::kQ8) {
    auto d = wb.abs().amax({2}) / 127.0;
    auto q = (wb / d.clamp_min(1e-30).unsqueeze(2)).round().clamp(-127, 127).to(torch::kInt8);
    return blocks_q8(q, as_half(d), torch::Tensor(), k);
  }
  auto d = wb.gather(2, wb.abs().argmax(2, true)).squeeze(2) / -8.0;  // llama.cpp's Q4_0 rounding
  auto inv = torch::where(d == 0, torch::zeros_like(d), 1.0 / d);
  auto u = ((wb * inv.unsqueeze(2)).round().clamp(-8, 7) + 8).to(torch::kInt32);
  auto nibbles = (u.narrow(2, 0, kBlock / 2) + u.narrow(2, kBlock / 2, kBlock / 2) * 16).to(torch::kUInt8);
  return blocks_q4(nibbles, as_half(d), torch::Tensor(), k);
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
  torch::Tensor data;
  if (bf16) {
    p.k2 = (p.k + 1) / 2 * 2;
    data = torch::zeros({panels * p.k2 * kLanes}, torch::kInt16);
    auto* dst = reinterpret_cast<uint16_t*>(data.data_ptr<int16_t>());
    const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    for (int64_t o = 0; o < p.n; ++o)
      for (int64_t i = 0; i < p.k; ++i)
        dst[((o / kLanes) * (p.k2 / 2) + i / 2) * 2 * kLanes + (o % kLanes) * 2 + (i % 2)] = src[o * p.k + i];
  } else {
    p.k2 = p.k;
    data = torch::zeros({panels * p.k * kLanes}, torch::kFloat32);
    float* dst = data.data_ptr<float>();
    const float* src = w.data_ptr<float>();
    for (int64_t o = 0; o < p.n; ++o)
      for (int64_t i = 0; i < p.k; ++i) dst[((o / kLanes) * p.k + i) * kLanes + (o % kLanes)] = src[o * p.k + i];
  }
  p.ptr = hold(p, "ptr", data);
  return p;
}


