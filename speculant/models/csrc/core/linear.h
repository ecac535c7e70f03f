// One quantized linear layer as the layer code sees it: its packed weight, its bias, and the
// kernel family that multiplies with it.
#pragma once

#include <cstdint>

#include "parallel.h"
#include "quant.h"

namespace spk {

struct Linear {
  QWeights w;
  const float* bias;  // [N] (zeros for none)
  int64_t N() const { return w.N; }
  int64_t K() const { return w.K; }
};

// y [M, N] = x [M, K] @ W^T + bias
inline void apply(const Linear& l, const float* x, int64_t M, float* y, const ParallelFor& parallel) {
  quant_linear(x, M, l.w, l.bias, y, parallel);
}

}  // namespace spk
