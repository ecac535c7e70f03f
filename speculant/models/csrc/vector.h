// 16-float vectors in GCC/Clang's vector extensions (any x86 width: one AVX-512 register or two
// AVX2 ones), shared by the CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

constexpr int LANES = 16;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));  // GCC/Clang vectors: any x86 width

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

// exp(x) for x <= 0, LANES at a time (Cephes' expf: 2^n times a polynomial): each lane's value is a
// function of its x alone (attention builds it without contraction: every operation a plain IEEE one)
inline vf exp_vector(vf x) {
  const vf zero = x - x, lo = zero - 87.0f;
  x = x < lo ? lo : x;
  x = x > zero ? zero : x;  // lanes past a query's keys hold other scores: kept finite
  const vf t = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);  // toward zero, then down: floor(t)
  n -= __builtin_convertvector(n > t, vf) * -1.0f;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf p;
  std::memcpy(&p, &bits, sizeof p);
  return y * p;
}

}  // namespace
