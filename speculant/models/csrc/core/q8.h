// Linear layers over GGUF blocks with int8 activations (``dtype="q8"``): the scheme llama.cpp uses.
//
// Each row of x is quantized alone, in blocks of 32 inputs: d = max|x| / 127, q = x / d rounded to
// the nearest integer (ties to even), with the sums of q over the block and over each half of it
// kept. A weight's block is w = scale * code + min, with a scale (and a min) per block of 32 or per
// half of one (16 inputs), so its dot product with a block of x is
//     sum over the block's parts h of  scale_h * d * sum_h(code * q)  +  min_h * d * sum_h(q),
// where sum_h(code * q) is an integer: exact in any order, on any ISA (vpdpbusd, vpmaddubsw, sdot, or
// plain C++). The float part is fixed: per output, over the blocks in order, for each part
//     acc = fma(float(sum_h(code * q)), scale_h * d, acc),  then for each part  acc = fma(min_h, d * float(sum_h(q)), acc)
// (the mins only for a kind with mins), then y = acc + bias. A row's values depend on that row
// alone: width-invariant, and the same bits on every ISA branch.
//
// Layout, lanes over outputs (an output per int32 lane: no horizontal sums): outputs in groups of
// 16, and per group block after block. The codes of a block: 4-bit, 4 chunks x 16 outputs x 4 bytes
// (byte j's low nibble is input 8c + j, its high nibble input 8c + 4 + j); 8-bit, 8 chunks x 16
// outputs x 4 signed bytes (input 4c + j). Their scales come in one of two forms (``Q8Kind``):
// - direct (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; a drafter's rounding): before each block's codes
//   16 scales, then 16 mins for a kind with mins, float16 where every one of a weight is a half
//   (GGUF's are), else float32: a half widens to its float exactly, so both give the same bits;
// - super-blocks (the K-quants, IQ4_XS): every 8 blocks (256 inputs) a header of 16 float16 scales D
//   (and 16 negated float16 mins -Dmin), and before each block's codes 16 signed byte multipliers sc
//   per part (and 16 m per part): scale_h = D * sc_h, min_h = -Dmin * m_h, products of a half and a
//   small integer that are exact in float32, as the file's own dequantisation computes them, so
//   they stream ~4.6 bits a weight for Q4_K where float32 products per block took 6.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "quant.h"
#include "simd.h"
#include "vector.h"

