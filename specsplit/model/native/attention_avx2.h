// Part of decoder.cpp (included once, inside its anonymous namespace) in the AVX2 build, and of the
// kernel check (tests/kernelcheck.cpp): attention, with no torch.
//
// One task per (row, KV head): the row's query heads of that group against the row's own key list
// (keys [0, base) of its sequence's cache, then the slots of its path), each score a dot product
// in dim order (8 lanes, then a fixed horizontal sum); softmax with exp in 8-key lanes summed
// lane-wise in key order, then across lanes; out = P V, each (head, dim) accumulating its keys'
// weighted values in key order. Exact by construction: a query's result depends on its own vector
// and keys alone, in one fixed order, whatever the batch, chunk or thread.
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

// Keys (plane 0) or values (plane cap) of slots[j0, j0 + nk) of KV head g, as fp32, to buf[t * d + i]:
// a block is widened once for all of the group's query heads (each widened them itself before: a
// fifth of a 1-row forward at 1,500 keys went to widening bf16).
inline void widen_block(const AttendShape& a, const AttendRow& row, const int64_t* slots, int64_t nk, int64_t g,
                        int64_t plane, float* buf) {
  constexpr int64_t kAhead = 8;  // keys: the cache rows are strided by the KV heads, so the stream is fetched ahead by hand
  const int64_t bytes = a.d * (a.bf16 ? 2 : 4), rowb = a.kv_heads * bytes;
  const char* base = static_cast<const char*>(row.kv) + (plane * a.kv_heads + g) * bytes;
  for (int64_t t = 0; t < nk; ++t) {
    if (t + kAhead < nk)
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(base + slots[t + kAhead] * rowb + b, _MM_HINT_T0);
    for (int64_t i = 0; i < a.d; i += kHalf) _mm256_storeu_ps(buf + t * a.d + i, kv8(a, row.kv, slots[t], g, i, plane));
  }
}

// out[r] (heads * d) for rows[0, n) from their queries (qkv + r * ld), by every thread of an OpenMP team.
void attend_rows_team(const AttendShape& a, const float* qkv, int64_t ld, const AttendRow* rows, int64_t n,
                      float* out) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, chunks = d / kHalf;
  constexpr int64_t kChunks = 4;  // P V: 32 dims at a time
  constexpr int64_t kKeys = 4;  // Q K: four keys' chains at a time, so that they overlap
  constexpr int64_t kBlockKeys = 64;  // keys widened at a time (16 KB of fp32 at d = 64)
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int64_t longest = 0;
  for (int64_t r = 0; r < n; ++r) longest = std::max(longest, rows[r].keys());
  const int64_t room = (longest + kHalf - 1) / kHalf * kHalf;
  std::vector<float> scores(group * room);  // this thread's: [head][key]
  std::vector<float> block(kBlockKeys * d), sums(group * d);  // a block of keys or values; P V's partial sums
  std::vector<int64_t> slots(room);
  const int64_t tasks = n * a.kv_heads;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t r = task / a.kv_heads, g = task % a.kv_heads, len = rows[r].keys();
    const AttendRow& row = rows[r];
    for (int64_t j = 0; j < len; ++j) slots[j] = j < row.base ? j : (*row.path)[j - row.base];
    const float* q0 = qkv + r * ld + g * group * d;  // the group's heads, one after another
    // Each score is one chain of FMAs over its dims, in dim order; KEYS keys' chains at a time.
    auto score = [&](auto keys, int64_t h, int64_t j0, int64_t t0) {
      constexpr int64_t KEYS = decltype(keys)::value;
      __m256 acc[KEYS];
      for (int64_t t = 0; t < KEYS; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(q0 + h * d + c * kHalf);
        for (int64_t t = 0; t < KEYS; ++t)
          acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(block.data() + (t0 + t) * d + c * kHalf), acc[t]);
      }
      for (int64_t t = 0; t < KEYS; ++t) scores[h * room + j0 + t0 + t] = hsum8(acc[t]) * scale;
    };
    for (int64_t j0 = 0; j0 < len; j0 += kBlockKeys) {
      const int64_t nk = std::min(kBlockKeys, len - j0);
      widen_block(a, row, slots.data() + j0, nk, g, 0, block.data());
      for (int64_t h = 0; h < group; ++h) {
        int64_t t = 0;
        for (; t + kKeys <= nk; t += kKeys) score(std::integral_constant<int64_t, kKeys>{}, h, j0, t);
        for (; t < nk; ++t) score(std::integral_constant<int64_t, 1>{}, h, j0, t);
      }
    }
    std::vector<float> inv(group);  // 1 / each head's softmax total
    for (int64_t h = 0; h < group; ++h) {
      float* p = scores.data() + h * room;
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
      inv[h] = 1.0f / hsum8(total);
    }
    // out = P V: each (head, dim) accumulates its keys' weighted values in key order, a block of
    // values at a time (the partial sums kept in `sums` between blocks, NC chunks in registers)
    std::fill(sums.begin(), sums.end(), 0.0f);
    auto weigh = [&](auto nc, int64_t h, int64_t c0, int64_t j0, int64_t nk) {
      constexpr int64_t NC = decltype(nc)::value;
      float* acc_at = sums.data() + h * d + c0 * kHalf;
      const float* p = scores.data() + h * room + j0;
      __m256 acc[NC];
      for (int64_t c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(acc_at + c * kHalf);
      for (int64_t t = 0; t < nk; ++t) {
        const __m256 wj = _mm256_set1_ps(p[t]);
        for (int64_t c = 0; c < NC; ++c)
          acc[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(block.data() + t * d + (c0 + c) * kHalf), acc[c]);
      }
      for (int64_t c = 0; c < NC; ++c) _mm256_storeu_ps(acc_at + c * kHalf, acc[c]);
    };
    for (int64_t j0 = 0; j0 < len; j0 += kBlockKeys) {
      const int64_t nk = std::min(kBlockKeys, len - j0);
      widen_block(a, row, slots.data() + j0, nk, g, row.cap, block.data());
      for (int64_t h = 0; h < group; ++h) {
        int64_t c0 = 0;
        for (; c0 + kChunks <= chunks; c0 += kChunks) weigh(std::integral_constant<int64_t, kChunks>{}, h, c0, j0, nk);
        for (; c0 < chunks; ++c0) weigh(std::integral_constant<int64_t, 1>{}, h, c0, j0, nk);
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      float* o = out + r * a.heads * d + (g * group + h) * d;
      for (int64_t c = 0; c < chunks; ++c)
        _mm256_storeu_ps(o + c * kHalf, _mm256_mul_ps(_mm256_loadu_ps(sums.data() + h * d + c * kHalf), _mm256_set1_ps(inv[h])));
    }
  }
}
