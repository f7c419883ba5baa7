// Part of decoder.cpp (included once, inside its anonymous namespace): activation rows as the
// GEMMs read them, the same on every instruction set.
#pragma once


// Activation rows as the GEMM reads them: bf16 pairs, fp32, or q8 blocks (signed bytes and a scale
// per block), `stride` elements apart.
struct Rows {
  std::vector<uint16_t> h;
  std::vector<float> f;
  std::vector<int8_t> q;
  std::vector<float> qs;  // q8: per row and block, x = q * qs
  std::vector<int32_t> qi;  // q8: per row and half-block (16 inputs), sum(q): what the weights' offsets multiply
  std::vector<float> qsum;  // q8: per row and block, qs * sum(q): what q4_1's m multiplies
  int64_t stride = 0;
};

enum class Act { kF32, kBF16, kQ8 };

// Sizes `out` for `rows` rows of k features (done once, before the rows are filled in parallel).
void shape_rows(int64_t rows, int64_t k, Act act, Rows& out) {
  if (act == Act::kQ8) {
    out.stride = (k + kBlock - 1) / kBlock * kBlock;
    out.q.resize(rows * out.stride);
    out.qs.resize(rows * out.stride / kBlock);
    out.qi.resize(rows * out.stride / kBlock * 2);
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

