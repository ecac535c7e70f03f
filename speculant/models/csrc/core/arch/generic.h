// Plain C++ lanes: the reference every ISA branch must equal bit for bit, and the branch for CPUs
// with none of the others (its speed does not matter; its bits do).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../vector.h"

namespace spk {

constexpr const char* ISA = "generic";

struct V16 {
  float v[16];
};

inline V16 zero16() { return V16{}; }
inline V16 set16(float s) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = s;
  return r;
}
inline V16 load16(const float* p) {
  V16 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline V16 load16h(const uint16_t* p) {  // 16 halves widened (exact: vector.h's conversion)
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = to_float(f16{p[i]});
  return r;
}
// 16 bfloat16 widened (exact: a float's upper half), stored in pairs: p[2j] is lane j, p[2j + 1] lane
// 8 + j (quant.h's bits-16 layout: each 32-bit word holds lane j low and lane 8 + j high)
inline V16 load16b(const uint16_t* p) {
  V16 r;
  for (int j = 0; j < 8; ++j) {
    const uint32_t lo = uint32_t(p[2 * j]) << 16, hi = uint32_t(p[2 * j + 1]) << 16;
    std::memcpy(&r.v[j], &lo, 4);
    std::memcpy(&r.v[8 + j], &hi, 4);
  }
  return r;
}
inline vn halves_native(const uint16_t* p) {  // NATIVE halves widened (exact: vector.h's conversion)
  vn r;
  for (int i = 0; i < NATIVE; ++i) r[i] = to_float(f16{p[i]});
  return r;
}
inline void store_halves_native(uint16_t* p, vn x) {  // rounded to nearest even (vector.h's conversion)
  for (int i = 0; i < NATIVE; ++i) p[i] = from_float<f16>(x[i]).bits;
}
inline void store16(float* p, const V16& a) { std::memcpy(p, a.v, sizeof a.v); }
inline V16 fma16(const V16& a, const V16& b, const V16& c) {  // a * b + c, one rounding
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline V16 add16(const V16& a, const V16& b) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline V16 mul16(const V16& a, const V16& b) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}

// the lanes' sum in the one fixed tree every branch uses: i + (i + 8), then i + (i + 4), then
// (0 + 2) + (1 + 3)
inline float sum16(const V16& a) {
  float b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) c[i] = b[i] + b[i + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// One block of 32 weights, dequantized: w = fma(code, scale, min). 4-bit: byte i holds inputs i
// (low nibble) and 16 + i (high nibble); 8-bit: signed codes.
template <int BITS>
inline void dequant(const uint8_t* codes, float scale, float min, V16& lo, V16& hi) {
  for (int i = 0; i < 16; ++i) {
    const float a = BITS == 4 ? float(codes[i] & 15) : float(int8_t(codes[i]));
    const float b = BITS == 4 ? float(codes[i] >> 4) : float(int8_t(codes[16 + i]));
    lo.v[i] = std::fma(a, scale, min);
    hi.v[i] = std::fma(b, scale, min);
  }
}

// Float kernel tiles (outputs x rows a tile takes together): plain loops, one row at a time.
constexpr int ONE_ROW_OUTS = 1, NARROW_OUTS = 1, NARROW_ROWS = 4, WIDE_FROM = 1 << 30, WIDE_OUTS = 1, WIDE_ROWS = 4;

// ---- int8 activations (q8.h): 16 outputs in 16 int32 lanes

struct I16 {
  int32_t v[16];
};

inline V16 to_float16(const I16& a) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}
inline V16 load16_i8(const int8_t* p) {  // 16 signed bytes widened (exact)
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}

inline I16 minus(const I16& a, int32_t s) {  // each lane less s (an offset's share of the sums)
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - s;
  return r;
}

// For R rows: lane o of out[r] = sum over the block's inputs in chunks [C0, C1) of code(o, k) *
// x[r][k], exact. Codes (q8.h's layout): 4-bit, 4 chunks x 16 outputs x 4 bytes (low nibbles inputs
// 8c + j, high nibbles 8c + 4 + j); 5- and 6-bit, those nibbles and 1 or 2 planes of their high bits
// (plane k's byte 16c + o, bit j: bit 4 + k of input 8c + j); 8-bit, 8 chunks x 16 outputs x 4
// signed bytes (inputs 4c + j).
template <int BITS, int R, int C0 = 0, int C1 = q8_chunks(BITS)>
inline void dot_rows(const uint8_t* codes, const int8_t* const* x, const int32_t*, I16* out) {
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < 16; ++o) {
      int32_t sum = 0;
      if (BITS < 8) {
        for (int c = C0; c < C1; ++c)
          for (int j = 0; j < 8; ++j) {
            const uint8_t b = codes[(c * 16 + o) * 4 + j % 4];
            int q = j < 4 ? b & 15 : b >> 4;
            for (int k = 0; k < BITS - 4; ++k) q |= ((codes[256 + 64 * k + 16 * c + o] >> j) & 1) << (4 + k);
            sum += q * x[r][8 * c + j];
          }
      } else {
        for (int c = C0; c < C1; ++c)
          for (int j = 0; j < 4; ++j) sum += int8_t(codes[(c * 16 + o) * 4 + j]) * x[r][4 * c + j];
      }
      out[r].v[o] = sum;
    }
}

constexpr int Q8_ROWS = 1;  // rows a q8 tile takes together
constexpr int q8_one_tile_rows(int) { return Q8_ROWS; }  // no block is one wider tile
// bytes past a block's start a one-row q8 tile asks for (the plain branch: not tuned)
constexpr int64_t Q8_PREFETCH_AHEAD = 256;

}  // namespace spk
