// Part of decoder.cpp (included once, inside its anonymous namespace) in the AVX-512 build: the
// row steps (quantizing, norm, SiLU, argmax) and the GEMMs (bf16/fp32/int8 weight-only, VNNI block
// formats, AMX tiles).
#pragma once

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


// One row quantized per block of 32: s = max|x| / 127, q = round-to-nearest-even(x / s) in
// [-127, 127]; the integer sum of q per half-block and s * sum(q) per block (exact conversions).
void quantize_row_q8(const float* src, int64_t k, int64_t stride, int8_t* dst, float* scales, int32_t* isums,
                     float* sums) {
  auto lanes = [](int64_t n) {  // the first n of 16 lanes (none for n <= 0)
    return n >= kLanes ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
  };
  for (int64_t b = 0; b * kBlock < stride; ++b) {
    const int64_t n = k - b * kBlock;  // inputs left; past k the block reads zeros
    const __m512 lo = _mm512_maskz_loadu_ps(lanes(n), src + b * kBlock);
    const __m512 hi = _mm512_maskz_loadu_ps(lanes(n - kLanes), src + b * kBlock + kLanes);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.0f;
    scales[b] = s;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + b * kBlock + kLanes), _mm512_cvtsepi32_epi8(qhi));
    isums[2 * b] = _mm512_reduce_add_epi32(qlo);
    isums[2 * b + 1] = _mm512_reduce_add_epi32(qhi);
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

