// The kernel core's test harness: plain C++, no PyTorch, so any compiler for any ISA builds it
// (aarch64 cross-compiled and run under qemu-user in the tests). It runs every kernel on random
// inputs of its own making (a fixed generator: the same inputs on every machine) and prints one
// line per case, "<case> <hash of the output's bytes>": builds for different ISAs must print the
// same lines. It also checks width invariance itself (a row alone against the row in any block)
// and that attention's, a layer's and EAGLE's drafting's bits do not depend on how their loops are
// cut over threads, and prints "FAIL ..." where either breaks.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/accept.h"
#include "core/eagle.h"
#include "core/gguf.h"
#include "core/layer.h"

namespace {

struct Random {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) { return lo + (hi - lo) * float(next() >> 40) / float(1ull << 24); }
  std::vector<float> floats(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(lo, hi);
    return v;
  }
};

template <typename T>
uint64_t fnv(const T* p, size_t n) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n * sizeof(T); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

int failures = 0;

template <typename T>
void report(const std::string& name, const std::vector<T>& out) {
  std::printf("%s %016llx\n", name.c_str(), static_cast<unsigned long long>(fnv(out.data(), out.size())));
}

// a packed weight of random codes, scales and mins (float mode's layout: quant.h)
std::vector<uint8_t> random_packed(Random& rng, int64_t N, int64_t K, int bits) {
  const int64_t groups = (N + spk::GROUP - 1) / spk::GROUP, blocks = K / spk::BLOCK, rec = spk::record_bytes(bits);
  std::vector<uint8_t> p(groups * blocks * spk::GROUP * rec);
  for (size_t i = 0; i < p.size(); i += rec) {
    const float scale = rng.uniform(0.001f, 0.05f), min = bits == 4 ? rng.uniform(-0.4f, 0.0f) : 0.0f;
    std::memcpy(&p[i], &scale, 4);
    std::memcpy(&p[i + 4], &min, 4);
    for (int64_t j = 8; j < rec; ++j) p[i + j] = static_cast<uint8_t>(rng.next());
  }
  return p;
}

// a packed weight of the int8 kernels' layout (q8.h): random codes, scales and mins (float32, or
// float16: random bits of a finite half, subnormals included)
std::vector<uint8_t> random_q8_packed(Random& rng, int64_t N, int64_t K, int bits, bool half) {
  const int64_t groups = (N + spk::Q8_GROUP - 1) / spk::Q8_GROUP, blocks = K / spk::BLOCK;
  const int64_t bytes = spk::q8_block_bytes(bits, half), sb = spk::q8_scale_bytes(half);
  std::vector<uint8_t> p(groups * blocks * bytes);
  for (int64_t i = 0; i < groups * blocks; ++i) {
    uint8_t* b = &p[i * bytes];
    for (int o = 0; o < 16; ++o) {
      if (half) {  // exponents up to 2^-1 (0x3BFF): sums stay finite
        const uint16_t scale = static_cast<uint16_t>(rng.next() % 0x3C00), min = static_cast<uint16_t>(0x8000 | rng.next() % 0x3C00);
        std::memcpy(b + 2 * o, &scale, 2);
        if (bits == 4) std::memcpy(b + sb + 2 * o, &min, 2);
        continue;
      }
      const float scale = rng.uniform(0.001f, 0.05f), min = rng.uniform(-0.4f, 0.0f);
      std::memcpy(b + 4 * o, &scale, 4);
      if (bits == 4) std::memcpy(b + sb + 4 * o, &min, 4);
    }
    for (int64_t j = bits == 4 ? 2 * sb : sb; j < bytes; ++j) b[j] = static_cast<uint8_t>(rng.next());
  }
  return p;
}

// a loop's items in two chunks (as two threads take them) and one by one, run in turn
void halves_for(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  if (n > 0) body(0, (n + 1) / 2);
  if (n > 1) body((n + 1) / 2, n);
}
void ones_for(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  for (int64_t i = 0; i < n; ++i) body(i, i + 1);
}
// a launcher as a pool gives one: index 0 on the calling thread, each other on a thread of its own
void threads_for(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  std::vector<std::thread> members;
  for (int64_t i = 1; i < n; ++i) members.emplace_back([&body, i] { body(i, i + 1); });
  body(0, n > 0 ? 1 : 0);
  for (auto& m : members) m.join();
}

void check_rows(const std::string& name, const std::vector<float>& block, const std::vector<float>& alone) {
  if (block != alone) {
    std::printf("FAIL %s: a row's bits depend on the block\n", name.c_str());
    ++failures;
  }
}

