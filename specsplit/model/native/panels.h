// Part of decoder.cpp (included once, inside its anonymous namespace): a packed weight as the
// kernels read it: raw panels, scales and sizes, no torch (packing.h makes them from tensors, and
// the aarch64 kernel check, tests/kernelcheck.cpp, builds the kernels with this and no torch).
#pragma once

// A packed weight matrix and how to multiply rows by it.
enum class Kind { kBF16, kF32, kI8, kQ8, kQ4, kQ41, kQ8H, kQ6H };
// What a Decoder's GEMM weights are: the model's dtype, int8 weight-only, q8_0 (int8 weights and
// activations in blocks of 32) or q4_0 (4-bit weights in blocks of 32, int8 activations).
enum class Quant : int64_t { kNone = 0, kInt8 = 1, kQ8 = 2, kQ4 = 3 };
constexpr int64_t kBlock = 32;  // q8_0: inputs per scale
constexpr int64_t kSuperBlocks = 8;  // factored scales: blocks per float16 base (GGUF's K-quant super-block)
// How a block format's scales (and mins) are stored: float32; float16 (each one exactly so); or
// factored as GGUF's K-quants keep them, an int8 per block (or half-block) times a float16 base per
// super-block of 256 inputs (the products exact in float32, so the GEMM's bits are those of float32
// scales, from a quarter of the bytes).
enum class Meta { kF32, kF16, kFactored };

struct Packed {
  std::shared_ptr<void> keep;  // what owns the buffers below (packing.h: their tensors), shared by copies
  const void* ptr = nullptr;  // bf16 or int8 pairs, fp32 panels, or q8_0 quads
  const float* scale_ptr = nullptr;  // int8: float32 per output (w = q * scale)
  const void* block_scale = nullptr;  // blocks: per panel, block and output (q8_h: half-block), as `meta` says
  const void* block_min = nullptr;  // q4_1 (and q8_h with mins): m per panel, block and output
  const uint16_t* scale_base_ptr = nullptr;  // kFactored: float16 per panel, super-block (8 blocks) and output
  const uint16_t* min_base_ptr = nullptr;
  Meta meta = Meta::kF32;
  bool amx = false;  // bf16 on AMX tiles (tdpbf16ps) for every row count
  int64_t n = 0, k = 0, k2 = 0;  // outputs, inputs, inputs rounded up to even (q8_0: to a whole block)
  Kind kind = Kind::kBF16;
  int64_t panels() const { return (n + kLanes - 1) / kLanes; }
};

constexpr int kTileRows = 16;  // AMX: rows of a tile
