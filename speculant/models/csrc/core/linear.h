// One quantized linear layer as the layer code sees it: its packed weight, its bias, and the
// kernel family its layout belongs to (float32 activations, quant.h; int8 activations, q8.h).
#pragma once

#include <cstdint>

#include "parallel.h"
#include "q8.h"
#include "quant.h"

namespace spk {

struct Linear {
  QWeights w;         // packed: quant.h's layout, or q8.h's where int8
  const float* bias;  // [N] (zeros for none)
  bool int8;          // int8 activations (q8.h)
  bool half = false;  // q8.h's layout with float16 scales and mins
  int64_t N() const { return w.N; }
  int64_t K() const { return w.K; }
};

// y [M, N] = x [M, K] @ W^T + bias
inline void apply(const Linear& l, const float* x, int64_t M, float* y, const ParallelFor& parallel) {
  if (l.int8)
    q8_linear(x, M, {l.w.packed, l.w.N, l.w.K, l.w.bits, l.half}, l.bias, y, parallel);
  else
    quant_linear(x, M, l.w, l.bias, y, parallel);
}

}  // namespace spk
