// A Llama decoder layer over quantized linears, a row at a time: RMSNorm, q/k/v, rotary, the cache
// writes, attention, o, the residuals, gate/up, SiLU, down. Every value of a row is computed by
// operations whose order depends on nothing but that row, so the layer is width-invariant by
// construction, and each operation is a plain IEEE one or an explicit fused multiply-add (the core
// is built without contraction): the same bits on every ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "attention.h"
#include "linear.h"
#include "simd.h"
#include "vector.h"

namespace spk {

// HF's RMSNorm over rows of H (a multiple of 16): out = w * (x * (1 / sqrt(mean(x^2) + eps)))
inline void rms_norm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* out,
                     const ParallelFor& parallel = serial_for) {
  for_rows(M, H, parallel, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * H;
      V16 ss = zero16();
      for (int64_t i = 0; i < H; i += 16) ss = fma16(load16(xr + i), load16(xr + i), ss);
      const V16 inv = set16(1.0f / std::sqrt(sum16(ss) / static_cast<float>(H) + eps));
      for (int64_t i = 0; i < H; i += 16) store16(out + r * H + i, mul16(load16(w + i), mul16(load16(xr + i), inv)));
    }
  });
}

// silu(g) = g / (1 + exp(-g)), from e = exp(-|g|) <= 1 (the vector exp takes arguments <= 0)
template <typename V>
inline V silu(V g) {
  const V zero = g - g;
  const V e = exp_vector(g < zero ? g : zero - g);
  const V one = zero + 1.0f;
  return g * (g < zero ? e : one) / (one + e);
}

// rotary on the first `roped` heads of D of each row of y [M, width]: x * cos + rotate_half(x) * sin,
// element by element (two roundings and a sum, as PyTorch computes HF's expression)
inline void rotary(float* y, int64_t M, int64_t width, const float* cos, const float* sin, int64_t roped, int64_t D,
                   const ParallelFor& parallel = serial_for) {
  const int64_t half = D / 2;
  for_rows(M, roped * D, parallel, [&](int64_t r0, int64_t r1) {
    std::vector<float> head(D);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < roped; ++k) {
        float* p = y + r * width + k * D;
        std::memcpy(head.data(), p, D * sizeof(float));
        for (int64_t i = 0; i < D; ++i) {
          const float rot = i < half ? -head[i + half] : head[i - half];
          const float a = head[i] * cos[r * D + i], b = rot * sin[r * D + i];
          p[i] = a + b;
        }
      }
  });
}

// q/k/v of a block: y [M, qkv.N] = qkv(x), rotary on the first `roped` heads of D
inline void qkv_rotary(const float* x, int64_t M, const Linear& qkv, const float* cos, const float* sin, int64_t roped,
                       int64_t D, float* y, const ParallelFor& parallel) {
  apply(qkv, x, M, y, parallel);
  rotary(y, M, qkv.N(), cos, sin, roped, D, parallel);
}

// up to attention: norm, the q/k/v matmul, rotary on the first `roped` heads.
// h [M, H]; cos, sin [M, D]; y [M, qkv.N] (q, k and v heads side by side)
inline void layer_start(const float* h, int64_t M, int64_t H, const float* ln, float eps, const Linear& qkv,
                        const float* cos, const float* sin, int64_t roped, int64_t D, float* y,
                        const ParallelFor& parallel) {
  std::vector<float> x(M * H);
  rms_norm(h, M, H, ln, eps, x.data(), parallel);
  qkv_rotary(x.data(), M, qkv, cos, sin, roped, D, y, parallel);
}

// the rest: out = h + o(attn), then out += down(silu(gate) * up) of its norm. h, out [M, H]; attn [M, A]
inline void layer_end(const float* h, const float* attn, int64_t M, int64_t H, const Linear& o, const float* ln,
                      float eps, const Linear& gate_up, const Linear& down, float* out, const ParallelFor& parallel) {
  const int64_t I = gate_up.N() / 2;
  apply(o, attn, M, out, parallel);
  std::vector<float> x(M * H), gu(M * 2 * I), act(M * I), d(M * H);
  for_rows(M, H, parallel, [&](int64_t r0, int64_t r1) {  // the residual, then its norm
    for (int64_t i = r0 * H; i < r1 * H; ++i) out[i] = h[i] + out[i];
    rms_norm(out + r0 * H, r1 - r0, H, ln, eps, x.data() + r0 * H);
  });
  apply(gate_up, x.data(), M, gu.data(), parallel);
  for_rows(M, I, parallel, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < I; i += NATIVE)
        vstore(act.data() + r * I + i,
               silu(vload<vn>(gu.data() + r * 2 * I + i)) * vload<vn>(gu.data() + r * 2 * I + I + i));
  });
  apply(down, act.data(), M, d.data(), parallel);
  for (int64_t i = 0; i < M * H; ++i) out[i] += d[i];
}

struct LayerCaches {  // [B, n_kv, S, D], contiguous along D: float32, or float16 where `half` (q8's)
  void *k, *v;
  int64_t s0, s1, s2, S;
  bool half = false;
};

struct BlockAttention {  // where a block's keys and values go and which each query sees
  LayerCaches caches;
  const int64_t* write_at;  // [B, T]: the cache slot of each token
  const int64_t* slots;     // [B, T, W]: query t's key x is slot slots[b, t, x]; null: slot x
  int64_t W;
  const int64_t* count;  // [B, T]: keys each query sees
  float scale;
};

