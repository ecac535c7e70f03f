// Linear layers over GGUF blocks with int8 activations (``dtype="q8"``): the scheme llama.cpp uses.
//
// Each row of x is quantized alone, in blocks of 32 inputs: d = max|x| / 127, q = x / d rounded to
// the nearest integer (ties to even), with sum(q) kept. A block of a weight row is w = scale * code +
// min (quant.h's block format), so its dot product with a block of x is
//     scale * d * sum(code * q) + min * d * sum(q),
// where sum(code * q) is an integer: exact in any order, on any ISA (vpdpbusd, vpmaddubsw, sdot, or
// plain C++). The float part is fixed: per output, over the blocks in order,
//     acc = fma(float(sum(code * q)), scale * d, acc);  acc = fma(min, d * float(sum(q)), acc)
// (the second only for 4-bit codes, whose min is not zero), then y = acc + bias. A row's values
// depend on that row alone: width-invariant, and the same bits on every ISA branch.
//
// Layout, lanes over outputs (an output per int32 lane: no horizontal sums): outputs in groups of
// 16, and per group block after block: 16 scales, 16 mins (4-bit only), then the codes: 4-bit, 4
// chunks x 16 outputs x 4 bytes (byte j's low nibble is input 8c + j, its high nibble input 8c + 4
// + j); 8-bit, 8 chunks x 16 outputs x 4 signed bytes (input 4c + j). Scales and mins are float16
// where every one of a weight is a half (GGUF's Q4_0, Q4_1 and Q8_0 store them so), else float32:
// a half widens to its float exactly, so both give the same bits, and halves stream 17 % fewer
// bytes for 4-bit codes (a block of 16 outputs: 320 bytes against 384).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "quant.h"
#include "simd.h"
#include "vector.h"

namespace spk {

constexpr int64_t Q8_GROUP = 16;

// bytes of a block's 16 scales (and of its 16 mins): float16 or float32
inline int64_t q8_scale_bytes(bool half) { return half ? 32 : 64; }
inline int64_t q8_block_bytes(int bits, bool half = false) {
  return bits == 4 ? 2 * q8_scale_bytes(half) + 256 : q8_scale_bytes(half) + 512;
}

// 16 scales or mins of a block, float32 or float16 widened (exact)
template <bool HALF>
inline V16 load_scales(const uint8_t* p) {
  if constexpr (HALF)
    return load16h(reinterpret_cast<const uint16_t*>(p));
  else
    return load16(reinterpret_cast<const float*>(p));
}

// a row of x quantized in blocks of 32: codes, and per block d, sum(q) and d * sum(q)
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum;
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
    vni sums = {};
    for (int p = 0; p < P; ++p) {
      const vni q = __builtin_convertvector((vload<vn>(xb + p * NATIVE) * id + round) - round, vni);
      const vnb bytes = __builtin_convertvector(q, vnb);  // |q| <= 127: exact
      std::memcpy(out.q.data() + i * BLOCK + p * NATIVE, &bytes, NATIVE);
      sums += q;
    }
    int32_t s = 0;
    for (int l = 0; l < NATIVE; ++l) s += sums[l];
    out.d[i] = d, out.sum[i] = s, out.dsum[i] = d * static_cast<float>(s);
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
  for_rows(M, K, parallel, [&](int64_t r0, int64_t r1) { quantize_blocks(x, r0 * blocks, r1 * blocks, out); });
}

struct Q8Weights {
  const uint8_t* packed;  // [groups, blocks, q8_block_bytes]
  int64_t N, K;
  int bits;
  bool half;  // float16 scales and mins
  int64_t blocks() const { return K / BLOCK; }
  const uint8_t* block_of(int64_t group, int64_t b) const {
    return packed + (group * blocks() + b) * q8_block_bytes(bits, half);
  }
};

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

// acc += a block's sums (as float) times its scales, then its mins' part: the fixed order every
// branch and tile follows. i: the row's block (its d and d * sum(q)).
template <int BITS, bool HALF>
inline V16 add_block(const uint8_t* blk, const Q8Rows& a, int64_t i, const V16& dots, const V16& acc) {
  const V16 out = fma16(dots, mul16(load_scales<HALF>(blk), set16(a.d[i])), acc);
  return BITS == 4 ? fma16(load_scales<HALF>(blk + q8_scale_bytes(HALF)), set16(a.dsum[i]), out) : out;
}

