// Part of decoder.cpp (included once, inside its anonymous namespace) in the AVX2 build, and of the
// kernel check (tests/kernelcheck.cpp): attention, with no torch.
//
// Each query row's heads of a KV group against the row's own key list (keys [0, base) of its
// sequence's cache, then the slots of its path; the rows of one sequence share the prefix's reads),
// each score a dot product in dim order (8 lanes, then a fixed horizontal sum); softmax with exp in
// 8-key lanes summed lane-wise in key order, then across lanes; out = P V, each (head, dim)
// accumulating its keys' weighted values in key order. Exact by construction: a query's result
// depends on its own vector and keys alone, in one fixed order, whatever the batch, chunk or thread.
#pragma once

struct AttendShape {
  int64_t heads, kv_heads, d;  // query heads, KV heads, head dim
  bool bf16;  // the cache's dtype: bf16, else fp32
};

// What one query row attends: its sequence's cache of this layer, [2, cap, kv_heads, d] (keys, then
// values), the prefix [0, base), then the cache slots of its path (its ancestors, then its own).
struct AttendRow {
  const void* kv;
  int64_t cap, base;
  const std::vector<int64_t>* path;
  int64_t keys() const { return base + static_cast<int64_t>(path->size()); }
};

// 8 dims from dim i of key (plane 0) or value (plane cap) in cache slot `slot`, KV head g, as fp32.
inline __m256 kv8(const AttendShape& a, const void* base, int64_t slot, int64_t g, int64_t i, int64_t plane) {
  const int64_t off = (plane + slot) * a.kv_heads * a.d + g * a.d + i;
  if (a.bf16) return load_bf16x8(static_cast<const uint16_t*>(base) + off);
  return _mm256_loadu_ps(static_cast<const float*>(base) + off);
}

// Keys (plane 0) or values (plane cap) of cache slots slots[0, nk) of KV head g, as fp32, to
// buf[t * d + i]: a block is widened once for every query that reads it (the group's heads, and every
// row of a sequence for the prefix they share), and fetched ahead by hand (the cache's rows are
// strided by the KV heads).
inline void widen_block(const AttendShape& a, const void* kv, const int64_t* slots, int64_t nk, int64_t g,
                        int64_t plane, float* buf) {
  constexpr int64_t kAhead = 8;
  const int64_t bytes = a.d * (a.bf16 ? 2 : 4), rowb = a.kv_heads * bytes;
  const char* base = static_cast<const char*>(kv) + (plane * a.kv_heads + g) * bytes;
  for (int64_t t = 0; t < nk; ++t) {
    if (t + kAhead < nk)
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(base + slots[t + kAhead] * rowb + b, _MM_HINT_T0);
    for (int64_t i = 0; i < a.d; i += kHalf) _mm256_storeu_ps(buf + t * a.d + i, kv8(a, kv, slots[t], g, i, plane));
  }
}

