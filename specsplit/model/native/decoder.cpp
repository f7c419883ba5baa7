// A Llama-family decoder forward for x86 CPUs, built once per instruction set (isa_avx512.h: AVX-512,
// bf16 weights need AVX512_BF16, with AMX tiles where present; isa_avx2.h: AVX2 + FMA + F16C), the one
// that runs chosen at run time (native/__init__.py, SPECSPLIT_ISA).
//
// Why it exists: transformers' CPU step spends most of its time in per-op overhead and in GEMM
// kernels that are far from the memory bandwidth for 1-9 rows; and those kernels give a row other
// bits depending on how many rows share the call, which breaks exact speculation.
//
// Exactness by construction: every output element (row r, feature o) is computed by the same
// instruction sequence whatever the number of rows in the call or the number of threads: GEMMs
// parallelise over output panels only and keep a fixed pair of accumulators per (row, panel);
// attention for a row at position p reads exactly keys [0, p] and nothing else.
//
// Token trees: a call may carry parents (row -> earlier row of the call, -1 for a child of the
// prefix, or -2 - s for a child of cache slot s written by an earlier call, whose own parent slot
// is slot_parents[s - base], -1 for the prefix). The prefix is [0, base) (base = start unless a
// tree grows over several calls). A row then sits at position base + depth and attends the prefix
// and its own ancestors in depth order, read in the same order and summed the same way as if its
// path alone had been fed as a chain: each row's result is bit-identical to decoding its path one
// by one. Its key and value are stored in slot start + row; the caller keeps one path by moving
// its slots down (KVBuffer.keep), so rolling back stays a length change.
//
// Batches: forward_batch runs the rows of several sequences (each with its own cache, start and
// optional tree) in one call. GEMMs do not look at which sequence a row belongs to, and attention
// reads only the row's own cache, so every row's result is bit-identical to running its sequence
// alone: batching across sessions keeps speculation exact.
//
// Layouts and why the block formats stay exact: packing.h.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

// The instruction set this build is for (native/__init__.py compiles one library per set).
#if defined(__AVX512F__)
#define SPECSPLIT_AVX512 1
#define SPECSPLIT_ISA "avx512"
#else
#define SPECSPLIT_AVX512 0
#define SPECSPLIT_ISA "avx2"
#endif

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// The parts, in dependency order (each included once, here, inside this anonymous namespace).
#include "common.h"
#include "packing.h"
#include "rows.h"
#if SPECSPLIT_AVX512
#include "isa_avx512.h"
#else
#include "isa_avx2.h"
#endif
#include "choice.h"
#include "layers.h"

