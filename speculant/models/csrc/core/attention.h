// Width-invariant attention for the CPU: each query over exactly its own keys, in text order.
//
// A query's result is computed by operations whose order depends on nothing but that query's key
// count n: its scores (dot products summed in 16 fixed lanes, then a fixed tree), a float32 softmax
// summed key after key, and its probability-weighted values summed key after key. So a query gets
// the same bits whether it is a one-token step, a row of a verify block, a node of a token tree (its
// keys gathered by ``slots`` into text order) or a row beside other requests: the property
// speculative decoding needs to keep plain decoding's text, by construction. Queries of one row and
// kv head are taken together only to read each key once; their sums stay their own.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "vector.h"

namespace spk {

// queries a task takes together: each key is read (and laid out a key per lane) once for them. More
// for long blocks (a prompt), where laying keys out would otherwise cost more than scoring them, as
// long as their scores stay within SCORES_HELD floats. Which queries share a task changes no bits.
constexpr int64_t QUERIES = 8, QUERIES_LONG = 64, SCORES_HELD = int64_t(1) << 22;
constexpr int64_t MAX_D = 256;  // head dims up to this, in whole vectors
// the weighted values ask for the value row this many keys on (its half, where by halves): a thread
// otherwise waits on each row (8 and 16 alike; with AVX2's threes below, the attention at 1.5k keys
// ~7 % faster on a 2-core Zen 3)
constexpr int64_t VALUES_AHEAD = 16;
// how near the core those prefetches ask for the lines (__builtin_prefetch's locality). On AMD
// keys into L2 (below: measured best on a Zen 4) and values non-temporal (as timed on a Zen 3). On
// Intel (native.py defines SPK_CPU_INTEL) both into L1, as q8's weights there: prefetchnta stalled
// the values' loop. A 2-core Xeon (Emerald Rapids), a step's attention over 1,495 float16 keys in
// 30 layers (scripts/attention_core_ab.py, medians of 7 alternated runs): 3.28 ms as on AMD, 2.55
// with both into L1 (read cold: 5.06 -> 4.30; float32 keys 4.37 -> 3.20); 500 keys 10-14 % faster,
// 110 level. No bits change.
#if defined(SPK_CPU_INTEL)
constexpr int KEYS_LOCALITY = 3, VALUES_LOCALITY = 3;
#else
constexpr int KEYS_LOCALITY = 2, VALUES_LOCALITY = 0;
#endif

template <typename T>
struct Strided4 {  // a [B, H, T, D] tensor's data and strides (elements)
  T* data;
  int64_t s0, s1, s2, s3;
  T& at(int64_t a, int64_t b, int64_t c, int64_t d) const { return data[a * s0 + b * s1 + c * s2 + d * s3]; }
};

struct AttentionShape {
  int64_t B, H, T, D;  // queries [B, H, T, D]
  int64_t Hkv, S;      // keys and values [B, Hkv, S, D], contiguous along D
  int64_t W;           // slots [B, T, W] (0: query t's key x is slot x)
};

// Fewer tasks than SPREAD_TASKS over at least SPREAD_KEYS keys (a step or a short block over a long
// context has a task a kv head: 3 on 2 threads left one thread two of them) are spread over the
// threads step by step: the scores SPREAD_BLOCKS blocks of keys at a time, each row's softmax, the
// weighted values two or three heads at a time. Below 256 keys the two extra fork/joins cost what it saves.
constexpr int64_t SPREAD_TASKS = 16, SPREAD_KEYS = 256, SPREAD_BLOCKS = 4;

// NATIVE floats of a cache or query row: float32's as they are, 16-bit ones widened (exactly)
template <typename C>
inline vn load_native(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return vload<vn>(p);
  } else if constexpr (std::is_same_v<C, f16>) {
    return halves_native(reinterpret_cast<const uint16_t*>(p));
  } else {  // bfloat16: its bits are a float's upper half
    typedef uint16_t vh __attribute__((vector_size(NATIVE * sizeof(uint16_t))));
    typedef uint32_t vu __attribute__((vector_size(NATIVE * sizeof(uint32_t))));
    vh h;
    std::memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vn f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
}

// bytes a prefetch of a cache row steps by (a cache line)
constexpr int64_t LINE = 64;
// a 16-bit cache's values are widened once for a task of at least this many rows (a prompt's block,
// where each value is read by dozens of queries: widening it at every read made a 1.5k-token
// prefill 5 % slower); fewer rows read the cache's halves as they go (a step: half the bytes)
constexpr int64_t WIDEN_ROWS = 32;

// keys x0 .. x0 + LANES - 1 of a [S, D] cache with rows `stride` apart, a key per lane: kt[d * LANES
// + l] is key x0 + l's d (zeros past L). In NATIVE x NATIVE blocks transposed in registers (a
// one-token step lays out every key of its context: a float at a time, this took most of its
// attention's time), asking for the keys two blocks on meanwhile (KEYS_LOCALITY; on AMD into L2:
// 5-10 % faster than into L1 or non-temporal on a 1.5k-token context, a 2-core Zen 4).
template <typename C>
inline void lay_out_keys(const C* keys, int64_t stride, int64_t x0, int64_t L, int64_t D, float* kt) {
  for (int64_t x = x0 + 2 * LANES; x < std::min(x0 + 3 * LANES, L); ++x)
    for (int64_t d = 0; d < D; d += LINE / int64_t(sizeof(C)))
      __builtin_prefetch(keys + x * stride + d, 0, KEYS_LOCALITY);
  for (int64_t l0 = 0; l0 < LANES; l0 += NATIVE)
    for (int64_t d0 = 0; d0 < D; d0 += NATIVE) {
      vn rows[NATIVE];
      for (int i = 0; i < NATIVE; ++i)
        rows[i] = x0 + l0 + i < L ? load_native(keys + (x0 + l0 + i) * stride + d0) : vn{};
      transpose_native(rows);
      for (int j = 0; j < NATIVE; ++j) vstore(kt + (d0 + j) * LANES + l0, rows[j]);
    }
}

// The steps of a task: the queries of one batch row, kv head and chunk of queries over their keys.
// Each (query, head) row's result comes from the same operations in the same order whichever
// thread runs a step and whatever else it runs with. Queries and output are of T, keys and values
// of C (a float16 cache beside float32 queries: q8's); every cache value is widened exactly.
template <typename T, typename C = T>
struct Attender {
  const AttentionShape sh;
  const Strided4<const T> q;
  const Strided4<const C> k, v;
  const int64_t* slots;
  const int64_t* count;
  const float scale;
  const Strided4<T> out;
  const int64_t g = sh.H / sh.Hkv;

