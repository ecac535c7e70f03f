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
#include <vector>

#include "parallel.h"
#include "vector.h"

namespace spk {

constexpr int64_t QUERIES = 8;  // queries a task takes together (each key is read once for them)
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
  const int64_t g = sh.H / Hkv, chunks = (T_ + QUERIES - 1) / QUERIES, C = D / LANES;
  parallel(B * Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, kf, vf_, s, kt(D * LANES), own(D * LANES), row(D), total(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv * chunks), h = (item / chunks) % Hkv, t0 = (item % chunks) * QUERIES;
      const int64_t tn = std::min(QUERIES, T_ - t0), R = tn * g;
      int64_t longest = 0;
      for (int64_t u = 0; u < tn; ++u) longest = std::max(longest, count[b * T_ + t0 + u]);
      const int64_t L = std::min(longest, S), L16 = (longest + LANES - 1) / LANES * LANES;
      const T* kbase = &k.at(b, h, 0, 0);
      const T* vbase = &v.at(b, h, 0, 0);
      // float copies of the keys and values at slots 0..L-1 (where a query's key x is slot x)
      kf.assign(L16 * D, 0.f);
      vf_.assign(std::max<int64_t>(L, 1) * D, 0.f);
      for (int64_t x = 0; x < L; ++x)
        for (int64_t d = 0; d < D; ++d) {
          kf[x * D + d] = to_float(kbase[x * k.s2 + d]);
          vf_[x * D + d] = to_float(vbase[x * v.s2 + d]);
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
          vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
          for (int64_t d = 0; d < D; ++d) {
            const vf kd = vload(keys + d * LANES);
            a0 += qr[0][d] * kd;
            a1 += qr[1][d] * kd;
            a2 += qr[2][d] * kd;
            a3 += qr[3][d] * kd;
          }
          vf res[4] = {a0 * scale, a1 * scale, a2 * scale, a3 * scale};
          for (int64_t k4 = 0; k4 < 4; ++k4) std::memcpy(s.data() + to[k4] * L16 + x0, &res[k4], sizeof(vf));
        }
      };
      for (int64_t x0 = 0; x0 < L16; x0 += LANES) {
        for (int64_t l = 0; l < LANES; ++l)
          for (int64_t d = 0; d < D; ++d) kt[d * LANES + l] = kf[(x0 + l) * D + d];
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
          for (int64_t x = 0; x < n; x += LANES) {  // the row has L16 >= n columns: whole vectors
            vf e = exp_vector(vload(sr + x) - m);
            std::memcpy(sr + x, &e, sizeof e);
          }
          float l = 0.f;
          for (int64_t x = 0; x < n; ++x) l += sr[x];
          total[j] = l;
        }
        // probability-weighted values, key after key, two heads at a time (a zero weight pads the
        // last pair), the outputs in registers
        for (int64_t j = 0; j < g; j += 2) {
          const float* w0 = s.data() + (u * g + j) * L16;
          const float* w1 = j + 1 < g ? w0 + L16 : nullptr;
          vf acc0[MAX_D / LANES] = {}, acc1[MAX_D / LANES] = {};
          for (int64_t x = 0; x < n; ++x) {
            const int64_t slot = slot_of(u, x);
            const float* val = vf_.data() + x * D;
            if (slot != x || x >= L) {
              const T* src = vbase + slot * v.s2;
              for (int64_t d = 0; d < D; ++d) row[d] = to_float(src[d]);
              val = row.data();
            }
            const float p0 = w0[x], p1 = w1 ? w1[x] : 0.f;
            for (int64_t c = 0; c < C; ++c) {
              const vf vc = vload(val + c * LANES);
              acc0[c] += p0 * vc;
              acc1[c] += p1 * vc;
            }
          }
          for (int64_t i = 0; i < 2 && j + i < g; ++i) {
            const vf* acc = i ? acc1 : acc0;
            for (int64_t c = 0; c < C; ++c)
              for (int64_t lane = 0; lane < LANES; ++lane)
                out.at(b, h * g + j + i, t0 + u, c * LANES + lane) = from_float<T>(acc[c][lane] / total[j + i]);
          }
        }
      }
    }
  });
}

}  // namespace spk
