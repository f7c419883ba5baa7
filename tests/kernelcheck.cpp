// The AVX2 path's kernels (specsplit/model/native/isa_avx2.h) with no torch, for one instruction set:
// built for x86-64 with AVX2, or for aarch64 where they run on NEON (neon_avx2.h), so that
// tests/test_kernelcheck.py can run the aarch64 build under qemu-user and compare its bits with the
// x86 build's on the same packed weights.
//
// Usage: kernelcheck CASES OUT. CASES holds weights as packing.h packed them (Weight.buffers) and
// input rows; OUT gets, per case, float32: the GEMM of all rows in one call, the same rows one call
// each, RMS norm of the inputs, SiLU(gate) * up of the outputs (when they pair up), each output
// row's argmax (as float) and its sum of exp(y - max). Then attention cases (a cache, queries and
// each query's key list): the attention of all rows in one call, then of each row alone.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__aarch64__)
#include "neon_avx2.h"
#else
#include <immintrin.h>
#endif

namespace {
#include "common.h"
#include "panels.h"
#include "rows.h"
#include "scratch.h"
#include "isa_avx2.h"
#include "attention_avx2.h"
}  // namespace

namespace {

struct Reader {
  FILE* f;
  int64_t i64() {
    int64_t v = 0;
    if (std::fread(&v, 8, 1, f) != 1) throw std::runtime_error("truncated case file");
    return v;
  }
  std::vector<char> bytes(int64_t n) {
    std::vector<char> b(n);
    if (n && std::fread(b.data(), 1, n, f) != static_cast<size_t>(n)) throw std::runtime_error("truncated case file");
    return b;
  }
};

void put(FILE* out, const std::vector<float>& v) { std::fwrite(v.data(), 4, v.size(), out); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CASES OUT\n", argv[0]);
    return 2;
  }
  Reader in{std::fopen(argv[1], "rb")};
  FILE* out = std::fopen(argv[2], "wb");
  if (!in.f || !out) {
    std::perror("open");
    return 2;
  }
  try {
    const int64_t cases = in.i64();
    for (int64_t c = 0; c < cases; ++c) {
      Packed p;
      p.kind = static_cast<Kind>(in.i64());
      p.meta = static_cast<Meta>(in.i64());
      p.n = in.i64();
      p.k = in.i64();
      p.k2 = in.i64();
      const int64_t rows = in.i64();
      const Act act = static_cast<Act>(in.i64());
      std::map<std::string, std::vector<char>> bufs;
      for (int64_t b = in.i64(); b > 0; --b) {
        const auto name = in.bytes(in.i64());
        bufs[std::string(name.begin(), name.end())] = in.bytes(in.i64());
      }
      auto at = [&](const char* name) -> const void* {
        auto it = bufs.find(name);
        return it == bufs.end() ? nullptr : it->second.data();
      };
      p.ptr = at("ptr");
      p.scale_ptr = static_cast<const float*>(at("scale_ptr"));
      p.block_scale = at("block_scale");
      p.block_min = at("block_min");
      p.scale_base_ptr = static_cast<const uint16_t*>(at("scale_base_ptr"));
      p.min_base_ptr = static_cast<const uint16_t*>(at("min_base_ptr"));
      const auto raw = in.bytes(rows * p.k * 4);
      std::vector<float> x(rows * p.k);
      std::memcpy(x.data(), raw.data(), raw.size());

      Rows r;
      to_rows(x.data(), rows, p.k, act, r);
      std::vector<float> y(rows * p.n), alone(rows * p.n);
      gemm_team(p, r, rows, y.data());
      for (int64_t i = 0; i < rows; ++i) {
        Rows one;
        to_rows(x.data() + i * p.k, 1, p.k, act, one);
        gemm_team(p, one, 1, alone.data() + i * p.n);
      }
      put(out, y);
      put(out, alone);

      std::vector<float> normed(rows * p.k), weight(x.begin(), x.begin() + p.k);
      rms_norm(x.data(), weight.data(), rows, p.k, 1e-5f, normed.data());
      put(out, normed);
      if (p.n % (2 * kLanes) == 0) {
        std::vector<float> h(rows * p.n / 2);
        for (int64_t i = 0; i < rows; ++i) silu_mul(y.data() + i * p.n, h.data() + i * p.n / 2, p.n / 2);
        put(out, h);
      }
      std::vector<float> picks;
      for (int64_t i = 0; i < rows; ++i) {
        float best;
        int64_t where;
        argmax_span(y.data() + i * p.n, 0, p.n, best, where);
        picks.push_back(static_cast<float>(where));
        picks.push_back(sum_exp(y.data() + i * p.n, p.n, best));
      }
      put(out, picks);
    }
    const int64_t attention = in.i64();
    for (int64_t c = 0; c < attention; ++c) {
      AttendShape shape{};
      shape.heads = in.i64();
      shape.kv_heads = in.i64();
      shape.d = in.i64();
      shape.bf16 = in.i64() != 0;
      const int64_t rows = in.i64(), cap = in.i64();
      const auto kv = in.bytes(2 * cap * shape.kv_heads * shape.d * (shape.bf16 ? 2 : 4));
      std::vector<std::vector<int64_t>> paths(rows);
      std::vector<AttendRow> attend(rows);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t base = in.i64();
        for (int64_t k = in.i64(); k > 0; --k) paths[r].push_back(in.i64());
        attend[r] = AttendRow{kv.data(), cap, base, &paths[r]};
      }
      const int64_t ld = (shape.heads + 2 * shape.kv_heads) * shape.d, width = shape.heads * shape.d;
      const auto raw = in.bytes(rows * ld * 4);
      std::vector<float> qkv(rows * ld);
      std::memcpy(qkv.data(), raw.data(), raw.size());
      std::vector<float> all(rows * width), alone(rows * width);
      attend_rows_team(shape, qkv.data(), ld, attend.data(), rows, all.data());
      for (int64_t r = 0; r < rows; ++r)
        attend_rows_team(shape, qkv.data() + r * ld, ld, attend.data() + r, 1, alone.data() + r * width);
      put(out, all);
      put(out, alone);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernelcheck: %s\n", e.what());
    return 1;
  }
  std::fclose(out);
  return 0;
}
