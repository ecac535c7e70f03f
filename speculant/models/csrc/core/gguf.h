// A GGUF tensor's blocks repacked for the int8 kernels (q8.h), straight from the file's bytes.
//
// Every block type maps onto one of q8.h's kinds exactly: each weight is w = fma(code, scale, min)
// with a code the type stores (shifted, or looked up in IQ4's table) and a scale and min that are a
// float16 of the file (Q4_0's min, -8 * d, is one too) or a float16 times a small integer, whose
// float32 product is exact: the very values the file's dequantisation (ggml's, the gguf package's)
// gives, bit for bit, which the tests check type by type.
//
//   Q4_0, Q4_1          -> Q8_D4    codes 0..15, scale d, min -8d or m
//   Q8_0, IQ4_NL        -> Q8_D8    codes q or IQ4's table value; scale d
//   Q5_0                -> Q8_D5    codes 0..31 less 16; scale d
//   Q5_1                -> Q8_D5M   codes 0..31, scale d, min m
//   Q4_K                -> Q8_K4    codes 0..15, scale d * sc, min -dmin * m a block of 32
//   Q5_K                -> Q8_K5M   codes 0..31, the same
//   Q2_K                -> Q8_K4S2  codes 0..3, scale d * sc, min -dmin * m a half block of 16
//   Q6_K                -> Q8_K6S2  codes 0..63 less 32; scale d * sc a half block
//   Q3_K, IQ4_XS        -> Q8_K8S2  codes -4..3 or IQ4's table value; scale d * sc a half block
// 5- and 6-bit codes stream in 5 and 6 bits (a high-bit plane beside 4-bit nibbles) and give the very
// integer sums 8-bit ones would: the same bits as a repacking to 8-bit codes.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "q8.h"
#include "vector.h"

namespace spk {

// ggml's type ids (the GGUF tensor table's)
enum GGMLType : int {
  GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
  GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20,
  GGML_IQ4_XS = 23, GGML_BF16 = 30,
};

// the q8 kind a GGUF block type repacks to, or -1 (a dense or unsupported type)
constexpr int gguf_q8_kind(int type) {
  switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: return Q8_D4;
    case GGML_Q8_0: case GGML_IQ4_NL: return Q8_D8;
    case GGML_Q5_0: return Q8_D5;
    case GGML_Q5_1: return Q8_D5M;
    case GGML_Q4_K: return Q8_K4;
    case GGML_Q5_K: return Q8_K5M;
    case GGML_Q2_K: return Q8_K4S2;
    case GGML_Q6_K: return Q8_K6S2;
    case GGML_Q3_K: case GGML_IQ4_XS: return Q8_K8S2;
    default: return -1;
  }
}

// (inputs a block, bytes a block) of a block type, or (0, 0)
struct GGUFBlock {
  int64_t inputs, bytes;
};
constexpr GGUFBlock gguf_block(int type) {
  switch (type) {
    case GGML_Q4_0: return {32, 18};
    case GGML_Q4_1: return {32, 20};
    case GGML_Q5_0: return {32, 22};
    case GGML_Q5_1: return {32, 24};
    case GGML_Q8_0: return {32, 34};
    case GGML_IQ4_NL: return {32, 18};
    case GGML_Q2_K: return {256, 84};
    case GGML_Q3_K: return {256, 110};
    case GGML_Q4_K: return {256, 144};
    case GGML_Q5_K: return {256, 176};
    case GGML_Q6_K: return {256, 210};
    case GGML_IQ4_XS: return {256, 136};
    default: return {0, 0};
  }
}

constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// One row's blocks as q8.h stores them: per block of 32 its codes (the values w = code * scale + min
// takes: a kind with an offset stores them plus it), and, direct, its float16 scale
// and min; in super-blocks, per block its multipliers sc and m (one per part) and per super-block
// its float16 D and -Dmin.
struct DecodedRow {
  std::vector<int8_t> code, sc, m;  // [K], [blocks * 2], [blocks * 2]
  std::vector<uint16_t> scale, min;  // direct: [blocks]; super-blocks: D and -Dmin [K / 256]
  explicit DecodedRow(int64_t K)
      : code(K), sc(K / 16), m(K / 16), scale(K / 32), min(K / 32) {}
};

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
constexpr uint16_t negated(uint16_t h) { return h ^ 0x8000; }

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins: sub-block j's (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int8_t& sc, int8_t& m) {
  if (j < 4) {
    sc = static_cast<int8_t>(q[j] & 63), m = static_cast<int8_t>(q[j + 4] & 63);
  } else {
    sc = static_cast<int8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<int8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// one row of K inputs (raw: its blocks) decoded; false where a value has no exact form (a Q4_0
// block whose -8d overflows a half)
inline bool decode_row(int type, const uint8_t* raw, int64_t K, DecodedRow& r) {
  const GGUFBlock blk = gguf_block(type);
  for (int64_t u = 0; u < K / blk.inputs; ++u) {
    const uint8_t* p = raw + u * blk.bytes;
    int8_t* code = r.code.data() + u * blk.inputs;
    if (blk.inputs == 32) {
      const int64_t b = u;
      switch (type) {
        case GGML_Q4_0: case GGML_Q4_1: case GGML_IQ4_NL: {
          const uint8_t* qs = p + (type == GGML_Q4_1 ? 4 : 2);
          for (int j = 0; j < 16; ++j) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            code[j] = static_cast<int8_t>(type == GGML_IQ4_NL ? IQ4_VALUES[lo] : lo);
            code[j + 16] = static_cast<int8_t>(type == GGML_IQ4_NL ? IQ4_VALUES[hi] : hi);
          }
          r.scale[b] = half_bits(p);
          if (type == GGML_Q4_1) {
            r.min[b] = half_bits(p + 2);
          } else if (type == GGML_Q4_0) {  // (q - 8) d = q d + (-8 d): -8 d is a half unless it overflows
            const float m = -8.0f * to_float(f16{r.scale[b]});
            r.min[b] = from_float<f16>(m).bits;
            if (to_float(f16{r.min[b]}) != m) return false;
          }
          break;
        }
        case GGML_Q5_0: case GGML_Q5_1: {
          const bool one = type == GGML_Q5_1;
          uint32_t qh;
          std::memcpy(&qh, p + (one ? 4 : 2), 4);
          const uint8_t* qs = p + (one ? 8 : 6);
          for (int j = 0; j < 16; ++j) {
            const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            code[j] = static_cast<int8_t>(one ? lo : lo - 16);
            code[j + 16] = static_cast<int8_t>(one ? hi : hi - 16);
          }
          r.scale[b] = half_bits(p);
          if (one) r.min[b] = half_bits(p + 2);
          break;
        }
        case GGML_Q8_0:
          std::memcpy(code, p + 2, 32);
          r.scale[b] = half_bits(p);
          break;
        default:
          return false;
      }
      continue;
    }
    // a super-block of 256: blocks 8u.. 8u + 7, parts 16u.. 16u + 15
    int8_t* sc = r.sc.data() + 16 * u;
    int8_t* m = r.m.data() + 16 * u;
    switch (type) {
      case GGML_Q4_K: case GGML_Q5_K: {
        r.scale[u] = half_bits(p), r.min[u] = negated(half_bits(p + 2));
        const uint8_t* scales = p + 4;
        const uint8_t* qh = p + 16;
        const uint8_t* ql = p + (type == GGML_Q5_K ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          scale_min_k4(j, scales, sc[2 * j], m[2 * j]);
          sc[2 * j + 1] = sc[2 * j], m[2 * j + 1] = m[2 * j];  // one part a block: each half the block's
          for (int l = 0; l < 32; ++l) {  // block j: the low (j even) or high nibbles of bytes 32 (j / 2)..
            int q = (ql[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
            if (type == GGML_Q5_K) q |= ((qh[l] >> j) & 1) << 4;
            code[32 * j + l] = static_cast<int8_t>(q);
          }
        }
        break;
      }
      case GGML_Q6_K: {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
        r.scale[u] = half_bits(p + 208);
        for (int i = 0; i < 16; ++i) sc[i] = scales[i];
        for (int n = 0; n < 2; ++n)  // two halves of 128 inputs
          for (int l = 0; l < 32; ++l) {
            const uint8_t* a = ql + 64 * n;
            const uint8_t h = qh[32 * n + l];
            int8_t* y = code + 128 * n;
            y[l] = static_cast<int8_t>(((a[l] & 15) | ((h & 3) << 4)) - 32);
            y[l + 32] = static_cast<int8_t>(((a[l + 32] & 15) | (((h >> 2) & 3) << 4)) - 32);
            y[l + 64] = static_cast<int8_t>(((a[l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
            y[l + 96] = static_cast<int8_t>(((a[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32);
          }
        break;
      }
      case GGML_Q3_K: {
        const uint8_t *hm = p, *qs = p + 32;
        r.scale[u] = half_bits(p + 108);
        uint32_t aux[4];
        std::memcpy(aux, p + 96, 12);
        const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f, tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
        int8_t six[16];
        std::memcpy(six, aux, 16);
        for (int i = 0; i < 16; ++i) sc[i] = static_cast<int8_t>(six[i] - 32);
        for (int n = 0; n < 2; ++n)
          for (int j = 0; j < 4; ++j)  // inputs 128n + 32j + l: bits 2j of byte 32n + l, high bit 4n + j
            for (int l = 0; l < 32; ++l) {
              const int q = (qs[32 * n + l] >> (2 * j)) & 3, high = (hm[l] >> (4 * n + j)) & 1;
              code[128 * n + 32 * j + l] = static_cast<int8_t>(q - (high ? 0 : 4));
            }
        break;
      }
      case GGML_Q2_K: {
        const uint8_t *scales = p, *qs = p + 16;
        r.scale[u] = half_bits(p + 80), r.min[u] = negated(half_bits(p + 82));
        for (int i = 0; i < 16; ++i) sc[i] = static_cast<int8_t>(scales[i] & 15), m[i] = static_cast<int8_t>(scales[i] >> 4);
        for (int n = 0; n < 2; ++n)
          for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 32; ++l) code[128 * n + 32 * j + l] = static_cast<int8_t>((qs[32 * n + l] >> (2 * j)) & 3);
        break;
      }
      case GGML_IQ4_XS: {
        r.scale[u] = half_bits(p);
        const uint16_t scales_h = half_bits(p + 2);
        const uint8_t *scales_l = p + 4, *qs = p + 8;
        for (int b = 0; b < 8; ++b) {
          const int ls = ((scales_l[b / 2] >> (4 * (b % 2))) & 15) | (((scales_h >> (2 * b)) & 3) << 4);
          sc[2 * b] = sc[2 * b + 1] = static_cast<int8_t>(ls - 32);
          for (int j = 0; j < 16; ++j) {
            code[32 * b + j] = IQ4_VALUES[qs[16 * b + j] & 15];
            code[32 * b + j + 16] = IQ4_VALUES[qs[16 * b + j] >> 4];
          }
        }
        break;
      }
      default:
        return false;
    }
  }
  return true;
}

// group g's bytes (q8.h's layout for kind) from its 16 rows decoded (rows past N: zeros)
inline void write_group(int kind, const std::vector<DecodedRow>& rows, int64_t valid, int64_t K, uint8_t* out) {
  const int64_t blocks = K / BLOCK, bits = q8_bits(kind), sub = q8_sub(kind);
  const bool mins = q8_mins(kind), super = q8_super(kind);
  std::memset(out, 0, q8_group_bytes(kind, true, K));
  auto put_half = [](uint8_t* at, uint16_t h) { std::memcpy(at, &h, 2); };
  uint8_t* at = out;
  for (int64_t b = 0; b < blocks; ++b) {
    if (super && b % Q8_SUPER == 0) {  // the super-block's header
      for (int64_t o = 0; o < valid; ++o) {
        put_half(at + 2 * o, rows[o].scale[b / Q8_SUPER]);
        if (mins) put_half(at + 32 + 2 * o, rows[o].min[b / Q8_SUPER]);
      }
      at += q8_header_bytes(kind);
    }
    if (super) {
      for (int64_t o = 0; o < valid; ++o)
        for (int64_t h = 0; h < sub; ++h) {
          // a block's two halves' multipliers (one part: the block's, the same in both)
          at[16 * h + o] = static_cast<uint8_t>(rows[o].sc[2 * b + h]);
          if (mins) at[16 * (sub + h) + o] = static_cast<uint8_t>(rows[o].m[2 * b + h]);
        }
      at += 16 * sub * (mins ? 2 : 1);
    } else {
      for (int64_t o = 0; o < valid; ++o) {
        put_half(at + 2 * o, rows[o].scale[b]);
        if (mins) put_half(at + 32 + 2 * o, rows[o].min[b]);
      }
      at += 32 * (mins ? 2 : 1);
    }
    for (int64_t o = 0; o < valid; ++o) {
      const int8_t* code = rows[o].code.data() + b * BLOCK;
      if (bits < 8) {  // nibbles, then the high bits' planes (q8.h)
        const int offset = q8_offset(kind);
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 8; ++j) {
            const int q = code[8 * c + j] + offset;
            at[(c * 16 + o) * 4 + j % 4] |= static_cast<uint8_t>((q & 15) << (j < 4 ? 0 : 4));
            for (int k = 0; k < bits - 4; ++k) at[256 + 64 * k + 16 * c + o] |= static_cast<uint8_t>(((q >> (4 + k)) & 1) << j);
          }
      } else {
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) at[(c * 16 + o) * 4 + j] = static_cast<uint8_t>(code[4 * c + j]);
      }
    }
    at += q8_code_bytes(kind);
  }
}

// A GGUF tensor [N rows of K inputs] of a block type (raw: its bytes, rows one after another)
// repacked into q8.h's layout for gguf_q8_kind(type) (or ``wide``: the 8-bit codes of the same form,
// Q5_0's and Q6_K's, for the harness's comparison): out holds ceil(N / 16) *
// q8_group_bytes(kind, true, K) bytes. False where a value has no exact form (nothing is promised
// of out then).
inline bool gguf_pack_q8(int type, const uint8_t* raw, int64_t N, int64_t K, uint8_t* out,
                         const ParallelFor& parallel = serial_for, bool wide = false) {
  const int narrow = gguf_q8_kind(type);
  const int kind = !wide ? narrow : narrow == Q8_D5 ? Q8_D8 : narrow == Q8_K6S2 ? Q8_K8S2 : -1;
  const GGUFBlock blk = gguf_block(type);
  if (kind < 0 || K % blk.inputs != 0) return false;
  const int64_t row_bytes = K / blk.inputs * blk.bytes, groups = (N + Q8_GROUP - 1) / Q8_GROUP;
  const int64_t group_bytes = q8_group_bytes(kind, true, K);
  std::atomic<bool> ok{true};
  parallel(groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<DecodedRow> rows(Q8_GROUP, DecodedRow(K));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t valid = std::min<int64_t>(Q8_GROUP, N - g * Q8_GROUP);
      for (int64_t o = 0; o < valid; ++o)
        if (!decode_row(type, raw + (g * Q8_GROUP + o) * row_bytes, K, rows[o])) ok = false;
      write_group(kind, rows, valid, K, out + g * group_bytes);
    }
  });
  return ok;
}

}  // namespace spk