namespace spk {

constexpr int64_t Q8_GROUP = 16;
constexpr int64_t Q8_SUPER = 8;  // blocks a super-block's header serves (256 inputs)

// The kinds of q8 weights: their codes' bits, the parts of a block that have a scale of their own,
// whether they have mins, the form of their scales (above), and an offset their codes carry (the
// integer sums take it off: sum((code - offset) * q) = sum(code * q) - offset * sum(q), exact). The
// id is what Python passes.
enum Q8KindId : int {
  Q8_D4 = 4,     // 4-bit codes, a scale and a min a block: Q4_0, Q4_1 (a drafter's 4-bit rounding)
  Q8_D8 = 8,     // 8-bit codes, a scale a block: Q8_0, IQ4_NL (a drafter's 8-bit rounding)
  Q8_D5 = 50,    // 5-bit codes less 16, a scale a block: Q5_0
  Q8_D5M = 51,   // 5-bit codes, a scale and a min a block: Q5_1
  Q8_K4 = 41,    // 4-bit codes in super-blocks, a multiplier and a min a block: Q4_K
  Q8_K4S2 = 42,  // 4-bit codes in super-blocks, a multiplier and a min a half block: Q2_K
  Q8_K5M = 53,   // 5-bit codes in super-blocks, a multiplier and a min a block: Q5_K
  Q8_K6S2 = 62,  // 6-bit codes less 32 in super-blocks, a multiplier a half block: Q6_K
  Q8_K8S2 = 82,  // 8-bit codes in super-blocks, a multiplier a half block: Q3_K, IQ4_XS
};

constexpr bool q8_kind_known(int kind) {
  return kind == Q8_D4 || kind == Q8_D8 || kind == Q8_D5 || kind == Q8_D5M || kind == Q8_K4 || kind == Q8_K4S2 ||
         kind == Q8_K5M || kind == Q8_K6S2 || kind == Q8_K8S2;
}
constexpr int q8_bits(int kind) {
  return kind == Q8_D4 || kind == Q8_K4 || kind == Q8_K4S2 ? 4
         : kind == Q8_D5 || kind == Q8_D5M || kind == Q8_K5M ? 5
         : kind == Q8_K6S2 ? 6 : 8;
}
constexpr int q8_sub(int kind) { return kind == Q8_K4S2 || kind == Q8_K6S2 || kind == Q8_K8S2 ? 2 : 1; }
constexpr bool q8_mins(int kind) { return kind != Q8_D8 && kind != Q8_D5 && kind != Q8_K6S2 && kind != Q8_K8S2; }
constexpr bool q8_super(int kind) { return kind != Q8_D4 && kind != Q8_D8 && kind != Q8_D5 && kind != Q8_D5M; }
constexpr int q8_offset(int kind) { return kind == Q8_D5 ? 16 : kind == Q8_K6S2 ? 32 : 0; }
// a block's codes: 4-bit nibbles (256 bytes); 5- and 6-bit, the nibbles and then 1 or 2 planes of
// 64 bytes (plane k's byte 16c + o: bit 4 + k of output o's inputs 8c..8c + 7, bit j of input 8c + j);
// 8-bit, 512 bytes
constexpr int64_t q8_code_bytes(int kind) { return q8_bits(kind) == 8 ? 512 : 256 + 64 * (q8_bits(kind) - 4); }

template <int KIND>
struct Q8Kind {
  static constexpr int BITS = q8_bits(KIND), SUB = q8_sub(KIND), OFFSET = q8_offset(KIND);
  static constexpr bool MINS = q8_mins(KIND), SUPER = q8_super(KIND);
};

// bytes of a block's 16 scales (and of its 16 mins): float16 or float32
constexpr int64_t q8_scale_bytes(bool half) { return half ? 32 : 64; }
// bytes of one block: direct, its scales (and mins) and codes; in super-blocks, its multipliers
// (and mins) and codes, without the header
constexpr int64_t q8_block_bytes(int kind, bool half = false) {
  if (q8_super(kind)) return q8_sub(kind) * Q8_GROUP * (q8_mins(kind) ? 2 : 1) + q8_code_bytes(kind);
  return (q8_mins(kind) ? 2 : 1) * q8_scale_bytes(half) + q8_code_bytes(kind);
}
constexpr int64_t q8_header_bytes(int kind) { return q8_super(kind) ? (q8_mins(kind) ? 64 : 32) : 0; }
// bytes of one group of 16 outputs over K inputs (super-block kinds: K a multiple of 256)
constexpr int64_t q8_group_bytes(int kind, bool half, int64_t K) {
  const int64_t blocks = K / 32;
  if (q8_super(kind)) return blocks / Q8_SUPER * (q8_header_bytes(kind) + Q8_SUPER * q8_block_bytes(kind));
  return blocks * q8_block_bytes(kind, half);
}

// 16 scales or mins of a block, float32 or float16 widened (exact)
template <bool HALF>
inline V16 load_scales(const uint8_t* p) {
  if constexpr (HALF)
    return load16h(reinterpret_cast<const uint16_t*>(p));
  else
    return load16(reinterpret_cast<const float*>(p));
}

// a row of x quantized in blocks of 32: codes, and per block d, sum(q) and d * sum(q), and per half
// block (inputs 0-15, 16-31) its sum(q) and d * that
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum, dsum2;
  std::vector<int32_t> sum, sum2;
};