// int8: q8.h's kernels (half: its float16 scales), else quant.h's
void linears(Random& rng, bool int8, bool half = false) {
  const int64_t shapes[][2] = {{150, 544}, {64, 32}, {13, 64}, {96, 1536}};
  for (int bits : {4, 8})
    for (const auto& s : shapes) {
      const int64_t N = s[0], K = s[1];
      const auto packed = int8 ? random_q8_packed(rng, N, K, bits, half) : random_packed(rng, N, K, bits);
      const auto bias = rng.floats(N, -1, 1);
      const spk::Linear l{{packed.data(), N, K, bits}, bias.data(), int8, half};
      const int64_t M = 19;
      const auto x = rng.floats(M * K, -2, 2);
      std::vector<float> alone(M * N);
      for (int64_t r = 0; r < M; ++r) spk::apply(l, x.data() + r * K, 1, alone.data() + r * N, spk::serial_for);
      const std::string name = std::string(int8 ? (half ? "int8 half-scales " : "int8 ") : "") + "linear q" + std::to_string(bits) + " " + std::to_string(N) + "x" + std::to_string(K);
      for (int64_t m : {2, 3, 4, 5, 6, 7, 8, 9, 16, 19}) {
        std::vector<float> y(m * N);
        spk::apply(l, x.data(), m, y.data(), spk::serial_for);
        check_rows(name + " rows " + std::to_string(m), y, std::vector<float>(alone.begin(), alone.begin() + m * N));
      }
      report(name, alone);
    }
}

// bits 32: a float32 weight as a model holds it. Its bits in any block width, and those of quant.h's
// blocks where the weight is their dequantised one (w = fma(code, scale, min)).
// Random blocks of a GGUF type: random bytes with its float16 fields finite and small (either sign,
// subnormals included), as quantized.random_gguf_blocks makes them
std::vector<uint8_t> random_gguf(Random& rng, int type, int64_t N, int64_t K) {
  const spk::GGUFBlock blk = spk::gguf_block(type);
  std::vector<uint8_t> raw(N * K / blk.inputs * blk.bytes);
  for (auto& b : raw) b = static_cast<uint8_t>(rng.next());
  std::vector<int> halves;
  switch (type) {
    case spk::GGML_Q4_1: case spk::GGML_Q5_1: case spk::GGML_Q4_K: case spk::GGML_Q5_K: halves = {0, 2}; break;
    case spk::GGML_Q2_K: halves = {80, 82}; break;
    case spk::GGML_Q3_K: halves = {108}; break;
    case spk::GGML_Q6_K: halves = {208}; break;
    default: halves = {0};
  }
  for (size_t at = 0; at < raw.size(); at += blk.bytes)
    for (int h : halves) {
      const uint16_t v = static_cast<uint16_t>((rng.next() % 0x2000) | (rng.next() % 2) << 15);
      std::memcpy(&raw[at + h], &v, 2);
    }
  return raw;
}

