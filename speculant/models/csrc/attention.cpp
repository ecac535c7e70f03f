// Width-invariant attention for the CPU: each query over exactly its own keys, in text order.
//
// A query's result is computed by operations whose order depends on nothing but that query's key
// count n: its scores (dot products summed in 16 fixed lanes, then a fixed tree), a float32 softmax
// summed key after key, and its probability-weighted values summed key after key. So a query gets
// the same bits whether it is a one-token step, a row of a verify block, a node of a token tree (its
// keys gathered by ``slots`` into text order) or a row beside other requests: the property
// speculative decoding needs to keep plain decoding's text, by construction. Queries of one row and
// kv head are taken together only to read each key once; their sums stay their own.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector.h"

namespace {

constexpr int64_t QUERIES = 8;  // queries a task takes together (each key is read once for them)

constexpr int64_t MAX_D = 256;  // head dims up to this, in whole vectors

template <typename scalar_t>
void attend_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                   const at::Tensor& count, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), g = H / Hkv, W = slots.numel() ? slots.size(2) : 0, S = k.size(2);
  const int64_t chunks = (T + QUERIES - 1) / QUERIES, C = D / LANES;
  const auto qa = q.accessor<scalar_t, 4>();
  const auto ca = count.accessor<int64_t, 2>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const int64_t* sp = W ? slots.data_ptr<int64_t>() : nullptr;
  const int64_t kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vs = v.stride(2);
  auto oa = out.accessor<scalar_t, 4>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, kf, vf_, s, kt(D * LANES), own(D * LANES), row(D), total(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (Hkv * chunks), h = (item / chunks) % Hkv, t0 = (item % chunks) * QUERIES;
      const int64_t tn = std::min(QUERIES, T - t0), R = tn * g;
      int64_t longest = 0;
      for (int64_t u = 0; u < tn; ++u) longest = std::max(longest, ca[b][t0 + u]);
      const int64_t L = std::min(longest, S), L16 = (longest + LANES - 1) / LANES * LANES;
      const scalar_t* kbase = kp + b * kb + h * kh;
      const scalar_t* vbase = vp + b * vb + h * vh;
      // float copies of the keys and values at slots 0..L-1 (where a query's key x is slot x)
      kf.assign(L16 * D, 0.f);
      vf_.assign(std::max<int64_t>(L, 1) * D, 0.f);
      for (int64_t x = 0; x < L; ++x)
        for (int64_t d = 0; d < D; ++d) {
          kf[x * D + d] = static_cast<float>(kbase[x * ks + d]);
          vf_[x * D + d] = static_cast<float>(vbase[x * vs + d]);
        }
      qf.assign((R + 3) * D, 0.f);  // rows R.. stay zero: the padding of the last group of four
      for (int64_t u = 0; u < tn; ++u)
        for (int64_t j = 0; j < g; ++j)
          for (int64_t d = 0; d < D; ++d) qf[(u * g + j) * D + d] = static_cast<float>(qa[b][h * g + j][t0 + u][d]);
      auto slot_of = [&](int64_t u, int64_t x) { return sp ? sp[(b * T + t0 + u) * W + x] : x; };
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
          vf out[4] = {a0 * sc, a1 * sc, a2 * sc, a3 * sc};
          for (int64_t k4 = 0; k4 < 4; ++k4) std::memcpy(s.data() + to[k4] * L16 + x0, &out[k4], sizeof(vf));
        }
      };
      for (int64_t x0 = 0; x0 < L16; x0 += LANES) {
        for (int64_t l = 0; l < LANES; ++l)
          for (int64_t d = 0; d < D; ++d) kt[d * LANES + l] = kf[(x0 + l) * D + d];
        rows_shared.clear();
        for (int64_t u = 0; u < tn; ++u) {
          const int64_t n = ca[b][t0 + u];
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
            const scalar_t* src = kbase + slot_of(u, x0 + l) * ks;
            for (int64_t d = 0; d < D; ++d) own[d * LANES + l] = static_cast<float>(src[d]);
          }
          rows_own.clear();
          for (int64_t j = 0; j < g; ++j) rows_own.push_back(u * g + j);
          score_rows(rows_own, own.data(), x0);
        }
        score_rows(rows_shared, kt.data(), x0);
      }
      for (int64_t u = 0; u < tn; ++u) {
        const int64_t n = ca[b][t0 + u];
        if (n <= 0) {  // sees nothing (a padding column): zeros
          for (int64_t j = 0; j < g; ++j)
            for (int64_t d = 0; d < D; ++d) oa[b][h * g + j][t0 + u][d] = static_cast<scalar_t>(0.f);
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
              const scalar_t* src = vbase + slot * vs;
              for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(src[d]);
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
                oa[b][h * g + j + i][t0 + u][c * LANES + lane] = static_cast<scalar_t>(acc[c][lane] / total[j + i]);
          }
        }
      }
    }
  });
}

}  // namespace

// q [B, H, T, D]; k, v [B, Hkv, S, D] with contiguous rows; slots [B, T, W] int64 (query t's key x is
// slot slots[b, t, x]), or empty where key x is slot x; count [B, T]: keys each query sees.
at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor count, double scale) {
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attend: keys and values need contiguous rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "attend: one dtype");
  TORCH_CHECK(q.size(3) % LANES == 0 && q.size(3) <= MAX_D, "attend: head dims a multiple of 16, at most 256");
  auto out = at::empty(q.sizes(), q.options());
  auto c = count.to(at::kLong).contiguous();
  auto sl = slots.numel() ? slots.to(at::kLong).contiguous() : slots;
  if (q.scalar_type() == at::kFloat) {
    attend_kernel<float>(q, k, v, sl, c, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_kernel<at::BFloat16>(q, k, v, sl, c, scale, out);
  } else if (q.scalar_type() == at::kHalf) {
    attend_kernel<at::Half>(q, k, v, sl, c, scale, out);
  } else {
    TORCH_CHECK(false, "attend: float32, bfloat16 or float16 only");
  }
  return out;
}