// blocks [b0, b1) of rows of K quantized (a block's values depend on it alone; the max and the sums
// are exact in any order, so vector lanes give the bits of a scalar loop)
inline void quantize_blocks(const float* x, int64_t b0, int64_t b1, Q8Rows& out) {
  typedef int32_t vni __attribute__((vector_size(sizeof(vn))));
  typedef int8_t vnb __attribute__((vector_size(NATIVE)));
  const vn round = vn{} + 12582912.0f;  // 1.5 * 2^23: (v + round) - round is v rounded to nearest, ties to even
  constexpr int P = BLOCK / NATIVE;     // native vectors a block (the machine's width: see vector.h)
  for (int64_t i = b0; i < b1; ++i) {
    const float* xb = x + i * BLOCK;
    vn a = {};
    for (int p = 0; p < P; ++p) {
      const vn v = vload<vn>(xb + p * NATIVE), m = v < 0.0f ? -v : v;
      a = a > m ? a : m;
    }
    float amax = 0.0f;
    for (int l = 0; l < NATIVE; ++l) amax = std::max(amax, a[l]);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    vni sums[2] = {};  // the two halves' (a native vector lies within one half: NATIVE <= 16)
    for (int p = 0; p < P; ++p) {
      const vni q = __builtin_convertvector((vload<vn>(xb + p * NATIVE) * id + round) - round, vni);
      const vnb bytes = __builtin_convertvector(q, vnb);  // |q| <= 127: exact
      std::memcpy(out.q.data() + i * BLOCK + p * NATIVE, &bytes, NATIVE);
      sums[2 * p / P] += q;
    }
    int32_t s[2] = {0, 0};
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < NATIVE; ++l) s[h] += sums[h][l];
    out.d[i] = d, out.sum[i] = s[0] + s[1], out.dsum[i] = d * static_cast<float>(s[0] + s[1]);
    for (int h = 0; h < 2; ++h) out.sum2[2 * i + h] = s[h], out.dsum2[2 * i + h] = d * static_cast<float>(s[h]);
  }
}

// rows of codes past the last a kernel may read: AMX loads a tile's 16 rows whatever the block's
// width (their sums are never used)
#if defined(SPK_Q8_AMX)
constexpr int64_t Q8_PAD_ROWS = AMX_ROWS - 1;
#else
constexpr int64_t Q8_PAD_ROWS = 0;
#endif

inline void quantize_rows(const float* x, int64_t M, int64_t K, Q8Rows& out,
                          const ParallelFor& parallel = serial_for) {
  const int64_t blocks = K / BLOCK;
  out.q.resize((M + Q8_PAD_ROWS) * K);
  out.d.resize(M * blocks), out.dsum.resize(M * blocks), out.sum.resize(M * blocks);
  out.dsum2.resize(2 * M * blocks), out.sum2.resize(2 * M * blocks);
  for_rows(M, K, parallel, [&](int64_t r0, int64_t r1) { quantize_blocks(x, r0 * blocks, r1 * blocks, out); });
}

struct Q8Weights {
  const uint8_t* packed;  // groups of 16 outputs, each q8_group_bytes(kind, half, K) long
  int64_t N, K;
  int kind;
  bool half;  // direct kinds: float16 scales and mins (super-block kinds always have them)
  int64_t blocks() const { return K / BLOCK; }
  int64_t group_bytes() const { return q8_group_bytes(kind, half, K); }
  // where block b of a group starts (its scales, or its multipliers, then its codes)
  const uint8_t* block_of(int64_t group, int64_t b) const {
    const uint8_t* g = packed + group * group_bytes();
    if (!q8_super(kind)) return g + b * q8_block_bytes(kind, half);
    const int64_t super_bytes = q8_header_bytes(kind) + Q8_SUPER * q8_block_bytes(kind);
    return g + (b / Q8_SUPER) * super_bytes + q8_header_bytes(kind) + (b % Q8_SUPER) * q8_block_bytes(kind);
  }
  // a super-block kind's header of block b's super-block: 16 D, then 16 -Dmin
  const uint16_t* header_of(int64_t group, int64_t b) const {
    const int64_t super_bytes = q8_header_bytes(kind) + Q8_SUPER * q8_block_bytes(kind);
    return reinterpret_cast<const uint16_t*>(packed + group * group_bytes() + (b / Q8_SUPER) * super_bytes);
  }
};

