// Part of decoder.cpp (included once, inside its anonymous namespace, after the Decoder): a draft
// head's whole greedy round in one call (EAGLE's head: one decoder layer on the target's features).
// The Decoder holds the head's layer and its output rows (the draft vocabulary); this adds its input
// projection, row x = fc [feature, embed(token)], and the drafting loop: the choices of every step,
// the confidence stop or the dynamic tree's expansion, with no Python between the head's steps.
#pragma once

class DraftHead {
 public:
  // fc [hidden, 2 hidden], packed like the layer's weights; embed [target vocab, hidden] (bf16 or
  // fp32, the target's input embedding); ids [draft vocab]: the target id of each output row.
  DraftHead(Decoder& decoder, const Weight& fc, torch::Tensor embed, torch::Tensor ids) : dec_(decoder) {
    const int64_t d = dec_.hidden();
    TORCH_CHECK(fc.p.k == 2 * d && fc.p.n == d, "fc must be [hidden, 2 hidden]");
    TORCH_CHECK(act_of(fc.p.kind) == dec_.act(), "fc must read the same kind of input rows as the layer");
    TORCH_CHECK(embed.dim() == 2 && embed.size(1) == d, "embed must be [vocab, hidden]");
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.numel() == dec_.output_head().n,
                "ids: one target id per output row");
    fc_ = fc.p;
    in_embed_ = embed.contiguous();
    ids_ = ids.contiguous();
  }

  int64_t hidden() const { return dec_.hidden(); }

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
    const size_t m = caches.size();
    TORCH_CHECK(counts.size() == m && forced.size() == m && starts.size() == m && prev_pred.size() == m &&
                    prev_logits.size() == m, "one count, forced list, start and prev per cache");
    TORCH_CHECK(width >= 0 && width <= 16 && gamma >= 0, "width in [0, 16], gamma >= 0");
    const int64_t d = dec_.hidden(), vocab = dec_.output_head().n;
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
      Rows rows;
      to_rows(in.data(), n, 2 * d, dec_.act(), rows);
      std::vector<float> x(n * d);
#pragma omp parallel num_threads(at::get_num_threads())
      gemm_team(fc_, rows, n, x.data());
      std::vector<torch::Tensor> cs, trees, slots;
      std::vector<int64_t> starts_of, counts_of, heads, bases;
      for (auto& f : feeds) {
        Session& se = ss[f.i];
        const int64_t k = static_cast<int64_t>(f.t.size());
        cs.push_back(caches[f.i]);
        starts_of.push_back(se.length);
        counts_of.push_back(k);
        heads.push_back(f.tree ? 2 : 1);
        trees.push_back(f.tree ? torch::from_blob(f.parents.data(), {k}, torch::kLong).clone() : torch::Tensor());
        bases.push_back(f.tree ? se.base : se.length);
        slots.push_back(torch::from_blob(se.slot_parents.data(), {static_cast<int64_t>(se.slot_parents.size())},
                                         torch::kLong).clone());
      }
      return dec_.forward_f32(x, cs, starts_of, counts_of, heads, trees, bases, slots);
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
    const int64_t d = dec_.hidden();
    if (in_embed_.scalar_type() == torch::kBFloat16) {
      const auto* src = static_cast<const uint16_t*>(in_embed_.data_ptr()) + token * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_f32(src[i]);
    } else {
      std::memcpy(dst, in_embed_.data_ptr<float>() + token * d, d * 4);
    }
  }

  Decoder& dec_;
  Packed fc_;
  torch::Tensor in_embed_, ids_;
};

// One sequence's head state kept in the kernels (what headserving.HeadTrack and a KVBuffer hold in
// Python): the committed tokens, the target's features of positions [first, count) (those before
// are in the head's cache: a step never rolls back past what it committed), the head's KV cache
// (its first `cached` positions from true features) and its last prediction. A round right after a
// target forward is then two calls that take only their arguments, follow (the step's tokens and
// features) and draft (the chain): Python run there runs on caches the forward flushed (measured on
// an EPYC Zen 5: HeadTrack and NativeHead.run took 0.23 ms around a 0.25 ms kernel call).
class HeadSequence {
 public:
  // cache: the head's empty KV cache, [1, 2, 0, kv heads, head dim] in its dtype.
  HeadSequence(DraftHead& head, int64_t max_positions, torch::Tensor cache)
      : head_(head), max_positions_(max_positions), d_(head.hidden()), kv_(std::move(cache)) {
    TORCH_CHECK(kv_.dim() == 5 && kv_.size(0) == 1 && kv_.size(1) == 2, "cache must be [1, 2, positions, kv heads, head dim]");
  }

  // The prompt is in: tokens (it and the first generated token), features [prompt, hidden].
  void begin(const std::vector<int64_t>& tokens, const torch::Tensor& features) {
    tokens_ = tokens;
    count_ = cached_ = first_ = 0;
    feats_.clear();
    put(0, features);
  }

