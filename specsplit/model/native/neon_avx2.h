// The AVX2 intrinsics isa_avx2.h and attention_avx2.h use, on Arm NEON (aarch64), each with the
// x86 instruction's exact semantics: an aarch64 build runs the AVX2 path's code, so it gives the
// AVX2 path's bits for every format (tests/test_kernelcheck.py runs both builds on the same packed
// weights and compares). One source for the maths on both; a __m256 is two 128-bit registers.
//
// Float ops are the same IEEE operations (FMA fused on both; max/min as x86's, which return the
// second operand when either is NaN; conversions round to nearest even as MXCSR's default), and the
// integer ops keep x86's saturation and wrap-around.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

struct __m256 {
  float32x4_t lo, hi;
};
struct __m256i {
  int32x4_t lo, hi;
};
using __m128 = float32x4_t;
using __m128i = int32x4_t;

#define _MM_HINT_T0 0
#define _CMP_EQ_OQ 0
#define _CMP_UNORD_Q 3
#define _MM_FROUND_TO_NEAREST_INT 0
#define _MM_FROUND_NO_EXC 8

static inline void _mm_prefetch(const void* p, int) { __builtin_prefetch(p, 0, 3); }

// ---- reinterpretations
static inline int8x16_t s8(int32x4_t v) { return vreinterpretq_s8_s32(v); }
static inline uint8x16_t u8(int32x4_t v) { return vreinterpretq_u8_s32(v); }
static inline int16x8_t s16(int32x4_t v) { return vreinterpretq_s16_s32(v); }
static inline uint16x8_t u16(int32x4_t v) { return vreinterpretq_u16_s32(v); }
static inline int32x4_t i32(int8x16_t v) { return vreinterpretq_s32_s8(v); }
static inline int32x4_t i32(uint8x16_t v) { return vreinterpretq_s32_u8(v); }
static inline int32x4_t i32(int16x8_t v) { return vreinterpretq_s32_s16(v); }
static inline int32x4_t i32(uint16x8_t v) { return vreinterpretq_s32_u16(v); }
static inline int32x4_t i32(uint32x4_t v) { return vreinterpretq_s32_u32(v); }
static inline int32x4_t i32(float32x4_t v) { return vreinterpretq_s32_f32(v); }
static inline float32x4_t f32(int32x4_t v) { return vreinterpretq_f32_s32(v); }
static inline float32x4_t f32(uint32x4_t v) { return vreinterpretq_f32_u32(v); }

template <typename F>
static inline __m256 map_ps(__m256 a, __m256 b, F f) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
template <typename F>
static inline __m256i map_si(__m256i a, __m256i b, F f) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
// An x86 op that works lane by lane as a NEON op on each 128-bit half.
#define SPECSPLIT_HALVES_PS(name, op) \
  static inline __m256 name(__m256 a, __m256 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
#define SPECSPLIT_HALVES_SI(name, op) \
  static inline __m256i name(__m256i a, __m256i b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }

// x86's maxps / minps: a > b ? a : b (a < b ? a : b), so NaN in either gives b.
static inline float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float32x4_t min4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }

// ---- 256-bit float
static inline __m256 _mm256_setzero_ps() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
static inline __m256 _mm256_set1_ps(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
static inline __m256 _mm256_loadu_ps(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline void _mm256_storeu_ps(float* p, __m256 v) {
  vst1q_f32(p, v.lo);
  vst1q_f32(p + 4, v.hi);
}
SPECSPLIT_HALVES_PS(_mm256_add_ps, vaddq_f32)
SPECSPLIT_HALVES_PS(_mm256_sub_ps, vsubq_f32)
SPECSPLIT_HALVES_PS(_mm256_mul_ps, vmulq_f32)
SPECSPLIT_HALVES_PS(_mm256_div_ps, vdivq_f32)
SPECSPLIT_HALVES_PS(_mm256_max_ps, max4)
SPECSPLIT_HALVES_PS(_mm256_min_ps, min4)
static inline __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) {  // a b + c, one rounding
  return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)};
}
static inline __m256 _mm256_fnmadd_ps(__m256 a, __m256 b, __m256 c) {  // c - a b, one rounding
  return {vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)};
}
static inline __m256 _mm256_and_ps(__m256 a, __m256 b) {
  return map_ps(a, b, [](auto x, auto y) { return f32(vandq_s32(i32(x), i32(y))); });
}
static inline __m256 _mm256_andnot_ps(__m256 a, __m256 b) {  // ~a & b
  return map_ps(a, b, [](auto x, auto y) { return f32(vbicq_s32(i32(y), i32(x))); });
}
static inline __m256 _mm256_castsi256_ps(__m256i v) { return {f32(v.lo), f32(v.hi)}; }
static inline __m128 _mm256_castps256_ps128(__m256 v) { return v.lo; }
static inline __m128 _mm256_extractf128_ps(__m256 v, int half) { return half ? v.hi : v.lo; }
static inline __m256 _mm256_cmp_ps(__m256 a, __m256 b, int op) {  // _CMP_EQ_OQ or _CMP_UNORD_Q: lanes all ones where true
  auto one = [op](float32x4_t x, float32x4_t y) {
    if (op == _CMP_UNORD_Q) return f32(vmvnq_u32(vandq_u32(vceqq_f32(x, x), vceqq_f32(y, y))));
    return f32(vceqq_f32(x, y));
  };
  return {one(a.lo, b.lo), one(a.hi, b.hi)};
}
static inline int _mm256_movemask_ps(__m256 v) {  // the sign bits, lane 0 in bit 0
  alignas(16) uint32_t u[8];
  vst1q_u32(u, vreinterpretq_u32_f32(v.lo));
  vst1q_u32(u + 4, vreinterpretq_u32_f32(v.hi));
  int m = 0;
  for (int i = 0; i < 8; ++i) m |= static_cast<int>(u[i] >> 31) << i;
  return m;
}
static inline __m256 _mm256_maskload_ps(const float* p, __m256i mask) {  // masked-off lanes 0, never read
  alignas(16) int32_t m[8];
  vst1q_s32(m, mask.lo);
  vst1q_s32(m + 4, mask.hi);
  alignas(16) float v[8];
  for (int i = 0; i < 8; ++i) v[i] = m[i] < 0 ? p[i] : 0.0f;
  return _mm256_loadu_ps(v);
}
static inline void _mm256_maskstore_ps(float* p, __m256i mask, __m256 v) {
  alignas(16) int32_t m[8];
  vst1q_s32(m, mask.lo);
  vst1q_s32(m + 4, mask.hi);
  alignas(16) float x[8];
  _mm256_storeu_ps(x, v);
  for (int i = 0; i < 8; ++i)
    if (m[i] < 0) p[i] = x[i];
}
static inline __m256 _mm256_round_ps(__m256 v, int) { return {vrndnq_f32(v.lo), vrndnq_f32(v.hi)}; }  // to nearest even
static inline __m256i _mm256_cvtps_epi32(__m256 v) { return {vcvtnq_s32_f32(v.lo), vcvtnq_s32_f32(v.hi)}; }
static inline __m256 _mm256_cvtepi32_ps(__m256i v) { return {vcvtq_f32_s32(v.lo), vcvtq_f32_s32(v.hi)}; }
static inline __m256 _mm256_cvtph_ps(__m128i h) {  // 8 float16 -> float32 (exact)
  const float16x8_t x = vreinterpretq_f16_s32(h);
  return {vcvt_f32_f16(vget_low_f16(x)), vcvt_f32_f16(vget_high_f16(x))};
}

// ---- 128-bit float
static inline __m128 _mm_add_ps(__m128 a, __m128 b) { return vaddq_f32(a, b); }
static inline __m128 _mm_max_ps(__m128 a, __m128 b) { return max4(a, b); }
static inline __m128 _mm_movehl_ps(__m128 a, __m128 b) {  // b2 b3 a2 a3
  return vcombine_f32(vget_high_f32(b), vget_high_f32(a));
}
static inline __m128 _mm_movehdup_ps(__m128 a) { return vtrn2q_f32(a, a); }  // a1 a1 a3 a3
static inline __m128 _mm_add_ss(__m128 a, __m128 b) {
  return vsetq_lane_f32(vgetq_lane_f32(a, 0) + vgetq_lane_f32(b, 0), a, 0);
}
static inline __m128 _mm_max_ss(__m128 a, __m128 b) { return vsetq_lane_f32(vgetq_lane_f32(max4(a, b), 0), a, 0); }
static inline float _mm_cvtss_f32(__m128 a) { return vgetq_lane_f32(a, 0); }