// block_of and header_of of a kind known when compiled, from its group's start (the tiles' inner loop)
template <int KIND, bool HALF>
inline const uint8_t* q8_block_at(const uint8_t* group, int64_t b) {
  if constexpr (q8_super(KIND)) {
    constexpr int64_t bytes = q8_block_bytes(KIND), super_bytes = q8_header_bytes(KIND) + Q8_SUPER * bytes;
    return group + (b / Q8_SUPER) * super_bytes + q8_header_bytes(KIND) + (b % Q8_SUPER) * bytes;
  } else {
    return group + b * q8_block_bytes(KIND, HALF);
  }
}
template <int KIND>
inline const uint16_t* q8_header_at(const uint8_t* group, int64_t b) {
  constexpr int64_t super_bytes = q8_header_bytes(KIND) + Q8_SUPER * q8_block_bytes(KIND);
  return reinterpret_cast<const uint16_t*>(group + (b / Q8_SUPER) * super_bytes);
}

// Weights stream from memory once a pass, and a tile reads a block's cache lines one after another
// as it multiplies: asking for all of them at once, some bytes on, keeps several reads in flight.
// On AMD, non-temporal prefetches (they are read once) Q8_PREFETCH_AHEAD on (the arch header's,
// measured per class): a one-token step of the default target 3.1 against 3.6-4.0 ms without (a
// 2-core Zen 4, float16 scales, 256 bytes ahead); on a 2-core Zen 3 (AVX2) 2 KB ahead took its
// decoder layers 3.04 -> 2.79 ms and its LM head 1.04 -> 0.94 against 256 bytes (1 KB: 2.84 / 0.93;
// 4 and 8 KB slower again). On Intel (native.py defines SPK_CPU_INTEL) prefetchnta is a loss: a
// one-row pass's linears on one core of a Xeon (Emerald Rapids) took 7.9-9.8 ms with it, 3.4 with
// no prefetch and 2.8-3.4 with prefetcht0 128 B-1 KB ahead; there prefetcht0, 1 KB ahead. The
// float32-activation kernels of quant.h do not prefetch: their multiplies take longer than their reads.
#if defined(SPK_CPU_INTEL)
constexpr int64_t Q8_PREFETCH_BYTES = 1024;
constexpr int Q8_PREFETCH_LOCALITY = 3;
#else
constexpr int64_t Q8_PREFETCH_BYTES = Q8_PREFETCH_AHEAD;
constexpr int Q8_PREFETCH_LOCALITY = 0;
#endif
inline void prefetch_stream(const uint8_t* at, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(at + Q8_PREFETCH_BYTES + l, 0, Q8_PREFETCH_LOCALITY);
}

// A block's scales and mins for its 16 outputs, one per part: read (direct) or made (D * sc, -Dmin * m)
template <int KIND, bool HALF>
struct BlockScales {
  static constexpr int SUB = Q8Kind<KIND>::SUB;
  V16 scale[SUB], min[SUB];
  const uint8_t* codes;

  // block b of a group that starts at g
  BlockScales(const uint8_t* g, int64_t b) {
    const uint8_t* blk = q8_block_at<KIND, HALF>(g, b);
    if constexpr (Q8Kind<KIND>::SUPER) {
      const uint16_t* header = q8_header_at<KIND>(g, b);
      const V16 D = load16h(header);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk);
      for (int h = 0; h < SUB; ++h) scale[h] = mul16(D, load16_i8(sc + 16 * h));
      if constexpr (Q8Kind<KIND>::MINS) {
        const V16 neg_dmin = load16h(header + 16);
        for (int h = 0; h < SUB; ++h) min[h] = mul16(neg_dmin, load16_i8(sc + 16 * (SUB + h)));
      }
      codes = blk + 16 * SUB * (Q8Kind<KIND>::MINS ? 2 : 1);
    } else {
      scale[0] = load_scales<HALF>(blk);
      if constexpr (Q8Kind<KIND>::MINS) min[0] = load_scales<HALF>(blk + q8_scale_bytes(HALF));
      codes = blk + q8_scale_bytes(HALF) * (Q8Kind<KIND>::MINS ? 2 : 1);
    }
  }

  // acc + this block's part for a row (i: its block in Q8Rows): the fixed order every branch and tile follows
  V16 add(const Q8Rows& a, int64_t i, const V16* dots, const V16& acc) const {
    V16 out = acc;
    const V16 d = set16(a.d[i]);
    for (int h = 0; h < SUB; ++h) out = fma16(dots[h], mul16(scale[h], d), out);
    if constexpr (Q8Kind<KIND>::MINS) {
      if constexpr (SUB == 1)
        out = fma16(min[0], set16(a.dsum[i]), out);
      else
        for (int h = 0; h < SUB; ++h) out = fma16(min[h], set16(a.dsum2[2 * i + h]), out);
    }
    return out;
  }
};