// Every GGUF block type the int8 kernels take: its blocks repacked (core/gguf.h), its rows
// dequantized, and the int8 linear over them at many widths; q/k/v of two types side by side
// (Q4_K_M's Q4_K q and k beside a Q6_K v) as one linear
void gguf_linears(Random& rng) {
  const int types[] = {spk::GGML_Q4_0, spk::GGML_Q4_1, spk::GGML_Q5_0, spk::GGML_Q5_1, spk::GGML_Q8_0, spk::GGML_Q2_K,
                       spk::GGML_Q3_K, spk::GGML_Q4_K, spk::GGML_Q5_K, spk::GGML_Q6_K, spk::GGML_IQ4_NL, spk::GGML_IQ4_XS};
  const int64_t K = 512, M = 11;
  auto pack = [&](int type, int64_t N) {
    const auto raw = random_gguf(rng, type, N, K);
    std::vector<uint8_t> packed((N + 15) / 16 * spk::q8_group_bytes(spk::gguf_q8_kind(type), true, K));
    if (!spk::gguf_pack_q8(type, raw.data(), N, K, packed.data())) {
      std::printf("FAIL gguf type %d: not repacked\n", type);
      ++failures;
    }
    return packed;
  };
  auto run = [&](const std::string& name, const spk::Linear& l) {
    const int64_t N = l.N();
    const auto x = rng.floats(M * K, -2, 2);
    std::vector<float> alone(M * N);
    for (int64_t r = 0; r < M; ++r) spk::apply(l, x.data() + r * K, 1, alone.data() + r * N, spk::serial_for);
    for (int64_t m : {2, 3, 4, 5, 6, 7, 8, 9, 11}) {
      std::vector<float> y(m * N);
      spk::apply(l, x.data(), m, y.data(), halves_for);
      check_rows(name + " rows " + std::to_string(m), y, std::vector<float>(alone.begin(), alone.begin() + m * N));
    }
    report(name, alone);
  };
  for (int type : types) {
    const int64_t N = 37;
    const auto packed = pack(type, N);
    const int kind = spk::gguf_q8_kind(type);
    const spk::Q8Weights w{packed.data(), N, K, kind, true};
    std::vector<float> rows(N * K);
    for (int64_t n = 0; n < N; ++n) spk::q8_dequantize_row(w, n, rows.data() + n * K);
    report("gguf type " + std::to_string(type) + " dequantized", rows);
    const auto bias = rng.floats(N, -1, 1);
    const spk::Linear l{{packed.data(), N, K, kind}, bias.data(), true, true};
    run("gguf type " + std::to_string(type) + " int8 linear", l);
    if (spk::q8_offset(kind)) {  // 5- and 6-bit codes less an offset: the integer sums of 8-bit ones, the same bits
      const auto raw = random_gguf(rng, type, N, K);
      const int wide_kind = kind == spk::Q8_D5 ? spk::Q8_D8 : spk::Q8_K8S2;
      std::vector<uint8_t> narrow(packed.size()), wide((N + 15) / 16 * spk::q8_group_bytes(wide_kind, true, K));
      spk::gguf_pack_q8(type, raw.data(), N, K, narrow.data());
      const bool packed_wide = spk::gguf_pack_q8(type, raw.data(), N, K, wide.data(), spk::serial_for, true);
      const auto x = rng.floats(5 * K, -2, 2);
      std::vector<float> a(5 * N), b(5 * N);
      spk::apply(spk::Linear{{narrow.data(), N, K, kind}, bias.data(), true, true}, x.data(), 5, a.data(), spk::serial_for);
      spk::apply(spk::Linear{{wide.data(), N, K, wide_kind}, bias.data(), true, true}, x.data(), 5, b.data(), spk::serial_for);
      if (!packed_wide || a != b) {
        std::printf("FAIL gguf type %d: its %d-bit codes do not give the 8-bit codes' bits\n", type, spk::q8_bits(kind));
        ++failures;
      }
    }
  }
  const auto q = pack(spk::GGML_Q4_K, 64), v = pack(spk::GGML_Q6_K, 21);
  const auto bias = rng.floats(85, -1, 1);
  spk::Linear qkv{{q.data(), 64, K, spk::Q8_K4}, bias.data(), true, true};
  qkv.n_more = 1, qkv.more[0] = {v.data(), 21, K, spk::gguf_q8_kind(spk::GGML_Q6_K), true};
  run("gguf Q4_K beside Q6_K int8 linear", qkv);
}