// out[r] (heads * d) for rows[0, n) from their queries (qkv + r * ld), by every thread of an OpenMP team.
// One task per run of consecutive rows of one sequence (the same cache and prefix: a verify's or a
// tree's rows) and KV head; the prefix's keys and values are read once for all of the run's queries.
void attend_rows_team(const AttendShape& a, const float* qkv, int64_t ld, const AttendRow* rows, int64_t n,
                      float* out) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, chunks = d / kHalf;
  constexpr int64_t kChunks = 4;  // P V: 32 dims at a time
  constexpr int64_t kKeys = 4;  // Q K: four keys' chains at a time, so that they overlap
  constexpr int64_t kBlockKeys = 64;  // keys widened at a time (16 KB of fp32 at d = 64)
  constexpr int64_t kRunRows = 16;  // rows sharing a task's reads at most (its scores: kRunRows * group * keys)
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<int64_t> run_start;  // every thread the same runs: rows of one sequence, at most kRunRows
  int64_t longest = 0, widest = 0;
  for (int64_t r = 0; r < n; ++r) {
    longest = std::max(longest, rows[r].keys());
    if (r == 0 || rows[r].kv != rows[r - 1].kv || rows[r].base != rows[r - 1].base || r - run_start.back() == kRunRows)
      run_start.push_back(r);
  }
  run_start.push_back(n);
  for (size_t i = 0; i + 1 < run_start.size(); ++i) widest = std::max(widest, run_start[i + 1] - run_start[i]);
  const int64_t room = (std::max(longest, kBlockKeys) + kHalf - 1) / kHalf * kHalf;
  // this thread's: scores [query][key] (query = row of the run * group + head), P V's partial sums
  // [query][dim], a block of keys or values, its slots
  std::vector<float> scores(widest * group * room), sums(widest * group * d), block(kBlockKeys * d), inv(widest * group);
  std::vector<int64_t> slots(kBlockKeys);
  const int64_t tasks = static_cast<int64_t>(run_start.size() - 1) * a.kv_heads;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t run = task / a.kv_heads, g = task % a.kv_heads, r0 = run_start[run], count = run_start[run + 1] - r0;
    const AttendRow& first = rows[r0];
    const int64_t base = first.base;
    // A chain (a prefill's rows, a chain's verify): every row's path a prefix of the longest's (a
    // path ends at its own slot, which only its own ancestors' paths pass through), so every block
    // of the longest row's keys is read once for all the rows that reach it.
    const std::vector<int64_t>* chain = rows[r0].path;
    for (int64_t i = 1; i < count; ++i)
      if (rows[r0 + i].path->size() > chain->size()) chain = rows[r0 + i].path;
    for (int64_t i = 0; i < count && chain; ++i) {
      const std::vector<int64_t>& path = *rows[r0 + i].path;
      if (!path.empty() && path.back() != (*chain)[path.size() - 1]) chain = nullptr;
    }
    auto query = [&](int64_t i, int64_t h) { return qkv + (r0 + i) * ld + (g * group + h) * d; };
    // Each score is one chain of FMAs over its dims, in dim order; KEYS keys' chains at a time. The
    // block's keys t0.. are keys j0.. of query q's list.
    auto score = [&](auto keys, const float* qv, int64_t q, int64_t j0, int64_t t0) {
      constexpr int64_t KEYS = decltype(keys)::value;
      __m256 acc[KEYS];
      for (int64_t t = 0; t < KEYS; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(qv + c * kHalf);
        for (int64_t t = 0; t < KEYS; ++t)
          acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(block.data() + (t0 + t) * d + c * kHalf), acc[t]);
      }
      for (int64_t t = 0; t < KEYS; ++t) scores[q * room + j0 + t0 + t] = hsum8(acc[t]) * scale;
    };
    auto score_block = [&](int64_t i, int64_t j0, int64_t nk) {  // row i's heads against the block
      for (int64_t h = 0; h < group; ++h) {
        int64_t t = 0;
        for (; t + kKeys <= nk; t += kKeys) score(std::integral_constant<int64_t, kKeys>{}, query(i, h), i * group + h, j0, t);
        for (; t < nk; ++t) score(std::integral_constant<int64_t, 1>{}, query(i, h), i * group + h, j0, t);
      }
    };
    // out = P V: each (query, dim) accumulates its keys' weighted values in key order, NC chunks in
    // registers, the partial sums in `sums` between blocks
    auto weigh = [&](auto nc, int64_t q, int64_t c0, int64_t j0, int64_t nk) {
      constexpr int64_t NC = decltype(nc)::value;
      float* acc_at = sums.data() + q * d + c0 * kHalf;
      const float* p = scores.data() + q * room + j0;
      __m256 acc[NC];
      for (int64_t c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(acc_at + c * kHalf);
      for (int64_t t = 0; t < nk; ++t) {
        const __m256 wj = _mm256_set1_ps(p[t]);
        for (int64_t c = 0; c < NC; ++c)
          acc[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(block.data() + t * d + (c0 + c) * kHalf), acc[c]);
      }
      for (int64_t c = 0; c < NC; ++c) _mm256_storeu_ps(acc_at + c * kHalf, acc[c]);
    };
    auto weigh_block = [&](int64_t i, int64_t j0, int64_t nk) {
      for (int64_t h = 0; h < group; ++h) {
        int64_t c0 = 0;
        for (; c0 + kChunks <= chunks; c0 += kChunks) weigh(std::integral_constant<int64_t, kChunks>{}, i * group + h, c0, j0, nk);
        for (; c0 < chunks; ++c0) weigh(std::integral_constant<int64_t, 1>{}, i * group + h, c0, j0, nk);
      }
    };
    // a chain's keys block by block, each row to its own length; else the prefix [0, base), shared,
    // then each row's own path (its ancestors, then itself)
    auto each_block = [&](int64_t plane, auto&& use) {
      const int64_t shared = chain ? base + static_cast<int64_t>(chain->size()) : base;
      for (int64_t j0 = 0; j0 < shared; j0 += kBlockKeys) {
        const int64_t nk = std::min(kBlockKeys, shared - j0);
        for (int64_t j = j0; j < j0 + nk; ++j) slots[j - j0] = j < base ? j : (*chain)[j - base];
        widen_block(a, first.kv, slots.data(), nk, g, plane, block.data());
        for (int64_t i = 0; i < count; ++i) {
          const int64_t reach = std::min(nk, rows[r0 + i].keys() - j0);
          if (reach > 0) use(i, j0, reach);
        }
      }
      if (chain) return;
      for (int64_t i = 0; i < count; ++i) {
        const std::vector<int64_t>& path = *rows[r0 + i].path;
        for (size_t p0 = 0; p0 < path.size(); p0 += kBlockKeys) {
          const int64_t nk = std::min<int64_t>(kBlockKeys, static_cast<int64_t>(path.size() - p0));
          widen_block(a, first.kv, path.data() + p0, nk, g, plane, block.data());
          use(i, base + static_cast<int64_t>(p0), nk);
        }
      }
    };
    each_block(0, score_block);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t len = rows[r0 + i].keys();
      for (int64_t h = 0; h < group; ++h) {
        float* p = scores.data() + (i * group + h) * room;
        float top = -INFINITY;
        for (int64_t j = 0; j < len; ++j) top = std::max(top, p[j]);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < len; j0 += kHalf) {
          const __m256i valid = lanes8(len - j0);
          const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(valid),
                                         exp8(_mm256_sub_ps(_mm256_maskload_ps(p + j0, valid), _mm256_set1_ps(top))));
          _mm256_storeu_ps(p + j0, e);
          total = _mm256_add_ps(total, e);
        }
        inv[i * group + h] = 1.0f / hsum8(total);
      }
    }
    std::fill(sums.begin(), sums.begin() + count * group * d, 0.0f);
    each_block(first.cap, weigh_block);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t h = 0; h < group; ++h) {
        const int64_t q = i * group + h;
        float* o = out + (r0 + i) * a.heads * d + (g * group + h) * d;
        for (int64_t c = 0; c < chunks; ++c)
          _mm256_storeu_ps(o + c * kHalf, _mm256_mul_ps(_mm256_loadu_ps(sums.data() + q * d + c * kHalf), _mm256_set1_ps(inv[q])));
      }
  }
}

// The Decoder's attention in the AVX2 build: attend_rows_team over one call's rows.
struct Attention {
  AttendShape shape;

  void plan_runs(Scratch&) const {}  // the AVX-512 build's key-block sharing; nothing to plan here

  void attend_team(size_t li, const float* qkv, int64_t ld, const Scratch& s, float* out) const {
    std::vector<AttendRow> rows(s.rows());  // each thread its own copy: n small structs
    for (int64_t r = 0; r < s.rows(); ++r) {
      const Segment& seg = s.segs[s.seg_of[r]];
      rows[r] = AttendRow{seg.kv[li], seg.cap, seg.base, &s.path[r]};
    }
    attend_rows_team(shape, qkv, ld, rows.data(), s.rows(), out);
  }
};