  struct Task {
    int64_t b, h, t0, tn, R, L, L16;
    const C *kbase, *vbase;
    std::vector<float> qf;     // the rows' queries [R, D]
    std::vector<float> vf;     // a 16-bit cache's values at slots 0..L-1 widened (WIDEN_ROWS), else empty
    std::vector<float> total;  // each row's sum of exps
  };

  void start(Task& t, int64_t b, int64_t h, int64_t t0, int64_t tn) const {
    t.b = b, t.h = h, t.t0 = t0, t.tn = tn, t.R = tn * g;
    int64_t longest = 0;
    for (int64_t u = 0; u < tn; ++u) longest = std::max(longest, count[b * sh.T + t0 + u]);
    t.L = std::min(longest, sh.S), t.L16 = (longest + LANES - 1) / LANES * LANES;
    t.kbase = &k.at(b, h, 0, 0), t.vbase = &v.at(b, h, 0, 0);
    t.vf.clear();
    if constexpr (!std::is_same_v<C, float>) {
      if (t.R >= WIDEN_ROWS && !slots) {
        t.vf.resize(t.L * sh.D);
        for (int64_t x = 0; x < t.L; ++x)
          for (int64_t d = 0; d < sh.D; d += NATIVE) vstore(t.vf.data() + x * sh.D + d, load_native(t.vbase + x * v.s2 + d));
      }
    }
    t.qf.assign(t.R * sh.D, 0.f);
    for (int64_t u = 0; u < tn; ++u)
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < sh.D; ++d) t.qf[(u * g + j) * sh.D + d] = to_float(q.at(b, h * g + j, t0 + u, d));
    t.total.assign(t.R, 0.f);
  }

