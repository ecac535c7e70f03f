// ARM NEON (aarch64: 32 registers of 4 floats): a 16-lane vector is four registers. Nibbles are
// split with vand/vshr on 16 bytes at once, widened with vmovl and converted with vcvtq; vfmaq is
// the fused multiply-add.
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "../../vector.h"

namespace spk {

#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* ISA = "neon-dotprod";
#else
constexpr const char* ISA = "neon";
#endif

struct V16 {
  float32x4_t q[4];  // lanes 0-3, 4-7, 8-11, 12-15
};

inline V16 zero16() { return {{vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)}}; }
inline V16 set16(float s) { return {{vdupq_n_f32(s), vdupq_n_f32(s), vdupq_n_f32(s), vdupq_n_f32(s)}}; }
inline V16 load16(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline V16 load16h(const uint16_t* p) {  // 16 halves widened (exact)
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
  return r;
}
// 16 bfloat16 widened (exact), stored in pairs (generic.h): lanes 0-7 the words' low halves, 8-15 their high
inline V16 load16b(const uint16_t* p) {
  const uint32x4_t a = vld1q_u32(reinterpret_cast<const uint32_t*>(p)), b = vld1q_u32(reinterpret_cast<const uint32_t*>(p + 8));
  const uint32x4_t mask = vdupq_n_u32(0xFFFF0000u);
  V16 r;
  r.q[0] = vreinterpretq_f32_u32(vshlq_n_u32(a, 16));
  r.q[1] = vreinterpretq_f32_u32(vshlq_n_u32(b, 16));
  r.q[2] = vreinterpretq_f32_u32(vandq_u32(a, mask));
  r.q[3] = vreinterpretq_f32_u32(vandq_u32(b, mask));
  return r;
}
inline vn halves_native(const uint16_t* p) {  // NATIVE (4) halves widened (exact)
  const float32x4_t f = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  vn r;
  std::memcpy(&r, &f, sizeof r);
  return r;
}
inline void store_halves_native(uint16_t* p, vn x) {  // rounded to nearest even (FPCR's default)
  float32x4_t f;
  std::memcpy(&f, &x, sizeof f);
  vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(f)));
}
inline void store16(float* p, const V16& v) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, v.q[i]);
}
inline V16 fma16(const V16& x, const V16& y, const V16& z) {  // z + x * y, one rounding
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vfmaq_f32(z.q[i], x.q[i], y.q[i]);
  return r;
}
inline V16 add16(const V16& x, const V16& y) {
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vaddq_f32(x.q[i], y.q[i]);
  return r;
}
inline V16 mul16(const V16& x, const V16& y) {
  V16 r;
  for (int i = 0; i < 4; ++i) r.q[i] = vmulq_f32(x.q[i], y.q[i]);
  return r;
}

inline float sum16(const V16& v) {  // generic.h's tree
  const float32x4_t a0 = vaddq_f32(v.q[0], v.q[2]), a1 = vaddq_f32(v.q[1], v.q[3]);  // i + (i + 8)
  const float32x4_t b = vaddq_f32(a0, a1);                                          // i + (i + 4)
  const float32x2_t c = vadd_f32(vget_low_f32(b), vget_high_f32(b));                // (0 + 2), (1 + 3)
  return vget_lane_f32(c, 0) + vget_lane_f32(c, 1);
}

inline void widen_u8(uint8x16_t b, float32x4_t s, float32x4_t m, float32x4_t* out) {  // 16 codes -> 16 weights
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
  out[0] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), s);
  out[1] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_high_u16(lo)), s);
  out[2] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), s);
  out[3] = vfmaq_f32(m, vcvtq_f32_u32(vmovl_high_u16(hi)), s);
}

inline void widen_s8(int8x16_t b, float32x4_t s, float32x4_t m, float32x4_t* out) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  out[0] = vfmaq_f32(m, vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), s);
  out[1] = vfmaq_f32(m, vcvtq_f32_s32(vmovl_high_s16(lo)), s);
  out[2] = vfmaq_f32(m, vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), s);
  out[3] = vfmaq_f32(m, vcvtq_f32_s32(vmovl_high_s16(hi)), s);
}

template <int BITS>
inline void dequant(const uint8_t* codes, float scale, float min, V16& lo, V16& hi) {
  const float32x4_t s = vdupq_n_f32(scale), m = vdupq_n_f32(min);
  if constexpr (BITS == 4) {
    const uint8x16_t bytes = vld1q_u8(codes);
    widen_u8(vandq_u8(bytes, vdupq_n_u8(15)), s, m, lo.q);
    widen_u8(vshrq_n_u8(bytes, 4), s, m, hi.q);
  } else {
    widen_s8(vld1q_s8(reinterpret_cast<const int8_t*>(codes)), s, m, lo.q);
    widen_s8(vld1q_s8(reinterpret_cast<const int8_t*>(codes + 16)), s, m, hi.q);
  }
}

