// Part of decoder.cpp (included once, inside its anonymous namespace) in the AVX2 build (AVX2, FMA,
// F16C: every x86-64 server CPU since 2013, AMD EPYC before Zen 4 among them): the row steps and the
// GEMMs, on the same packed layouts as the AVX-512 build (packing.h).
//
// A 16-output panel is two halves of 8 lanes; each half is computed on its own, by the same
// instruction sequence whatever the row count or thread, so the exactness rules of decoder.cpp hold.
// Block formats: AVX2 has no vpdpbusd; vpmaddubsw multiplies unsigned by signed bytes into int16 pairs
// (saturating), vpmaddwd widens them to int32. A block's integer sum is exact and the same integer the
// AVX-512 build computes, and it is scaled into the row's float accumulator in the same order, so
// these formats give the AVX-512 build's bits. Saturation is avoided by construction: nibbles (q4,
// at most 15 * 127 * 2 = 3810 a pair, 8 quads summed in int16: 30480) and 6-bit values (16002 a pair,
// 2 quads summed) go as stored; q8's stored q + 128 would overflow a pair (255 * 127 * 2), so it is
// taken back to q and multiplied as |q| by x carrying q's sign (at most 128 * 127 * 2 = 32512), with
// no offset to take out. bf16 and int8 weights are widened to fp32 and multiplied by fp32 FMA (the
// products exact, as vdpbf16ps's are; the sums in another order, so other bits than AVX-512's).
#pragma once

constexpr int kHalf = 8;  // lanes of a __m256: half a panel
constexpr int kRowsAvx2 = 8;  // rows per block: the weights unpacked once for all (spills to L1 cost less than unpacking twice)

inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline float hsum8(__m256 v) {  // a fixed order: halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline __m256i lanes8(int64_t n) {  // a mask of the first n of 8 lanes
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(n, 0, 8))), idx);
}

// exp as the AVX-512 build's exp_ps (the same constants and steps, lane by lane).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

bool amx_permitted() { return false; }  // no AMX in this build

// One row quantized per block of 32, exactly as the AVX-512 build does (the same s, q and sums).
void quantize_row_q8(const float* src, int64_t k, int64_t stride, int8_t* dst, float* scales, int32_t* isums,
                     float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b * kBlock < stride; ++b) {
    const int64_t n = k - b * kBlock;  // inputs left; past k the block reads zeros
    __m256 v[4];
    for (int t = 0; t < 4; ++t) v[t] = _mm256_maskload_ps(src + b * kBlock + t * kHalf, lanes8(n - t * kHalf));
    __m256 top = _mm256_andnot_ps(sign, v[0]);
    for (int t = 1; t < 4; ++t) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[t]));
    const float amax = hmax8(top);
    const float s = amax / 127.0f;
    scales[b] = s;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int t = 0; t < 4; ++t) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
    // int32 -> int8 (values already in [-127, 127]); packs interleave 128-bit lanes, the permute undoes it
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * kBlock), bytes);
    isums[2 * b] = hsum8i(_mm256_add_epi32(q[0], q[1]));
    isums[2 * b + 1] = hsum8i(_mm256_add_epi32(q[2], q[3]));
    sums[b] = s * static_cast<float>(isums[2 * b] + isums[2 * b + 1]);  // exact: |sum| < 2^24
  }
}

// Row r of `out` (shaped for k features) from src.
void row_to(const float* src, int64_t r, int64_t k, Act act, Rows& out) {
  if (act == Act::kQ8) {
    const int64_t blocks = out.stride / kBlock;
    quantize_row_q8(src, k, out.stride, out.q.data() + r * out.stride, out.qs.data() + r * blocks,
                    out.qi.data() + r * blocks * 2, out.qsum.data() + r * blocks);
    return;
  }
  if (act == Act::kF32) {
    std::memcpy(out.f.data() + r * k, src, k * 4);
    return;
  }
  uint16_t* dst = out.h.data() + r * out.stride;
  for (int64_t i = 0; i < k; ++i) dst[i] = f32_to_bf16(src[i]);
  if (out.stride > k) dst[k] = 0;
}

