// Part of decoder.cpp (included once, inside its anonymous namespace, after the instruction set's
// part): a draft head's choices from its logits.
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