void dense_linears(Random& rng) {
  const int64_t shapes[][2] = {{150, 544}, {13, 64}, {96, 1536}};
  for (const auto& s : shapes) {
    const int64_t N = s[0], K = s[1], M = 19;
    const auto packed = random_packed(rng, N, K, 4);
    const spk::QWeights q{packed.data(), N, K, 4};
    std::vector<float> w(N * K);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t b = 0; b < q.blocks(); ++b) {
        const uint8_t* rec = q.record_of(n, b);
        float scale, min;
        std::memcpy(&scale, rec, 4);
        std::memcpy(&min, rec + 4, 4);
        spk::V16 lo, hi;
        spk::dequant<4>(rec + 8, scale, min, lo, hi);
        spk::store16(&w[n * K + b * spk::BLOCK], lo);
        spk::store16(&w[n * K + b * spk::BLOCK + 16], hi);
      }
    const auto bias = rng.floats(N, -1, 1), x = rng.floats(M * K, -2, 2);
    const spk::Linear dense{{reinterpret_cast<const uint8_t*>(w.data()), N, K, 32}, bias.data(), false};
    const spk::Linear blocks{q, bias.data(), false};
    const std::string name = "linear float32 " + std::to_string(N) + "x" + std::to_string(K);
    std::vector<float> alone(M * N), quant(M * N);
    for (int64_t r = 0; r < M; ++r) spk::apply(dense, x.data() + r * K, 1, alone.data() + r * N, spk::serial_for);
    for (int64_t m : {2, 3, 4, 5, 8, 19}) {
      std::vector<float> y(m * N);
      spk::apply(dense, x.data(), m, y.data(), spk::serial_for);
      check_rows(name + " rows " + std::to_string(m), y, std::vector<float>(alone.begin(), alone.begin() + m * N));
    }
    spk::apply(blocks, x.data(), M, quant.data(), spk::serial_for);
    if (quant != alone) {
      std::printf("FAIL %s: differs from its blocks' (the same weights)\n", name.c_str());
      ++failures;
    }
    report(name, alone);
    // bits 16: the weight cut to bfloat16 values, kept as bfloat16 (inputs j and 8 + j of each 16 side
    // by side: quant.h's layout): the bits of those values in float32
    std::vector<uint16_t> halves(N * K);
    for (int64_t i = 0; i < N * K; ++i) {
      uint32_t u;
      std::memcpy(&u, &w[i], 4);
      const int64_t j = i % 16, at = i - j + (j < 8 ? 2 * j : 2 * (j - 8) + 1);
      halves[at] = static_cast<uint16_t>(u >> 16);
      u &= 0xFFFF0000u;
      std::memcpy(&w[i], &u, 4);
    }
    const spk::Linear bf16{{reinterpret_cast<const uint8_t*>(halves.data()), N, K, 16}, bias.data(), false};
    std::vector<float> wide(M * N), narrow(M * N);
    spk::apply(dense, x.data(), M, wide.data(), spk::serial_for);
    for (int64_t r = 0; r < M; ++r) spk::apply(bf16, x.data() + r * K, 1, narrow.data() + r * N, spk::serial_for);
    std::vector<float> block(M * N);
    spk::apply(bf16, x.data(), M, block.data(), spk::serial_for);
    check_rows(name + " bfloat16 rows 19", block, narrow);
    if (narrow != wide) {
      std::printf("FAIL %s: bfloat16 weights differ from their float32 values\n", name.c_str());
      ++failures;
    }
    report(name + " bfloat16", narrow);
  }
}

// short: up to 4 blocks of keys (3 laid out ahead), a task a kv head; long: 300+ keys, whose few
// tasks attend spreads over the threads step by step
// (H, Hkv, D) = (6, 2, 64): three query heads a kv head, SmolLM2's head dim (weighed three heads at
// a time where the registers allow: AVX-512; two elsewhere)
// queries and output of T, keys and values of C (a float16 cache beside float32 queries: q8's, whose
// results must be those of a float32 cache holding the very same values). T_ queries a row: from
// 256, a prompt's block (its tasks take dozens of queries, and a 16-bit cache's values are widened once)
template <typename T, typename C = T>
void attention(Random& rng, const char* type, bool long_context, int64_t H = 4, int64_t Hkv = 2, int64_t D = 32,
               int64_t T_ = 5) {
  const int64_t B = 2, first = long_context ? 290 : 17, step = T_ > 16 ? 1 : 9;
  const int64_t S = std::max<int64_t>(long_context ? 340 : 72, first + step * T_ + B), W = S;
  std::vector<T> q(B * H * T_ * D), out(q.size());
  std::vector<C> k(B * Hkv * S * D), v(B * Hkv * S * D);
  for (auto& e : q) e = spk::from_float<T>(rng.uniform(-2, 2));
  for (auto* t : {&k, &v})
    for (auto& e : *t) e = spk::from_float<C>(rng.uniform(-2, 2));
  std::vector<int64_t> count(B * T_), slots(B * T_ * W);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t) {
      count[b * T_ + t] = first + step * t + b;
      for (int64_t x = 0; x < W; ++x) slots[(b * T_ + t) * W + x] = x < first ? x : (x * 7 + t) % S;  // a tree's own keys
    }
  const spk::AttentionShape sh{B, H, T_, D, Hkv, S, W};
  const spk::Strided4<const T> qs{q.data(), H * T_ * D, T_ * D, D, 1};
  const spk::Strided4<const C> ks{k.data(), Hkv * S * D, S * D, D, 1}, vs{v.data(), Hkv * S * D, S * D, D, 1};
  const spk::Strided4<T> os{out.data(), H * T_ * D, T_ * D, D, 1};
  const std::string name = std::string(long_context ? "long " : "") + type + (H == 4 ? "" : " 3 heads a kv head") +
                           (T_ > 16 ? " prompt block" : "");
  for (const bool tree : {false, true}) {
    const int64_t* sl = tree ? slots.data() : nullptr;
    spk::attend(sh, qs, ks, vs, sl, count.data(), 0.125f, os, spk::serial_for);
    report(std::string("attention ") + (tree ? "tree " : "chain ") + name, out);
    if constexpr (!std::is_same_v<T, C>) {  // the cache's values widened to T: the same bits
      std::vector<T> kw(k.size()), vw(v.size()), wide(out.size());
      for (size_t i = 0; i < k.size(); ++i) kw[i] = spk::from_float<T>(spk::to_float(k[i]));
      for (size_t i = 0; i < v.size(); ++i) vw[i] = spk::from_float<T>(spk::to_float(v[i]));
      const spk::Strided4<const T> kws{kw.data(), Hkv * S * D, S * D, D, 1}, vws{vw.data(), Hkv * S * D, S * D, D, 1};
      spk::attend(sh, qs, kws, vws, sl, count.data(), 0.125f, spk::Strided4<T>{wide.data(), H * T_ * D, T_ * D, D, 1},
                  spk::serial_for);
      if (std::memcmp(wide.data(), out.data(), out.size() * sizeof(T)) != 0) {
        std::printf("FAIL attention %s: differs from its cache's values widened\n", name.c_str());
        ++failures;
      }
    }
    // the loops cut as threads would take them (a call's items in one chunk, in two, one by one)
    for (const spk::ParallelFor& split : {spk::ParallelFor(halves_for), spk::ParallelFor(ones_for)}) {
      std::vector<T> again(out.size());
      const spk::Strided4<T> as{again.data(), H * T_ * D, T_ * D, D, 1};
      spk::attend(sh, qs, ks, vs, sl, count.data(), 0.125f, as, split);
      if (std::memcmp(again.data(), out.data(), out.size() * sizeof(T)) != 0) {
        std::printf("FAIL attention %s: the split of its loops changes its bits\n", name.c_str());
        ++failures;
      }
    }
  }
}