void to_rows(const float* x, int64_t rows, int64_t k, Act act, Rows& out) {
  shape_rows(rows, k, act, out);
  for (int64_t r = 0; r < rows; ++r) row_to(x + r * k, r, k, act, out);
}

// Lanes [0, valid) of v to y.
inline void store8(float* y, __m256 v, int64_t valid) {
  if (valid >= kHalf) _mm256_storeu_ps(y, v);
  else _mm256_maskstore_ps(y, lanes8(valid), v);
}

// bf16 or int8 pairs by bf16 rows, half h of a panel: each pair's weights widened to fp32 (even
// input in a dword's low half, odd in its high half), two accumulators a row (even and odd pairs of
// inputs), summed at the end; int8 scales per output.
template <int R, bool I8>
void half_pairs(const Packed& w, int64_t panel, int h, const uint16_t* x, int64_t stride, float* y, int64_t ldy) {
  constexpr int64_t kPairBytes = I8 ? 2 * kLanes : 4 * kLanes;
  const char* wp = static_cast<const char*>(w.ptr) + panel * (w.k2 / 2) * kPairBytes + h * kPairBytes / 2;
  const int64_t pairs = w.k2 / 2;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const char* at = wp + kp * kPairBytes;
    __m256 even, odd;
    if constexpr (I8) {
      const __m256i d = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(d, 16), 16));
      odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(d, 16));
    } else {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      even = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
      odd = _mm256_castsi256_ps(_mm256_and_si256(d, high));
    }
    _mm_prefetch(at + kPrefetchBytes, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = x + r * stride + 2 * kp;
      __m256& a = acc[r][kp & 1];
      a = _mm256_fmadd_ps(_mm256_set1_ps(bf16_to_f32(xr[0])), even, a);
      a = _mm256_fmadd_ps(_mm256_set1_ps(bf16_to_f32(xr[1])), odd, a);
    }
  }
  const int64_t o = panel * kLanes + h * kHalf;
  const __m256 scale = I8 ? _mm256_loadu_ps(w.scale_ptr + o) : _mm256_set1_ps(1.0f);  // padded to whole panels
  for (int r = 0; r < R; ++r) store8(y + r * ldy + o, _mm256_mul_ps(_mm256_add_ps(acc[r][0], acc[r][1]), scale), w.n - o);
}

template <int R>
void half_f32(const Packed& w, int64_t panel, int h, const float* x, int64_t stride, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const float* wp = static_cast<const float*>(w.ptr) + panel * w.k * kLanes + h * kHalf;
  for (int64_t i = 0; i < w.k; ++i) {
    const __m256 wv = _mm256_loadu_ps(wp + i * kLanes);
    _mm_prefetch(reinterpret_cast<const char*>(wp + i * kLanes) + 2 * kPrefetchBytes, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * stride + i]), wv, acc[r]);
  }
  const int64_t o = panel * kLanes + h * kHalf;
  for (int r = 0; r < R; ++r) store8(y + r * ldy + o, acc[r], w.n - o);
}