// y's R rows from m0 (fewer outputs where N ends): acc + bias; y's rows ldy apart
inline void store_rows(const V16* acc, int64_t m0, int64_t R, const Q8Weights& w, int64_t n0, const float* bias,
                       float* y, int64_t ldy) {
  const int64_t outs = std::min<int64_t>(Q8_GROUP, w.N - n0);
  if (outs == Q8_GROUP) {
    const V16 b = load16(bias + n0);
    for (int64_t r = 0; r < R; ++r) store16(y + (m0 + r) * ldy + n0, add16(acc[r], b));
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    float v[16];
    store16(v, acc[r]);
    float* yr = y + (m0 + r) * ldy + n0;
    for (int64_t o = 0; o < outs; ++o) yr[o] = v[o] + bias[n0 + o];
  }
}

// R rows (from m0) against the 16 outputs of one group; y's columns from n0 (fewer where N ends).
// stream: the call's only tile of the group, so it prefetches (several tiles a group are bound by
// their multiplies: there prefetching measured 10 % slower on the AVX2 branch, and no faster on AVX-512)
template <int KIND, bool HALF, int R>
inline void q8_tile(const Q8Rows& a, int64_t m0, const Q8Weights& w, int64_t group, const float* bias, float* y,
                    int64_t ldy, bool stream) {
  using Kind = Q8Kind<KIND>;
  constexpr int BITS = Kind::BITS, SUB = Kind::SUB, C = q8_chunks(BITS);
  const int64_t K = w.K, blocks = w.blocks();
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero16();
  const int64_t bytes = q8_block_bytes(KIND, HALF);
  const uint8_t* g = w.packed + group * w.group_bytes();
  for (int64_t b = 0; b < blocks; ++b) {
    const BlockScales<KIND, HALF> s(g, b);
    if (stream) prefetch_stream(q8_block_at<KIND, HALF>(g, b), bytes);
    const int8_t* x[R];
    I16 dots[SUB][R];
    for (int r = 0; r < R; ++r) x[r] = a.q.data() + (m0 + r) * K + b * BLOCK;
    if constexpr (SUB == 1) {
      int32_t sums[R];
      for (int r = 0; r < R; ++r) sums[r] = a.sum[(m0 + r) * blocks + b];
      dot_rows<BITS, R>(s.codes, x, sums, dots[0]);
      if constexpr (Kind::OFFSET != 0)
        for (int r = 0; r < R; ++r) dots[0][r] = minus(dots[0][r], Kind::OFFSET * sums[r]);
    } else {
      int32_t lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * blocks + b;
        lo[r] = a.sum2[2 * i], hi[r] = a.sum2[2 * i + 1];
      }
      dot_rows<BITS, R, 0, C / 2>(s.codes, x, lo, dots[0]);
      dot_rows<BITS, R, C / 2, C>(s.codes, x, hi, dots[1]);
      if constexpr (Kind::OFFSET != 0)
        for (int r = 0; r < R; ++r) dots[0][r] = minus(dots[0][r], Kind::OFFSET * lo[r]), dots[1][r] = minus(dots[1][r], Kind::OFFSET * hi[r]);
    }
    for (int r = 0; r < R; ++r) {
      V16 f[SUB];
      for (int h = 0; h < SUB; ++h) f[h] = to_float16(dots[h][r]);
      acc[r] = s.add(a, (m0 + r) * blocks + b, f, acc[r]);
    }
  }
  store_rows(acc, m0, R, w, group * Q8_GROUP, bias, y, ldy);
}

