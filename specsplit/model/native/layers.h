// Part of decoder.cpp (included once, inside its anonymous namespace): a layer's weights, a
// packed weight as Python builds it.
#pragma once

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
  static Weight q8_0(const torch::Tensor& q, const torch::Tensor& d, int64_t k) {
    return Weight{blocks_q8(q, d, torch::Tensor(), k)};
  }
  // d [n, blocks, 2]: a scale per 16 inputs; m [n, blocks] or None: w = d q + m. With d_base (and
  // m_base for m), float16 [n, blocks / 8], d and m are int8 factors of it (packing.h, Meta).
  // narrow: values that fit 6 bits are stored as 6 (q6_h, the same products); false keeps 8 (tests).
  static Weight q8_h(const torch::Tensor& q, const torch::Tensor& d, const std::optional<torch::Tensor>& m, int64_t k,
                     const std::optional<torch::Tensor>& d_base, const std::optional<torch::Tensor>& m_base,
                     bool narrow) {
    return Weight{blocks_q8(q, d, m.value_or(torch::Tensor()), k, d_base.value_or(torch::Tensor()),
                            m_base.value_or(torch::Tensor()), narrow)};
  }
  std::string kind_name() const {
    static const char* names[] = {"bf16", "f32", "int8", "q8_0", "q4_0", "q4_1", "q8_h", "q6_h"};
    return names[static_cast<int>(p.kind)];
  }
  static Weight q4_0(const torch::Tensor& nibbles, const torch::Tensor& d, int64_t k) {
    return Weight{blocks_q4(nibbles, d, torch::Tensor(), k)};
  }
  static Weight q4_1(const torch::Tensor& nibbles, const torch::Tensor& d, const torch::Tensor& m, int64_t k,
                     const std::optional<torch::Tensor>& d_base, const std::optional<torch::Tensor>& m_base) {
    return Weight{blocks_q4(nibbles, d, m, k, d_base.value_or(torch::Tensor()), m_base.value_or(torch::Tensor()))};
  }
  // What the kernels read, for the kernel check (tests/kernelcheck.cpp): each buffer under its
  // pointer's name, and "sizes": kind, meta, outputs, inputs, padded inputs.
  std::map<std::string, torch::Tensor> buffers() const {
    std::map<std::string, torch::Tensor> out;
    for (const auto& [name, t] : static_cast<const Held*>(p.keep.get())->tensors) out[name] = t;
    out["sizes"] = torch::tensor({static_cast<int64_t>(p.kind), static_cast<int64_t>(p.meta), p.n, p.k, p.k2});
    return out;
  }
  int64_t outputs() const { return p.n; }
  int64_t inputs() const { return p.k; }
};

Act act_of(Kind kind) {
  switch (kind) {
    case Kind::kQ8: case Kind::kQ4: case Kind::kQ41: case Kind::kQ8H: case Kind::kQ6H: return Act::kQ8;
    case Kind::kF32: return Act::kF32;
    default: return Act::kBF16;
  }
}