// Block formats by q8 rows, half h of a panel (the AVX-512 build's panel_q8, 8 outputs at a time).
template <int R, Kind K, Meta META>
void half_q8(const Packed& w, int64_t panel, int h, const int8_t* x, const float* xs, const int32_t* xi,
             const float* xsum, int64_t stride, float* y, int64_t ldy) {
  constexpr bool SIX = K == Kind::kQ6H, Q4 = K == Kind::kQ4 || K == Kind::kQ41, HALVES = K == Kind::kQ8H || SIX;
  constexpr bool SIGNED = !Q4 && !SIX;  // q8 and q8_h: multiplied as |q| by x with q's sign, no offset
  constexpr int64_t kParts = HALVES ? 2 : 1;
  constexpr int32_t kOffset = K == Kind::kQ4 ? 8 : SIX ? 32 : 0;  // stored weight - q, taken out after
  constexpr int kGroup = Q4 ? 8 : SIX ? 2 : 1;  // quads whose int16 products are summed before widening
  const int64_t blocks = w.k2 / kBlock, xblocks = stride / kBlock;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  constexpr int64_t kBlockBytes = Q4 ? kBlock * kLanes / 2 : SIX ? kBlock * kLanes * 3 / 4 : kBlock * kLanes;
  const uint8_t* wp = static_cast<const uint8_t*>(w.ptr) + panel * blocks * kBlockBytes + h * 32;
  using Stored = std::conditional_t<META == Meta::kF32, float, std::conditional_t<META == Meta::kF16, uint16_t, int8_t>>;
  const Stored* sp = static_cast<const Stored*>(w.block_scale) + panel * blocks * kParts * kLanes + h * kHalf;
  const Stored* mp = w.block_min ? static_cast<const Stored*>(w.block_min) + panel * blocks * kLanes + h * kHalf : nullptr;
  const int64_t supers = blocks / kSuperBlocks;
  const uint16_t* sbp = META == Meta::kFactored ? w.scale_base_ptr + panel * supers * kLanes + h * kHalf : nullptr;
  const uint16_t* mbp = META == Meta::kFactored && mp ? w.min_base_ptr + panel * supers * kLanes + h * kHalf : nullptr;
  __m256 scale_base = _mm256_setzero_ps(), min_base = _mm256_setzero_ps();
  auto half16 = [](const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  auto load = [&](const Stored* p, __m256 base) {
    if constexpr (META == Meta::kF32) return _mm256_loadu_ps(p);
    else if constexpr (META == Meta::kF16) return half16(p);
    else return _mm256_mul_ps(base, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  };
  constexpr int kQuads = kBlock / 4;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    if (META == Meta::kFactored && b % kSuperBlocks == 0) {
      scale_base = half16(sbp + b / kSuperBlocks * kLanes);
      if (mbp) min_base = half16(mbp + b / kSuperBlocks * kLanes);
    }
    const uint8_t* wb = wp + b * kBlockBytes;  // vector v of the block: wb + v * 64 (this half: 32 bytes)
    auto vec = [&](int v) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + v * 4 * kLanes)); };
    __m256i wq[kQuads];
    if constexpr (Q4 || SIX) {
      for (int v = 0; v < kQuads / 2; ++v) {
        const __m256i packed = vec(v);
        _mm_prefetch(reinterpret_cast<const char*>(wb + v * 4 * kLanes) + kBlockPrefetchBytes, _MM_HINT_T0);
        wq[v] = _mm256_and_si256(packed, nibble);
        wq[v + kQuads / 2] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      }
      if constexpr (SIX) {  // bits 2s..2s+1 of high vector t are bits 4..5 of quad 4t + s
        const __m256i pair = _mm256_set1_epi8(0x30);
        for (int t = 0; t < 2; ++t) {
          const __m256i high = vec(4 + t);
          wq[4 * t] = _mm256_or_si256(wq[4 * t], _mm256_and_si256(_mm256_slli_epi16(high, 4), pair));
          wq[4 * t + 1] = _mm256_or_si256(wq[4 * t + 1], _mm256_and_si256(_mm256_slli_epi16(high, 2), pair));
          wq[4 * t + 2] = _mm256_or_si256(wq[4 * t + 2], _mm256_and_si256(high, pair));
          wq[4 * t + 3] = _mm256_or_si256(wq[4 * t + 3], _mm256_and_si256(_mm256_srli_epi16(high, 2), pair));
        }
      }
    } else {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int j = 0; j < kQuads; ++j) {
        wq[j] = _mm256_xor_si256(vec(j), flip);  // q + 128 -> q
        _mm_prefetch(reinterpret_cast<const char*>(wb + j * 4 * kLanes) + kBlockPrefetchBytes, _MM_HINT_T0);
      }
    }
    // int32 sums over quads [j0, j1) of row xb: 8 outputs, each the sum of its 4-input products