// floats rounded to halves by the ISA's vector conversion (q8's cache writes) against vector.h's:
// ties, subnormals, overflow, infinities and NaNs with payloads
void half_rounding(Random& rng) {
  std::vector<float> x;
  for (int i = 0; i < 4096; ++i) {
    const float scale[] = {1e-7f, 3e-5f, 1.0f, 300.0f, 7e4f};
    x.push_back(rng.uniform(-1, 1) * scale[i % 5]);
  }
  for (uint32_t bits : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC12345u, 0x7F80F001u, 0x33800000u, 0x33000000u,
                        0x3F801000u, 0x3F803000u, 0x477FF000u, 0x477FEFFFu, 0x387FC000u, 0x80000000u}) {
    float f;
    std::memcpy(&f, &bits, 4);
    x.push_back(f);
  }
  x.resize((x.size() + spk::NATIVE - 1) / spk::NATIVE * spk::NATIVE, 0.f);
  std::vector<uint16_t> vec(x.size()), ref(x.size());
  for (size_t i = 0; i < x.size(); i += spk::NATIVE) spk::store_halves_native(vec.data() + i, spk::vload<spk::vn>(x.data() + i));
  for (size_t i = 0; i < x.size(); ++i) ref[i] = spk::from_float<spk::f16>(x[i]).bits;
  if (vec != ref) {
    std::printf("FAIL float16 rounding: the vector conversion differs from vector.h's\n");
    ++failures;
  }
  report("float16 rounding", vec);
}