#if defined(SPK_Q8_AMX)
// rows [m0, m0 + R), R <= 16, against one group on AMX (arch/x86/amx.h), two blocks a round, the
// float part (q8_tile's) of a round while the next round's tiles multiply (the sums of a tile store
// are read a round later: a pass's linears at 4 rows, all on the tiles, 11.0 -> 8.4 ms on one core
// of an Emerald Rapids Xeon). ROWS: R known when compiled (16: a full tile, its sums in registers),
// or 0. The caller has set the tile shapes (amx_configure) on this thread. Kinds with one part a block.
template <int KIND, bool HALF, int ROWS>
inline void q8_amx_tile(const Q8Rows& a, int64_t m0, int64_t R, const Q8Weights& w, int64_t group,
                        const float* bias, float* y, int64_t ldy, bool stream) {
  constexpr int BITS = Q8Kind<KIND>::BITS;
  static_assert(Q8Kind<KIND>::SUB == 1 && (BITS == 4 || BITS == 8), "a block's sums whole, of 4- or 8-bit codes");
  const int64_t rows = ROWS ? ROWS : R, K = w.K, blocks = w.blocks();
  const int64_t bytes = q8_block_bytes(KIND, HALF);
  V16 acc[AMX_ROWS];
  for (int64_t r = 0; r < rows; ++r) acc[r] = zero16();
  alignas(64) int32_t dots[2][2][AMX_ROWS * 16];
  const int8_t* x = a.q.data() + m0 * K;
  const uint8_t* g = w.packed + group * w.group_bytes();
  // the float part of the round before, while this round's tiles multiply
  auto scale = [&](int64_t b, int n, const int32_t (*d)[AMX_ROWS * 16]) {
    for (int j = 0; j < n; ++j) {
      const BlockScales<KIND, HALF> s(g, b + j);
      for (int64_t r = 0; r < rows; ++r) {
        const V16 f = to_float16(load16i(d[j] + 16 * r));
        acc[r] = s.add(a, (m0 + r) * blocks + b + j, &f, acc[r]);
      }
    }
  };
  int cur = 0;
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool pair = b + 1 < blocks;
    const BlockScales<KIND, HALF> s0(g, b);
    if (stream) prefetch_stream(q8_block_at<KIND, HALF>(g, b), pair ? 2 * bytes : bytes);
    if (pair)
      amx_dots2<BITS>(s0.codes, BlockScales<KIND, HALF>(g, b + 1).codes, x + b * BLOCK, K, dots[cur][0],
                      dots[cur][1]);
    else
      amx_dots1<BITS>(s0.codes, x + b * BLOCK, K, dots[cur][0]);
    if (b > 0) scale(b - 2, 2, dots[cur ^ 1]);
    cur ^= 1;
  }
  const int64_t last = (blocks - 1) & ~int64_t(1);
  scale(last, blocks - last, dots[cur ^ 1]);
  store_rows(acc, m0, rows, w, group * Q8_GROUP, bias, y, ldy);
}
#endif

// a block of M rows, Q8_ROWS < M <= q8_one_tile_rows(BITS), as one tile of M (false: M is not so)
template <int KIND, bool HALF, int R = q8_one_tile_rows(Q8Kind<KIND>::BITS)>
inline bool q8_one_tile(const Q8Rows& a, int64_t M, const Q8Weights& w, int64_t group, const float* bias, float* y,
                        int64_t ldy) {
  if constexpr (R > Q8_ROWS) {
    if (M == R) return q8_tile<KIND, HALF, R>(a, 0, w, group, bias, y, ldy, true), true;
    return q8_one_tile<KIND, HALF, R - 1>(a, M, w, group, bias, y, ldy);
  }
  return false;
}

#if defined(SPK_Q8_AMX)
// whether a block of M rows of this kind goes to the AMX tiles
inline bool q8_on_amx(int kind, int64_t M) {  // a block's sums whole, of 4- or 8-bit codes
  return q8_sub(kind) == 1 && (q8_bits(kind) == 4 || q8_bits(kind) == 8) && M >= q8_amx_from_rows(q8_bits(kind)) &&
         amx_usable();
}
#endif