  int64_t slot_of(const Task& t, int64_t u, int64_t x) const {
    return slots ? slots[(t.b * sh.T + t.t0 + u) * sh.W + x] : x;
  }

  // NR rows against 16 keys laid out a key per lane: each key's sum over d in order, the rows' sums
  // in registers (PARTS native vectors a row)
  template <int NR>
  void score_group(const float* const* qr, const int64_t* to, const float* keys, int64_t x0, float* s, int64_t L16) const {
    vn a[NR][PARTS] = {};
    for (int64_t d = 0; d < sh.D; ++d) {
#pragma GCC unroll 4
      for (int p = 0; p < PARTS; ++p) {
        const vn kd = vload<vn>(keys + d * LANES + p * NATIVE);
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) a[r][p] += qr[r][d] * kd;
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int p = 0; p < PARTS; ++p) vstore(s + to[r] * L16 + x0 + p * NATIVE, a[r][p] * scale);
  }

  // rows (query, head) against keys laid out a key per lane, four rows at a time (a step's three
  // query heads of a kv head as three: no zero row's work), every row by the very same instructions
  void score_rows(const Task& t, const std::vector<int64_t>& rows, const float* keys, int64_t x0, float* s) const {
    for (size_t i = 0; i < rows.size(); i += 4) {
      const float* qr[4];
      int64_t to[4];
      const size_t nr = std::min<size_t>(4, rows.size() - i);
      for (size_t r = 0; r < nr; ++r) qr[r] = t.qf.data() + rows[i + r] * sh.D, to[r] = rows[i + r];
      switch (nr) {
        case 4: score_group<4>(qr, to, keys, x0, s, t.L16); break;
        case 3: score_group<3>(qr, to, keys, x0, s, t.L16); break;
        case 2: score_group<2>(qr, to, keys, x0, s, t.L16); break;
        default: score_group<1>(qr, to, keys, x0, s, t.L16); break;
      }
    }
  }

  struct Scratch {  // a thread's: keys laid out, a tree node's own keys, rows
    std::vector<float> kt, own;
    std::vector<int64_t> shared, mine;
    explicit Scratch(int64_t D) : kt(D * LANES), own(D * LANES) {}
  };

  // the scores of keys x0 .. x0 + LANES - 1 for every row of t, into s [R, L16]
  void score_block(const Task& t, int64_t x0, float* s, Scratch& w) const {
    const int64_t D = sh.D;
    lay_out_keys(t.kbase, k.s2, x0, t.L, D, w.kt.data());
    w.shared.clear();
    for (int64_t u = 0; u < t.tn; ++u) {
      const int64_t n = count[t.b * sh.T + t.t0 + u];
      if (x0 >= n) continue;
      bool moved = false;
      for (int64_t l = 0; l < LANES && x0 + l < n; ++l) moved |= slot_of(t, u, x0 + l) != x0 + l;
      if (!moved) {
        for (int64_t j = 0; j < g; ++j) w.shared.push_back(u * g + j);
        continue;
      }
      // a tree node's own keys past where its path leaves the shared slots
      std::fill(w.own.begin(), w.own.end(), 0.f);
      for (int64_t l = 0; l < LANES && x0 + l < n; ++l) {
        const C* src = t.kbase + slot_of(t, u, x0 + l) * k.s2;
        for (int64_t d = 0; d < D; ++d) w.own[d * LANES + l] = to_float(src[d]);
      }
      w.mine.clear();
      for (int64_t j = 0; j < g; ++j) w.mine.push_back(u * g + j);
      score_rows(t, w.mine, w.own.data(), x0, s);
    }
    score_rows(t, w.shared, w.kt.data(), x0, s);
  }