class Decoder {
 public:
  // Every GEMM weight (head included) comes packed (Weight); its kind decides the GEMM inputs: the
  // block formats read int8 rows (q8), int8 weight-only and bf16 read bf16 rows, fp32 reads fp32.
  // amx: attention on AMX tiles (bf16 caches only; see attend_amx), for every row count.
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor embed, torch::Tensor cos,
          torch::Tensor sin, torch::Tensor norm, const Weight& head, bool amx)
      : heads_(heads), kv_heads_(kv_heads), d_(head_dim), eps_(static_cast<float>(eps)),
        embed_(embed.contiguous()), cos_(cos.to(torch::kFloat32).contiguous()),
        sin_(sin.to(torch::kFloat32).contiguous()), norm_(norm.to(torch::kFloat32).contiguous()) {
    hidden_ = embed_.size(1);  // embed may have no rows (a draft head is fed rows, not ids)
    bf16_ = embed_.scalar_type() == torch::kBFloat16;
    act_ = act_of(head.p.kind);
    TORCH_CHECK(act_ != Act::kBF16 || bf16_ || head.p.kind != Kind::kI8, "int8 weights need a bfloat16 model");
    head_ = head.p;
    attn_amx_ = amx && bf16_;
    TORCH_CHECK(!attn_amx_ || amx_permitted(), "the kernel did not grant this process AMX tile state");
  }

  // gate_up: gate and up interleaved by panel (panel 2j holds gate outputs 16j.., panel 2j+1 the up
  // ones), so one GEMM yields both and SiLU(gate) * up pairs up panel by panel.
  void add_layer(const Weight& qkv, torch::Tensor qkv_bias, const Weight& o, const Weight& gate_up, const Weight& down,
                 torch::Tensor norm_in, torch::Tensor norm_post) {
    for (const Weight* w : {&qkv, &o, &gate_up, &down})
      TORCH_CHECK(act_of(w->p.kind) == act_, "every weight of a model must read the same kind of input rows");
    TORCH_CHECK(gate_up.p.n % (2 * kLanes) == 0, "intermediate size must be a multiple of 16");
    Layer l;
    l.qkv = qkv.p;
    l.o = o.p;
    l.gate_up = gate_up.p;
    l.down = down.p;
    l.qkv_bias = qkv_bias.defined() && qkv_bias.numel() ? qkv_bias.to(torch::kFloat32).contiguous() : torch::Tensor();
    l.norm_in = norm_in.to(torch::kFloat32).contiguous();
    l.norm_post = norm_post.to(torch::kFloat32).contiguous();
    layers_.push_back(std::move(l));
  }

  // ids [n] at positions [start, start + n); cache [layers, 2, capacity, kv_heads, head_dim].
  // head: 0 none, 1 last row, 2 every row. parents: empty (a chain) or [n] int64, a tree (see the
  // top of this file). Returns (logits fp32 or empty, hidden in model dtype).
  std::vector<torch::Tensor> forward(torch::Tensor ids, torch::Tensor cache, int64_t start, int64_t head,
                                     torch::Tensor parents, int64_t base, torch::Tensor slot_parents) {
    std::vector<float> x = embed(ids);
    Scratch s;
    add_segment(s, cache, ids.size(0), start, head, parents, base, slot_parents);
    return run(x, s);
  }

  // As forward, from input rows [n, hidden] (float32) instead of token ids: a draft head whose
  // input is a projection of the target's features.
  std::vector<torch::Tensor> forward_rows(torch::Tensor rows, torch::Tensor cache, int64_t start, int64_t head,
                                          torch::Tensor parents, int64_t base, torch::Tensor slot_parents) {
    TORCH_CHECK(rows.dim() == 2 && rows.size(1) == hidden_, "rows must be [n, hidden]");
    auto r = rows.to(torch::kFloat32).contiguous();
    std::vector<float> x(r.data_ptr<float>(), r.data_ptr<float>() + r.numel());
    Scratch s;
    add_segment(s, cache, rows.size(0), start, head, parents, base, slot_parents);
    return run(x, s);
  }

  // Several sequences in one forward: sequence i feeds counts[i] consecutive rows at positions
  // [starts[i], starts[i] + counts[i]) of caches[i], with heads[i] as in forward, trees[i] (empty:
  // a chain) and, for a tree grown over calls, bases[i] and slot_parents[i] as in forward. The rows
  // are token ids, or input rows [n, hidden] (float32) when ids is empty (a draft head). Returns
  // (the logits of every sequence's head rows in order, hidden [n]).
  std::vector<torch::Tensor> forward_batch(torch::Tensor ids, torch::Tensor rows, std::vector<torch::Tensor> caches,
                                           std::vector<int64_t> starts, std::vector<int64_t> counts,
                                           std::vector<int64_t> heads, std::vector<torch::Tensor> trees,
                                           std::vector<int64_t> bases, std::vector<torch::Tensor> slot_parents) {
    const size_t m = caches.size();
    TORCH_CHECK(starts.size() == m && counts.size() == m && heads.size() == m && trees.size() == m &&
                    bases.size() == m && slot_parents.size() == m,
                "one start, count, head, tree, base and slot_parents per cache");
    int64_t total = 0;
    for (int64_t c : counts) total += c;
    std::vector<float> x;
    if (ids.numel() > 0) {
      TORCH_CHECK(total == ids.size(0), "counts must add up to the number of ids");
      x = embed(ids);
    } else {
      TORCH_CHECK(rows.dim() == 2 && rows.size(0) == total && rows.size(1) == hidden_,
                  "without ids, rows must be [sum of counts, hidden]");
      auto r = rows.to(torch::kFloat32).contiguous();
      x.assign(r.data_ptr<float>(), r.data_ptr<float>() + r.numel());
    }
    Scratch s;
    for (size_t i = 0; i < m; ++i)
      add_segment(s, caches[i], counts[i], starts[i], heads[i], trees[i], bases[i], slot_parents[i]);
    return run(x, s);
  }

  // A draft head's input projection (EAGLE): row x = fc [feature, embed(token)], fc [hidden, 2 hidden]
  // packed like the layer's weights; embed [target vocab, hidden] (bf16 or fp32, the target's input
  // embedding); ids [draft vocab]: the target id of each row of the output head. With it set, draft()
  // runs whole drafting rounds in one call.
  void set_input(const Weight& fc, torch::Tensor embed, torch::Tensor ids) {
    TORCH_CHECK(fc.p.k == 2 * hidden_ && fc.p.n == hidden_, "fc must be [hidden, 2 hidden]");
    TORCH_CHECK(act_of(fc.p.kind) == act_, "fc must read the same kind of input rows as the layer");
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == hidden_, "embed must be [vocab, hidden]");
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.numel() == head_.n, "ids: one target id per output row");
    fc_ = fc.p;
    in_embed_ = embed.contiguous();
    ids_ = ids.contiguous();
    has_input_ = true;
  }

  // One greedy drafting round for several sessions (each its own cache), in one call with no Python
  // between head steps. Per session i: counts[i] rows of target features (features, with the tokens
  // after them) fed at starts[i] (none: the session's last prediction prev_pred[i] / prev_logits[i]
  // stands), then forced[i] (tokens already assumed: fed on the head's own predictions), then gamma
  // draft steps: a chain (width 0) that stops before a step whose running product of top
  // probabilities falls below min_confidence, or EAGLE-2's dynamic tree (width > 0: at each depth the
  // `width` best nodes by path probability, at least min_expand, are expanded in one step, each
  // giving its `width` best tokens). Sessions step in lock-step, one forward per step for all.
  // Returns per session: [pred [hidden] and logits [draft vocab] after its target features (the next
  // round's prev), rows fed (int64 [1]), then for a chain: tokens, top probabilities, runner-up tokens
  // (-1: none) and probabilities; for a tree, its nodes in the order made: parents (-1: root), tokens,
  // path probabilities].
  std::vector<std::vector<torch::Tensor>> draft(torch::Tensor features, torch::Tensor tokens, std::vector<int64_t> counts,
                                                std::vector<torch::Tensor> forced, std::vector<torch::Tensor> caches,
                                                std::vector<int64_t> starts, std::vector<torch::Tensor> prev_pred,
                                                std::vector<torch::Tensor> prev_logits, int64_t gamma,
                                                double min_confidence, int64_t width, double min_expand) {
    TORCH_CHECK(has_input_, "draft() needs set_input()");
    const size_t m = caches.size();
    TORCH_CHECK(counts.size() == m && forced.size() == m && starts.size() == m && prev_pred.size() == m &&
                    prev_logits.size() == m, "one count, forced list, start and prev per cache");
    TORCH_CHECK(width >= 0 && width <= 16 && gamma >= 0, "width in [0, 16], gamma >= 0");
    const int64_t d = hidden_, vocab = head_.n;
    auto feats = features.to(torch::kFloat32).contiguous();
    auto toks = tokens.contiguous();
    struct Node { int64_t node, slot; std::vector<float> pred, logits; double score; };
    struct Session {
      std::vector<float> pred, logits;  // the head's latest prediction and its draft logits
      int64_t length = 0, fed = 0, base = 0;
      std::vector<int64_t> slot_parents;
      std::vector<int64_t> a, c;  // chain: tokens, runner-up tokens; tree: parents, tokens
      std::vector<float> b, e;    // chain: top probabilities, runner-up probabilities; tree: scores
      std::vector<Node> frontier;
      double confidence = 1.0;
      bool active = true;
    };
    std::vector<Session> ss(m);
    std::vector<std::vector<torch::Tensor>> out(m);
    // A forward over some sessions' rows: rows (feature, token) with tree parents where given.
    struct Feed { size_t i; std::vector<const float*> f; std::vector<int64_t> t, parents; bool tree; };
    auto forward = [&](std::vector<Feed>& feeds) {
      int64_t n = 0;
      for (auto& f : feeds) n += static_cast<int64_t>(f.t.size());
      std::vector<float> in(n * 2 * d);
      int64_t r = 0;
      for (auto& f : feeds)
        for (size_t j = 0; j < f.t.size(); ++j, ++r) {
          std::memcpy(in.data() + r * 2 * d, f.f[j], d * 4);
          embed_row(f.t[j], in.data() + r * 2 * d + d);
        }
      Scratch s;
      to_rows(in.data(), n, 2 * d, act_, s.in);
      std::vector<float> x(n * d);
#pragma omp parallel num_threads(at::get_num_threads())
      gemm_team(fc_, s.in, n, x.data());
      for (auto& f : feeds) {
        Session& se = ss[f.i];
        const int64_t k = static_cast<int64_t>(f.t.size());
        auto parents = f.tree ? torch::from_blob(f.parents.data(), {k}, torch::kLong).clone() : torch::Tensor();
        auto slots = torch::from_blob(se.slot_parents.data(), {static_cast<int64_t>(se.slot_parents.size())},
                                      torch::kLong).clone();
        add_segment(s, caches[f.i], k, se.length, f.tree ? 2 : 1, parents, f.tree ? se.base : se.length, slots);
      }
      auto res = run(x, s);
      return std::make_pair(res[0], s.a);  // logits of the head rows (fp32), hidden rows (fp32)
    };
    // Phase 1: target features.
    {
      std::vector<Feed> feeds;
      int64_t row = 0;
      for (size_t i = 0; i < m; ++i) {
        ss[i].length = starts[i];
        Feed f{i, {}, {}, {}, false};
        for (int64_t j = 0; j < counts[i]; ++j, ++row) {
          f.f.push_back(feats.data_ptr<float>() + row * d);
          f.t.push_back(toks.data_ptr<int64_t>()[row]);
        }
        if (counts[i] > 0) feeds.push_back(std::move(f));
        else {
          auto pp = prev_pred[i].to(torch::kFloat32).contiguous(), pl = prev_logits[i].to(torch::kFloat32).contiguous();
          TORCH_CHECK(pp.numel() == d && pl.numel() == vocab, "prev_pred [hidden] and prev_logits [draft vocab]");
          ss[i].pred.assign(pp.data_ptr<float>(), pp.data_ptr<float>() + d);
          ss[i].logits.assign(pl.data_ptr<float>(), pl.data_ptr<float>() + vocab);
        }
      }
      if (!feeds.empty()) step_chain(feeds, forward, ss, d, vocab);
      for (size_t i = 0; i < m; ++i) {
        out[i].push_back(torch::from_blob(ss[i].pred.data(), {d}, torch::kFloat32).clone());
        out[i].push_back(torch::from_blob(ss[i].logits.data(), {vocab}, torch::kFloat32).clone());
      }
    }
    // Phase 2: tokens already assumed, one at a time on the head's own predictions.
    for (int64_t j = 0;; ++j) {
      std::vector<Feed> feeds;
      for (size_t i = 0; i < m; ++i)
        if (j < forced[i].numel()) feeds.push_back(Feed{i, {ss[i].pred.data()}, {forced[i].data_ptr<int64_t>()[j]}, {}, false});
      if (feeds.empty()) break;
      step_chain(feeds, forward, ss, d, vocab);
    }
    // Phase 3: the draft.
    for (size_t i = 0; i < m; ++i) {
      ss[i].base = ss[i].length;
      ss[i].frontier.push_back(Node{-1, -1, ss[i].pred, ss[i].logits, 1.0});
    }
    int64_t idx[16];
    float prob[16];
    for (int64_t depth = 0; depth < gamma; ++depth) {
      std::vector<Feed> feeds;
      std::vector<std::vector<std::pair<double, std::array<int64_t, 4>>>> grown(m);  // (score, {node, slot, frontier, token})
      for (size_t i = 0; i < m; ++i) {
        Session& se = ss[i];
        if (!se.active) continue;
        if (width == 0) {  // chain
          const int64_t k = top_k(se.logits.data(), vocab, 2, idx, prob);
          se.confidence *= prob[0];
          if (se.confidence < min_confidence) { se.active = false; continue; }
          se.a.push_back(ids_.data_ptr<int64_t>()[idx[0]]);
          se.b.push_back(prob[0]);
          se.c.push_back(k > 1 && prob[1] > 0 ? ids_.data_ptr<int64_t>()[idx[1]] : -1);
          se.e.push_back(k > 1 ? prob[1] : 0.0f);
          if (depth + 1 == gamma) { se.active = false; continue; }
          feeds.push_back(Feed{i, {se.pred.data()}, {se.a.back()}, {}, false});
          continue;
        }
        auto& g = grown[i];
        for (size_t fi = 0; fi < se.frontier.size(); ++fi) {
          const Node& nd = se.frontier[fi];
          const int64_t k = top_k(nd.logits.data(), vocab, width, idx, prob);
          for (int64_t c = 0; c < k; ++c) {
            if (!(prob[c] > 0)) continue;
            const int64_t token = ids_.data_ptr<int64_t>()[idx[c]];
            const double score = nd.score * prob[c];
            se.a.push_back(nd.node);
            se.c.push_back(token);
            se.b.push_back(static_cast<float>(score));
            g.push_back({score, {static_cast<int64_t>(se.c.size()) - 1, nd.slot, static_cast<int64_t>(fi), token}});
          }
        }
        std::stable_sort(g.begin(), g.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
        if (static_cast<int64_t>(g.size()) > width) g.resize(width);
        while (!g.empty() && g.back().first < min_expand) g.pop_back();
        if (depth + 1 == gamma || g.empty()) { se.active = false; continue; }
        Feed f{i, {}, {}, {}, true};
        for (auto& [score, v] : g) {
          f.f.push_back(se.frontier[v[2]].pred.data());
          f.t.push_back(v[3]);
          f.parents.push_back(v[1] < 0 ? -1 : -2 - v[1]);
        }
        feeds.push_back(std::move(f));
      }
      if (feeds.empty()) break;
      if (width == 0) {
        step_chain(feeds, forward, ss, d, vocab);
        continue;
      }
      std::vector<int64_t> starts_now(m);
      for (auto& f : feeds) starts_now[f.i] = ss[f.i].length;
      auto [logits, hidden] = forward(feeds);
      const float* lp = logits.data_ptr<float>();
      int64_t row = 0;
      for (auto& f : feeds) {
        Session& se = ss[f.i];
        std::vector<Node> next;
        for (size_t j = 0; j < f.t.size(); ++j, ++row) {
          const auto& [score, v] = grown[f.i][j];
          se.slot_parents.push_back(v[1]);
          next.push_back(Node{v[0], starts_now[f.i] + static_cast<int64_t>(j),
                              std::vector<float>(hidden.begin() + row * d, hidden.begin() + (row + 1) * d),
                              std::vector<float>(lp + row * vocab, lp + (row + 1) * vocab), score});
        }
        se.length += static_cast<int64_t>(f.t.size());
        se.fed += static_cast<int64_t>(f.t.size());
        se.frontier = std::move(next);
      }
    }
    for (size_t i = 0; i < m; ++i) {
      Session& se = ss[i];
      auto i64 = [](std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong); };
      auto f32 = [](std::vector<float>& v) { return torch::tensor(v, torch::kFloat32); };
      out[i].push_back(torch::tensor({se.fed}, torch::kLong));
      if (width == 0) {
        out[i].insert(out[i].end(), {i64(se.a), f32(se.b), i64(se.c), f32(se.e)});
      } else {
        out[i].insert(out[i].end(), {i64(se.a), i64(se.c), f32(se.b)});
      }
    }
    return out;
  }

 private:
  // One chain step for the fed sessions (one row each, or a session's target rows): each session's
  // prediction and logits become its last row's, its cache advances.
  template <typename Forward, typename Feeds, typename Sessions>
  static void step_chain(Feeds& feeds, Forward& forward, Sessions& ss, int64_t d, int64_t vocab) {
    auto [logits, hidden] = forward(feeds);
    const float* lp = logits.template data_ptr<float>();
    int64_t row = 0, head = 0;
    for (auto& f : feeds) {
      auto& se = ss[f.i];
      const int64_t k = static_cast<int64_t>(f.t.size());
      row += k;
      se.pred.assign(hidden.begin() + (row - 1) * d, hidden.begin() + row * d);
      se.logits.assign(lp + head * vocab, lp + (head + 1) * vocab);
      ++head;
      se.length += k;
      se.fed += k;
    }
  }

  // Row `token` of the input embedding, as fp32, to dst.
  void embed_row(int64_t token, float* dst) const {
    TORCH_CHECK(token >= 0 && token < in_embed_.size(0), "token id out of range");
    const int64_t d = hidden_;
    if (in_embed_.scalar_type() == torch::kBFloat16) {
      const auto* src = static_cast<const uint16_t*>(in_embed_.data_ptr()) + token * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_f32(src[i]);
    } else {
      std::memcpy(dst, in_embed_.data_ptr<float>() + token * d, d * 4);
    }
  }

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

  std::vector<float> embed(const torch::Tensor& ids) const {
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "ids must be int64 [n]");
    const int64_t n = ids.size(0), width = hidden_;
    std::vector<float> x(n * width);
    const auto* id = ids.data_ptr<int64_t>();
    const void* table = embed_.data_ptr();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(id[r] >= 0 && id[r] < embed_.size(0), "token id out of range");
      for (int64_t i = 0; i < width; ++i)
        x[r * width + i] = bf16_ ? bf16_to_f32(static_cast<const uint16_t*>(table)[id[r] * width + i])
                                 : static_cast<const float*>(table)[id[r] * width + i];
    }
    return x;
  }

  void add_segment(Scratch& s, const torch::Tensor& cache, int64_t n, int64_t start, int64_t head,
                   const torch::Tensor& parents, int64_t base, const torch::Tensor& slot_parents) const {
    TORCH_CHECK(cache.size(0) == static_cast<int64_t>(layers_.size()), "cache has the wrong number of layers");
    TORCH_CHECK(cache.scalar_type() == embed_.scalar_type(), "cache must be in the model dtype");
    TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
    TORCH_CHECK(n >= 1 && start >= 0 && start + n <= cache.size(2), "cache too small");
    TORCH_CHECK(start + n <= cos_.size(0), "positions beyond the rotary table");
    TORCH_CHECK(head >= 0 && head <= 2, "head must be 0, 1 or 2");
    Segment seg;
    seg.cap = cache.size(2);
    seg.start = start;
    seg.base = base;
    for (int64_t li = 0; li < cache.size(0); ++li) seg.kv.push_back(static_cast<char*>(cache[li].data_ptr()));
    const int64_t index = static_cast<int64_t>(s.segs.size()), row0 = s.rows();
    s.segs.push_back(std::move(seg));
    const bool tree = parents.defined() && parents.numel() > 0;
    TORCH_CHECK(!tree || (parents.numel() == n && parents.scalar_type() == torch::kInt64),
                "parents must be int64 with one entry per row");
    TORCH_CHECK(0 <= base && base <= start, "base must be in [0, start]");
    TORCH_CHECK(tree || base == start, "a chain's prefix is everything before start");
    const auto pc = tree ? parents.contiguous() : parents;
    const int64_t* p = tree ? pc.data_ptr<int64_t>() : nullptr;
    const auto sc = slot_parents.defined() && slot_parents.numel() ? slot_parents.contiguous() : torch::Tensor();
    TORCH_CHECK(!sc.defined() || (sc.scalar_type() == torch::kInt64 && sc.numel() == start - base),
                "slot_parents must be int64 with one entry per slot in [base, start)");
    const int64_t* sp = sc.defined() ? sc.data_ptr<int64_t>() : nullptr;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t parent = tree ? p[r] : r - 1;
      TORCH_CHECK(parent >= -2 - (start - 1) && parent < r, "a row's parent must be an earlier row, -1, or -2 - slot");
      std::vector<int64_t> path;
      if (parent >= 0) {
        path = s.path[row0 + parent];
      } else if (parent <= -2) {  // a slot from an earlier call: its ancestry from slot_parents
        int64_t slot = -2 - parent;
        TORCH_CHECK(slot >= base && slot < start && sp, "a parent slot must be in [base, start) with slot_parents");
        for (int64_t hops = 0; slot >= 0; ++hops) {
          TORCH_CHECK(slot >= base && slot < start && hops < start - base, "slot_parents do not form a tree");
          path.push_back(slot);
          slot = sp[slot - base];
        }
        std::reverse(path.begin(), path.end());
      }
      path.push_back(start + r);
      s.path.push_back(std::move(path));
      s.seg_of.push_back(index);
    }
    if (head == 1) s.head_rows.push_back(row0 + n - 1);
    if (head == 2)
      for (int64_t r = 0; r < n; ++r) s.head_rows.push_back(row0 + r);
  }

  // The layers, the final norm (none when the norm weight is empty) and the output head, in one
  // OpenMP parallel region: the GEMMs and attention are shared out, the small row-wise steps run on
  // one thread between barriers (a barrier costs far less than a fork/join per op).
  std::vector<torch::Tensor> run(std::vector<float>& x, Scratch& s) {
    const int64_t width = hidden_, n = s.rows();
    TORCH_CHECK(d_ % kLanes == 0 && d_ <= 256, "head_dim must be a multiple of 16, at most 256");
    const int64_t inter = layers_.empty() ? 0 : layers_[0].gate_up.n / 2;
    const int64_t qkv_n = layers_.empty() ? 0 : layers_[0].qkv.n;
    s.a.resize(n * width);
    s.qkv.resize(n * qkv_n);
    s.att.resize(n * heads_ * d_);
    s.y.resize(n * width);
    s.gu.resize(n * 2 * inter);
    s.h.resize(n * inter);
    shape_rows(n, width, act_, s.in);
    shape_rows(n, heads_ * d_, act_, s.in_att);
    shape_rows(n, inter, act_, s.in_mlp);
    const int64_t rows = static_cast<int64_t>(s.head_rows.size());
    const bool head = rows > 0;
    torch::Tensor logits = head ? torch::empty({rows, head_.n}, torch::kFloat32) : torch::Tensor();
    float* out = head ? logits.data_ptr<float>() : nullptr;
    torch::Tensor choices = head ? torch::empty({rows}, torch::kLong) : torch::Tensor();
    std::vector<float> part_v;  // argmax_team's per-thread answers
    std::vector<int64_t> part_i;
    const bool norm = norm_.numel() > 0;
    const float* norm_w = norm ? norm_.data_ptr<float>() : nullptr;
    std::vector<float> picked;
    plan_runs(s);
#pragma omp parallel num_threads(at::get_num_threads())
    {
      for (size_t li = 0; li < layers_.size(); ++li) layer_team(layers_[li], li, x.data(), s);
#pragma omp single
      {
        if (norm)
          rms_norm(x.data(), norm_w, n, width, eps_, s.a.data());
        else
          s.a = x;
        if (head) {
          picked.resize(rows * width);
          for (int64_t i = 0; i < rows; ++i)
            std::memcpy(picked.data() + i * width, s.a.data() + s.head_rows[i] * width, width * 4);
          to_rows(picked.data(), rows, width, act_, s.in);
        }
      }
      if (head) {
        gemm_team(head_, s.in, rows, out);
        argmax_team(out, rows, head_.n, part_v, part_i, choices.data_ptr<int64_t>());
      }
    }
    auto hidden = torch::from_blob(s.a.data(), {n, width}, torch::kFloat32).to(embed_.scalar_type(), false, true);
    return {logits, hidden, choices};
  }

  // Per row of y [rows][n], the index of its largest value as torch.argmax gives it (the first of
  // equals; with a NaN, the first NaN), by the team right after the output GEMM: each thread scans
  // the panels it is likely to have just written (a contiguous share, as the GEMM's), in its own
  // cache; then one thread takes the shares' answers in column order. Read from Python after the
  // forward, the rows written by the other core cost a cross-core transfer of the whole vocabulary
  // (~50 us a row measured on 2 cores); here a row costs a few microseconds.
  static void argmax_team(const float* y, int64_t rows, int64_t n, std::vector<float>& part_v,
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

  // One layer, called by every thread of the team: GEMMs and attention shared out as they say,
  // the row-wise steps shared out by rows (each row's arithmetic is the same on any thread).
  void layer_team(const Layer& l, size_t li, float* x, Scratch& s) {
    const int64_t n = s.rows(), width = hidden_, qw = heads_ * d_, kw = kv_heads_ * d_, ld = l.qkv.n;
    const int64_t inter = l.gate_up.n / 2;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      rms_norm(x + r * width, l.norm_in.data_ptr<float>(), 1, width, eps_, s.a.data() + r * width);
      row_to(s.a.data() + r * width, r, width, act_, s.in);
    }
    gemm_team(l.qkv, s.in, n, s.qkv.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* row = s.qkv.data() + r * ld;
      if (l.qkv_bias.defined()) {
        const float* b = l.qkv_bias.data_ptr<float>();
        for (int64_t i = 0; i < ld; ++i) row[i] += b[i];
      }
      const Segment& seg = s.segs[s.seg_of[r]];
      rope(row, heads_ + kv_heads_, seg.base + static_cast<int64_t>(s.path[r].size()) - 1);
      store_kv(seg.kv[li], seg.cap, row + qw, row + qw + kw, s.path[r].back());
    }
#if SPECSPLIT_AVX512
    if (attn_amx_)
      attend_amx_team(li, s.qkv.data(), ld, s, s.att.data());
    else
#endif
      attend_team(li, s.qkv.data(), ld, s, s.att.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) row_to(s.att.data() + r * qw, r, qw, act_, s.in_att);
    gemm_team(l.o, s.in_att, n, s.y.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      float* xr = x + r * width;
      for (int64_t i = 0; i < width; ++i) xr[i] += s.y[r * width + i];
      rms_norm(xr, l.norm_post.data_ptr<float>(), 1, width, eps_, s.a.data() + r * width);
      row_to(s.a.data() + r * width, r, width, act_, s.in);
    }
    gemm_team(l.gate_up, s.in, n, s.gu.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      silu_mul(s.gu.data() + r * 2 * inter, s.h.data() + r * inter, inter);
      row_to(s.h.data() + r * inter, r, inter, act_, s.in_mlp);
    }
    gemm_team(l.down, s.in_mlp, n, s.y.data());
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < width; ++i) x[r * width + i] += s.y[r * width + i];
  }

  // Rotary embedding of `count` heads of one row (rotate-half convention, transformers' tables).
  void rope(float* v, int64_t count, int64_t pos) const {
    const float* c = cos_.data_ptr<float>() + pos * d_;
    const float* s = sin_.data_ptr<float>() + pos * d_;
    const int64_t half = d_ / 2;
    for (int64_t h = 0; h < count; ++h) {
      float* q = v + h * d_;
      for (int64_t i = 0; i < half; ++i) {
        const float lo = q[i], hi = q[i + half];
        q[i] = lo * c[i] - hi * s[i];
        q[i + half] = hi * c[i + half] + lo * s[i + half];
      }
    }
  }

  // kv: one layer's [2, capacity, kv_heads, head_dim] block in the model dtype.
  void store_kv(char* kv, int64_t cap, const float* k, const float* v, int64_t pos) const {
    const int64_t kw = kv_heads_ * d_;
    if (bf16_) {
      auto* base = reinterpret_cast<uint16_t*>(kv);
      for (int64_t i = 0; i < kw; ++i) {
        base[pos * kw + i] = f32_to_bf16(k[i]);
        base[(cap + pos) * kw + i] = f32_to_bf16(v[i]);
      }
    } else {
      float* base = reinterpret_cast<float*>(kv);
      std::memcpy(base + pos * kw, k, kw * 4);
      std::memcpy(base + (cap + pos) * kw, v, kw * 4);
    }
  }