// acc + dot(w's unsigned bytes, the 4 signed bytes at p broadcast): vpdpbusd with its broadcast
// folded into the instruction (one uop fewer per product than a separate vpbroadcastd, which GCC emits).
inline __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// Block formats by q8 activations. vpdpbusd multiplies unsigned by signed bytes: the weights are
// stored unsigned (q8: q + 128; q4: the nibble u) and the activations signed, so a block's integer
// sum is corrected by the weights' offset times the activations' own integer sum (computed once per
// row when it was quantized; no per-weight correction is stored). Per block and row, vpdpbusd in
// int32 (two chains summed for 1-2 rows, whose latency they hide; one from 3 rows on: the same
// integer either way), corrected, converted to float and scaled into the row's float accumulator,
// block after block in input order (the same for every row count).
// K, the block format: kQ8 (q8_0), kQ4 (q4_0, offset 8), kQ41 (q4_1: no offset; adds m * qs * sum(q)
// per block, after the block's product), kQ8H (q8_h: the chains are the block's halves, quads 0-3
// and 4-7, each scaled and added in turn; then m * qs * sum(q) where the matrix has mins). META: how scales and mins are
// stored (packing.h); factored ones are multiplied out here, exactly.
template <int R, Kind K, Meta META>
void panel_q8(const Packed& w, int64_t panel, const int8_t* x, const float* xs, const int32_t* xi, const float* xsum,
              int64_t stride, float* y, int64_t ldy) {
  constexpr bool SIX = K == Kind::kQ6H, Q4 = K == Kind::kQ4 || K == Kind::kQ41, HALVES = K == Kind::kQ8H || SIX;
  constexpr int64_t kParts = HALVES ? 2 : 1;  // scales a block
  constexpr int32_t kOffset = K == Kind::kQ4 ? 8 : K == Kind::kQ41 ? 0 : SIX ? 32 : 128;  // stored weight - q
  const int64_t blocks = w.k2 / kBlock, xblocks = stride / kBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t kBlockBytes = Q4 ? kBlock * kLanes / 2 : SIX ? kBlock * kLanes * 3 / 4 : kBlock * kLanes;  // 256, 384, 512
  const uint8_t* wp = static_cast<const uint8_t*>(w.ptr) + panel * blocks * kBlockBytes;
  using Stored = std::conditional_t<META == Meta::kF32, float, std::conditional_t<META == Meta::kF16, uint16_t, int8_t>>;
  const Stored* sp = static_cast<const Stored*>(w.block_scale) + panel * blocks * kParts * kLanes;
  const Stored* mp = w.block_min ? static_cast<const Stored*>(w.block_min) + panel * blocks * kLanes : nullptr;
  const int64_t supers = blocks / kSuperBlocks;
  const uint16_t* sbp = META == Meta::kFactored ? w.scale_base_ptr + panel * supers * kLanes : nullptr;
  const uint16_t* mbp = META == Meta::kFactored && mp ? w.min_base_ptr + panel * supers * kLanes : nullptr;
  __m512 scale_base = _mm512_setzero_ps(), min_base = _mm512_setzero_ps();  // kFactored: this super-block's
  auto half16 = [](const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  auto load = [&](const Stored* p, __m512 base) {
    if constexpr (META == Meta::kF32) return _mm512_loadu_ps(p);
    else if constexpr (META == Meta::kF16) return half16(p);
    else return _mm512_mul_ps(base, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
  };
  constexpr int kQuads = kBlock / 4;  // 8 quads of 16 outputs
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; ++b) {
    if (META == Meta::kFactored && b % kSuperBlocks == 0) {
      scale_base = half16(sbp + b / kSuperBlocks * kLanes);
      if (mbp) min_base = half16(mbp + b / kSuperBlocks * kLanes);
    }
    const uint8_t* wb = wp + b * kBlockBytes;
    __m512i wq[kQuads];
    if constexpr (Q4 || SIX) {
      for (int v = 0; v < kQuads / 2; ++v) {
        const __m512i packed = _mm512_loadu_si512(wb + v * 4 * kLanes);
        _mm_prefetch(reinterpret_cast<const char*>(wb + v * 4 * kLanes) + kBlockPrefetchBytes, _MM_HINT_T0);
        wq[v] = _mm512_and_si512(packed, nibble);
        wq[v + kQuads / 2] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      }
      if constexpr (SIX) {  // bits 2s..2s+1 of high vector t are bits 4..5 of quad 4t + s
        const __m512i pair = _mm512_set1_epi8(0x30);
        for (int t = 0; t < 2; ++t) {
          const uint8_t* hp = wb + (4 + t) * 4 * kLanes;
          const __m512i high = _mm512_loadu_si512(hp);
          _mm_prefetch(reinterpret_cast<const char*>(hp) + kBlockPrefetchBytes, _MM_HINT_T0);
          wq[4 * t] = _mm512_or_si512(wq[4 * t], _mm512_and_si512(_mm512_slli_epi16(high, 4), pair));
          wq[4 * t + 1] = _mm512_or_si512(wq[4 * t + 1], _mm512_and_si512(_mm512_slli_epi16(high, 2), pair));
          wq[4 * t + 2] = _mm512_or_si512(wq[4 * t + 2], _mm512_and_si512(high, pair));
          wq[4 * t + 3] = _mm512_or_si512(wq[4 * t + 3], _mm512_and_si512(_mm512_srli_epi16(high, 2), pair));
        }
      }
    } else {
      for (int j = 0; j < kQuads; ++j) {
        wq[j] = _mm512_loadu_si512(wb + j * 4 * kLanes);
        _mm_prefetch(reinterpret_cast<const char*>(wb + j * 4 * kLanes) + kBlockPrefetchBytes, _MM_HINT_T0);
      }
    }
    const __m512 mins = mp ? load(mp + b * kLanes, min_base) : _mm512_setzero_ps();
    if constexpr (HALVES) {
      const __m512 ws0 = load(sp + 2 * b * kLanes, scale_base), ws1 = load(sp + (2 * b + 1) * kLanes, scale_base);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = x + r * stride + b * kBlock;
        const int32_t* xir = xi + (r * xblocks + b) * 2;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int j = 0; j < kQuads / 2; ++j) {
          s0 = dpbusd_bcst(s0, wq[j], xb + 4 * j);
          s1 = dpbusd_bcst(s1, wq[j + kQuads / 2], xb + 4 * j + kBlock / 2);
        }
        s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(kOffset * xir[0]));
        s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(kOffset * xir[1]));
        const __m512 xsv = _mm512_set1_ps(xs[r * xblocks + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(ws0, xsv), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(ws1, xsv), acc[r]);
        if (mp) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[r * xblocks + b]), acc[r]);
      }
      continue;
    }
    const __m512 ws = load(sp + b * kLanes, scale_base);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x + r * stride + b * kBlock;
      const int32_t* xir = xi + (r * xblocks + b) * 2;
      __m512i sum;
      if constexpr (R >= 3) {  // the rows' chains overlap: one chain a row, no sum
        sum = _mm512_setzero_si512();
        for (int j = 0; j < kQuads; ++j) sum = dpbusd_bcst(sum, wq[j], xb + 4 * j);
      } else {
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int j = 0; j < kQuads; j += 2) {
          s0 = dpbusd_bcst(s0, wq[j], xb + 4 * j);
          s1 = dpbusd_bcst(s1, wq[j + 1], xb + 4 * j + 4);
        }
        sum = _mm512_add_epi32(s0, s1);
      }
      if constexpr (kOffset != 0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(kOffset * (xir[0] + xir[1])));
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(xs[r * xblocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
      if constexpr (K == Kind::kQ41) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[r * xblocks + b]), acc[r]);
    }
  }
  const int64_t o = panel * kLanes;
  const __mmask16 m = (w.n - o >= kLanes) ? 0xffff : static_cast<__mmask16>((1u << (w.n - o)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + o, m, acc[r]);
}

