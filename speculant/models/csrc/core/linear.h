// One quantized linear layer as the layer code sees it: its packed weight, its bias, and the
// kernel family its layout belongs to (float32 activations, quant.h; int8 activations, q8.h).
#pragma once

#include <cstdint>

#include "parallel.h"
#include "q8.h"
#include "quant.h"

namespace spk {

struct Linear {
  QWeights w;         // packed: quant.h's layout, or q8.h's where int8 (w.bits is then its q8 kind)
  const float* bias;  // [N] of every part (zeros for none)
  bool int8;          // int8 activations (q8.h)
  bool half = false;  // q8.h's direct layout with float16 scales and mins
  // int8 only: up to two more weights of other kinds whose outputs follow the first's (q/k/v or
  // gate/up of a GGUF whose tensors have different types: Q4_K_M's q and k beside a Q6_K v)
  int n_more = 0;
  Q8Weights more[2] = {};
  int64_t N() const { return w.N + (n_more > 0 ? more[0].N : 0) + (n_more > 1 ? more[1].N : 0); }
  int64_t K() const { return w.K; }
};

// y [M, N] = x [M, K] @ W^T + bias
inline void apply(const Linear& l, const float* x, int64_t M, float* y, const ParallelFor& parallel) {
  if (!l.int8) return quant_linear(x, M, l.w, l.bias, y, parallel);
  Q8Weights parts[3] = {{l.w.packed, l.w.N, l.w.K, l.w.bits, l.half}};
  int64_t col[3] = {0, l.w.N, 0};
  for (int p = 0; p < l.n_more; ++p) parts[p + 1] = l.more[p];
  if (l.n_more > 1) col[2] = col[1] + l.more[0].N;
  q8_linear_parts(x, M, parts, col, 1 + l.n_more, l.bias, y, l.N(), parallel);
}

}  // namespace spk
