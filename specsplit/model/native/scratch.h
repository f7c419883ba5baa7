// Part of decoder.cpp (included once, inside its anonymous namespace): what one forward call
// holds while its layers run, shared by the Decoder and the attention kernels.
#pragma once

// One sequence's part of a call: its cache and where its rows sit.
struct Segment {
  std::vector<char*> kv;  // per layer: [2, capacity, kv_heads, head_dim]
  int64_t cap = 0, start = 0, base = 0;
};

// Activations between the ops of a layer, shared by the team, and what each row is.
struct Scratch {
  std::vector<float> a, qkv, att, y, gu, h;
  Rows in, in_att, in_mlp;  // GEMM inputs of hidden, heads * head_dim and intermediate features
  std::vector<Segment> segs;
  std::vector<int64_t> seg_of;  // row -> its segment
  // Per row: the cache slots at and after its segment's base it attends, in depth order
  // (ancestors, then its own), so that it sits at position base + path.size() - 1.
  std::vector<std::vector<int64_t>> path;
  std::vector<int64_t> head_rows;  // the rows whose logits are returned, in order
  // AMX attention: runs of consecutive rows of one segment, each the child of the one before (a
  // chain, or a chain inside a tree): every row's key list is a prefix of the run's last row's.
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  // AVX-512 attention: groups of consecutive rows of one segment (plan_runs).
  std::vector<std::pair<int64_t, int64_t>> groups;  // (first row, rows)
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (run, the run after it or -1)

  int64_t rows() const { return static_cast<int64_t>(seg_of.size()); }
  int64_t keys(int64_t r) const { return segs[seg_of[r]].base + static_cast<int64_t>(path[r].size()); }
};
