// AVX2 + FMA (16 ymm registers of 8 floats): a 16-lane vector is two registers, so tiles hold few
// accumulators (an output x row pair takes two); a 4-bit block widens its nibbles with vpmovzxbd
// and converts them (on AVX2 that is cheaper than a lookup of the 16 values: two vpermps and a blend
// for every 8 weights).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../../vector.h"

namespace spk {

constexpr const char* ISA = "avx2";

struct V16 {
  __m256 a, b;  // lanes 0-7, 8-15
};

inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load16h(const uint16_t* p) {  // 16 halves widened (exact; F16C)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// 16 bfloat16 widened (exact), stored in pairs (generic.h): a word's low half is lane j, its high
// half lane 8 + j, so one load, a shift and a mask give both registers
inline V16 load16b(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))))};
}
inline vn halves_native(const uint16_t* p) {  // NATIVE (8) halves widened (exact; F16C)
  return (vn)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_halves_native(uint16_t* p, vn x) {  // rounded to nearest even (F16C)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
}
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

// ---- int8 activations (q8.h): 16 outputs in two registers of 8 int32 lanes. vpmaddubsw multiplies
// unsigned by signed bytes and adds pairs into int16 (4-bit codes: at most 15 * 127 * 2, no
// saturation; 8-bit codes go as |code| with x's sign flipped where the code is negative: at most
// 128 * 127 * 2 < 32768), vpmaddwd adds pairs into int32: each lane one output's 4 products.

struct I16 {
  __m256i a, b;
};

inline V16 to_float16(const I16& i) { return {_mm256_cvtepi32_ps(i.a), _mm256_cvtepi32_ps(i.b)}; }
inline V16 load16_i8(const int8_t* p) {  // 16 signed bytes widened (exact)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}

inline __m256i x4(const int8_t* p) {  // 4 inputs, broadcast to every output's lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// Integer sums may be added in any order, and GCC reorders them: a 4-row tile's 32 products of a
// block all first, through the stack, then their adds. An empty asm taking each row's sum in a
// register after a chunk (it emits nothing) keeps the adds with their products: the same sums,
// the decoder layers of a 3-row verify block 4.69 -> 3.97 ms, 4 rows 5.80 -> 5.05, 8 rows
// 11.49 -> 9.71 after 60 tokens (medians; a 2-core Zen 3: cpu-AVX2-2026-11-28-zen3-q8-tiles).
template <int R>
inline void keep_in_registers(__m256i (*sums)[2], int h) {
  for (int r = 0; r < R; ++r) asm("" : "+x"(sums[r][h]));
}

inline I16 minus(const I16& i, int32_t s) {
  const __m256i v = _mm256_set1_epi32(s);
  return {_mm256_sub_epi32(i.a, v), _mm256_sub_epi32(i.b, v)};
}

// half h (outputs 8h..8h + 7) of chunk c of 5- or 6-bit codes: its low and high nibbles with their
// high bits from the planes (each output's plane byte spread over its 4 bytes, bit j of it to byte
// j % 4 of the low nibbles (j < 4) or of the high ones)
template <int BITS>
inline void chunk_codes(const uint8_t* codes, int c, int h, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * c + 32 * h));
  lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  const __m256i spread = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C);
  const __m256i low_bits = _mm256_set1_epi32(0x08040201), high_bits = _mm256_set1_epi32(int(0x80402010u));
  for (int k = 0; k < BITS - 4; ++k) {
    const __m128i plane = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 256 + 64 * k + 16 * c + 8 * h));
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_cvtepu8_epi32(plane), spread);
    const __m256i add = _mm256_set1_epi8(static_cast<char>(16 << k));
    const __m256i lo_set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, low_bits), low_bits);
    const __m256i hi_set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, high_bits), high_bits);
    lo = _mm256_or_si256(lo, _mm256_and_si256(lo_set, add)), hi = _mm256_or_si256(hi, _mm256_and_si256(hi_set, add));
  }
}

template <int BITS, int R, int C0 = 0, int C1 = q8_chunks(BITS)>
inline void dot_rows(const uint8_t* codes, const int8_t* const* x, const int32_t*, I16* out) {
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  if constexpr (BITS == 5 || BITS == 6) {
    // a chunk's pair sums widened at once (2 of at most 2 * 63 * 127: 32004 < 32768)
    for (int c = C0; c < C1; ++c)
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;
        chunk_codes<BITS>(codes, c, h, lo, hi);
        for (int r = 0; r < R; ++r)
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, x4(x[r] + 8 * c)), _mm256_maddubs_epi16(hi, x4(x[r] + 8 * c + 4))),
              _mm256_set1_epi16(1)));
        keep_in_registers<R>(acc, h);
      }
  } else if constexpr (BITS == 4) {
    // the block's pair sums stay in int16 (8 of at most 2 * 15 * 127: 30480 < 32768), widened once
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i pairs[R][2];
    for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
    for (int c = C0; c < C1; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * c + 32 * h));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int r = 0; r < R; ++r)
          pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x4(x[r] + 8 * c)),
                                                                       _mm256_maddubs_epi16(hi, x4(x[r] + 8 * c + 4))));
        keep_in_registers<R>(pairs, h);
      }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_madd_epi16(pairs[r][h], _mm256_set1_epi16(1));
  } else {
    for (int c = C0; c < C1; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * c + 32 * h));
        const __m256i mag = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) acc[r][h] = dot_u8s8(acc[r][h], mag, _mm256_sign_epi8(x4(x[r] + 4 * c), v));
        keep_in_registers<R>(acc, h);
      }
  }
  for (int r = 0; r < R; ++r) out[r] = {acc[r][0], acc[r][1]};
}

// rows a tile: a block's nibbles are unpacked once for all of them, and 4 rows' int16 pair sums (8
// registers) with the codes, their halves and the mask fit the 16 (2 rows: each extra verify row
// cost 23-37 % of a one-row pass on a Zen 3, 4 rows: 13-25 % at widths 2-8)
constexpr int Q8_ROWS = 4;
// a block of exactly 5 rows (a γ-4 chain's) is one tile of 5: the group's weights read once, and
// prefetched as a one-tile stream (4 + 1 read them twice; tiles of 5 for wider blocks made 6 and 8
// rows slower: q8.h)
constexpr int q8_one_tile_rows(int) { return 5; }
// bytes past a block's start a one-row q8 tile asks for (2 KB: measured on a 2-core Zen 3 (q8.h))
constexpr int64_t Q8_PREFETCH_AHEAD = 2048;

}  // namespace spk
