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
inline void rms_norm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * H;
    V16 ss = zero16();
    for (int64_t i = 0; i < H; i += 16) ss = fma16(load16(xr + i), load16(xr + i), ss);
    const V16 inv = set16(1.0f / std::sqrt(sum16(ss) / static_cast<float>(H) + eps));
    for (int64_t i = 0; i < H; i += 16) store16(out + r * H + i, mul16(load16(w + i), mul16(load16(xr + i), inv)));
  }
}

// silu(g) = g / (1 + exp(-g)), from e = exp(-|g|) <= 1 (the vector exp takes arguments <= 0)
inline vf silu(vf g) {
  const vf zero = g - g;
  const vf e = exp_vector(g < zero ? g : zero - g);
  const vf one = zero + 1.0f;
  return g * (g < zero ? e : one) / (one + e);
}

// rotary on the first `roped` heads of D of each row of y [M, width]: x * cos + rotate_half(x) * sin,
// element by element (two roundings and a sum, as PyTorch computes HF's expression)
inline void rotary(float* y, int64_t M, int64_t width, const float* cos, const float* sin, int64_t roped, int64_t D) {
  const int64_t half = D / 2;
  std::vector<float> head(D);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < roped; ++k) {
      float* p = y + r * width + k * D;
      std::memcpy(head.data(), p, D * sizeof(float));
      for (int64_t i = 0; i < D; ++i) {
        const float rot = i < half ? -head[i + half] : head[i - half];
        const float a = head[i] * cos[r * D + i], b = rot * sin[r * D + i];
        p[i] = a + b;
      }
    }
}

// up to attention: norm, the q/k/v matmul, rotary on the first `roped` heads.
// h [M, H]; cos, sin [M, D]; y [M, qkv.N] (q, k and v heads side by side)
inline void layer_start(const float* h, int64_t M, int64_t H, const float* ln, float eps, const Linear& qkv,
                        const float* cos, const float* sin, int64_t roped, int64_t D, float* y,
                        const ParallelFor& parallel) {
  std::vector<float> x(M * H);
  rms_norm(h, M, H, ln, eps, x.data());
  apply(qkv, x.data(), M, y, parallel);
  rotary(y, M, qkv.N(), cos, sin, roped, D);
}

// the rest: out = h + o(attn), then out += down(silu(gate) * up) of its norm. h, out [M, H]; attn [M, A]
inline void layer_end(const float* h, const float* attn, int64_t M, int64_t H, const Linear& o, const float* ln,
                      float eps, const Linear& gate_up, const Linear& down, float* out, const ParallelFor& parallel) {
  const int64_t I = gate_up.N() / 2;
  apply(o, attn, M, out, parallel);
  for (int64_t i = 0; i < M * H; ++i) out[i] = h[i] + out[i];
  std::vector<float> x(M * H), gu(M * 2 * I), act(M * I), d(M * H);
  rms_norm(out, M, H, ln, eps, x.data());
  apply(gate_up, x.data(), M, gu.data(), parallel);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < I; i += LANES)
      vstore(act.data() + r * I + i, silu(vload(gu.data() + r * 2 * I + i)) * vload(gu.data() + r * 2 * I + I + i));
  apply(down, act.data(), M, d.data(), parallel);
  for (int64_t i = 0; i < M * H; ++i) out[i] += d[i];
}

struct LayerCaches {  // float32 [B, n_kv, S, D], contiguous along D
  float *k, *v;
  int64_t s0, s1, s2, S;
};

// A whole decoder layer for the passes after the prefill: layer_start; the new keys and values
// written at (row, write_at); attention, each query over its `count` keys (gathered by `slots` for
// a tree, else slots 0..); layer_end. h, out [B, T, H]; cos, sin [B, T, D]; write_at, count [B, T].
inline void layer(const float* h, int64_t B, int64_t T, int64_t H, const float* ln1, float eps, const Linear& qkv,
                  const float* cos, const float* sin, int64_t n_heads, int64_t n_kv, int64_t D, LayerCaches c,
                  const int64_t* write_at, const int64_t* slots, int64_t W, const int64_t* count, float scale,
                  const Linear& o, const float* ln2, const Linear& gate_up, const Linear& down, float* out,
                  const ParallelFor& parallel) {
  const int64_t heads = n_heads + 2 * n_kv, M = B * T;
  std::vector<float> y(M * heads * D), a(M * n_heads * D);
  layer_start(h, M, H, ln1, eps, qkv, cos, sin, n_heads + n_kv, D, y.data(), parallel);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = write_at[b * T + t];
      if (slot < 0 || slot >= c.S) throw std::out_of_range("layer: write_at outside the cache");
      for (int64_t j = 0; j < n_kv; ++j) {
        const float* src = y.data() + ((b * T + t) * heads + n_heads + j) * D;
        std::memcpy(c.k + b * c.s0 + j * c.s1 + slot * c.s2, src, D * sizeof(float));
        std::memcpy(c.v + b * c.s0 + j * c.s1 + slot * c.s2, src + n_kv * D, D * sizeof(float));
      }
    }
  // queries [B, n_heads, T, D] read in place from y [B, T, heads, D]; the output [B, T, n_heads, D]
  const AttentionShape sh{B, n_heads, T, D, n_kv, c.S, W};
  const Strided4<const float> q{y.data(), T * heads * D, D, heads * D, 1};
  const Strided4<const float> keys{c.k, c.s0, c.s1, c.s2, 1}, values{c.v, c.s0, c.s1, c.s2, 1};
  const Strided4<float> att{a.data(), T * n_heads * D, D, n_heads * D, 1};
  attend<float>(sh, q, keys, values, slots, count, scale, att, parallel);
  layer_end(h, a.data(), M, H, o, ln2, eps, gate_up, down, out, parallel);
}

}  // namespace spk