template <int KIND, bool HALF>
inline void q8_group(const Q8Rows& a, int64_t M, const Q8Weights& w, int64_t group, const float* bias, float* y,
                     int64_t ldy) {
  // a block of up to q8_one_tile_rows(BITS) rows in one tile: the group's weights read once and
  // prefetched as a one-tile stream (4 + 1 read them twice: on a 2-core Zen 3, AVX2's 5-row block's
  // decoder layers 5.35 -> 5.02 ms and its LM head 1.55 -> 1.32, while tiles of 5 or 6 for every
  // block made 6 and 8 rows slower; on a 2-core Zen 4, AVX-512's 5-8 rows 7-14 % faster); integer
  // sums, so any tiling gives the same bits
#if defined(SPK_Q8_AMX)
  if constexpr (Q8Kind<KIND>::SUB == 1 && (Q8Kind<KIND>::BITS == 4 || Q8Kind<KIND>::BITS == 8)) {
    if (q8_on_amx(KIND, M)) {
      int64_t m = 0;
      for (; m + AMX_ROWS <= M; m += AMX_ROWS)
        q8_amx_tile<KIND, HALF, AMX_ROWS>(a, m, AMX_ROWS, w, group, bias, y, ldy, false);
      if (m < M) q8_amx_tile<KIND, HALF, 0>(a, m, M - m, w, group, bias, y, ldy, M < AMX_ROWS);
      return;
    }
  }
#endif
  if (q8_one_tile<KIND, HALF>(a, M, w, group, bias, y, ldy)) return;
  const bool stream = M <= Q8_ROWS;
  int64_t m = 0;
  for (; m + Q8_ROWS <= M; m += Q8_ROWS) q8_tile<KIND, HALF, Q8_ROWS>(a, m, w, group, bias, y, ldy, stream);
  switch (M - m) {
    case 3: if constexpr (Q8_ROWS > 3) q8_tile<KIND, HALF, 3>(a, m, w, group, bias, y, ldy, stream); break;
    case 2: if constexpr (Q8_ROWS > 2) q8_tile<KIND, HALF, 2>(a, m, w, group, bias, y, ldy, stream); break;
    case 1: q8_tile<KIND, HALF, 1>(a, m, w, group, bias, y, ldy, stream); break;
    default: break;
  }
}

// one group of a weight of any kind, all M rows
inline void q8_any_group(const Q8Rows& a, int64_t M, const Q8Weights& w, int64_t g, const float* bias, float* y,
                         int64_t ldy) {
  switch (w.kind) {
    case Q8_D4: return w.half ? q8_group<Q8_D4, true>(a, M, w, g, bias, y, ldy) : q8_group<Q8_D4, false>(a, M, w, g, bias, y, ldy);
    case Q8_D8: return w.half ? q8_group<Q8_D8, true>(a, M, w, g, bias, y, ldy) : q8_group<Q8_D8, false>(a, M, w, g, bias, y, ldy);
    case Q8_D5: return q8_group<Q8_D5, true>(a, M, w, g, bias, y, ldy);
    case Q8_D5M: return q8_group<Q8_D5M, true>(a, M, w, g, bias, y, ldy);
    case Q8_K4: return q8_group<Q8_K4, true>(a, M, w, g, bias, y, ldy);
    case Q8_K4S2: return q8_group<Q8_K4S2, true>(a, M, w, g, bias, y, ldy);
    case Q8_K5M: return q8_group<Q8_K5M, true>(a, M, w, g, bias, y, ldy);
    case Q8_K6S2: return q8_group<Q8_K6S2, true>(a, M, w, g, bias, y, ldy);
    case Q8_K8S2: return q8_group<Q8_K8S2, true>(a, M, w, g, bias, y, ldy);
    default: return;
  }
}