#if defined(__ARM_FEATURE_DOTPROD)
    // Arm's sdot does a quad's four products and their sum in one instruction, where the shim's
    // vpmaddubsw + vpmaddwd take a dozen. The same int32 sums: the int16 steps below never saturate
    // (|q| <= 128 by |x| <= 127 in pairs, kGroup quads at most 30720) and every stored q fits int8
    // (q8's signed values; q4's 0..15 and q6's 0..63 unsigned).
    auto dot = [&](const int8_t* xb, int j0, int j1) {
      int32x4_t lo = vdupq_n_s32(0), hi = lo;
      for (int t = j0; t < j1; t += 4) {  // four quads of x in one register, one lane per quad
        const int8x16_t x16 = vld1q_s8(xb + 4 * t);
        lo = vdotq_laneq_s32(lo, s8(wq[t].lo), x16, 0);
        hi = vdotq_laneq_s32(hi, s8(wq[t].hi), x16, 0);
        lo = vdotq_laneq_s32(lo, s8(wq[t + 1].lo), x16, 1);
        hi = vdotq_laneq_s32(hi, s8(wq[t + 1].hi), x16, 1);
        lo = vdotq_laneq_s32(lo, s8(wq[t + 2].lo), x16, 2);
        hi = vdotq_laneq_s32(hi, s8(wq[t + 2].hi), x16, 2);
        lo = vdotq_laneq_s32(lo, s8(wq[t + 3].lo), x16, 3);
        hi = vdotq_laneq_s32(hi, s8(wq[t + 3].hi), x16, 3);
      }
      return __m256i{lo, hi};
    };
    static_assert(kQuads % 8 == 0, "dot runs over halves of a block in steps of four quads");
#else
    auto dot = [&](const int8_t* xb, int j0, int j1) {
      __m256i sum = _mm256_setzero_si256();
      for (int j = j0; j < j1; j += kGroup) {
        __m256i p16 = _mm256_setzero_si256();
        for (int t = j; t < std::min(j1, j + kGroup); ++t) {
          int32_t x4;
          std::memcpy(&x4, xb + 4 * t, 4);
          const __m256i xv = _mm256_set1_epi32(x4);
          const __m256i p = SIGNED ? _mm256_maddubs_epi16(_mm256_abs_epi8(wq[t]), _mm256_sign_epi8(xv, wq[t]))
                                   : _mm256_maddubs_epi16(wq[t], xv);
          p16 = t == j ? p : _mm256_add_epi16(p16, p);
        }
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, ones));
      }
      return sum;
    };
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
    // Arm's smmla multiplies a 2x8 by an 8x2 block of int8 into int32 (32 multiply-adds, twice
    // sdot's): two output lanes' eight inputs (quads t and t + 1, zipped) by two rows' eight. The
    // rows go in pairs, a last odd one by sdot; the sums are the same integers, so the same bits.
    auto dot2 = [&](const int8_t* xa, const int8_t* xc, int j0, int j1, __m256i& ya, __m256i& yc) {
      int32x4_t m01 = vdupq_n_s32(0), m23 = m01, m45 = m01, m67 = m01;  // [l·a, l·c, (l+1)·a, (l+1)·c]
      for (int t = j0; t < j1; t += 2) {
        const int8x16_t xx = vcombine_s8(vld1_s8(xa + 4 * t), vld1_s8(xc + 4 * t));
        m01 = vmmlaq_s32(m01, s8(vzip1q_s32(wq[t].lo, wq[t + 1].lo)), xx);
        m23 = vmmlaq_s32(m23, s8(vzip2q_s32(wq[t].lo, wq[t + 1].lo)), xx);
        m45 = vmmlaq_s32(m45, s8(vzip1q_s32(wq[t].hi, wq[t + 1].hi)), xx);
        m67 = vmmlaq_s32(m67, s8(vzip2q_s32(wq[t].hi, wq[t + 1].hi)), xx);
      }
      ya = __m256i{vuzp1q_s32(m01, m23), vuzp1q_s32(m45, m67)};
      yc = __m256i{vuzp2q_s32(m01, m23), vuzp2q_s32(m45, m67)};
    };
    __m256i pre[2][R];  // every row's sums over the block's quads (pre[0]), or over each half
    auto prepare = [&](int parts) {
      for (int part = 0; part < parts; ++part) {
        const int j0 = part * kQuads / parts, j1 = (part + 1) * kQuads / parts;
        int r = 0;
        for (; r + 1 < R; r += 2)
          dot2(x + r * stride + b * kBlock, x + (r + 1) * stride + b * kBlock, j0, j1, pre[part][r], pre[part][r + 1]);
        for (; r < R; ++r) pre[part][r] = dot(x + r * stride + b * kBlock, j0, j1);
      }
    };
    auto row_sum = [&](int r, int part, int, int) { return pre[part][r]; };
