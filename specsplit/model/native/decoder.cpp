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
#include <omp.h>

// The instruction set this build is for (native/__init__.py compiles one library per set). Arm
// builds the AVX2 path's code on NEON (neon_avx2.h: the intrinsics it uses, with their semantics).
#if defined(__AVX512F__)
#include <immintrin.h>
#define SPECSPLIT_AVX512 1
#define SPECSPLIT_ISA "avx512"
#elif defined(__aarch64__)
#include "neon_avx2.h"
#define SPECSPLIT_AVX512 0
#define SPECSPLIT_ISA "neon"
#else
#include <immintrin.h>
#define SPECSPLIT_AVX512 0
#define SPECSPLIT_ISA "avx2"
#endif

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// The parts, in dependency order (each included once, here, inside this anonymous namespace).
#include "common.h"
#include "panels.h"
#include "packing.h"
#include "rows.h"
#include "scratch.h"
#if SPECSPLIT_AVX512
#include "isa_avx512.h"
#include "attention_avx512.h"
#include "attention_amx.h"
#else
#include "isa_avx2.h"
#include "attention_avx2.h"
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

  // A draft head's rows for several sequences in one forward (as forward_batch with rows: x is
  // [sum of counts, hidden] fp32), the hidden rows kept in fp32: (logits of the head rows, hidden).
  using Tensors = std::vector<torch::Tensor>;
  using Ints = std::vector<int64_t>;
  std::pair<torch::Tensor, std::vector<float>> forward_f32(std::vector<float>& x, const Tensors& caches, const Ints& starts,
                                                           const Ints& counts, const Ints& heads, const Tensors& trees,
                                                           const Ints& bases, const Tensors& slot_parents) {
    Scratch s;
    for (size_t i = 0; i < caches.size(); ++i)
      add_segment(s, caches[i], counts[i], starts[i], heads[i], trees[i], bases[i], slot_parents[i]);
    auto out = run(x, s);
    return {out[0], std::move(s.a)};
  }

  // A quantized output head's few best logits a row computed again from these rows ([head rows,
  // hidden], bfloat16; empty: none): a draft head's picks as a float head would make them for a few
  // dot products a row (on the default target's head, q4_0 rows moved the step-1 pick off the
  // target's token at 0.011 of held-out positions more than q8_0 rows did).
  void set_exact_head(torch::Tensor rows) {
    if (!rows.defined() || rows.numel() == 0) {  // none: the packed rows' logits as they are
      exact_ = torch::Tensor();
      return;
    }
    TORCH_CHECK(rows.dim() == 2 && rows.size(0) == head_.n && rows.size(1) == hidden_,
                "exact head rows must be [head rows, hidden]");
    TORCH_CHECK(rows.scalar_type() == torch::kBFloat16, "exact head rows must be bfloat16");
    exact_ = rows.contiguous();
  }

  int64_t hidden() const { return hidden_; }
  const Packed& output_head() const { return head_; }
  Act act() const { return act_; }

 private:
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
    attention().plan_runs(s);
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
        if (exact_.defined()) refine_team(exact_, picked.data(), rows, width, out);
        argmax_team(out, rows, head_.n, part_v, part_i, choices.data_ptr<int64_t>());
      }
    }
    auto hidden = torch::from_blob(s.a.data(), {n, width}, torch::kFloat32).to(embed_.scalar_type(), false, true);
    return {logits, hidden, choices};
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
      attention().attend_amx_team(li, s.qkv.data(), ld, s, s.att.data());
    else
#endif
      attention().attend_team(li, s.qkv.data(), ld, s, s.att.data());
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

  Attention attention() const { return Attention{{heads_, kv_heads_, d_, bf16_}}; }

  int64_t heads_, kv_heads_, d_, hidden_ = 0;
  float eps_;
  bool bf16_ = true, attn_amx_ = false;
  Act act_ = Act::kBF16;
  torch::Tensor embed_, cos_, sin_, norm_;
  Packed head_;
  torch::Tensor exact_;  // set_exact_head's rows (undefined: the head's logits as its packed rows give them)
  std::vector<Layer> layers_;
};

#include "draft.h"

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
      .def("buffers", &Weight::buffers)
      .def_property_readonly("outputs", &Weight::outputs)
      .def_property_readonly("amx", &Weight::on_amx)
      .def_property_readonly("kind", &Weight::kind_name)
      .def_property_readonly("inputs", &Weight::inputs);
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, const Weight&, bool>())
      .def("add_layer", &Decoder::add_layer)
      .def("set_exact_head", &Decoder::set_exact_head)
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_rows", &Decoder::forward_rows, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_batch", &Decoder::forward_batch, pybind11::call_guard<pybind11::gil_scoped_release>())
;
  pybind11::class_<DraftHead>(m, "DraftHead")
      .def(pybind11::init<Decoder&, const Weight&, torch::Tensor, torch::Tensor>(), pybind11::keep_alive<1, 2>())
      .def("draft", &DraftHead::draft, pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<HeadSequence>(m, "HeadSequence")
      .def(pybind11::init<DraftHead&, int64_t, torch::Tensor>(), pybind11::keep_alive<1, 2>())
      .def("begin", &HeadSequence::begin, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("follow", &HeadSequence::follow, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("draft", &HeadSequence::draft, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("draft_tree", &HeadSequence::draft_tree, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("length", &HeadSequence::length);
}
