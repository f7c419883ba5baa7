// Part of decoder.cpp's AVX-512 build (included by isa_avx512.h): bf16 GEMMs on AMX tiles, and the
// tile and transpose helpers AMX attention shares.
#pragma once

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

