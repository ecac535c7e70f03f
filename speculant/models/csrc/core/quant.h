// Linear layers over GGUF blocks with float32 activations (``dtype="quantized"``).
//
// A weight [N, K] is kept as GGUF keeps it: blocks of 32 inputs, each w = scale * q + min with a
// float32 scale and min per block and 4-bit (two to a byte: byte i holds inputs i and 16 + i) or
// 8-bit signed codes. Q4_0, Q4_1, Q4_K and Q8_0 all map onto it exactly (quantized.py repacks).
// Packed for streaming: outputs in groups of GROUP, and per group block after block, each output's
// record: float32 scale, float32 min, its codes. A tile of outputs then reads one contiguous stream.
//
// Per output and row, whatever else the call computes: over the blocks in order, acc = fma(w_lo,
// x_lo, acc), then acc = fma(w_hi, x_hi, acc) in 16 lanes (w = fma(code, scale, min): the dequantised
// model's very weights); y = the lanes' sum in a fixed tree, plus the bias. No sum crosses rows and
// none is split by how many rows a call holds, so a row gets the same bits in a one-token step, a
// verify block, a tree or a batch (width invariance), and every ISA branch gives the same bits.
//
// BITS 32: a float32 model's own weight [N, K] as it holds it (row-major, not packed), read 32
// inputs at a time in that very order (``float32`` on the kernels: a dequantised GGUF's weights give
// its blocks' bits); BITS 16: such a weight kept in bfloat16 where each of its values is one (a bf16
// checkpoint's), widened exactly: the float32 weight's very bits from half the bytes. Its 16 inputs
// a vector in pairs (input j and 8 + j side by side: arch/generic.h's load16b), so one load, a shift
// and a mask widen them on AVX2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "simd.h"

namespace spk {

constexpr int64_t BLOCK = 32;
constexpr int64_t GROUP = 4;  // outputs a group of the packed layout holds (every ISA)

inline int64_t record_bytes(int bits) { return 8 + (bits == 4 ? 16 : 32); }

struct QWeights {
  const uint8_t* packed;  // [groups, blocks, GROUP, record]; BITS 32: float32 [N, K]; 16: bfloat16 [N, K]
  int64_t N, K;
  int bits;
  int64_t blocks() const { return K / BLOCK; }
  int64_t record() const { return record_bytes(bits); }
  const uint8_t* record_of(int64_t n, int64_t b) const {
    return packed + (((n / GROUP) * blocks() + b) * GROUP + n % GROUP) * record();
  }
};

// R rows of x against O outputs from n0; a block's weights are dequantized in registers once for
// the R rows (measured: faster than a scratch of them dequantized once for all rows)
template <int BITS, int O, int R>
inline void tile(const float* x, const QWeights& w, int64_t n0, float* y, int64_t ldy) {
  const int64_t K = w.K;
  V16 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = zero16();
  for (int64_t b = 0; b < w.blocks(); ++b) {
    for (int o = 0; o < O; ++o) {
      V16 lo, hi;
      if constexpr (BITS == 32) {
        const float* row = reinterpret_cast<const float*>(w.packed) + (n0 + o) * K + b * BLOCK;
        lo = load16(row), hi = load16(row + 16);
      } else if constexpr (BITS == 16) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(w.packed) + (n0 + o) * K + b * BLOCK;
        lo = load16b(row), hi = load16b(row + 16);
      } else {
        const uint8_t* rec = w.record_of(n0 + o, b);
        float scale, min;
        std::memcpy(&scale, rec, 4);
        std::memcpy(&min, rec + 4, 4);
        dequant<BITS>(rec + 8, scale, min, lo, hi);
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + b * BLOCK;
        acc[o][r] = fma16(lo, load16(xr), acc[o][r]);
        acc[o][r] = fma16(hi, load16(xr + 16), acc[o][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) y[r * ldy + o] = sum16(acc[o][r]);
}

// all M rows against O outputs, in tiles of RT rows (the remainder in one smaller tile)
template <int BITS, int O, int RT>
inline void rows_of(const float* x, int64_t M, const QWeights& w, int64_t n0, float* y) {
  const int64_t K = w.K, N = w.N;
  int64_t m = 0;
  for (; m + RT <= M; m += RT) tile<BITS, O, RT>(x + m * K, w, n0, y + m * N + n0, N);
  const float* xm = x + m * K;
  float* ym = y + m * N + n0;
  switch (M - m) {
    case 7: if constexpr (RT > 7) tile<BITS, O, 7>(xm, w, n0, ym, N); break;
    case 6: if constexpr (RT > 6) tile<BITS, O, 6>(xm, w, n0, ym, N); break;
    case 5: if constexpr (RT > 5) tile<BITS, O, 5>(xm, w, n0, ym, N); break;
    case 4: if constexpr (RT > 4) tile<BITS, O, 4>(xm, w, n0, ym, N); break;
    case 3: if constexpr (RT > 3) tile<BITS, O, 3>(xm, w, n0, ym, N); break;
    case 2: if constexpr (RT > 2) tile<BITS, O, 2>(xm, w, n0, ym, N); break;
    case 1: tile<BITS, O, 1>(xm, w, n0, ym, N); break;
    default: break;
  }
}

// one group of GROUP outputs from n0 (fewer where N ends), all M rows, in this ISA's tiles
template <int BITS, int O, int RT>
inline void group_in_tiles(const float* x, int64_t M, const QWeights& w, int64_t n0, float* y) {
  static_assert(GROUP % O == 0, "tiles split a group evenly");
  for (int64_t o = 0; o < GROUP; o += O) rows_of<BITS, O, RT>(x, M, w, n0 + o, y);
}

template <int BITS>
inline void linear_group(const float* x, int64_t M, const QWeights& w, int64_t n0, float* y) {
  if (n0 + GROUP > w.N) {  // the last few outputs, one at a time
    for (int64_t n = n0; n < w.N; ++n) rows_of<BITS, 1, NARROW_ROWS>(x, M, w, n, y);
  } else if (M == 1) {
    group_in_tiles<BITS, ONE_ROW_OUTS, 1>(x, M, w, n0, y);
  } else if (M < WIDE_FROM && BITS <= 8) {  // dense weights (16, 32) take the wide tiles from 2 rows:
    // one stream of whole rows (a float32 pass of 2 and 3 rows 25.3 and 29.1 ms in narrow tiles, 19.7
    // and 22.8 in wide ones, 4 rows 21.8; a 2-core Zen 3)
    group_in_tiles<BITS, NARROW_OUTS, NARROW_ROWS>(x, M, w, n0, y);
  } else {
    group_in_tiles<BITS, WIDE_OUTS, WIDE_ROWS>(x, M, w, n0, y);
  }
}

// y [M, N] = x [M, K] @ w^T + bias (bias may be null)
inline void quant_linear(const float* x, int64_t M, const QWeights& w, const float* bias, float* y,
                         const ParallelFor& parallel) {
  const int64_t groups = (w.N + GROUP - 1) / GROUP;
  parallel(groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (w.bits == 4)
        linear_group<4>(x, M, w, g * GROUP, y);
      else if (w.bits == 8)
        linear_group<8>(x, M, w, g * GROUP, y);
      else if (w.bits == 16)
        linear_group<16>(x, M, w, g * GROUP, y);
      else
        linear_group<32>(x, M, w, g * GROUP, y);
    }
  });
  if (bias)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = 0; n < w.N; ++n) y[r * w.N + n] += bias[n];
}

}  // namespace spk
