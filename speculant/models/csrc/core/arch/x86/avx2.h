// AVX2 + FMA (16 ymm registers of 8 floats): a 16-lane vector is two registers, so tiles hold few
// accumulators (an output x row pair takes two); a 4-bit block widens its nibbles with vpmovzxbd
// and converts them (on AVX2 that is cheaper than a lookup of the 16 values: two vpermps and a blend
// for every 8 weights).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace spk {

constexpr const char* ISA = "avx2";

struct V16 {
  __m256 a, b;  // lanes 0-7, 8-15
};

inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, const V16& v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
inline V16 fma16(const V16& x, const V16& y, const V16& z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
inline V16 add16(const V16& x, const V16& y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V16 mul16(const V16& x, const V16& y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }

inline float sum16(const V16& v) {  // generic.h's tree
  const __m256 a = _mm256_add_ps(v.a, v.b);                                          // i + (i + 8)
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // i + (i + 4)
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                // (0 + 2), (1 + 3)
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

inline __m256 codes_to_weights(__m128i bytes8, __m256 s, __m256 m) {  // the low 8 bytes: 8 weights
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)), s, m);
}

template <int BITS>
inline void dequant(const uint8_t* codes, float scale, float min, V16& lo, V16& hi) {
  const __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(min);
  if constexpr (BITS == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    lo = {codes_to_weights(low, s, m), codes_to_weights(_mm_unpackhi_epi64(low, low), s, m)};
    hi = {codes_to_weights(high, s, m), codes_to_weights(_mm_unpackhi_epi64(high, high), s, m)};
  } else {
    auto part = [&](int at) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + at));
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s, m);
    };
    lo = {part(0), part(8)};
    hi = {part(16), part(24)};
  }
}

// Float kernel tiles: one row, 4 outputs (8 accumulators); a few rows, 2 x 2; many rows, 1 x 4.
constexpr int ONE_ROW_OUTS = 4, NARROW_OUTS = 2, NARROW_ROWS = 2, WIDE_FROM = 4, WIDE_OUTS = 1, WIDE_ROWS = 4;

}  // namespace spk
