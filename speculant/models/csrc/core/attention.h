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
#include "vector.h"

namespace spk {

// queries a task takes together: each key is read (and laid out a key per lane) once for them. More
// for long blocks (a prompt), where laying keys out would otherwise cost more than scoring them, as
// long as their scores stay within SCORES_HELD floats. Which queries share a task changes no bits.
constexpr int64_t QUERIES = 8, QUERIES_LONG = 64, SCORES_HELD = int64_t(1) << 22;
constexpr int64_t MAX_D = 256;  // head dims up to this, in whole vectors

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

// q, out: [B, H, T, D]; k, v: [B, Hkv, S, D] (rows contiguous); slots: [B, T, W] or null; count [B, T]
template <typename T>
void attend(const AttentionShape& sh, Strided4<const T> q, Strided4<const T> k, Strided4<const T> v,
            const int64_t* slots, const int64_t* count, float scale, Strided4<T> out, const ParallelFor& parallel) {
  const int64_t B = sh.B, T_ = sh.T, D = sh.D, Hkv = sh.Hkv, S = sh.S, W = sh.W;
  const int64_t g = sh.H / Hkv;
  const int64_t Q = T_ >= 4 * QUERIES_LONG
                        ? std::clamp(SCORES_HELD / (g * (S + LANES)), QUERIES, QUERIES_LONG)
                        : QUERIES;
  const int64_t chunks = (T_ + Q - 1) / Q;
  parallel(B * Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, vf_, s, kt(D * LANES), own(D * LANES), row(D), total(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv * chunks), h = (item / chunks) % Hkv, t0 = (item % chunks) * Q;
      const int64_t tn = std::min(Q, T_ - t0), R = tn * g;
      int64_t longest = 0;
      for (int64_t u = 0; u < tn; ++u) longest = std::max(longest, count[b * T_ + t0 + u]);
      const int64_t L = std::min(longest, S), L16 = (longest + LANES - 1) / LANES * LANES;
      const T* kbase = &k.at(b, h, 0, 0);
      const T* vbase = &v.at(b, h, 0, 0);
      // values at slots 0..L-1 (where a query's key x is slot x) as floats: a 16-bit cache's
      // converted once for the task's queries, a float32 cache's read in place
      const float* values_f = nullptr;
      int64_t values_stride = D;
      if constexpr (std::is_same_v<T, float>) {
        values_f = vbase, values_stride = v.s2;
      } else {
        vf_.resize(std::max<int64_t>(L, 1) * D);
        for (int64_t x = 0; x < L; ++x)
          for (int64_t d = 0; d < D; ++d) vf_[x * D + d] = to_float(vbase[x * v.s2 + d]);
        values_f = vf_.data();
      }
      qf.assign((R + 3) * D, 0.f);  // rows R.. stay zero: the padding of the last group of four
      for (int64_t u = 0; u < tn; ++u)
        for (int64_t j = 0; j < g; ++j)
          for (int64_t d = 0; d < D; ++d) qf[(u * g + j) * D + d] = to_float(q.at(b, h * g + j, t0 + u, d));
      auto slot_of = [&](int64_t u, int64_t x) { return slots ? slots[(b * T_ + t0 + u) * W + x] : x; };
      // scores, LANES keys at a time: a key per lane, each summed over d in order. Rows (query, head)
      // go four at a time (padded with a zero row), so every row runs the very same instructions.
      s.assign((R + 3) * L16, 0.f);
      std::vector<int64_t> rows_shared, rows_own;
      auto score_rows = [&](const std::vector<int64_t>& rows, const float* keys, int64_t x0) {
        for (size_t i = 0; i < rows.size(); i += 4) {
          const float* qr[4];
          int64_t to[4];
          for (int64_t k4 = 0; k4 < 4; ++k4) {
            const bool real = i + k4 < rows.size();
            qr[k4] = qf.data() + (real ? rows[i + k4] : R) * D;  // row R..R+2: zeros
            to[k4] = real ? rows[i + k4] : R;
          }
          vn a[4][PARTS] = {};  // the 16 keys' sums as PARTS native vectors: kept in registers
          for (int64_t d = 0; d < D; ++d) {
#pragma GCC unroll 4
            for (int p = 0; p < PARTS; ++p) {
              const vn kd = vload<vn>(keys + d * LANES + p * NATIVE);
#pragma GCC unroll 4
              for (int r = 0; r < 4; ++r) a[r][p] += qr[r][d] * kd;
            }
          }
          for (int r = 0; r < 4; ++r)
            for (int p = 0; p < PARTS; ++p) vstore(s.data() + to[r] * L16 + x0 + p * NATIVE, a[r][p] * scale);
        }
      };
      for (int64_t x0 = 0; x0 < L16; x0 += LANES) {
        for (int64_t l = 0; l < LANES; ++l) {  // the block's keys, a key per lane (zeros past L)
          if (x0 + l < L) {
            const T* src = kbase + (x0 + l) * k.s2;
            for (int64_t d = 0; d < D; ++d) kt[d * LANES + l] = to_float(src[d]);
          } else {
            for (int64_t d = 0; d < D; ++d) kt[d * LANES + l] = 0.f;
          }
        }
        rows_shared.clear();
        for (int64_t u = 0; u < tn; ++u) {
          const int64_t n = count[b * T_ + t0 + u];
          if (x0 >= n) continue;
          bool moved = false;
          for (int64_t l = 0; l < LANES && x0 + l < n; ++l) moved |= slot_of(u, x0 + l) != x0 + l;
          if (!moved) {
            for (int64_t j = 0; j < g; ++j) rows_shared.push_back(u * g + j);
            continue;
          }
          // a tree node's own keys past where its path leaves the shared slots
          std::fill(own.begin(), own.end(), 0.f);
          for (int64_t l = 0; l < LANES && x0 + l < n; ++l) {
            const T* src = kbase + slot_of(u, x0 + l) * k.s2;
            for (int64_t d = 0; d < D; ++d) own[d * LANES + l] = to_float(src[d]);
          }
          rows_own.clear();
          for (int64_t j = 0; j < g; ++j) rows_own.push_back(u * g + j);
          score_rows(rows_own, own.data(), x0);
        }
        score_rows(rows_shared, kt.data(), x0);
      }
      for (int64_t u = 0; u < tn; ++u) {
        const int64_t n = count[b * T_ + t0 + u];
        if (n <= 0) {  // sees nothing (a padding column): zeros
          for (int64_t j = 0; j < g; ++j)
            for (int64_t d = 0; d < D; ++d) out.at(b, h * g + j, t0 + u, d) = from_float<T>(0.f);
          continue;
        }
        for (int64_t j = 0; j < g; ++j) {  // each (query, head): its max, exps and their sum, in order
          float* sr = s.data() + (u * g + j) * L16;
          float m = sr[0];
          for (int64_t x = 1; x < n; ++x) m = std::max(m, sr[x]);
          for (int64_t x = 0; x < n; x += NATIVE)  // the row has L16 >= n columns: whole vectors
            vstore(sr + x, exp_vector(vload<vn>(sr + x) - m));
          float l = 0.f;
          for (int64_t x = 0; x < n; ++x) l += sr[x];
          total[j] = l;
        }
        // probability-weighted values, key after key, two heads at a time (a zero weight pads the
        // last pair), the outputs in registers where the head dim is 64 or 128
        auto weigh = [&](auto width) {
          constexpr int64_t NC = decltype(width)::value / NATIVE;  // native vectors of a head's values
          const int64_t nc = NC ? NC : D / NATIVE;
          for (int64_t j = 0; j < g; j += 2) {
            const float* w0 = s.data() + (u * g + j) * L16;
            const float* w1 = j + 1 < g ? w0 + L16 : nullptr;
            vn acc0[NC ? NC : MAX_D / NATIVE] = {}, acc1[NC ? NC : MAX_D / NATIVE] = {};
            for (int64_t x = 0; x < n; ++x) {
              const int64_t slot = slot_of(u, x);
              const float* val = values_f + x * values_stride;
              if (slot != x || x >= L) {
                const T* src = vbase + slot * v.s2;
                for (int64_t d = 0; d < D; ++d) row[d] = to_float(src[d]);
                val = row.data();
              }
              const float p0 = w0[x], p1 = w1 ? w1[x] : 0.f;
#pragma GCC unroll 32
              for (int64_t c = 0; c < (NC ? NC : nc); ++c) {
                const vn vc = vload<vn>(val + c * NATIVE);
                acc0[c] += p0 * vc;
                acc1[c] += p1 * vc;
              }
            }
            for (int64_t i = 0; i < 2 && j + i < g; ++i) {
              const vn* acc = i ? acc1 : acc0;
              for (int64_t c = 0; c < nc; ++c)
                for (int64_t lane = 0; lane < NATIVE; ++lane)
                  out.at(b, h * g + j + i, t0 + u, c * NATIVE + lane) = from_float<T>(acc[c][lane] / total[j + i]);
            }
          }
        };
        if (D == 64)
          weigh(std::integral_constant<int64_t, 64>{});
        else if (D == 128)
          weigh(std::integral_constant<int64_t, 128>{});
        else
          weigh(std::integral_constant<int64_t, 0>{});
      }
    }
  });
}

}  // namespace spk