#else
    auto prepare = [](int) {};
    auto row_sum = [&](int r, int, int j0, int j1) { return dot(x + r * stride + b * kBlock, j0, j1); };
#endif
    const __m256 mins = mp ? load(mp + b * kLanes, min_base) : _mm256_setzero_ps();
    if constexpr (HALVES) {
      const __m256 ws0 = load(sp + 2 * b * kLanes, scale_base), ws1 = load(sp + (2 * b + 1) * kLanes, scale_base);
      prepare(2);
      for (int r = 0; r < R; ++r) {
        const int32_t* xir = xi + (r * xblocks + b) * 2;
        __m256i s0 = row_sum(r, 0, 0, kQuads / 2), s1 = row_sum(r, 1, kQuads / 2, kQuads);
        if constexpr (kOffset != 0) {
          s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(kOffset * xir[0]));
          s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(kOffset * xir[1]));
        }
        const __m256 xsv = _mm256_set1_ps(xs[r * xblocks + b]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(ws0, xsv), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(ws1, xsv), acc[r]);
        if (mp) acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xsum[r * xblocks + b]), acc[r]);
      }
      continue;
    }
    const __m256 ws = load(sp + b * kLanes, scale_base);
    prepare(1);
    for (int r = 0; r < R; ++r) {
      const int32_t* xir = xi + (r * xblocks + b) * 2;
      __m256i sum = row_sum(r, 0, 0, kQuads);
      if constexpr (kOffset != 0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(kOffset * (xir[0] + xir[1])));
      const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(xs[r * xblocks + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
      if constexpr (K == Kind::kQ41) acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(xsum[r * xblocks + b]), acc[r]);
    }
  }
  const int64_t o = panel * kLanes + h * kHalf;
  for (int r = 0; r < R; ++r) store8(y + r * ldy + o, acc[r], w.n - o);
}

template <int R, Kind K>
void half_q(const Packed& w, int64_t panel, int h, const Rows& x, int64_t row, float* y, int64_t ldy) {
  const int64_t blocks = x.stride / kBlock;
  auto run = w.meta == Meta::kF16 ? half_q8<R, K, Meta::kF16>
             : w.meta == Meta::kFactored ? half_q8<R, K, Meta::kFactored> : half_q8<R, K, Meta::kF32>;
  run(w, panel, h, x.q.data() + row * x.stride, x.qs.data() + row * blocks, x.qi.data() + row * blocks * 2,
      x.qsum.data() + row * blocks, x.stride, y + row * ldy, ldy);
}

