// AVX-512 (32 zmm registers of 16 floats): a 16-lane vector is one register. A 4-bit block is
// dequantized by looking its codes up in the 16 values they can take (one FMA makes them, two
// vpermps pick them: the index's low 4 bits are the low nibble, a shift gives the high one).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../../vector.h"

namespace spk {

#if defined(__AVX512VNNI__) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
constexpr const char* ISA = "avx512-vnni-amx";  // q8's wider blocks on AMX tiles (amx.h)
#elif defined(__AVX512VNNI__)
constexpr const char* ISA = "avx512-vnni";
#else
constexpr const char* ISA = "avx512";
#endif

struct V16 {
  __m512 a;
};

inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float s) { return {_mm512_set1_ps(s)}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load16h(const uint16_t* p) {  // 16 halves widened (exact)
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 16 bfloat16 widened (exact), stored in pairs (generic.h): lanes 0-7 the words' low halves, 8-15 their high
inline V16 load16b(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_slli_epi32(v, 16), hi = _mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u)));
  return {_mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1))};
}
inline vn halves_native(const uint16_t* p) {  // NATIVE (16) halves widened (exact)
  return (vn)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_halves_native(uint16_t* p, vn x) {  // rounded to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT));
}
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

// ---- int8 activations (q8.h): 16 outputs in one register of 16 int32 lanes. With VNNI, vpdpbusd
// adds each lane's 4 unsigned-by-signed byte products into it (8-bit codes go offset by 128 as
// unsigned bytes, and 128 * sum(x) comes off after); without, vpmaddubsw and vpmaddwd as on AVX2.

struct I16 {
  __m512i a;
};

inline V16 to_float16(const I16& i) { return {_mm512_cvtepi32_ps(i.a)}; }
inline V16 load16_i8(const int8_t* p) {  // 16 signed bytes widened (exact)
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}

inline __m512i x4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

inline I16 minus(const I16& a, int32_t s) { return {_mm512_sub_epi32(a.a, _mm512_set1_epi32(s))}; }

// chunk c's codes, its low and its high nibbles, each lane's 4 bytes; 5- and 6-bit codes with their
// high bits from the planes (each output's plane byte spread over its 4 bytes, bit j of it to byte
// j % 4 of the low nibbles (j < 4) or of the high ones)
template <int BITS>
inline void chunk_codes(const uint8_t* codes, int c, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(15);
  const __m512i v = _mm512_loadu_si512(codes + 64 * c);
  lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  if constexpr (BITS > 4) {
    const __m512i spread = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000);
    const __m512i low_bits = _mm512_set1_epi32(0x08040201), high_bits = _mm512_set1_epi32(int(0x80402010u));
    for (int k = 0; k < BITS - 4; ++k) {
      const __m128i plane = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 256 + 64 * k + 16 * c));
      const __m512i bytes = _mm512_shuffle_epi8(_mm512_cvtepu8_epi32(plane), spread);
      const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << k));
      lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bytes, low_bits), lo, add);
      hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bytes, high_bits), hi, add);
    }
  }
}

template <int BITS, int R, int C0 = 0, int C1 = q8_chunks(BITS)>
inline void dot_rows(const uint8_t* codes, const int8_t* const* x, const int32_t* sumq, I16* out) {
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  if constexpr (BITS < 8) {
    for (int c = C0; c < C1; ++c) {
      __m512i lo, hi;
      chunk_codes<BITS>(codes, c, lo, hi);
      for (int r = 0; r < R; ++r) acc[r] = dot_u8s8(dot_u8s8(acc[r], lo, x4(x[r] + 8 * c)), hi, x4(x[r] + 8 * c + 4));
    }
  } else {
#if defined(__AVX512VNNI__)
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int c = C0; c < C1; ++c) {
      const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(codes + 64 * c), offset);  // code + 128
      for (int r = 0; r < R; ++r) acc[r] = dot_u8s8(acc[r], u, x4(x[r] + 4 * c));
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(128 * sumq[r]));
#else
    for (int c = C0; c < C1; ++c) {
      const __m512i v = _mm512_loadu_si512(codes + 64 * c);
      const __m512i mag = _mm512_abs_epi8(v);
      const __mmask64 negative = _mm512_movepi8_mask(v);
      for (int r = 0; r < R; ++r) {
        const __m512i xs = x4(x[r] + 4 * c);
        acc[r] = dot_u8s8(acc[r], mag, _mm512_mask_sub_epi8(xs, negative, _mm512_setzero_si512(), xs));
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r) out[r] = {acc[r]};
}

constexpr int Q8_ROWS = 4;
// a block of 5-8 rows (a γ-4..7 chain's, a tree's) is one tile: 32 registers hold 8 rows' sums. 8-bit
// weights stop at 6: an 8-row tile of the default target's 8-bit LM head took 1.79 ms against 1.42 as 4 + 4
constexpr int q8_one_tile_rows(int bits) { return bits == 8 ? 6 : 8; }  // 5- and 6-bit codes unpack as 4-bit ones do
// bytes past a block's start a one-row q8 tile asks for (measured on a 2-core Zen 4: 0, 128 and 256 alike, 384 up slower)
#if defined(SPK_Q8_PREFETCH_AHEAD)  // an experiment's (scripts/q8_widths_ab.py-style builds)
constexpr int64_t Q8_PREFETCH_AHEAD = SPK_Q8_PREFETCH_AHEAD;
#else
constexpr int64_t Q8_PREFETCH_AHEAD = 256;
#endif

}  // namespace spk

#if defined(__AVX512VNNI__) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include "amx.h"
#endif