// ---- 256-bit integer
static inline __m256i _mm256_setzero_si256() { return {vdupq_n_s32(0), vdupq_n_s32(0)}; }
static inline __m256i _mm256_set1_epi32(int32_t x) { return {vdupq_n_s32(x), vdupq_n_s32(x)}; }
static inline __m256i _mm256_set1_epi16(int16_t x) { return {i32(vdupq_n_s16(x)), i32(vdupq_n_s16(x))}; }
static inline __m256i _mm256_set1_epi8(char x) {
  return {i32(vdupq_n_s8(static_cast<int8_t>(x))), i32(vdupq_n_s8(static_cast<int8_t>(x)))};
}
static inline __m256i _mm256_setr_epi32(int32_t a, int32_t b, int32_t c, int32_t d, int32_t e, int32_t f, int32_t g,
                                        int32_t h) {
  const int32_t lo[4] = {a, b, c, d}, hi[4] = {e, f, g, h};
  return {vld1q_s32(lo), vld1q_s32(hi)};
}
static inline __m256i _mm256_loadu_si256(const __m256i* p) {
  const int32_t* q = reinterpret_cast<const int32_t*>(p);
  return {vld1q_s32(q), vld1q_s32(q + 4)};
}
static inline void _mm256_storeu_si256(__m256i* p, __m256i v) {
  int32_t* q = reinterpret_cast<int32_t*>(p);
  vst1q_s32(q, v.lo);
  vst1q_s32(q + 4, v.hi);
}
SPECSPLIT_HALVES_SI(_mm256_and_si256, vandq_s32)
SPECSPLIT_HALVES_SI(_mm256_or_si256, vorrq_s32)
SPECSPLIT_HALVES_SI(_mm256_xor_si256, veorq_s32)
SPECSPLIT_HALVES_SI(_mm256_add_epi32, vaddq_s32)
SPECSPLIT_HALVES_SI(_mm256_sub_epi32, vsubq_s32)
static inline __m256i _mm256_add_epi16(__m256i a, __m256i b) {  // wraps, as paddw
  return map_si(a, b, [](auto x, auto y) { return i32(vaddq_s16(s16(x), s16(y))); });
}
static inline __m256i _mm256_cmpgt_epi32(__m256i a, __m256i b) {
  return map_si(a, b, [](auto x, auto y) { return i32(vcgtq_s32(x, y)); });
}
// Shifts by a count (x86: counts past the width give 0, or the sign for arithmetic right shifts).
static inline __m256i _mm256_slli_epi32(__m256i v, int n) {
  const int32x4_t c = vdupq_n_s32(n > 31 ? 32 : n);
  return {i32(vshlq_u32(vreinterpretq_u32_s32(v.lo), c)), i32(vshlq_u32(vreinterpretq_u32_s32(v.hi), c))};
}
static inline __m256i _mm256_srai_epi32(__m256i v, int n) {
  const int32x4_t c = vdupq_n_s32(-(n > 31 ? 31 : n));
  return {vshlq_s32(v.lo, c), vshlq_s32(v.hi, c)};
}
static inline __m256i _mm256_slli_epi16(__m256i v, int n) {
  const int16x8_t c = vdupq_n_s16(static_cast<int16_t>(n > 15 ? 16 : n));
  return {i32(vshlq_u16(u16(v.lo), c)), i32(vshlq_u16(u16(v.hi), c))};
}
static inline __m256i _mm256_srli_epi16(__m256i v, int n) {
  const int16x8_t c = vdupq_n_s16(static_cast<int16_t>(-(n > 15 ? 16 : n)));
  return {i32(vshlq_u16(u16(v.lo), c)), i32(vshlq_u16(u16(v.hi), c))};
}
static inline __m256i _mm256_abs_epi8(__m256i v) { return {i32(vabsq_s8(s8(v.lo))), i32(vabsq_s8(s8(v.hi)))}; }
static inline __m256i _mm256_sign_epi8(__m256i a, __m256i b) {  // a where b > 0, -a (wrapping) where b < 0, else 0
  auto one = [](int32x4_t x, int32x4_t y) {
    const int8x16_t v = s8(x), s = s8(y);
    const int8x16_t neg = vbslq_s8(vcltzq_s8(s), vnegq_s8(v), v);
    return i32(vbslq_s8(vceqzq_s8(s), vdupq_n_s8(0), neg));
  };
  return map_si(a, b, one);
}
// vpmaddubsw: unsigned bytes of a by signed bytes of b, adjacent products summed with saturation.
static inline __m256i _mm256_maddubs_epi16(__m256i a, __m256i b) {
  auto one = [](int32x4_t x, int32x4_t y) {
    const uint8x16_t ua = u8(x);
    const int8x16_t sb = s8(y);
    const int16x8_t p0 = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(ua))), vmovl_s8(vget_low_s8(sb)));
    const int16x8_t p1 = vmulq_s16(vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(ua))), vmovl_s8(vget_high_s8(sb)));
    return i32(vqaddq_s16(vuzp1q_s16(p0, p1), vuzp2q_s16(p0, p1)));  // |product| <= 255 * 128: exact in int16
  };
  return map_si(a, b, one);
}
// vpmaddwd: int16 by int16, adjacent products summed into int32 (wrapping).
static inline __m256i _mm256_madd_epi16(__m256i a, __m256i b) {
  auto one = [](int32x4_t x, int32x4_t y) {
    const int16x8_t p = s16(x), q = s16(y);
    const int32x4_t lo = vmull_s16(vget_low_s16(p), vget_low_s16(q)), hi = vmull_high_s16(p, q);
    return vreinterpretq_s32_u32(vpaddq_u32(vreinterpretq_u32_s32(lo), vreinterpretq_u32_s32(hi)));
  };
  return map_si(a, b, one);
}
// packs, per 128-bit lane as x86 does: lane l of the result holds a's lane l, then b's, narrowed with saturation.
static inline __m256i _mm256_packs_epi32(__m256i a, __m256i b) {
  return {i32(vcombine_s16(vqmovn_s32(a.lo), vqmovn_s32(b.lo))), i32(vcombine_s16(vqmovn_s32(a.hi), vqmovn_s32(b.hi)))};
}
static inline __m256i _mm256_packs_epi16(__m256i a, __m256i b) {
  return {i32(vcombine_s8(vqmovn_s16(s16(a.lo)), vqmovn_s16(s16(b.lo)))),
          i32(vcombine_s8(vqmovn_s16(s16(a.hi)), vqmovn_s16(s16(b.hi))))};
}
static inline __m256i _mm256_permutevar8x32_epi32(__m256i v, __m256i idx) {
  alignas(16) int32_t x[8], i[8], y[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(i), idx);
  for (int k = 0; k < 8; ++k) y[k] = x[i[k] & 7];
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
}
static inline __m128i _mm256_castsi256_si128(__m256i v) { return v.lo; }
static inline __m128i _mm256_extracti128_si256(__m256i v, int half) { return half ? v.hi : v.lo; }
static inline __m256i _mm256_cvtepi8_epi16(__m128i v) {  // 16 int8 -> 16 int16
  const int8x16_t b = s8(v);
  return {i32(vmovl_s8(vget_low_s8(b))), i32(vmovl_high_s8(b))};
}
static inline __m256i _mm256_cvtepi8_epi32(__m128i v) {  // the low 8 int8 -> 8 int32
  const int16x8_t w = vmovl_s8(vget_low_s8(s8(v)));
  return {vmovl_s16(vget_low_s16(w)), vmovl_high_s16(w)};
}
static inline __m256i _mm256_cvtepu16_epi32(__m128i v) {  // 8 uint16 -> 8 int32
  const uint16x8_t w = u16(v);
  return {i32(vmovl_u16(vget_low_u16(w))), i32(vmovl_high_u16(w))};
}

// ---- 128-bit integer
static inline __m128i _mm_loadu_si128(const __m128i* p) { return vld1q_s32(reinterpret_cast<const int32_t*>(p)); }
static inline __m128i _mm_loadl_epi64(const __m128i* p) {  // 8 bytes, the rest 0
  int64_t v;
  std::memcpy(&v, p, 8);
  return vreinterpretq_s32_s64(vsetq_lane_s64(v, vdupq_n_s64(0), 0));
}
static inline __m128i _mm_add_epi32(__m128i a, __m128i b) { return vaddq_s32(a, b); }
static inline __m128i _mm_shuffle_epi32(__m128i v, int imm) {
  alignas(16) int32_t x[4], y[4];
  vst1q_s32(x, v);
  for (int k = 0; k < 4; ++k) y[k] = x[(imm >> (2 * k)) & 3];
  return vld1q_s32(y);
}
static inline int32_t _mm_cvtsi128_si32(__m128i v) { return vgetq_lane_s32(v, 0); }