// Float kernel tiles (not measured on ARM hardware): 16 accumulators of 4 lanes at most.
constexpr int ONE_ROW_OUTS = 4, NARROW_OUTS = 2, NARROW_ROWS = 2, WIDE_FROM = 4, WIDE_OUTS = 1, WIDE_ROWS = 4;

// ---- int8 activations (q8.h): 16 outputs in four registers of 4 int32 lanes. With the dot-product
// extension, sdot adds each lane's 4 byte products into it; without, vmull_s8, a pairwise add (at
// most 2 * 128 * 127 < 32768) and vpadalq (into int32) do the same.

struct I16 {
  int32x4_t q[4];
};

inline V16 to_float16(const I16& i) {
  V16 r;
  for (int k = 0; k < 4; ++k) r.q[k] = vcvtq_f32_s32(i.q[k]);
  return r;
}

inline V16 load16_i8(const int8_t* p) {  // 16 signed bytes widened (exact)
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  V16 r;
  r.q[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), r.q[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  r.q[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), r.q[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
  return r;
}

inline int8x16_t x4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else
  const int16x8_t pairs = vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(x)), vmull_high_s8(w, x));
  return vpadalq_s16(acc, pairs);
#endif
}

inline I16 minus(const I16& i, int32_t s) {
  I16 r;
  for (int k = 0; k < 4; ++k) r.q[k] = vsubq_s32(i.q[k], vdupq_n_s32(s));
  return r;
}

// register k (outputs 4k..4k + 3) of chunk c: its low and high nibbles, with 5- and 6-bit codes'
// high bits from the planes (each output's plane byte spread over its 4 bytes, bit j of it to byte
// j % 4 of the low nibbles (j < 4) or of the high ones)
template <int BITS>
inline void chunk_codes(const uint8_t* codes, int c, int k, int8x16_t& lo, int8x16_t& hi) {
  const uint8x16_t v = vld1q_u8(codes + 64 * c + 16 * k);
  uint8x16_t l = vandq_u8(v, vdupq_n_u8(15)), h = vshrq_n_u8(v, 4);
  if constexpr (BITS > 4) {
    const uint8_t at = static_cast<uint8_t>(4 * k);
    const uint8_t spread_bytes[16] = {at, at, at, at, uint8_t(at + 1), uint8_t(at + 1), uint8_t(at + 1), uint8_t(at + 1),
                                      uint8_t(at + 2), uint8_t(at + 2), uint8_t(at + 2), uint8_t(at + 2),
                                      uint8_t(at + 3), uint8_t(at + 3), uint8_t(at + 3), uint8_t(at + 3)};
    const uint8_t low_bytes[16] = {1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8};
    const uint8x16_t spread = vld1q_u8(spread_bytes), low_bits = vld1q_u8(low_bytes);
    const uint8x16_t high_bits = vshlq_n_u8(low_bits, 4);
    for (int p = 0; p < BITS - 4; ++p) {
      const uint8x16_t bytes = vqtbl1q_u8(vld1q_u8(codes + 256 + 64 * p + 16 * c), spread);
      const uint8x16_t add = vdupq_n_u8(static_cast<uint8_t>(16 << p));
      l = vorrq_u8(l, vandq_u8(vtstq_u8(bytes, low_bits), add));
      h = vorrq_u8(h, vandq_u8(vtstq_u8(bytes, high_bits), add));
    }
  }
  lo = vreinterpretq_s8_u8(l), hi = vreinterpretq_s8_u8(h);
}

template <int BITS, int R, int C0 = 0, int C1 = q8_chunks(BITS)>
inline void dot_rows(const uint8_t* codes, const int8_t* const* x, const int32_t*, I16* out) {
  int32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) acc[r][k] = vdupq_n_s32(0);
  if constexpr (BITS < 8) {  // codes 0..63: signed bytes as they are
    for (int c = C0; c < C1; ++c)
      for (int k = 0; k < 4; ++k) {
        int8x16_t lo, hi;
        chunk_codes<BITS>(codes, c, k, lo, hi);
        for (int r = 0; r < R; ++r) acc[r][k] = dot4(dot4(acc[r][k], lo, x4(x[r] + 8 * c)), hi, x4(x[r] + 8 * c + 4));
      }
  } else {
    for (int c = C0; c < C1; ++c)
      for (int k = 0; k < 4; ++k) {
        const int8x16_t v = vld1q_s8(reinterpret_cast<const int8_t*>(codes + 64 * c + 16 * k));
        for (int r = 0; r < R; ++r) acc[r][k] = dot4(acc[r][k], v, x4(x[r] + 4 * c));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < 4; ++k) out[r].q[k] = acc[r][k];
}

constexpr int Q8_ROWS = 2;
constexpr int q8_one_tile_rows(int) { return Q8_ROWS; }  // no block is one wider tile
// bytes past a block's start a one-row q8 tile asks for (not measured on ARM hardware: the x86 AVX-512 figure)
constexpr int64_t Q8_PREFETCH_AHEAD = 256;

}  // namespace spk