void layers(Random& rng) {
  const int64_t B = 2, T = 3, H = 64, heads = 4, kv = 2, D = 16, I = 128, S = 24;
  const auto pq = random_packed(rng, (heads + 2 * kv) * D, H, 4), po = random_packed(rng, H, heads * D, 8);
  const auto pg = random_packed(rng, 2 * I, H, 4), pd = random_packed(rng, H, I, 4);
  const auto bq = rng.floats((heads + 2 * kv) * D, -0.1f, 0.1f), zo = std::vector<float>(H, 0.f);
  const auto zg = std::vector<float>(2 * I, 0.f);
  const spk::Linear lq{{pq.data(), (heads + 2 * kv) * D, H, 4}, bq.data(), false};
  const spk::Linear lo{{po.data(), H, heads * D, 8}, zo.data(), false};
  const spk::Linear lg{{pg.data(), 2 * I, H, 4}, zg.data(), false}, ld{{pd.data(), H, I, 4}, zo.data(), false};
  const auto h = rng.floats(B * T * H, -1, 1), ln1 = rng.floats(H, 0.8f, 1.2f), ln2 = rng.floats(H, 0.8f, 1.2f);
  const auto cos = rng.floats(B * T * D, -1, 1), sin = rng.floats(B * T * D, -1, 1);
  std::vector<float> kc = rng.floats(B * kv * S * D, -1, 1), vc = rng.floats(B * kv * S * D, -1, 1);
  std::vector<int64_t> write_at(B * T), count(B * T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      write_at[b * T + t] = 10 + b + t;
      count[b * T + t] = 11 + b + t;
    }
  std::vector<float> out(B * T * H);
  const spk::LayerWeights w{ln1.data(), ln2.data(), 1e-5f, lq, lo, lg, ld};
  const spk::BlockAttention at{{kc.data(), vc.data(), kv * S * D, S * D, D, S}, write_at.data(), nullptr, 0,
                               count.data(), 0.25f};
  spk::layer(h.data(), B, T, H, w, cos.data(), sin.data(), heads, kv, D, at, out.data(), spk::serial_for);
  report("layer", out);
  report("layer cache", kc);
  // twice more, each loop shared by a team of 3 threads in one region: the same bits
  std::vector<float> team(out.size());
  for (int pass = 0; pass < 2; ++pass)
    spk::in_one_region(threads_for, 3, [&](const spk::ParallelFor& parallel) {
      spk::layer(h.data(), B, T, H, w, cos.data(), sin.data(), heads, kv, D, at, team.data(), parallel);
    });
  if (team != out) {
    std::printf("FAIL layer: a team's loops change its bits\n");
    ++failures;
  }
  {  // q8's float16 cache: the block's keys and values rounded to halves as they are written
    std::vector<spk::f16> kh(kc.size()), vh(vc.size());
    for (size_t i = 0; i < kc.size(); ++i) kh[i] = spk::from_float<spk::f16>(kc[i]), vh[i] = spk::from_float<spk::f16>(vc[i]);
    spk::BlockAttention half = at;
    half.caches = {kh.data(), vh.data(), kv * S * D, S * D, D, S, true};
    spk::layer(h.data(), B, T, H, w, cos.data(), sin.data(), heads, kv, D, half, out.data(), spk::serial_for);
    report("layer float16 cache", out);
    report("layer float16 cache written", kh);
  }
  std::vector<float> norm(B * T * H);
  spk::rms_norm(h.data(), B * T, H, ln1.data(), 1e-5f, norm.data());
  report("norm", norm);
  // EAGLE-3's first layer: q/k/v over [embeds, hidden] (twice the width), a tree's slots
  const auto pe = random_q8_packed(rng, (heads + 2 * kv) * D, 2 * H, 8, true);
  const spk::LayerWeights we{ln1.data(), ln2.data(), 1e-5f,
                             {{pe.data(), (heads + 2 * kv) * D, 2 * H, 8}, bq.data(), true, true},
                             lo, lg, ld};
  const auto hn = rng.floats(H, 0.8f, 1.2f), embeds = rng.floats(B * T * H, -1, 1);
  std::vector<int64_t> slots(B * T * S);
  for (int64_t i = 0; i < B * T; ++i)
    for (int64_t x = 0; x < S; ++x) slots[i * S + x] = x < 10 ? x : (x + 3 * i) % S;
  const spk::BlockAttention tree{{kc.data(), vc.data(), kv * S * D, S * D, D, S}, write_at.data(), slots.data(), S,
                                 count.data(), 0.25f};
  for (bool before : {false, true}) {
    spk::eagle_layer(embeds.data(), h.data(), B, T, H, we, hn.data(), before, cos.data(), sin.data(), heads, kv, D,
                     tree, out.data(), spk::serial_for);
    report(std::string("eagle layer") + (before ? " norm before residual" : ""), out);
  }
}

// row-wise work and an int8 linear over 40 rows, their loops shared by a team of 3 threads: the bits
// of one thread's
void rows_in_a_team(Random& rng) {
  const int64_t M = 40, K = 1536, N = 96;
  const auto x = rng.floats(M * K, -2, 2), w = rng.floats(K, 0.8f, 1.2f), bias = rng.floats(N, -1, 1);
  const auto packed = random_q8_packed(rng, N, K, 4, true);
  const spk::Linear l{{packed.data(), N, K, 4}, bias.data(), true, true};
  auto run = [&](const spk::ParallelFor& parallel) {
    std::vector<float> norm(M * K), y(M * N), roped(x);
    spk::rms_norm(x.data(), M, K, w.data(), 1e-5f, norm.data(), parallel);
    spk::rotary(roped.data(), M, K, x.data(), x.data() + M * 64, K / 64, 64, parallel);  // any values serve as cos, sin
    spk::Q8Rows q;
    spk::quantize_rows(x.data(), M, K, q, parallel);
    spk::apply(l, x.data(), M, y.data(), parallel);
    return std::vector<uint64_t>{fnv(norm.data(), norm.size()), fnv(roped.data(), roped.size()),
                                 fnv(q.q.data(), q.q.size()) ^ fnv(q.d.data(), q.d.size()), fnv(y.data(), y.size())};
  };
  const auto alone = run(spk::serial_for);
  std::vector<uint64_t> team;
  spk::in_one_region(threads_for, 3, [&](const spk::ParallelFor& parallel) { team = run(parallel); });
  if (team != alone) {
    std::printf("FAIL rows: a team's loops change their bits\n");
    ++failures;
  }
}