  // row (u, j)'s max and exps (in place; its sum: sum_rows); a query that sees nothing: zeros out.
  // Returns the row's scores, or null for such a query. A max is exact in any order: by vectors.
  float* exps(const Task& t, int64_t u, int64_t j, float* s) const {
    const int64_t n = count[t.b * sh.T + t.t0 + u];
    if (n <= 0) {  // a padding column
      for (int64_t d = 0; d < sh.D; ++d) out.at(t.b, t.h * g + j, t.t0 + u, d) = from_float<T>(0.f);
      return nullptr;
    }
    float* sr = s + (u * g + j) * t.L16;
    vn mv = vn{} + sr[0];
    int64_t x = 0;
    for (; x + NATIVE <= n; x += NATIVE) {
      const vn v = vload<vn>(sr + x);
      mv = mv < v ? v : mv;  // std::max(m, v) a lane at a time
    }
    float m = mv[0];
    for (int l = 1; l < NATIVE; ++l) m = std::max(m, mv[l]);
    for (; x < n; ++x) m = std::max(m, sr[x]);
    for (x = 0; x < n; x += NATIVE)  // the row has L16 >= n columns: whole vectors
      vstore(sr + x, exp_vector(vload<vn>(sr + x) - m));
    return sr;
  }

  // the rows' (u, j) softmax: exps, then each row's sum key after key, in its own order, the rows'
  // sums side by side, up to CHAINS (independent chains: a row's sum alone waits on each add; a
  // step's 9 rows on 2 threads are 5 and 4, and 5 by fours left one row's 1.5k adds alone)
  static constexpr int64_t CHAINS = 6;
  void softmax_rows(Task* const* tasks, const int64_t* us, const int64_t* js, int64_t k, float* const* scores) const {
    for (int64_t i0 = 0; i0 < k; i0 += CHAINS) {
      const int64_t m = std::min<int64_t>(CHAINS, k - i0);
      const float* rows[CHAINS];
      int64_t n[CHAINS], common = INT64_MAX;
      float l[CHAINS] = {};
      for (int64_t i = 0; i < m; ++i) {
        const Task& t = *tasks[i0 + i];
        rows[i] = exps(t, us[i0 + i], js[i0 + i], scores[i0 + i]);
        n[i] = rows[i] ? count[t.b * sh.T + t.t0 + us[i0 + i]] : 0;
        common = std::min(common, n[i]);
      }
      switch (m) {
        case 6: sum_chains<6>(rows, common, l); break;
        case 5: sum_chains<5>(rows, common, l); break;
        case 4: sum_chains<4>(rows, common, l); break;
        case 3: sum_chains<3>(rows, common, l); break;
        case 2: sum_chains<2>(rows, common, l); break;
        default: sum_chains<1>(rows, common, l); break;
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t x = common; x < n[i]; ++x) l[i] += rows[i][x];
        if (rows[i]) tasks[i0 + i]->total[us[i0 + i] * g + js[i0 + i]] = l[i];
      }
    }
  }

  template <int M>
  static void sum_chains(const float* const* rows, int64_t n, float* l) {
    float a[M] = {};
    for (int64_t x = 0; x < n; ++x)
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) a[i] += rows[i][x];
    for (int i = 0; i < M; ++i) l[i] = a[i];
  }

  // query u's rows (its g heads) of a task, four at a time
  void softmax(Task& t, int64_t u, float* s) const {
    Task* tasks[4] = {&t, &t, &t, &t};
    float* scores[4] = {s, s, s, s};
    const int64_t us[4] = {u, u, u, u};
    for (int64_t j0 = 0; j0 < g; j0 += 4) {
      const int64_t js[4] = {j0, j0 + 1, j0 + 2, j0 + 3};
      softmax_rows(tasks, us, js, std::min<int64_t>(4, g - j0), scores);
    }
  }

  // heads j .. j + N - 1 of query u (zero weights pad heads past g): the probability-weighted values
  // key after key, over the rows' sums; of the head dim, NV native vectors from vector c0 (in
  // registers; NV = 0: all D, in memory). Each head's and each lane's sum is its own, in the same
  // order however heads and lanes are shared out.
  template <int64_t NV, int N>
  void weigh(const Task& t, int64_t u, int64_t j, int64_t c0, const float* s) const {
    if (!t.vf.empty())
      weigh_from<NV, N>(t, u, j, c0, s, t.vf.data(), sh.D);
    else
      weigh_from<NV, N>(t, u, j, c0, s, t.vbase, v.s2);
  }

  // weigh over values of V at values[slot * stride] (the cache's, or a task's widened copy)
  template <int64_t NV, int N, typename V>
  void weigh_from(const Task& t, int64_t u, int64_t j, int64_t c0, const float* s, const V* values, int64_t stride) const {
    const int64_t n = count[t.b * sh.T + t.t0 + u], D = sh.D, nv = NV ? NV : D / NATIVE;
    if (n <= 0) return;
    const float* w[N];
    for (int i = 0; i < N; ++i) w[i] = j + i < g ? s + (u * g + j + i) * t.L16 : nullptr;
    vn acc[N][NV ? NV : MAX_D / NATIVE] = {};
    for (int64_t x = 0; x < n; ++x) {
      const V* val = values + slot_of(t, u, x) * stride;
      if (x + VALUES_AHEAD < t.L)
        for (int64_t b = 0; b < (NV ? NV : nv) * NATIVE; b += LINE / int64_t(sizeof(V)))
          __builtin_prefetch(values + (x + VALUES_AHEAD) * stride + c0 * NATIVE + b, 0, VALUES_LOCALITY);
      float p[N];
      for (int i = 0; i < N; ++i) p[i] = w[i] ? w[i][x] : 0.f;
#pragma GCC unroll 32
      for (int64_t c = 0; c < (NV ? NV : nv); ++c) {
        const vn vc = load_native(val + (c0 + c) * NATIVE);
#pragma GCC unroll 4
        for (int i = 0; i < N; ++i) acc[i][c] += p[i] * vc;
      }
    }
    for (int64_t i = 0; i < N && j + i < g; ++i)
      for (int64_t c = 0; c < nv; ++c)
        for (int64_t lane = 0; lane < NATIVE; ++lane)
          out.at(t.b, t.h * g + j + i, t.t0 + u, (c0 + c) * NATIVE + lane) =
              from_float<T>(acc[i][c][lane] / t.total[u * g + j + i]);
  }

  // heads a call of weigh_heads takes: three where the query heads of a kv head come in threes at
  // head dim 64 and three heads' accumulators for half of it fit in 12 registers (AVX-512, AVX2: the
  // values read once for SmolLM2's 3 query heads, not twice as by pairs, and no zero-weight fourth
  // head), else two
  int64_t heads_at_once() const { return g % 3 == 0 && sh.D == 64 && NATIVE >= 8 ? 3 : 2; }

  // heads j.. (heads_at_once of them) of query u; where three, half 0 or 1 of the head dim alone
  // (-1: all of it, in one pass where the whole head dim's accumulators fit in half the registers,
  // as on AVX-512, else half after half: AVX2's 16 registers)
  void weigh_heads(const Task& t, int64_t u, int64_t j, int64_t half, const float* s) const {
    constexpr int64_t HALF = 32 / NATIVE;
    if (heads_at_once() == 3 && half >= 0) {
      weigh<HALF, 3>(t, u, j, half * HALF, s);
    } else if (heads_at_once() == 3) {
      if constexpr (3 * 2 * HALF <= 16) {
        weigh<2 * HALF, 3>(t, u, j, 0, s);
      } else {
        weigh<HALF, 3>(t, u, j, 0, s);
        weigh<HALF, 3>(t, u, j, HALF, s);
      }
    } else if (sh.D == 64) {
      weigh<64 / NATIVE, 2>(t, u, j, 0, s);
    } else if (sh.D == 128) {
      weigh<128 / NATIVE, 2>(t, u, j, 0, s);
    } else {
      weigh<0, 2>(t, u, j, 0, s);
    }
  }
};