template <int R>
void half_any(const Packed& w, int64_t panel, int h, const Rows& x, int64_t row, float* y, int64_t ldy) {
  switch (w.kind) {
    case Kind::kQ8: half_q<R, Kind::kQ8>(w, panel, h, x, row, y, ldy); break;
    case Kind::kQ4: half_q<R, Kind::kQ4>(w, panel, h, x, row, y, ldy); break;
    case Kind::kQ41: half_q<R, Kind::kQ41>(w, panel, h, x, row, y, ldy); break;
    case Kind::kQ8H: half_q<R, Kind::kQ8H>(w, panel, h, x, row, y, ldy); break;
    case Kind::kQ6H: half_q<R, Kind::kQ6H>(w, panel, h, x, row, y, ldy); break;
    case Kind::kBF16: half_pairs<R, false>(w, panel, h, x.h.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
    case Kind::kI8: half_pairs<R, true>(w, panel, h, x.h.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
    case Kind::kF32: half_f32<R>(w, panel, h, x.f.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
  }
}

using HalfFn = void (*)(const Packed&, int64_t, int, const Rows&, int64_t, float*, int64_t);
constexpr HalfFn kHalfFn[kRowsAvx2 + 1] = {nullptr, half_any<1>, half_any<2>, half_any<3>, half_any<4>,
                                          half_any<5>, half_any<6>, half_any<7>, half_any<8>};

// y[rows][w.n] = x @ W^T, by every thread of an OpenMP team: output panels shared out, barrier at the end.
void gemm_team(const Packed& w, const Rows& x, int64_t rows, float* y) {
  const int64_t panels = w.panels();
#pragma omp for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t r = 0; r < rows; r += kRowsAvx2) {
      const int64_t block = std::min<int64_t>(kRowsAvx2, rows - r);
      for (int h = 0; h < 2 && p * kLanes + h * kHalf < w.n; ++h) kHalfFn[block](w, p, h, x, r, y, w.n);
    }
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t width, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    __m256 acc = _mm256_setzero_ps();  // the same lanes and order for every row
    int64_t i = 0;
    for (; i + kHalf <= width; i += kHalf) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; i < width; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(width) + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + kHalf <= width; i += kHalf)
      _mm256_storeu_ps(y + r * width + i,
                       _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), _mm256_loadu_ps(weight + i)));
    for (; i < width; ++i) y[r * width + i] = xr[i] * inv * weight[i];
  }
}

// SiLU(gate) * up for one row of the gate_up GEMM's output (gate and up interleaved by panel).
void silu_mul(const float* gu, float* h, int64_t inter) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t j = 0; j < inter; j += kLanes)
    for (int t = 0; t < 2; ++t) {
      const float* pair = gu + 2 * j + t * kHalf;
      const __m256 g = _mm256_loadu_ps(pair), u = _mm256_loadu_ps(pair + kLanes);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_storeu_ps(h + j + t * kHalf, _mm256_mul_ps(silu, u));
    }
}

// The largest of row[c0, c1) and its first index (with a NaN: the first NaN); true if there is a NaN.
bool argmax_span(const float* row, int64_t c0, int64_t c1, float& best, int64_t& at) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int nan = 0;
  int64_t c = c0;
  for (; c + kHalf <= c1; c += kHalf) {
    const __m256 v = _mm256_loadu_ps(row + c);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  best = hmax8(top);
  bool any_nan = nan != 0;
  for (; c < c1; ++c) {
    any_nan = any_nan || std::isnan(row[c]);
    best = std::max(best, row[c]);
  }
  at = -1;
  const __m256 want = _mm256_set1_ps(best);
  for (c = c0; c + kHalf <= c1 && at < 0; c += kHalf) {
    const __m256 v = _mm256_loadu_ps(row + c);
    const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
    if (hit) at = c + __builtin_ctz(hit);
  }
  for (; c < c1 && at < 0; ++c)
    if (any_nan ? std::isnan(row[c]) : row[c] == best) at = c;
  return any_nan;
}

// sum over row[0, n) of exp(row[i] - top), lane-wise in index order, then across lanes.
float sum_exp(const float* row, int64_t n, float top) {
  __m256 acc = _mm256_setzero_ps();
  const __m256 t = _mm256_set1_ps(top);
  for (int64_t i = 0; i < n; i += kHalf) {
    const __m256 m = _mm256_castsi256_ps(lanes8(n - i));
    acc = _mm256_add_ps(acc, _mm256_and_ps(m, exp8(_mm256_sub_ps(_mm256_maskload_ps(row + i, lanes8(n - i)), t))));
  }
  return hsum8(acc);
}