// y [M, ldy] columns of several weights side by side (q/k/v of different GGUF types), x [M, K]
// quantized once: parts[p] writes columns [col[p], col[p] + parts[p].N); every part's groups in one
// parallel loop. Each output is its own dot product: any split gives the same bits.
inline void q8_linear_parts(const float* x, int64_t M, const Q8Weights* parts, const int64_t* col, int n_parts,
                            const float* bias, float* y, int64_t ldy, const ParallelFor& parallel) {
  Q8Rows a;
  quantize_rows(x, M, parts[0].K, a, parallel);
  int64_t first[4] = {0}, groups = 0;
  for (int p = 0; p < n_parts; ++p) first[p] = groups, groups += (parts[p].N + Q8_GROUP - 1) / Q8_GROUP;
  parallel(groups, 4, [&](int64_t begin, int64_t end) {
#if defined(SPK_Q8_AMX)
    bool tiles = false;
    for (int p = 0; p < n_parts; ++p) tiles |= q8_on_amx(parts[p].kind, M);
    if (tiles) amx_configure();  // this thread's tile shapes: ours (oneDNN may have set others)
#endif
    int p = 0;
    for (int64_t g = begin; g < end; ++g) {
      while (p + 1 < n_parts && g >= first[p + 1]) ++p;
      q8_any_group(a, M, parts[p], g - first[p], bias + col[p], y + col[p], ldy);
    }
#if defined(SPK_Q8_AMX)
    if (tiles) amx_release();
#endif
  });
}

// y [M, N] = x [M, K] @ w^T + bias [N], with x quantized row by row
inline void q8_linear(const float* x, int64_t M, const Q8Weights& w, const float* bias, float* y,
                      const ParallelFor& parallel) {
  const int64_t col = 0;
  q8_linear_parts(x, M, &w, &col, 1, bias, y, w.N, parallel);
}

// Row n of a weight as floats: w = fma(code, scale_h, min_h) (code * scale_h for a kind without mins), the
// file's own dequantisation bit for bit (every GGUF type's products are exact in float32: gguf.h).
// For a quantized model's input embeddings and the tests.
inline void q8_dequantize_row(const Q8Weights& w, int64_t n, float* out) {
  const int64_t group = n / Q8_GROUP, o = n % Q8_GROUP, bits = q8_bits(w.kind), sub = q8_sub(w.kind);
  const bool mins = q8_mins(w.kind);
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const uint8_t* blk = w.block_of(group, b);
    float scale[2], min[2] = {0.0f, 0.0f};
    const uint8_t* codes;
    auto half_at = [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return to_float(f16{h}); };
    if (q8_super(w.kind)) {
      const uint8_t* header = reinterpret_cast<const uint8_t*>(w.header_of(group, b));
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk);
      for (int64_t h = 0; h < sub; ++h) {
        scale[h] = half_at(header + 2 * o) * static_cast<float>(sc[16 * h + o]);
        if (mins) min[h] = half_at(header + 32 + 2 * o) * static_cast<float>(sc[16 * (sub + h) + o]);
      }
      codes = blk + 16 * sub * (mins ? 2 : 1);
    } else {
      const int64_t sb = q8_scale_bytes(w.half);
      auto value = [&](const uint8_t* p) { float f; if (w.half) return half_at(p + 2 * o); std::memcpy(&f, p + 4 * o, 4); return f; };
      scale[0] = value(blk);
      if (mins) min[0] = value(blk + sb);
      codes = blk + sb * (mins ? 2 : 1);
    }
    for (int64_t i = 0; i < BLOCK; ++i) {
      int code;
      if (bits < 8) {
        const int64_t c = i / 8, j = i % 8;
        const uint8_t byte = codes[(c * 16 + o) * 4 + j % 4];
        code = j < 4 ? byte & 15 : byte >> 4;
        for (int64_t k = 0; k < bits - 4; ++k) code |= ((codes[256 + 64 * k + 16 * c + o] >> j) & 1) << (4 + k);
        code -= q8_offset(w.kind);
      } else {
        code = static_cast<int8_t>(codes[((i / 4) * 16 + o) * 4 + i % 4]);
      }
      const int64_t h = sub == 2 && i >= 16 ? 1 : 0;
      // a kind without mins multiplies only (a zero weight keeps the sign the file's product gives it)
      out[b * BLOCK + i] = mins ? std::fma(static_cast<float>(code), scale[h], min[h]) : static_cast<float>(code) * scale[h];
    }
  }
}

}  // namespace spk