// q, out: [B, H, T, D]; k, v: [B, Hkv, S, D] (rows contiguous); slots: [B, T, W] or null; count [B, T]
template <typename T, typename C>
void attend(const AttentionShape& sh, Strided4<const T> q, Strided4<const C> k, Strided4<const C> v,
            const int64_t* slots, const int64_t* count, float scale, Strided4<T> out, const ParallelFor& parallel) {
  const Attender<T, C> at{sh, q, k, v, slots, count, scale, out};
  const int64_t B = sh.B, T_ = sh.T, D = sh.D, Hkv = sh.Hkv, S = sh.S, g = at.g;
  const int64_t Q = T_ >= 4 * QUERIES_LONG
                        ? std::clamp(SCORES_HELD / (g * (S + LANES)), QUERIES, QUERIES_LONG)
                        : QUERIES;
  const int64_t chunks = (T_ + Q - 1) / Q;
  int64_t longest = 0;
  for (int64_t i = 0; i < B * T_; ++i) longest = std::max(longest, count[i]);
  if (chunks == 1 && B * Hkv < SPREAD_TASKS && std::min(longest, S) >= SPREAD_KEYS) {
    const int64_t tasks = B * Hkv;
    std::vector<typename Attender<T, C>::Task> ts(tasks);
    std::vector<std::vector<float>> scores(tasks);
    for (int64_t i = 0; i < tasks; ++i) {
      at.start(ts[i], i / Hkv, i % Hkv, 0, T_);
      scores[i].assign(ts[i].R * ts[i].L16, 0.f);
    }
    int64_t blocks = 0;  // of the task with the most keys
    for (const auto& t : ts) blocks = std::max(blocks, t.L16 / LANES);
    const int64_t pieces = (blocks + SPREAD_BLOCKS - 1) / SPREAD_BLOCKS;
    parallel(tasks * pieces, 1, [&](int64_t begin, int64_t end) {  // the scores, blocks of keys at a time
      typename Attender<T, C>::Scratch w(D);
      for (int64_t item = begin; item < end; ++item) {
        const auto& t = ts[item / pieces];
        const int64_t x_end = std::min(t.L16, (item % pieces + 1) * SPREAD_BLOCKS * LANES);
        for (int64_t x0 = (item % pieces) * SPREAD_BLOCKS * LANES; x0 < x_end; x0 += LANES)
          at.score_block(t, x0, scores[item / pieces].data(), w);
      }
    });
    const int64_t R = T_ * g;
    parallel(tasks * R, 1, [&](int64_t begin, int64_t end) {  // each row's softmax, a thread's rows together
      std::vector<typename Attender<T, C>::Task*> tp(end - begin);
      std::vector<int64_t> us(end - begin), js(end - begin);
      std::vector<float*> sp(end - begin);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t i = item - begin;
        tp[i] = &ts[item / R], us[i] = item % R / g, js[i] = item % R % g, sp[i] = scores[item / R].data();
      }
      at.softmax_rows(tp.data(), us.data(), js.data(), end - begin, sp.data());
    });
    // the weighted values, 2 or 3 heads at a time; threes by halves of the head dim (a step's three
    // kv heads on 2 threads: a head and a half each, not two and one), a thread's two halves of one
    // call taken as one call
    const int64_t per = at.heads_at_once(), calls = (g + per - 1) / per, halves = per == 3 ? 2 : 1;
    parallel(tasks * T_ * calls * halves, 1, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t item = unit / halves, task = item / (T_ * calls), u = item / calls % T_;
        const bool whole = halves == 1 || (unit % 2 == 0 && unit + 1 < end);
        at.weigh_heads(ts[task], u, per * (item % calls), whole ? -1 : unit % 2, scores[task].data());
        unit += whole && halves == 2;
      }
    });
    return;
  }
  // a row's chunks short and long in turn (0, last, 1, last - 1, ...): a causal block's later chunks
  // see more keys, and the threads take the items in contiguous ranges, so in text order the first
  // thread of two got the cheap half of a head and waited on the other (a 1.5k-token prompt's
  // layers 1-9 % faster so on a 2-core Zen 4); which thread runs a chunk changes no bits
  const auto chunk = [chunks](int64_t i) { return i % 2 == 0 ? i / 2 : chunks - 1 - i / 2; };
  parallel(B * Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    typename Attender<T, C>::Task t;
    typename Attender<T, C>::Scratch w(D);
    std::vector<float> s;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv * chunks), h = (item / chunks) % Hkv, t0 = chunk(item % chunks) * Q;
      at.start(t, b, h, t0, std::min(Q, T_ - t0));
      s.assign(t.R * t.L16, 0.f);
      for (int64_t x0 = 0; x0 < t.L16; x0 += LANES) at.score_block(t, x0, s.data(), w);
      for (int64_t u = 0; u < t.tn; ++u) {
        at.softmax(t, u, s.data());
        for (int64_t j = 0; j < g; j += at.heads_at_once()) at.weigh_heads(t, u, j, -1, s.data());
      }
    }
  });
}

}  // namespace spk
