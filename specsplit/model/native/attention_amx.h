// Part of decoder.cpp (included once, inside its anonymous namespace) in the AVX-512 build: the
// Decoder's attention on AMX tiles (attend_amx_team), beside AttentionAvx512's, whose shape, key
// access and run planning it shares.
#pragma once

struct Attention : AttentionAvx512 {
  // Attention on AMX tiles (bf16 cache). A task: one KV head and one or two runs of rows, each run
  // up to 16 query vectors (row, head of the group) in the lanes of its own tiles; the second run
  // shares the first's key and value tiles (half the cache traffic). Scores S^T = K Q^T (keys
  // straight from the cache as A tiles, the queries rounded to bf16 and paired as B tiles), kept
  // key-major [key][query]; softmax down each lane (max, then exp and the sum in key order); out =
  // P V with P in bf16 (A tiles) and pairs of value rows (B tile), 32 dims at a time, key blocks of
  // 32 in order. Exact by construction: a query's lane reads its own keys only (the others are
  // masked to zero weight, and adding zero products leaves a sum as it was), in key-list order, so
  // its result is the same in a run of any length, beside any other queries, chunked or not, on
  // any thread.
  __attribute__((target("amx-tile,amx-bf16")))
  void attend_amx_team(size_t li, const float* qkv, int64_t ld, const Scratch& s, float* out) const {
    const int64_t group = heads_ / kv_heads_, qc = group_heads(), kw = kv_heads_ * d_;
    const int64_t hchunks = (group + qc - 1) / qc, chunks = (d_ + 31) / 32;
    const bool direct = d_ % 32 == 0;  // key blocks load straight from the cache (else padded copies)
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    int64_t longest = 0;
    for (const auto& [first, count] : s.runs) longest = std::max(longest, s.keys(first + count - 1));
    const int64_t room = (longest + 31) / 32 * 32 * kLanes;
    std::vector<float> scores(2 * room);  // this thread's, per run: [key][query]
    const int64_t pstride = room / 2;  // P of one run: room / 16 keys in blocks of 32, 256 dwords a block
    std::vector<uint32_t> pblocks(2 * pstride);  // P per run: [block][query][key pair]
    alignas(64) uint32_t qt[2][8][16][16];  // queries per run: [32-dim chunk][dim pair][query]
    alignas(64) uint16_t kb[16][256];       // a gathered key block, zero-padded to whole chunks
    alignas(64) uint16_t vb[32][256];       // a gathered value block
    alignas(64) uint32_t vp[16][16];        // V: [key pair][dim], 16 dims
    alignas(64) float ob[16][16];
    alignas(64) int32_t lens[2][16];
    alignas(64) float total[2][16];
    configure_tiles();
    const int64_t tasks = static_cast<int64_t>(s.tasks.size()) * kv_heads_ * hchunks;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const auto [ra, rb] = s.tasks[task / (kv_heads_ * hchunks)];
      const int64_t g = (task / hchunks) % kv_heads_, h0 = g * group + (task % hchunks) * qc;
      const int64_t hc = std::min<int64_t>(qc, (g + 1) * group - h0);
      const bool two = rb >= 0;
      const std::pair<int64_t, int64_t> run[2] = {s.runs[ra], two ? s.runs[rb] : s.runs[ra]};
      const int64_t last = run[two ? 1 : 0].first + run[two ? 1 : 0].second - 1;
      const Segment& seg = s.segs[s.seg_of[last]];
      const std::vector<int64_t>& path = s.path[last];
      const int64_t prefix = seg.base, len = s.keys(last);
      auto slot = [&](int64_t j) { return j < prefix ? j : path[j - prefix]; };
      const uint16_t* kv = static_cast<const uint16_t*>(static_cast<const void*>(seg.kv[li]));
      const uint16_t* kplane = kv + g * d_;  // slot j's key: kplane + j * kw
      const uint16_t* vplane = kv + seg.cap * kw + g * d_;
      std::memset(qt, 0, sizeof(qt));
      for (int u = 0; u < 2; ++u) {
        const auto [row0, rows] = run[u];
        const int64_t queries = (u == 0 || two) ? rows * hc : 0;
        for (int64_t q = 0; q < kLanes; ++q) lens[u][q] = q < queries ? static_cast<int32_t>(s.keys(row0 + q / hc)) : 0;
        for (int64_t q = 0; q < queries; ++q) {
          const float* qv = qkv + (row0 + q / hc) * ld + (h0 + q % hc) * d_;
          for (int64_t i = 0; i < d_; i += 2)
            qt[u][i / 32][(i % 32) / 2][q] = f32_to_bf16(qv[i]) | (static_cast<uint32_t>(f32_to_bf16(qv[i + 1])) << 16);
        }
      }
      // Scores, 16 keys at a time, scaled, each lane's max over its own keys as they come.
      __m512 best[2] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY)};
      const __m512i vlens[2] = {_mm512_load_si512(lens[0]), _mm512_load_si512(lens[1])};
      for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
        const uint16_t* kp = kplane + slot(j0) * kw;
        int64_t stride = kw * 2;
        if (!direct || j0 + kLanes > len || slot(j0 + kLanes - 1) - slot(j0) != kLanes - 1) {
          std::memset(kb, 0, sizeof(kb));
          for (int64_t i = 0; i < kLanes && j0 + i < len; ++i) std::memcpy(kb[i], kplane + slot(j0 + i) * kw, d_ * 2);
          kp = kb[0];
          stride = sizeof(kb[0]);
        }
        _tile_zero(0);
        if (two) _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
          TILE_LOAD(1, kp + c * 32, stride);
          TILE_LOAD(2, qt[0][c], 64);
          _tile_dpbf16ps(0, 1, 2);
          if (two) {
            TILE_LOAD(4, qt[1][c], 64);
            _tile_dpbf16ps(3, 1, 4);
          }
        }
        for (int u = 0; u < (two ? 2 : 1); ++u) {
          float* sc = scores.data() + u * room + j0 * kLanes;
          if (u == 0) TILE_STORE(0, sc, 64);
          else TILE_STORE(3, sc, 64);
          for (int64_t j = j0; j < std::min(len, j0 + kLanes); ++j) {
            const __mmask16 valid = _mm512_cmpgt_epi32_mask(vlens[u], _mm512_set1_epi32(static_cast<int32_t>(j)));
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc + (j - j0) * kLanes), _mm512_set1_ps(scale));
            _mm512_storeu_ps(sc + (j - j0) * kLanes, v);
            best[u] = _mm512_mask_max_ps(best[u], valid, best[u], v);
          }
        }
      }
      // Weights: exp down each lane, summed in key order, and P in bf16 as A tiles, [block][query][key pair].
      const int64_t padded = (len + 31) / 32 * 32;
      for (int u = 0; u < (two ? 2 : 1); ++u) {
        const float* sc = scores.data() + u * room;
        uint32_t* pu = pblocks.data() + u * pstride;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < padded; j0 += 32) {
          __m512i w[16];
          __m512 e[2];
          for (int t = 0; t < 16; ++t) {
            for (int h = 0; h < 2; ++h) {
              const int64_t j = j0 + 2 * t + h;
              const __mmask16 valid = _mm512_cmpgt_epi32_mask(vlens[u], _mm512_set1_epi32(static_cast<int32_t>(j)));
              e[h] = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + j * kLanes), best[u])));
              sum = _mm512_add_ps(sum, e[h]);
            }
            w[t] = pair16((__m256i)_mm512_cvtneps_pbh(e[0]), (__m256i)_mm512_cvtneps_pbh(e[1]));
          }
          transpose16(w);
          for (int q = 0; q < 16; ++q) _mm512_storeu_si512(pu + j0 / 32 * 256 + q * 16, w[q]);
        }
        _mm512_store_ps(total[u], sum);
      }
      for (int64_t d0 = 0; d0 < d_; d0 += 32) {  // two 16-dim accumulators per run at a time
        const int64_t nc = std::min<int64_t>(2, (d_ - d0) / kLanes);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t j0 = 0; j0 < padded; j0 += 32) {
          TILE_LOAD(1, pblocks.data() + j0 / 32 * 256, 64);
          if (two) TILE_LOAD(3, pblocks.data() + pstride + j0 / 32 * 256, 64);
          // Values in pairs of rows: from the cache, or gathered (a tree's path, or the last
          // block's tail with zeros past the keys).
          const bool contiguous = j0 + 32 <= len && slot(j0 + 31) - slot(j0) == 31;
          const uint16_t* vrow = vplane + slot(j0) * kw;
          int64_t vstride = kw;
          if (!contiguous) {
            std::memset(vb, 0, sizeof(vb));
            for (int64_t i = 0; i < 32 && j0 + i < len; ++i) std::memcpy(vb[i], vplane + slot(j0 + i) * kw, d_ * 2);
            vrow = vb[0];
            vstride = 256;
          }
          for (int64_t c = 0; c < nc; ++c) {
            const uint16_t* v = vrow + d0 + c * kLanes;
            for (int t = 0; t < 16; ++t)
              _mm512_store_si512(vp[t], pair16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 2 * t * vstride)),
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (2 * t + 1) * vstride))));
            TILE_LOAD(2, vp, 64);
            if (c == 0) {
              _tile_dpbf16ps(4, 1, 2);
              if (two) _tile_dpbf16ps(6, 3, 2);
            } else {
              _tile_dpbf16ps(5, 1, 2);
              if (two) _tile_dpbf16ps(7, 3, 2);
            }
          }
        }
        for (int u = 0; u < (two ? 2 : 1); ++u)
          for (int64_t c = 0; c < nc; ++c) {
            if (u == 0 && c == 0) TILE_STORE(4, ob, 64);
            if (u == 0 && c == 1) TILE_STORE(5, ob, 64);
            if (u == 1 && c == 0) TILE_STORE(6, ob, 64);
            if (u == 1 && c == 1) TILE_STORE(7, ob, 64);
            const auto [row0, rows] = run[u];
            for (int64_t q = 0; q < rows * hc; ++q) {
              float* o = out + (row0 + q / hc) * heads_ * d_ + (h0 + q % hc) * d_ + d0 + c * kLanes;
              _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_load_ps(ob[q]), _mm512_set1_ps(1.0f / total[u][q])));
            }
          }
      }
    }
  }
};