#if SPECSPLIT_AVX512
#include "attention_avx512.inc"
#include "attention_amx.inc"

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
#else
#include "attention_avx2.inc"
#endif

  int64_t heads_, kv_heads_, d_, hidden_ = 0;
  float eps_;
  bool bf16_ = true, attn_amx_ = false;
  Act act_ = Act::kBF16;
  torch::Tensor embed_, cos_, sin_, norm_;
  Packed head_;
  std::vector<Layer> layers_;
  Packed fc_;  // a draft head's input projection (set_input)
  torch::Tensor in_embed_, ids_;
  bool has_input_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = SPECSPLIT_ISA;
  m.def("amx_permitted", &amx_permitted);
  pybind11::class_<Weight>(m, "Weight")
      .def_static("dense", &Weight::dense)
      .def_static("q8_0", &Weight::q8_0)
      .def_static("q8_h", &Weight::q8_h, pybind11::arg("q"), pybind11::arg("d"), pybind11::arg("m"),
                  pybind11::arg("k"), pybind11::arg("d_base") = pybind11::none(),
                  pybind11::arg("m_base") = pybind11::none(), pybind11::arg("narrow") = true)
      .def_static("q4_0", &Weight::q4_0)
      .def_static("q4_1", &Weight::q4_1, pybind11::arg("nibbles"), pybind11::arg("d"), pybind11::arg("m"),
                  pybind11::arg("k"), pybind11::arg("d_base") = pybind11::none(),
                  pybind11::arg("m_base") = pybind11::none())
      .def_property_readonly("outputs", &Weight::outputs)
      .def_property_readonly("amx", &Weight::on_amx)
      .def_property_readonly("kind", &Weight::kind_name)
      .def_property_readonly("inputs", &Weight::inputs);
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, const Weight&, bool>())
      .def("add_layer", &Decoder::add_layer)
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_rows", &Decoder::forward_rows, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_batch", &Decoder::forward_batch, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_input", &Decoder::set_input)
      .def("draft", &Decoder::draft, pybind11::call_guard<pybind11::gil_scoped_release>());
}