// EAGLE-3's drafting in one call (eagle.h, over q8's float16 cache): the catch-up block, a chain of
// head steps, each level's K most probable draft ids and log-probabilities (a log-softmax summed in
// double: libm's exp and log), the chain's tree (chain_best_first); the first row alone and a team
// of threads give the same bits
void eagle(Random& rng) {
  const int64_t B = 2, W = 3, H = 64, F = 3 * H, heads = 4, kv = 2, D = 16, I = 128, S = 24, V = 80, vocab = 120;
  const int64_t levels = 3, K = 4, Q = (heads + 2 * kv) * D;
  const auto pf = random_q8_packed(rng, H, F, 8, false), pq = random_q8_packed(rng, Q, 2 * H, 8, false);
  const auto po = random_q8_packed(rng, H, heads * D, 4, false), pg = random_q8_packed(rng, 2 * I, H, 4, false);
  const auto pd = random_q8_packed(rng, H, I, 4, false), ph = random_q8_packed(rng, V, H, 8, false);
  const auto bias = rng.floats(2 * I, -0.1f, 0.1f);  // every linear's bias: its first N
  const spk::Linear fc{{pf.data(), H, F, 8}, bias.data(), true}, head{{ph.data(), V, H, 8}, bias.data(), true};
  const auto ln1 = rng.floats(H, 0.8f, 1.2f), ln2 = rng.floats(H, 0.8f, 1.2f), hn = rng.floats(H, 0.8f, 1.2f);
  const auto fin = rng.floats(F, 0.8f, 1.2f), embed = rng.floats(vocab * H, -1, 1);
  const auto norm = rng.floats(H, 0.02f, 0.06f);  // small: draft logits a few units apart, not hundreds
  const spk::LayerWeights w{ln1.data(), ln2.data(), 1e-5f, {{pq.data(), Q, 2 * H, 8}, bias.data(), true},
                            {{po.data(), H, heads * D, 4}, bias.data(), true},
                            {{pg.data(), 2 * I, H, 4}, bias.data(), true}, {{pd.data(), H, I, 4}, bias.data(), true}};
  std::vector<int64_t> d2t(V);
  std::vector<uint8_t> outside(V);
  for (int64_t d = 0; d < V; ++d) d2t[d] = d * 37 % (vocab - V), outside[d] = d % 13 == 5;
  std::vector<spk::f16> k0(B * kv * S * D), v0(k0.size());
  for (size_t i = 0; i < k0.size(); ++i)
    k0[i] = spk::from_float<spk::f16>(rng.uniform(-1, 1)), v0[i] = spk::from_float<spk::f16>(rng.uniform(-1, 1));
  const auto feats = rng.floats(B * W * F, -1, 1), cos = rng.floats(B * W * D, -1, 1), sin = rng.floats(B * W * D, -1, 1);
  const auto step_cos = rng.floats((levels - 1) * B * D, -1, 1), step_sin = rng.floats((levels - 1) * B * D, -1, 1);
  std::vector<int64_t> tokens(B * W), write_at(B * W), count(B * W), last{W - 1, 1}, base(B);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < W; ++j) {
      tokens[b * W + j] = static_cast<int64_t>(rng.next() % vocab);
      write_at[b * W + j] = 5 + 3 * b + j, count[b * W + j] = 6 + 3 * b + j;
    }
    base[b] = 5 + 3 * b + W;
  }
  for (const bool mapped : {false, true}) {
    const spk::EagleHead e{w, hn.data(), mapped, heads, kv, D, 0.25f, norm.data(), 1e-5f, mapped, head,
                           mapped ? d2t.data() : nullptr, mapped ? outside.data() : nullptr, embed.data(), vocab};
    // rows [0, rows) of the block (row 0 alone: its own cache row, the same first rows of every input)
    auto run = [&](int64_t rows, const spk::ParallelFor& parallel, std::vector<spk::f16>& kc,
                   std::vector<int64_t>& ids, std::vector<float>& lp) {
      std::vector<spk::f16> vc(v0.begin(), v0.begin() + rows * kv * S * D);
      kc.assign(k0.begin(), k0.begin() + rows * kv * S * D);
      const spk::LayerCaches caches{kc.data(), vc.data(), kv * S * D, S * D, D, S, true};
      std::vector<float> cs((levels - 1) * rows * D), sn(cs.size());
      for (int64_t j = 0; j + 1 < levels; ++j)  // the steps' rotary rows [levels - 1, rows, D]
        for (int64_t b = 0; b < rows; ++b)
          for (int64_t d = 0; d < D; ++d)
            cs[(j * rows + b) * D + d] = step_cos[(j * B + b) * D + d], sn[(j * rows + b) * D + d] = step_sin[(j * B + b) * D + d];
      const spk::ChainCatchUp c{feats.data(), tokens.data(), F, mapped ? fin.data() : nullptr, fc, cos.data(), sin.data(),
                                write_at.data(), count.data(), last.data()};
      const spk::ChainSteps st{cs.data(), sn.data(), base.data(), levels, K, 0.0f};
      ids.assign(rows * levels * K, 0), lp.assign(rows * levels * K, 0.f);
      spk::eagle_chain(e, caches, rows, W, H, c, st, ids.data(), lp.data(), parallel);
    };
    const std::string name = std::string("eagle chain") + (mapped ? " mapped" : "");
    std::vector<spk::f16> kc, k1, kt;
    std::vector<int64_t> ids, ids1, idst;
    std::vector<float> lp, lp1, lpt;
    run(B, spk::serial_for, kc, ids, lp);
    report(name + " ids", ids);
    report(name + " log-probabilities", lp);
    report(name + " cache written", kc);
    run(1, spk::serial_for, k1, ids1, lp1);
    spk::in_one_region(threads_for, 3, [&](const spk::ParallelFor& parallel) { run(B, parallel, kt, idst, lpt); });
    if (!std::equal(ids1.begin(), ids1.end(), ids.begin()) || !std::equal(lp1.begin(), lp1.end(), lp.begin()) ||
        idst != ids || lpt != lp) {
      std::printf("FAIL %s: a row's bits depend on the other rows or the threads\n", name.c_str());
      ++failures;
    }
    const int64_t n = 7;  // of the chain's 12 candidates
    std::vector<int64_t> tree(n), parents(n);
    std::vector<float> probs(n);
    spk::chain_best_first(ids.data(), lp.data(), levels, K, n, mapped ? d2t.data() : nullptr, tree.data(),
                          parents.data(), probs.data());
    report(name + " tree", tree);
    report(name + " tree parents", parents);
    report(name + " tree probabilities", probs);
  }
  // greedy acceptance (accept.h): a chain and a tree walked against the target's choices
  const std::vector<int64_t> choice{4, 7, 1, 9, 2}, chain{4, 7, 3, 9}, tree{4, 5, 7, 1, 6}, parents{-1, -1, 0, 2, 2};
  std::vector<int64_t> path(5), walked;
  walked.push_back(spk::greedy_walk(choice.data(), chain.data(), nullptr, 4, 4, path.data()));
  walked.insert(walked.end(), path.begin(), path.begin() + 4);
  walked.push_back(spk::greedy_walk(choice.data(), tree.data(), parents.data(), 5, 5, path.data()));
  walked.insert(walked.end(), path.begin(), path.end());
  report("greedy walk", walked);
}

}  // namespace

int main() {
  Random rng{42};
  std::printf("isa %s\n", spk::ISA);
  linears(rng, false);
  linears(rng, true);
  linears(rng, true, true);
  dense_linears(rng);
  gguf_linears(rng);
  for (const bool long_context : {false, true}) {
    attention<float>(rng, "float32", long_context);
    attention<spk::bf16>(rng, "bfloat16", long_context);
    attention<spk::f16>(rng, "float16", long_context);
    attention<float, spk::f16>(rng, "float16 cache", long_context);
  }
  half_rounding(rng);
  layers(rng);
  for (const bool long_context : {false, true}) {
    attention<float>(rng, "float32", long_context, 6, 2, 64);
    attention<float, spk::f16>(rng, "float16 cache", long_context, 6, 2, 64);
  }
  attention<float, spk::f16>(rng, "float16 cache", false, 6, 2, 64, 260);
  rows_in_a_team(rng);
  eagle(rng);
  return failures ? 1 : 0;
}