  // A step committed `tokens` after the first `length` (tokens after them are dropped), with the
  // features of positions [length - 1, length - 1 + n).
  void follow(int64_t length, const std::vector<int64_t>& tokens, const torch::Tensor& features) {
    TORCH_CHECK(length >= 1 && length <= static_cast<int64_t>(tokens_.size()),
                "follow: length ", length, " outside the ", tokens_.size(), " tokens held");
    tokens_.resize(length);
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    cached_ = std::min(cached_, length - 1);  // head cache position i used feature i and token i + 1
    count_ = std::min(count_, length);
    put(length - 1, features);
  }

  // A greedy chain of at most gamma tokens after the committed ones (DraftHead::draft, width 0).
  std::vector<int64_t> draft(int64_t gamma, double min_confidence) {
    auto res = round(gamma, min_confidence, 0, 0.0);
    const auto* t = res[3].data_ptr<int64_t>();
    return std::vector<int64_t>(t, t + res[3].numel());
  }

  // EAGLE-2's dynamic tree, `width` nodes expanded a depth (DraftHead::draft): its nodes in the
  // order made, (parents (-1: the last committed token), tokens, path probabilities).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<float>> draft_tree(int64_t gamma, int64_t width,
                                                                                        double min_expand) {
    TORCH_CHECK(width > 0, "a tree is at least 1 wide");
    auto res = round(gamma, 0.0, width, min_expand);
    const auto* p = res[3].data_ptr<int64_t>();
    const auto* t = res[4].data_ptr<int64_t>();
    const auto* sc = res[5].data_ptr<float>();
    const int64_t n = res[4].numel();
    return {std::vector<int64_t>(p, p + n), std::vector<int64_t>(t, t + n), std::vector<float>(sc, sc + n)};
  }

  int64_t length() const { return static_cast<int64_t>(tokens_.size()); }

 private:
  // The features not yet fed (and the tokens after them), the tokens assumed past them, then the
  // draft; the head's cache afterwards holds every feature.
  std::vector<torch::Tensor> round(int64_t gamma, double min_confidence, int64_t width, double min_expand) {
    const int64_t have = count_, n = have - cached_, length = tokens_.size();
    const int64_t assumed = std::max<int64_t>(0, length - (have + 1));
    auto feats = torch::from_blob(feats_.data() + (cached_ - first_) * d_, {n, d_}, torch::kFloat32);
    auto next = torch::from_blob(tokens_.data() + cached_ + 1, {n}, torch::kLong);
    auto forced = torch::from_blob(tokens_.data() + have + 1, {assumed}, torch::kLong);
    const bool prev = n == 0;
    TORCH_CHECK(!prev || pred_.defined(), "draft: no features since the start");
    reserve(cached_ + n + assumed + gamma * std::max<int64_t>(1, width));
    auto res = head_.draft(feats, next, {n}, {forced}, {kv_}, {cached_}, {prev ? pred_ : torch::Tensor()},
                           {prev ? logits_ : torch::Tensor()}, gamma, min_confidence, width, min_expand)[0];
    cached_ = first_ = count_;  // every feature is in the head's cache now
    feats_.clear();
    pred_ = res[0];
    logits_ = res[1];
    return res;
  }

  void put(int64_t start, const torch::Tensor& features) {
    TORCH_CHECK(features.dim() == 2 && features.size(1) == d_, "features must be [n, hidden]");
    TORCH_CHECK(start <= count_, "features start at position ", start, "; the head has ", count_);
    TORCH_CHECK(start >= first_, "features start at position ", start, ", before ", first_, ", which the head's cache holds");
    const int64_t end = start + features.size(0);
    TORCH_CHECK(end <= length() - 1, "features up to position ", end, " for ", length(),
                " tokens: the last committed token has no feature yet");
    feats_.resize((end - first_) * d_);
    auto f = features.to(torch::kFloat32).contiguous();
    std::memcpy(feats_.data() + (start - first_) * d_, f.data_ptr<float>(), f.numel() * 4);
    count_ = end;
    cached_ = std::min(cached_, start);
  }

  // Room for positions [0, end): the cache at least doubles (the first positions kept).
  void reserve(int64_t end) {
    TORCH_CHECK(end <= max_positions_, end, " positions exceed the context of ", max_positions_);
    const int64_t capacity = kv_.size(2);
    if (end <= capacity) return;
    auto kv = torch::empty({1, 2, std::min(max_positions_, std::max({end, 2 * capacity, int64_t{256}})), kv_.size(3),
                            kv_.size(4)}, kv_.options());
    kv.narrow(2, 0, cached_).copy_(kv_.narrow(2, 0, cached_));
    kv_ = kv;
  }

  DraftHead& head_;
  int64_t max_positions_, d_;
  torch::Tensor kv_, pred_, logits_;
  std::vector<int64_t> tokens_;
  std::vector<float> feats_;  // [count - first, hidden]
  int64_t count_ = 0, cached_ = 0, first_ = 0;
};