template <int R, Kind K>
void panel_q(const Packed& w, int64_t panel, const Rows& x, int64_t row, float* y, int64_t ldy) {
  const int64_t blocks = x.stride / kBlock;
  auto run = w.meta == Meta::kF16 ? panel_q8<R, K, Meta::kF16>
             : w.meta == Meta::kFactored ? panel_q8<R, K, Meta::kFactored> : panel_q8<R, K, Meta::kF32>;
  run(w, panel, x.q.data() + row * x.stride, x.qs.data() + row * blocks, x.qi.data() + row * blocks * 2,
      x.qsum.data() + row * blocks, x.stride, y + row * ldy, ldy);
}

template <int R>
void panel_any(const Packed& w, int64_t panel, const Rows& x, int64_t row, float* y, int64_t ldy) {
  switch (w.kind) {
    case Kind::kQ8: panel_q<R, Kind::kQ8>(w, panel, x, row, y, ldy); break;
    case Kind::kQ4: panel_q<R, Kind::kQ4>(w, panel, x, row, y, ldy); break;
    case Kind::kQ41: panel_q<R, Kind::kQ41>(w, panel, x, row, y, ldy); break;
    case Kind::kQ8H: panel_q<R, Kind::kQ8H>(w, panel, x, row, y, ldy); break;
    case Kind::kQ6H: panel_q<R, Kind::kQ6H>(w, panel, x, row, y, ldy); break;
    case Kind::kBF16: panel_pairs<R, false>(w, panel, x.h.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
    case Kind::kI8: panel_pairs<R, true>(w, panel, x.h.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
    case Kind::kF32: panel_f32<R>(w, panel, x.f.data() + row * x.stride, x.stride, y + row * ldy, ldy); break;
  }
}

#include "gemm_amx.h"

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


// SiLU(gate) * up for one row of the gate_up GEMM's output (gate and up interleaved by panel).
void silu_mul(const float* gu, float* h, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < inter; j += kLanes) {  // 16 features at a time
    const float* pair = gu + 2 * j;
    const __m512 g = _mm512_loadu_ps(pair), u = _mm512_loadu_ps(pair + kLanes);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(h + j, _mm512_mul_ps(silu, u));
  }
}

// The largest of row[c0, c1) and its first index (with a NaN: the first NaN); true if there is a NaN.
bool argmax_span(const float* row, int64_t c0, int64_t c1, float& best, int64_t& at) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t c = c0;
  for (; c + kLanes <= c1; c += kLanes) {
    const __m512 v = _mm512_loadu_ps(row + c);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  best = _mm512_reduce_max_ps(top);
  bool any_nan = nan != 0;
  for (; c < c1; ++c) {
    any_nan = any_nan || std::isnan(row[c]);
    best = std::max(best, row[c]);
  }
  at = -1;
  const __m512 want = _mm512_set1_ps(best);
  for (c = c0; c + kLanes <= c1 && at < 0; c += kLanes) {
    const __m512 v = _mm512_loadu_ps(row + c);
    const __mmask16 hit = any_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, want, _CMP_EQ_OQ);
    if (hit) at = c + __builtin_ctz(hit);
  }
  for (; c < c1 && at < 0; ++c)
    if (any_nan ? std::isnan(row[c]) : row[c] == best) at = c;
  return any_nan;
}

// sum over row[0, n) of exp(row[i] - top), lane-wise in index order, then across lanes.
float sum_exp(const float* row, int64_t n, float top) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 t = _mm512_set1_ps(top);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = n - i >= kLanes ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), t))));
  }
  return _mm512_reduce_add_ps(acc);
}
