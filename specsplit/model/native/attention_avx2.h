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

// out[r] (heads * d) for rows[0, n) from their queries (qkv + r * ld), by every thread of an OpenMP team.
void attend_rows_team(const AttendShape& a, const float* qkv, int64_t ld, const AttendRow* rows, int64_t n,
                      float* out) {
  const int64_t group = a.heads / a.kv_heads, d = a.d, chunks = d / kHalf;
  constexpr int64_t kChunks = 4;  // P V: 32 dims at a time
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  int64_t longest = 0;
  for (int64_t r = 0; r < n; ++r) longest = std::max(longest, rows[r].keys());
  const int64_t room = (longest + kHalf - 1) / kHalf * kHalf;
  std::vector<float> scores(group * room);  // this thread's: [head][key]
  std::vector<int64_t> slots(room);
  const int64_t tasks = n * a.kv_heads;
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t r = task / a.kv_heads, g = task % a.kv_heads, len = rows[r].keys();
    const AttendRow& row = rows[r];
    for (int64_t j = 0; j < len; ++j) slots[j] = j < row.base ? j : (*row.path)[j - row.base];
    const float* q0 = qkv + r * ld + g * group * d;  // the group's heads, one after another
    for (int64_t j = 0; j < len; ++j) {
      for (int64_t h = 0; h < group; ++h) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + h * d + c * kHalf), kv8(a, row.kv, slots[j], g, c * kHalf, 0), acc);
        scores[h * room + j] = hsum8(acc) * scale;
      }
    }
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
      const __m256 inv = _mm256_set1_ps(1.0f / hsum8(total));
      float* o = out + r * a.heads * d + (g * group + h) * d;
      for (int64_t c0 = 0; c0 < chunks; c0 += kChunks) {
        const int64_t nc = std::min(kChunks, chunks - c0);
        __m256 acc[kChunks] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < len; ++j) {
          const __m256 wj = _mm256_set1_ps(p[j]);
          for (int64_t c = 0; c < nc; ++c)
            acc[c] = _mm256_fmadd_ps(wj, kv8(a, row.kv, slots[j], g, (c0 + c) * kHalf, row.cap), acc[c]);
        }
        for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(o + (c0 + c) * kHalf, _mm256_mul_ps(acc[c], inv));
      }
    }
  }
}
