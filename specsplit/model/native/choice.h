// Part of decoder.cpp (included once, inside its anonymous namespace, after the instruction set's
// part): a draft head's choices from its logits, and its best logits made exact (refine_team).
#pragma once

// The k best of row[0, n) (k <= 16; the first of equals first), best first, with their softmax
// probabilities over the whole row; returns how many (min(k, n)).
int64_t top_k(const float* row, int64_t n, int64_t k, int64_t* idx, float* prob) {
  k = std::min(k, n);
  int64_t have = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = row[i];
    if (have == k && !(v > row[idx[k - 1]])) continue;
    int64_t at = have < k ? have++ : k - 1;
    while (at > 0 && v > row[idx[at - 1]]) {
      idx[at] = idx[at - 1];
      --at;
    }
    idx[at] = i;
  }
  const float top = row[idx[0]];
  const float total = sum_exp(row, n, top);
  for (int64_t j = 0; j < k; ++j) prob[j] = std::exp(row[idx[j]] - top) / total;
  return k;
}

// Per row of y [rows][n], the index of its largest value as torch.argmax gives it (the first of
// equals; with a NaN, the first NaN), by the team right after the output GEMM: each thread scans
// the panels it is likely to have just written (a contiguous share, as the GEMM's), in its own
// cache; then one thread takes the shares' answers in column order. Read from Python after the
// forward, the rows written by the other core cost a cross-core transfer of the whole vocabulary
// (~50 us a row measured on 2 cores); here a row costs a few microseconds.
void argmax_team(const float* y, int64_t rows, int64_t n, std::vector<float>& part_v,
                        std::vector<int64_t>& part_i, int64_t* out) {
  const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
  const int64_t panels = (n + kLanes - 1) / kLanes;
#pragma omp single
  {
    part_v.assign(rows * team, -INFINITY);
    part_i.assign(rows * team, -1);
  }
  const int64_t c0 = std::min(n, panels * tid / team * kLanes), c1 = std::min(n, panels * (tid + 1) / team * kLanes);
  for (int64_t r = 0; r < rows && c0 < c1; ++r) {
    float best;
    int64_t at;
    const bool any_nan = argmax_span(y + r * n, c0, c1, best, at);
    part_v[tid * rows + r] = any_nan ? NAN : best;
    part_i[tid * rows + r] = at;
  }
#pragma omp barrier
#pragma omp single
  for (int64_t r = 0; r < rows; ++r) {
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t t = 0; t < team; ++t) {
      const float v = part_v[t * rows + r];
      const int64_t i = part_i[t * rows + r];
      if (i >= 0 && (at < 0 || (!std::isnan(best) && (v > best || std::isnan(v))))) best = v, at = i;
    }
    out[r] = at;
  }
}

// Each of `rows` logit rows y [rows, exact rows]: its kRefine largest entries recomputed from the
// input rows x [rows, width] and `exact` ([n, width] bf16: Decoder::set_exact_head), a row
// on one thread in one order (the same answer however rows are batched or shared out).
constexpr int kRefine = 8;
void refine_team(const torch::Tensor& exact, const float* x, int64_t rows, int64_t width, float* y) {
  const int64_t n = exact.size(0);
  const auto* w = static_cast<const uint16_t*>(exact.data_ptr());
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * n;
    int64_t idx[kRefine];
    float val[kRefine];
    int k = 0;
    for (int64_t c0 = 0; c0 < n; c0 += kLanes) {  // the kRefine largest, kept sorted (NaN never enters)
      const int64_t c1 = std::min(n, c0 + kLanes);
      const float floor = k < kRefine ? -INFINITY : val[k - 1];
      int above = 0;  // any of the panel above the floor (an int OR: vectorized, unlike a float max)
      for (int64_t c = c0; c < c1; ++c) above |= yr[c] > floor;
      if (!above && k == kRefine) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const float v = yr[c];
        if (!(k < kRefine || v > val[k - 1])) continue;
        int j = k < kRefine ? k++ : kRefine - 1;
        for (; j > 0 && val[j - 1] < v; --j) val[j] = val[j - 1], idx[j] = idx[j - 1];
        val[j] = v, idx[j] = c;
      }
    }
    const float* xr = x + r * width;
    for (int j = 0; j < k; ++j) {
      float lane[kLanes] = {};  // kLanes running sums (vectorized), then added in one fixed order
      int64_t i = 0;
      const uint16_t* wr = w + idx[j] * width;
      for (; i + kLanes <= width; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lane[l] += xr[i + l] * bf16_to_f32(wr[i + l]);
      for (; i < width; ++i) lane[0] += xr[i] * bf16_to_f32(wr[i]);
      float dot = 0.0f;
      for (int l = 0; l < kLanes; ++l) dot += lane[l];
      yr[idx[j]] = dot;
    }
  }
}