// y's R rows from m0 (fewer outputs where N ends): acc + bias
inline void store_rows(const V16* acc, int64_t m0, int64_t R, const Q8Weights& w, int64_t n0, const float* bias,
                       float* y) {
  const int64_t outs = std::min<int64_t>(Q8_GROUP, w.N - n0);
  if (outs == Q8_GROUP) {
    const V16 b = load16(bias + n0);
    for (int64_t r = 0; r < R; ++r) store16(y + (m0 + r) * w.N + n0, add16(acc[r], b));
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    float v[16];
    store16(v, acc[r]);
    float* yr = y + (m0 + r) * w.N + n0;
    for (int64_t o = 0; o < outs; ++o) yr[o] = v[o] + bias[n0 + o];
  }
}

// R rows (from m0) against the 16 outputs of one group; y's columns from n0 (fewer where N ends).
// stream: the call's only tile of the group, so it prefetches (several tiles a group are bound by
// their multiplies: there prefetching measured 10 % slower on the AVX2 branch, and no faster on AVX-512)
template <int BITS, bool HALF, int R>
inline void q8_tile(const Q8Rows& a, int64_t m0, const Q8Weights& w, int64_t group, const float* bias, float* y,
                    bool stream) {
  const int64_t K = w.K, blocks = w.blocks();
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero16();
  const int64_t bytes = q8_block_bytes(BITS, HALF), sb = q8_scale_bytes(HALF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w.block_of(group, b);
    if (stream) prefetch_stream(blk, bytes);
    const int8_t* x[R];
    int32_t sums[R];
    for (int r = 0; r < R; ++r) x[r] = a.q.data() + (m0 + r) * K + b * BLOCK, sums[r] = a.sum[(m0 + r) * blocks + b];
    I16 dots[R];
    dot_rows<BITS, R>(blk + (BITS == 4 ? 2 * sb : sb), x, sums, dots);
    for (int r = 0; r < R; ++r)
      acc[r] = add_block<BITS, HALF>(blk, a, (m0 + r) * blocks + b, to_float16(dots[r]), acc[r]);
  }
  store_rows(acc, m0, R, w, group * Q8_GROUP, bias, y);
}

#if defined(SPK_Q8_AMX)
// rows [m0, m0 + R), R <= 16, against one group on AMX (arch/x86/amx.h), two blocks a round, the
// float part (q8_tile's) of a round while the next round's tiles multiply (the sums of a tile store
// are read a round later: a pass's linears at 4 rows, all on the tiles, 11.0 -> 8.4 ms on one core
// of an Emerald Rapids Xeon). ROWS: R known when compiled (16: a full tile, its sums in registers),
// or 0. The caller has set the tile shapes (amx_configure) on this thread.
template <int BITS, bool HALF, int ROWS>
inline void q8_amx_tile(const Q8Rows& a, int64_t m0, int64_t R, const Q8Weights& w, int64_t group,
                        const float* bias, float* y, bool stream) {
  const int64_t rows = ROWS ? ROWS : R, K = w.K, blocks = w.blocks();
  const int64_t bytes = q8_block_bytes(BITS, HALF), codes = BITS == 4 ? 2 * q8_scale_bytes(HALF) : q8_scale_bytes(HALF);
  V16 acc[AMX_ROWS];
  for (int64_t r = 0; r < rows; ++r) acc[r] = zero16();
  alignas(64) int32_t dots[2][2][AMX_ROWS * 16];
  const int8_t* x = a.q.data() + m0 * K;
  // the float part of the round before, while this round's tiles multiply
  auto scale = [&](int64_t b, int n, const int32_t (*d)[AMX_ROWS * 16]) {
    for (int j = 0; j < n; ++j) {
      const uint8_t* blk = w.block_of(group, b + j);
      for (int64_t r = 0; r < rows; ++r)
        acc[r] = add_block<BITS, HALF>(blk, a, (m0 + r) * blocks + b + j, to_float16(load16i(d[j] + 16 * r)), acc[r]);
    }
  };
  int cur = 0;
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool pair = b + 1 < blocks;
    const uint8_t* blk0 = w.block_of(group, b);
    if (stream) prefetch_stream(blk0, pair ? 2 * bytes : bytes);
    if (pair)
      amx_dots2<BITS>(blk0 + codes, w.block_of(group, b + 1) + codes, x + b * BLOCK, K, dots[cur][0], dots[cur][1]);
    else
      amx_dots1<BITS>(blk0 + codes, x + b * BLOCK, K, dots[cur][0]);
    if (b > 0) scale(b - 2, 2, dots[cur ^ 1]);
    cur ^= 1;
  }
  const int64_t last = (blocks - 1) & ~int64_t(1);
  scale(last, blocks - last, dots[cur ^ 1]);
  store_rows(acc, m0, rows, w, group * Q8_GROUP, bias, y);
}
#endif

