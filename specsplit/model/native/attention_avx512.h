// Part of decoder.cpp (included once, inside its anonymous namespace) in the AVX-512 build: the
// Decoder's attention over one call's rows (Scratch) on AVX-512 (attend_team), and the run planning
// it shares with attention on AMX tiles (attention_amx.h). Free of the Decoder: it reads the shape
// it is given and the rows' caches.
#pragma once

struct AttentionAvx512 {
  int64_t heads_, kv_heads_, d_;
  bool bf16_;  // the caches' dtype (else fp32)

  // 16 elements of the key (plane 0) or value (plane offset cap) at position j, KV head g.
  inline __m512 key(const void* base, int64_t j, int64_t g, int64_t i, int64_t kw, int64_t plane) const {
    const int64_t off = (plane + j) * kw + g * d_ + i;
    if (bf16_) return load_bf16x16(static_cast<const uint16_t*>(base) + off);
    return _mm512_loadu_ps(static_cast<const float*>(base) + off);
  }

  // Every cache line of key (or value) j of KV head g: the keys of one head are strided in the
  // cache, and the hardware prefetcher alone leaves attention waiting on them at long contexts.
  inline void prefetch_key(const void* base, int64_t j, int64_t g, int64_t kw, int64_t plane) const {
    const int64_t size = bf16_ ? 2 : 4;
    const char* at = static_cast<const char*>(base) + ((plane + j) * kw + g * d_) * size;
    for (int64_t b = 0; b < d_ * size; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
  }

  // Attention on AVX-512.
  // One task per (row, head): the row attends keys [0, base) of its own sequence's cache and then
  // the slots of its path, exactly (a chain's row r: keys [0, start + r]). Called by every thread of
  // the team; barrier at the end.
  // Attention on AVX-512 (any cache dtype), for every row count. A task: one KV head and one group
  // of rows of a segment (plan_runs), its query vectors (rows x heads of the group, up to 16)
  // against the rows' key lists: each key block is built once for all the rows that have its keys
  // (the prefix's blocks for every row of a tree, a branch's own for the rows of that branch).
  // Scores 16 keys at a time: the block's keys transposed to [dim][key] in fp32, and each query's
  // lane sums its products in dim order (one FMA chain per query). Softmax down each query's own
  // keys: exp in 16-key lanes, summed lane-wise in key order, then across lanes. Out = P V: each
  // (query, dim) accumulates its keys' weighted values in key order, up to 12 queries at a time
  // sharing the value loads (the keys they all have), each over its own keys only. On bf16 caches
  // (head_dim a multiple of 32) both products run as bf16 pair dot products (pairs()), the query
  // and P rounded to bf16 first; the sums stay fp32 in the same order. Exact by construction:
  // a query's result depends on its own vector and keys alone, in one fixed order, whatever run,
  // chunk or thread computes it.
  // Scores of V queries against a transposed key block [dim][key]: one FMA chain per query, in dim order.
  template <int V>
  inline void qk_lanes(const float* const* q, const float* kt, __m512* acc) const {
    for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d_; ++i) {
      const __m512 k = _mm512_load_ps(kt + i * kLanes);
      for (int v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v][i]), k, acc[v]);
    }
  }

  // f(std::integral_constant<int, V>) for V = m (1..7), else 8: a query count as a template argument.
  template <typename F>
  static void by_queries(int64_t m, F&& f) {
    switch (m) {
      case 1: f(std::integral_constant<int, 1>{}); break;
      case 2: f(std::integral_constant<int, 2>{}); break;
      case 3: f(std::integral_constant<int, 3>{}); break;
      case 4: f(std::integral_constant<int, 4>{}); break;
      case 5: f(std::integral_constant<int, 5>{}); break;
      case 6: f(std::integral_constant<int, 6>{}); break;
      case 7: f(std::integral_constant<int, 7>{}); break;
      default: f(std::integral_constant<int, 8>{}); break;
    }
  }

  inline void qk(int64_t m, const float* const* q, const float* kt, __m512* acc) const {
    by_queries(m, [&](auto v) { qk_lanes<decltype(v)::value>(q, kt, acc); });
  }

  // Keys j0..j0+15 of KV head g as fp32 [dim][key] (keys past len: zero).
  inline void key_block(const void* base, int64_t prefix, const int64_t* path, int64_t j0, int64_t len, int64_t g,
                        int64_t kw, float* kt) const {
    for (int64_t j = j0 + kKeysAhead; j < std::min(j0 + kKeysAhead + kLanes, prefix); ++j) prefetch_key(base, j, g, kw, 0);
    for (int64_t c = 0; c < d_; c += kLanes) {
      __m512i r[16];
      for (int64_t t = 0; t < kLanes; ++t) {
        const int64_t j = j0 + t;
        r[t] = j < len ? _mm512_castps_si512(key(base, j < prefix ? j : path[j - prefix], g, c, kw, 0))
                       : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t t = 0; t < kLanes; ++t) _mm512_store_si512(kt + (c + t) * kLanes, r[t]);
    }
  }

  // bf16 caches (head_dim a multiple of 32): scores and P V as bf16 pair dot products
  // (vdpbf16ps), twice the products of an fp32 FMA; the query and the weights P rounded to bf16
  // (as transformers' bf16 attention has them), sums in fp32.
  bool pairs() const { return bf16_ && d_ % 32 == 0; }

  // Keys j0..j0+15 of KV head g as bf16 pairs [dim pair][key] (keys past len: zero).
  inline void key_pairs(const void* base, int64_t prefix, const int64_t* path, int64_t j0, int64_t len, int64_t g,
                        int64_t kw, uint32_t* kt) const {
    for (int64_t j = j0 + kKeysAhead; j < std::min(j0 + kKeysAhead + kLanes, prefix); ++j) prefetch_key(base, j, g, kw, 0);
    const auto* cache = static_cast<const uint16_t*>(base);
    for (int64_t c = 0; c < d_; c += 2 * kLanes) {
      __m512i r[16];
      for (int64_t t = 0; t < kLanes; ++t) {
        const int64_t j = j0 + t;
        r[t] = j < len ? _mm512_loadu_si512(cache + (j < prefix ? j : path[j - prefix]) * kw + g * d_ + c)
                       : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t t = 0; t < kLanes; ++t) _mm512_store_si512(kt + (c / 2 + t) * kLanes, r[t]);
    }
  }

  template <int V>
  inline void qk_pair_lanes(const uint32_t* const* q, const uint32_t* kt, __m512* acc) const {
    for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d_ / 2; ++i) {
      const __m512bh k = (__m512bh)_mm512_load_si512(kt + i * kLanes);
      for (int v = 0; v < V; ++v) acc[v] = _mm512_dpbf16_ps(acc[v], k, (__m512bh)_mm512_set1_epi32(q[v][i]));
    }
  }

  inline void qk_pairs(int64_t m, const uint32_t* const* q, const uint32_t* kt, __m512* acc) const {
    by_queries(m, [&](auto v) { qk_pair_lanes<decltype(v)::value>(q, kt, acc); });
  }

  // Values of keys j and j + 1 interleaved per dim: 16 dims from dim i (key j + 1 past end: zero).
  inline __m512i value_pair(const uint16_t* cache, int64_t vplane, int64_t prefix, const int64_t* path, int64_t j,
                            int64_t end, int64_t g, int64_t kw, int64_t i) const {
    const auto row = [&](int64_t k) {
      const uint16_t* at = cache + (vplane + (k < prefix ? k : path[k - prefix])) * kw + g * d_ + i;
      return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    };
    const __m512i lo = row(j);
    return j + 1 < end ? _mm512_or_si512(lo, _mm512_slli_epi32(row(j + 1), 16)) : lo;
  }

  // Out += P V over key pairs jp0..jp1 (keys 2 jp, 2 jp + 1; keys from end on: zero) for U queries,
  // C 16-dim chunks from chunk c0: one dot-product chain per (query, dim) in key order.
  template <int U, int C>
  inline void pv_pair_lanes(const uint32_t* const* p, const void* base, int64_t vplane, int64_t prefix,
                            const int64_t* path, int64_t jp0, int64_t jp1, int64_t end, int64_t g, int64_t kw,
                            int64_t c0, __m512 (*acc)[kPvChunks]) const {
    const auto* cache = static_cast<const uint16_t*>(base);
    __m512 a[U][C];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) a[u][c] = acc[u][c];
    for (int64_t jp = jp0; jp < jp1; ++jp) {
      const int64_t j = 2 * jp;
      if (j + 1 + kKeysAhead < prefix) {
        prefetch_key(base, j + kKeysAhead, g, kw, vplane);
        prefetch_key(base, j + 1 + kKeysAhead, g, kw, vplane);
      }
      __m512bh vv[C];
      for (int c = 0; c < C; ++c)
        vv[c] = (__m512bh)value_pair(cache, vplane, prefix, path, j, end, g, kw, (c0 + c) * kLanes);
      for (int u = 0; u < U; ++u) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(p[u][jp]);
        for (int c = 0; c < C; ++c) a[u][c] = _mm512_dpbf16_ps(a[u][c], vv[c], w);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) acc[u][c] = a[u][c];
  }

  template <int C, int... U>
  inline void pv_pair_queries(int64_t u, const uint32_t* const* p, const void* base, int64_t vplane, int64_t prefix,
                              const int64_t* path, int64_t jp0, int64_t jp1, int64_t end, int64_t g, int64_t kw,
                              int64_t c0, __m512 (*acc)[kPvChunks], std::integer_sequence<int, U...>) const {
    ((u == U + 1 ? (pv_pair_lanes<U + 1, C>(p, base, vplane, prefix, path, jp0, jp1, end, g, kw, c0, acc), 0) : 0),
     ...);
  }

  inline void pv_pairs(int64_t u, int64_t nc, const uint32_t* const* p, const void* base, int64_t vplane,
                       int64_t prefix, const int64_t* path, int64_t jp0, int64_t jp1, int64_t end, int64_t g,
                       int64_t kw, int64_t c0, __m512 (*acc)[kPvChunks]) const {
    const auto us = std::make_integer_sequence<int, kPvQueries>();
    if (nc == 1) pv_pair_queries<1>(u, p, base, vplane, prefix, path, jp0, jp1, end, g, kw, c0, acc, us);
    else pv_pair_queries<kPvChunks>(u, p, base, vplane, prefix, path, jp0, jp1, end, g, kw, c0, acc, us);
  }

  // Out += P V over keys j0..j1 for U queries and C 16-dim chunks from chunk c0: one FMA chain per
  // (query, dim) in key order; the queries share each value load.
  template <int U, int C>
  inline void pv_lanes(const float* const* p, const void* base, int64_t vplane, int64_t prefix, const int64_t* path,
                       int64_t j0, int64_t j1, int64_t g, int64_t kw, int64_t c0, __m512 (*acc)[kPvChunks]) const {
    __m512 a[U][C];
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) a[u][c] = acc[u][c];
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t at = j < prefix ? j : path[j - prefix];
      if (j + kKeysAhead < prefix) prefetch_key(base, j + kKeysAhead, g, kw, vplane);
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = key(base, at, g, (c0 + c) * kLanes, kw, vplane);
      for (int u = 0; u < U; ++u) {
        const __m512 w = _mm512_set1_ps(p[u][j]);
        for (int c = 0; c < C; ++c) a[u][c] = _mm512_fmadd_ps(w, vv[c], a[u][c]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int c = 0; c < C; ++c) acc[u][c] = a[u][c];
  }

  template <int C, int... U>
  inline void pv_queries(int64_t u, const float* const* p, const void* base, int64_t vplane, int64_t prefix,
                         const int64_t* path, int64_t j0, int64_t j1, int64_t g, int64_t kw, int64_t c0,
                         __m512 (*acc)[kPvChunks], std::integer_sequence<int, U...>) const {
    ((u == U + 1 ? (pv_lanes<U + 1, C>(p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc), 0) : 0), ...);
  }

  // Out += P V over keys j0..j1 for u queries (1..kPvQueries) and nc 16-dim chunks (1..kPvChunks) from chunk c0.
  inline void pv(int64_t u, int64_t nc, const float* const* p, const void* base, int64_t vplane, int64_t prefix,
                 const int64_t* path, int64_t j0, int64_t j1, int64_t g, int64_t kw, int64_t c0,
                 __m512 (*acc)[kPvChunks]) const {
    const auto us = std::make_integer_sequence<int, kPvQueries>();
    if (nc == 1) pv_queries<1>(u, p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc, us);
    else pv_queries<kPvChunks>(u, p, base, vplane, prefix, path, j0, j1, g, kw, c0, acc, us);
  }

  // Keys [j0, j0 + 16) of row a are those of row b wherever a has them (so b's key block serves a).
  static bool same_block(const Scratch& s, int64_t a, int64_t b, int64_t j0) {
    const int64_t prefix = s.segs[s.seg_of[a]].base, end = std::min(j0 + kLanes, s.keys(a));
    for (int64_t j = std::max(j0, prefix); j < end; ++j)
      if (j >= s.keys(b) || s.path[a][j - prefix] != s.path[b][j - prefix]) return false;
    return true;
  }

  // How many leading keys rows a and b have in common (both rows of one segment).
  static int64_t shared_keys(const Scratch& s, int64_t a, int64_t b) {
    const auto &pa = s.path[a], &pb = s.path[b];
    size_t n = 0;
    while (n < pa.size() && n < pb.size() && pa[n] == pb[n]) ++n;
    return s.segs[s.seg_of[a]].base + static_cast<int64_t>(n);
  }

  void attend_team(size_t li, const float* qkv, int64_t ld, const Scratch& s, float* out) const {
    const int64_t group = heads_ / kv_heads_, qc = group_heads(), kw = kv_heads_ * d_;
    const int64_t hchunks = (group + qc - 1) / qc, chunks = d_ / kLanes;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    int64_t longest = 0;
    for (int64_t r = 0; r < s.rows(); ++r) longest = std::max(longest, s.keys(r));
    const int64_t room = (longest + kLanes - 1) / kLanes * kLanes;
    const bool dot = pairs();
    std::vector<float> scores(kTileRows * room);  // this thread's: [query][key]
    std::vector<uint32_t> weights(dot ? kTileRows * room / 2 : 0);  // bf16 pairs of P: [query][key pair]
    std::vector<uint32_t> qpairs(dot ? kTileRows * d_ / 2 : 0);      // the queries as bf16 pairs
    std::vector<float> kt(d_ * kLanes + kLanes);   // a key block as [dim][key] (or [dim pair][key])

    float* ktp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(kt.data()) + 63) & ~uintptr_t(63));
    uint32_t* ktb = reinterpret_cast<uint32_t*>(ktp);
    const int64_t tasks = static_cast<int64_t>(s.groups.size()) * kv_heads_ * hchunks;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const auto [row0, rows] = s.groups[task / (kv_heads_ * hchunks)];
      const int64_t g = (task / hchunks) % kv_heads_, h0 = g * group + (task % hchunks) * qc;
      const int64_t hc = std::min<int64_t>(qc, (g + 1) * group - h0), nq = rows * hc;
      const Segment& seg = s.segs[s.seg_of[row0]];
      const int64_t prefix = seg.base;
      const void* base = seg.kv[li];
      const float* q[kTileRows];
      const uint32_t* qb[kTileRows];
      int64_t lens[kTileRows], len = 0;
      float* p[kTileRows];
      uint32_t* pb[kTileRows];
      for (int64_t v = 0; v < nq; ++v) {
        q[v] = qkv + (row0 + v / hc) * ld + (h0 + v % hc) * d_;
        lens[v] = s.keys(row0 + v / hc);
        p[v] = scores.data() + v * room;
        len = std::max(len, lens[v]);
        if (!dot) continue;
        uint32_t* qv = qpairs.data() + v * d_ / 2;
        for (int64_t i = 0; i < d_; i += 2 * kLanes)
          _mm512_storeu_si512(qv + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q[v] + i + kLanes),
                                                                        _mm512_loadu_ps(q[v] + i)));
        qb[v] = qv;
        pb[v] = weights.data() + v * room / 2;
      }
      // Scores, and each query's max over its own keys. A key block is built once for every row
      // whose keys it holds: all rows below the prefix's end, each branch of a tree past it.
      __m512 best[kTileRows];
      for (int64_t v = 0; v < nq; ++v) best[v] = _mm512_set1_ps(-INFINITY);
      for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
        uint32_t left = 0;  // rows still to score in this block
        for (int64_t r = 0; r < rows; ++r) left |= static_cast<uint32_t>(lens[r * hc] > j0) << r;
        while (left) {
          const int64_t ref = 31 - __builtin_clz(left);  // the deepest row left, and the rows it serves
          const float* cq[kTileRows];
          const uint32_t* cqb[kTileRows];
          int64_t cv[kTileRows], m = 0;
          for (int64_t r = ref; r >= 0; --r) {
            if (!(left >> r & 1) || !(j0 + kLanes <= prefix || same_block(s, row0 + r, row0 + ref, j0))) continue;
            left &= ~(1u << r);
            for (int64_t h = 0; h < hc; ++h, ++m) cv[m] = r * hc + h, cq[m] = q[cv[m]], cqb[m] = qb[cv[m]];
          }
          if (dot)
            key_pairs(base, prefix, s.path[row0 + ref].data(), j0, lens[ref * hc], g, kw, ktb);
          else
            key_block(base, prefix, s.path[row0 + ref].data(), j0, lens[ref * hc], g, kw, ktp);
          for (int64_t u0 = 0; u0 < m; u0 += 8) {
            __m512 acc[8];
            const int64_t mm = std::min<int64_t>(8, m - u0);
            if (dot)
              qk_pairs(mm, cqb + u0, ktb, acc);
            else
              qk(mm, cq + u0, ktp, acc);
            for (int64_t u = 0; u < mm; ++u) {
              const int64_t v = cv[u0 + u];
              const __m512 sc = _mm512_mul_ps(acc[u], _mm512_set1_ps(scale));
              _mm512_storeu_ps(p[v] + j0, sc);
              const int64_t valid = std::min<int64_t>(kLanes, lens[v] - j0);
              if (valid > 0)
                best[v] = _mm512_mask_max_ps(best[v], static_cast<__mmask16>((1u << valid) - 1), best[v], sc);
            }
          }
        }
      }
      // Weights: exp of each query's own keys, summed lane-wise in key order, then across lanes.
      float inv[kTileRows];
      for (int64_t v = 0; v < nq; ++v) {
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[v]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < lens[v]; j0 += kLanes) {
          const int64_t valid = std::min<int64_t>(kLanes, lens[v] - j0);
          const __mmask16 m = valid == kLanes ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
          const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p[v] + j0), top)));
          if (dot)  // P V reads the weights as bf16 pairs only
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb[v] + j0 / 2), (__m256i)_mm512_cvtneps_pbh(e));
          else
            _mm512_storeu_ps(p[v] + j0, e);
          total = _mm512_add_ps(total, e);
        }
        inv[v] = 1.0f / _mm512_reduce_add_ps(total);
      }
      // Out = P V, up to kPvQueries queries and 32 dims (a bf16 cache line) at a time; keys every
      // query has together, then each query's own rest.
      for (int64_t c0 = 0; c0 < chunks; c0 += kPvChunks) {
        const int64_t nc = std::min<int64_t>(kPvChunks, chunks - c0);
        for (int64_t v0 = 0; v0 < nq; v0 += kPvQueries) {
          const int64_t m = std::min<int64_t>(kPvQueries, nq - v0), r0 = row0 + v0 / hc;
          int64_t common = lens[v0];
          for (int64_t u = 1; u < m; ++u) common = std::min(common, shared_keys(s, r0, row0 + (v0 + u) / hc));
          __m512 acc[kPvQueries][kPvChunks];
          for (int64_t u = 0; u < kPvQueries; ++u)
            for (int64_t c = 0; c < kPvChunks; ++c) acc[u][c] = _mm512_setzero_ps();
          if (dot)  // key pairs from key 0: the keys all have, then each query's own
            pv_pairs(m, nc, pb + v0, base, seg.cap, prefix, s.path[r0].data(), 0, common / 2, common, g, kw, c0, acc);
          else
            pv(m, nc, p + v0, base, seg.cap, prefix, s.path[r0].data(), 0, common, g, kw, c0, acc);
          for (int64_t u = 0; u < m; ++u) {
            const int64_t v = v0 + u, r = row0 + v / hc;
            if (dot)
              pv_pairs(1, nc, pb + v, base, seg.cap, prefix, s.path[r].data(), common / 2, (lens[v] + 1) / 2, lens[v],
                       g, kw, c0, acc + u);
            else
              pv(1, nc, p + v, base, seg.cap, prefix, s.path[r].data(), common, lens[v], g, kw, c0, acc + u);
            float* o = out + r * heads_ * d_ + (h0 + v % hc) * d_;
            for (int64_t c = 0; c < nc; ++c)
              _mm512_storeu_ps(o + (c0 + c) * kLanes, _mm512_mul_ps(acc[u][c], _mm512_set1_ps(inv[v])));
          }
        }
      }
    }
  }

  // The run planning both attention paths share. Rows r and r + 1 chain: same segment, and r + 1 is r's child (its key list is r's plus one).
  static bool chained(const Scratch& s, int64_t r) {
    const auto &a = s.path[r], &b = s.path[r + 1];
    return s.seg_of[r] == s.seg_of[r + 1] && b.size() == a.size() + 1 && b[a.size() - 1] == a.back();
  }

  // AVX-512 attention's groups: consecutive rows of one segment, up to 16 query vectors each (a
  // chain, or a tree's rows, which share the prefix's key blocks). AMX attention's runs: chained
  // rows, up to 16 query vectors each, paired into tasks where the second run continues the first
  // (so both read a prefix of the second's key list).
  void plan_runs(Scratch& s) const {
    const int64_t most = std::max<int64_t>(1, kTileRows / group_heads());
    s.groups.clear();
    for (int64_t r = 0; r < s.rows(); ++r) {
      if (!s.groups.empty()) {
        auto& [first, count] = s.groups.back();
        if (count < most && s.seg_of[first] == s.seg_of[r]) {
          ++count;
          continue;
        }
      }
      s.groups.emplace_back(r, 1);
    }
    s.runs.clear();
    for (int64_t r = 0; r < s.rows(); ++r) {
      if (!s.runs.empty()) {
        auto& [first, count] = s.runs.back();
        if (count < most && first + count == r && chained(s, r - 1)) {
          ++count;
          continue;
        }
      }
      s.runs.emplace_back(r, 1);
    }
    s.tasks.clear();
    for (size_t i = 0; i < s.runs.size(); ++i) {
      const auto [first, count] = s.runs[i];
      const bool pair = i + 1 < s.runs.size() && chained(s, first + count - 1);
      s.tasks.emplace_back(static_cast<int64_t>(i), pair ? static_cast<int64_t>(i + 1) : -1);
      if (pair) ++i;
    }
  }

  // Query vectors per attention task (AVX-512 and AMX): all the heads of a KV group for as many rows
  // as fit 16.
  int64_t group_heads() const { return std::min<int64_t>(heads_ / kv_heads_, kTileRows); }
};
