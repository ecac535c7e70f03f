// AVX-512 (32 zmm registers of 16 floats): a 16-lane vector is one register. A 4-bit block is
// dequantized by looking its codes up in the 16 values they can take (one FMA makes them, two
// vpermps pick them: the index's low 4 bits are the low nibble, a shift gives the high one).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace spk {

constexpr const char* ISA = "avx512";

struct V16 {
  __m512 a;
};

inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float s) { return {_mm512_set1_ps(s)}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, const V16& v) { _mm512_storeu_ps(p, v.a); }
inline V16 fma16(const V16& x, const V16& y, const V16& z) { return {_mm512_fmadd_ps(x.a, y.a, z.a)}; }
inline V16 add16(const V16& x, const V16& y) { return {_mm512_add_ps(x.a, y.a)}; }
inline V16 mul16(const V16& x, const V16& y) { return {_mm512_mul_ps(x.a, y.a)}; }

inline float sum16(const V16& v) {  // generic.h's tree
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v.a),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.a), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

template <int BITS>
inline void dequant(const uint8_t* codes, float scale, float min, V16& lo, V16& hi) {
  if constexpr (BITS == 4) {
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(scale), _mm512_set1_ps(min));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    lo = {_mm512_permutexvar_ps(bytes, table)};  // the index's low 4 bits: the low nibble
    hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table)};
  } else {
    const __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(min);
    auto part = [&](int at) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + at));
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s, m);
    };
    lo = {part(0)};
    hi = {part(16)};
  }
}

// Float kernel tiles: 4 outputs x 4 rows; from 8 rows 2 outputs x 8 rows (a block dequantized for more rows).
constexpr int ONE_ROW_OUTS = 4, NARROW_OUTS = 4, NARROW_ROWS = 4, WIDE_FROM = 8, WIDE_OUTS = 2, WIDE_ROWS = 8;

}  // namespace spk