// a block of M rows, Q8_ROWS < M <= q8_one_tile_rows(BITS), as one tile of M (false: M is not so)
template <int BITS, bool HALF, int R = q8_one_tile_rows(BITS)>
inline bool q8_one_tile(const Q8Rows& a, int64_t M, const Q8Weights& w, int64_t group, const float* bias, float* y) {
  if constexpr (R > Q8_ROWS) {
    if (M == R) return q8_tile<BITS, HALF, R>(a, 0, w, group, bias, y, true), true;
    return q8_one_tile<BITS, HALF, R - 1>(a, M, w, group, bias, y);
  }
  return false;
}

template <int BITS, bool HALF>
inline void q8_group(const Q8Rows& a, int64_t M, const Q8Weights& w, int64_t group, const float* bias, float* y) {
  // a block of up to q8_one_tile_rows(BITS) rows in one tile: the group's weights read once and
  // prefetched as a one-tile stream (4 + 1 read them twice: on a 2-core Zen 3, AVX2's 5-row block's
  // decoder layers 5.35 -> 5.02 ms and its LM head 1.55 -> 1.32, while tiles of 5 or 6 for every
  // block made 6 and 8 rows slower; on a 2-core Zen 4, AVX-512's 5-8 rows 7-14 % faster); integer
  // sums, so any tiling gives the same bits
#if defined(SPK_Q8_AMX)
  if (M >= q8_amx_from_rows(BITS) && amx_usable()) {
    int64_t m = 0;
    for (; m + AMX_ROWS <= M; m += AMX_ROWS)
      q8_amx_tile<BITS, HALF, AMX_ROWS>(a, m, AMX_ROWS, w, group, bias, y, false);
    if (m < M) q8_amx_tile<BITS, HALF, 0>(a, m, M - m, w, group, bias, y, M < AMX_ROWS);
    return;
  }
#endif
  if (q8_one_tile<BITS, HALF>(a, M, w, group, bias, y)) return;
  const bool stream = M <= Q8_ROWS;
  int64_t m = 0;
  for (; m + Q8_ROWS <= M; m += Q8_ROWS) q8_tile<BITS, HALF, Q8_ROWS>(a, m, w, group, bias, y, stream);
  switch (M - m) {
    case 3: if constexpr (Q8_ROWS > 3) q8_tile<BITS, HALF, 3>(a, m, w, group, bias, y, stream); break;
    case 2: if constexpr (Q8_ROWS > 2) q8_tile<BITS, HALF, 2>(a, m, w, group, bias, y, stream); break;
    case 1: q8_tile<BITS, HALF, 1>(a, m, w, group, bias, y, stream); break;
    default: break;
  }
}

// y [M, N] = x [M, K] @ w^T + bias [N], with x quantized row by row
inline void q8_linear(const float* x, int64_t M, const Q8Weights& w, const float* bias, float* y,
                      const ParallelFor& parallel) {
  Q8Rows a;
  quantize_rows(x, M, w.K, a, parallel);
  const int64_t groups = (w.N + Q8_GROUP - 1) / Q8_GROUP;
  parallel(groups, 4, [&](int64_t begin, int64_t end) {
#if defined(SPK_Q8_AMX)
    const bool tiles = M >= q8_amx_from_rows(w.bits) && amx_usable();
    if (tiles) amx_configure();  // this thread's tile shapes: ours (oneDNN may have set others)
#endif
    for (int64_t g = begin; g < end; ++g) {
      if (w.bits == 4)
        w.half ? q8_group<4, true>(a, M, w, g, bias, y) : q8_group<4, false>(a, M, w, g, bias, y);
      else
        w.half ? q8_group<8, true>(a, M, w, g, bias, y) : q8_group<8, false>(a, M, w, g, bias, y);
    }
#if defined(SPK_Q8_AMX)
    if (tiles) amx_release();
#endif
  });
}

}  // namespace spk