// attend_block over caches of C: the new keys and values written (rounded to C), then the attention
template <typename C>
inline void attend_cache(const float* y, int64_t B, int64_t T, int64_t n_heads, int64_t n_kv, int64_t D,
                         const BlockAttention& at, float* a, const ParallelFor& parallel) {
  const int64_t heads = n_heads + 2 * n_kv;
  const LayerCaches& c = at.caches;
  C *kc = static_cast<C*>(c.k), *vc = static_cast<C*>(c.v);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = at.write_at[b * T + t];
      if (slot < 0 || slot >= c.S) throw std::out_of_range("layer: write_at outside the cache");
      for (int64_t j = 0; j < n_kv; ++j) {
        const float* src = y + ((b * T + t) * heads + n_heads + j) * D;
        C *kd = kc + b * c.s0 + j * c.s1 + slot * c.s2, *vd = vc + b * c.s0 + j * c.s1 + slot * c.s2;
        if constexpr (std::is_same_v<C, f16>) {
          for (int64_t d = 0; d < D; d += NATIVE) {  // D: a multiple of 16
            store_halves_native(reinterpret_cast<uint16_t*>(kd + d), vload<vn>(src + d));
            store_halves_native(reinterpret_cast<uint16_t*>(vd + d), vload<vn>(src + n_kv * D + d));
          }
        } else {
          std::memcpy(kd, src, D * sizeof(float));
          std::memcpy(vd, src + n_kv * D, D * sizeof(float));
        }
      }
    }
  // queries [B, n_heads, T, D] read in place from y [B, T, heads, D]; the output [B, T, n_heads, D]
  const AttentionShape sh{B, n_heads, T, D, n_kv, c.S, at.W};
  const Strided4<const float> q{y, T * heads * D, D, heads * D, 1};
  const Strided4<const C> keys{kc, c.s0, c.s1, c.s2, 1}, values{vc, c.s0, c.s1, c.s2, 1};
  const Strided4<float> att{a, T * n_heads * D, D, n_heads * D, 1};
  attend(sh, q, keys, values, at.slots, at.count, at.scale, att, parallel);
}

// A block's attention: the new keys and values of y [B, T, heads, D] (q, then n_kv k, then n_kv v
// heads) written at (row, write_at), then each query over its `count` keys. a: [B, T, n_heads, D]
inline void attend_block(const float* y, int64_t B, int64_t T, int64_t n_heads, int64_t n_kv, int64_t D,
                         const BlockAttention& at, float* a, const ParallelFor& parallel) {
  if (at.caches.half)
    attend_cache<f16>(y, B, T, n_heads, n_kv, D, at, a, parallel);
  else
    attend_cache<float>(y, B, T, n_heads, n_kv, D, at, a, parallel);
}

struct LayerWeights {  // a Llama decoder layer's
  const float *ln1, *ln2;
  float eps;
  Linear qkv, o, gate_up, down;
};

// A whole decoder layer for the passes after the prefill: layer_start, attend_block, layer_end.
// h, out [B, T, H]; cos, sin [B, T, D].
inline void layer(const float* h, int64_t B, int64_t T, int64_t H, const LayerWeights& w, const float* cos,
                  const float* sin, int64_t n_heads, int64_t n_kv, int64_t D, const BlockAttention& at, float* out,
                  const ParallelFor& parallel) {
  const int64_t M = B * T;
  std::vector<float> y(M * (n_heads + 2 * n_kv) * D), a(M * n_heads * D);
  layer_start(h, M, H, w.ln1, w.eps, w.qkv, cos, sin, n_heads + n_kv, D, y.data(), parallel);
  attend_block(y.data(), B, T, n_heads, n_kv, D, at, a.data(), parallel);
  layer_end(h, a.data(), M, H, w.o, w.ln2, w.eps, w.gate_up, w.down, out, parallel);
}

// EAGLE-3's first layer (speculators' Eagle3 layer): q/k/v read [norm1(embeds), hidden_norm(hidden)]
// (twice the hidden width), and the residual stream is hidden_norm(hidden) where
// norm_before_residual, else hidden; the rest is a Llama layer's. embeds, hidden, out [B, T, H].
inline void eagle_layer(const float* embeds, const float* hidden, int64_t B, int64_t T, int64_t H,
                        const LayerWeights& w, const float* hidden_norm, bool norm_before_residual, const float* cos,
                        const float* sin, int64_t n_heads, int64_t n_kv, int64_t D, const BlockAttention& at,
                        float* out, const ParallelFor& parallel) {
  const int64_t M = B * T;
  std::vector<float> e(M * H), n(M * H), x(M * 2 * H), y(M * (n_heads + 2 * n_kv) * D), a(M * n_heads * D);
  rms_norm(embeds, M, H, w.ln1, w.eps, e.data(), parallel);
  rms_norm(hidden, M, H, hidden_norm, w.eps, n.data(), parallel);
  for (int64_t r = 0; r < M; ++r) {
    std::memcpy(x.data() + r * 2 * H, e.data() + r * H, H * sizeof(float));
    std::memcpy(x.data() + r * 2 * H + H, n.data() + r * H, H * sizeof(float));
  }
  qkv_rotary(x.data(), M, w.qkv, cos, sin, n_heads + n_kv, D, y.data(), parallel);
  attend_block(y.data(), B, T, n_heads, n_kv, D, at, a.data(), parallel);
  layer_end(norm_before_residual ? n.data() : hidden, a.data(), M, H, w.o, w.ln2, w.eps, w.gate_up, w.down, out,
            parallel);
}

}  // namespace spk
