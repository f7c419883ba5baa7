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

