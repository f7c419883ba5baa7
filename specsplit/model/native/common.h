// Part of decoder.cpp (included once, inside its anonymous namespace): constants, bf16 and exp helpers.
#pragma once

constexpr int kLanes = 16;
constexpr int kMaxRows = 8;  // rows per register block of a GEMM
constexpr int kPrefetchBytes = 2048;  // how far ahead in a panel's weight stream to prefetch (bf16, f32)
// The same for the block formats (q8 and q4 by int8 rows): at several rows a block takes about as long
// to multiply as to load, and 2 KB ahead was too late (EPYC, gguf 5-row verify 1.21-1.35x a step; 8 KB: 1.00-1.16x).
constexpr int kBlockPrefetchBytes = 8192;
constexpr int kKeysAhead = 64;  // attention: how many keys (values) ahead to prefetch
constexpr int kPvQueries = 12, kPvChunks = 2;  // attention's P V: queries x 16-dim chunks per value load

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
