// 16-float vectors in GCC/Clang's vector extensions (one AVX-512 register, two AVX2 ones, four NEON
// ones): elementwise code every branch compiles alike (the core is built without contraction, so
// each operation is a plain IEEE one and gives the same bits on every ISA).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

namespace spk {

constexpr int LANES = 16;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

// The machine's own register width, for hot loops: compilers keep 16-float vectors in registers
// only where one register holds them (AVX-512); on AVX2 and NEON they go through the stack, so
// those loops run on `vn` (8 or 4 floats), LANES / NATIVE of them side by side: the same
// elementwise operations, the same bits.
#if defined(__AVX512F__)
constexpr int NATIVE = 16;
#elif defined(__AVX__)
constexpr int NATIVE = 8;
#else
constexpr int NATIVE = 4;
#endif
constexpr int PARTS = LANES / NATIVE;
// chunks of 4 int32 lanes' bytes a q8 block's codes come in (q8.h): 4 of 8 inputs (4- to 6-bit), 8 of 4 (8-bit);
// the first half of them holds the block's inputs 0-15, the second 16-31
constexpr int q8_chunks(int bits) { return bits == 8 ? 8 : 4; }
typedef float vn __attribute__((vector_size(NATIVE * sizeof(float))));

template <typename V = vf>
inline V vload(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void vstore(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0, a vector (vf or vn) at a time (Cephes' expf: 2^n times a polynomial): each
// lane's value is a function of its x alone
template <typename V>
inline V exp_vector(V x) {
  typedef int32_t VI __attribute__((vector_size(sizeof(V))));
  const V zero = x - x, lo = zero - 87.0f;
  x = x < lo ? lo : x;
  x = x > zero ? zero : x;  // lanes past a query's keys hold other scores: kept finite
  const V t = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(t, VI), V);  // toward zero, then down: floor(t)
  n -= __builtin_convertvector(n > t, V) * -1.0f;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V p;
  std::memcpy(&p, &bits, sizeof p);
  return y * p;
}

// NATIVE x NATIVE floats transposed in registers: rows[i][j] becomes rows[j][i], by swapping the
// off-diagonal blocks of each size S in turn (two-register shuffles): data moves, no arithmetic.
// Of rows i and i + S (i & S == 0), the first takes lanes K of a where K & S == 0, else b's lane
// K - S; the second a's lane K + S where K & S == 0, else b's lane K.
#define SPK_SWAP_LANE(K, S, HIGH) ((K & S) == 0 ? K + (HIGH ? S : 0) : NATIVE + K - (HIGH ? 0 : S))
template <int S, bool HIGH, int... K>
inline vn swap_blocks(vn a, vn b, std::integer_sequence<int, K...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, SPK_SWAP_LANE(K, S, HIGH)...);
#else
  typedef int32_t vni __attribute__((vector_size(sizeof(vn))));
  return __builtin_shuffle(a, b, vni{SPK_SWAP_LANE(K, S, HIGH)...});
#endif
}
#undef SPK_SWAP_LANE
template <int S = 1>
inline void transpose_native(vn (&rows)[NATIVE]) {
  if constexpr (S < NATIVE) {
    constexpr auto lanes = std::make_integer_sequence<int, NATIVE>{};
    for (int i = 0; i < NATIVE; ++i)
      if ((i & S) == 0) {
        const vn a = rows[i], b = rows[i + S];
        rows[i] = swap_blocks<S, false>(a, b, lanes), rows[i + S] = swap_blocks<S, true>(a, b, lanes);
      }
    transpose_native<S * 2>(rows);
  }
}

// the lanes' sum in the fixed tree of the arch headers' sum16
inline float lanes_sum(vf v) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// Index of the largest of x[0..n), the first where several are equal, and of the first NaN where
// there is one (NaN counts as the largest): PyTorch's max(-1).indices. One pass: each lane keeps its
// largest value and where it first saw it; the lanes' largest, at its first index, is the row's.
inline int64_t argmax(const float* x, int64_t n) {
  typedef int32_t vni __attribute__((vector_size(sizeof(vn))));
  vn most = vn{} - __builtin_inff();
  vni at{}, index{}, nan{};
  for (int l = 0; l < NATIVE; ++l) index[l] = l;
  int64_t i = 0;
  for (; i + NATIVE <= n && i < (int64_t(1) << 31) - NATIVE; i += NATIVE, index += NATIVE) {
    const vn v = vload<vn>(x + i);
    const vni more = v > most;
    most = more ? v : most;
    at = more ? index : at;
    nan |= v != v;
  }
  float best = -__builtin_inff();
  int64_t where = -1;
  bool any_nan = false;
  for (int l = 0; l < NATIVE; ++l) {
    any_nan |= nan[l] != 0;
    if (i > 0 && (most[l] > best || (most[l] == best && (where < 0 || at[l] < where)))) best = most[l], where = at[l];
  }
  for (int64_t j = i; j < n; ++j) {
    any_nan |= x[j] != x[j];
    if (where < 0 || x[j] > best) best = x[j], where = j;
  }
  if (any_nan)
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  return where < 0 ? 0 : where;
}

// element types of caches and activations: float, bfloat16 and float16 stored as 16 bits
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16 x) {  // exact: every half is a float
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16, exp = (x.bits >> 10) & 0x1F, mant = x.bits & 0x3FF;
  uint32_t u;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16 from_float<bf16>(float f) {  // round to nearest even, as PyTorch's conversion
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return {0x7FC0};
  u += 0x7FFF + ((u >> 16) & 1);
  return {static_cast<uint16_t>(u >> 16)};
}
template <>
inline f16 from_float<f16>(float f) {  // round to nearest even, as PyTorch's conversion and F16C's; a NaN
  uint32_t x;                          // quieted, its payload's top bits kept (as F16C and NEON do)
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xFF;
  uint32_t mant = x & 0x7FFFFF;
  if (exp == 0xFF) return {static_cast<uint16_t>(sign | (mant ? 0x7E00 | (mant >> 13) : 0x7C00))};
  const int e = static_cast<int>(exp) - 112;  // the half's biased exponent
  if (e >= 31) return {static_cast<uint16_t>(sign | 0x7C00)};
  uint32_t h, rest, half;
  if (e <= 0) {  // a subnormal half (or zero): units of 2^-24
    if (e < -10) return {static_cast<uint16_t>(sign)};
    mant |= 0x800000;
    const int shift = 14 - e;
    h = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  } else {
    h = (static_cast<uint32_t>(e) << 10) | (mant >> 13), rest = mant & 0x1FFF, half = 0x1000;
  }
  if (rest > half || (rest == half && (h & 1))) ++h;  // a carry moves into the exponent, as it should
  return {static_cast<uint16_t>(sign | h)};
}

}  // namespace spk
