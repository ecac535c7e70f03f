// AMX (Intel Xeon since Sapphire Rapids): a tile instruction multiplies up to 16 rows of int8 by a
// block's 16 outputs in one go (TDPBSUD: signed activations by unsigned 4-bit codes; TDPBSSD: by
// signed 8-bit ones), where vpdpbusd takes a register a row. q8.h's block layout is already AMX's:
// a B tile's row holds 4 consecutive inputs of each of 16 outputs, as a chunk of 16 outputs x 4
// bytes does, so an 8-bit block is its B tile as it lies (8 rows of 64 bytes) and a 4-bit one is two
// rows a chunk (its low nibbles inputs 8c..8c+3, its high ones 8c+4..8c+7). The sums are the same
// integers as every other branch's, and q8.h applies the scales to them as it does for any branch.
//
// Linux lends a process the tile registers on request (arch_prctl, once); a thread's tile shapes
// are its own state, and oneDNN (PyTorch's matmuls) sets its own, so a kernel sets ours before use.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace spk {

#define SPK_Q8_AMX 1
// blocks of more rows than avx512.h's one vpdpbusd tile holds go to the tiles; the tests define
// SPK_Q8_AMX_FROM_ROWS 1, so every width runs on them
constexpr int64_t q8_amx_from_rows(int bits) {
#if defined(SPK_Q8_AMX_FROM_ROWS)
  return bits * 0 + SPK_Q8_AMX_FROM_ROWS;
#else
  return q8_one_tile_rows(bits) + 1;
#endif
}

// whether this process may use the tile registers (asked once; an old kernel says no)
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// tiles 0-1: two blocks' sums (16 rows x 16 int32); 2-3: their codes (8 rows of 64 bytes, K = 32);
// 4-5: their activations (16 rows of 32 bytes). Rows past a call's last are read (the activations
// are padded to 16 rows: Q8Rows) and their sums never used.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32};
  uint8_t rows[16] = {16, 16, 8, 8, 16, 16};
};

inline void amx_configure() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

// the tiles back to their initial state: a thread switch then saves none of their 8 KB
inline void amx_release() { _tile_release(); }

constexpr int64_t AMX_ROWS = 16;

// GCC's tile intrinsics are asm without a memory clobber: it would drop the unpacked codes' stores
// (nothing it knows of reads them) and could move the activations' stores or the sums' reads across
// the tile loads and stores
inline void memory_barrier() { asm volatile("" ::: "memory"); }

inline I16 load16i(const int32_t* p) { return {_mm512_load_si512(p)}; }

// a 4-bit block's codes as a B tile: chunk c's low nibbles row 2c, its high ones row 2c + 1
inline void amx_unpack4(const uint8_t* codes, uint8_t* tile) {
  const __m512i mask = _mm512_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(codes + 64 * c);
    _mm512_store_si512(tile + 128 * c, _mm512_and_si512(v, mask));
    _mm512_store_si512(tile + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// two consecutive blocks' sums for 16 rows of activations (x: the first block's, rows K bytes apart)
// against one group's codes: out0 and out1 [16 rows][16 outputs]
template <int BITS>
inline void amx_dots2(const uint8_t* codes0, const uint8_t* codes1, const int8_t* x, int64_t K, int32_t* out0,
                      int32_t* out1) {
  memory_barrier();
  _tile_zero(0);
  _tile_zero(1);
  _tile_loadd(4, x, K);
  _tile_loadd(5, x + 32, K);
  if constexpr (BITS == 4) {
    alignas(64) uint8_t b0[512], b1[512];
    amx_unpack4(codes0, b0);
    amx_unpack4(codes1, b1);
    memory_barrier();
    _tile_loadd(2, b0, 64);
    _tile_loadd(3, b1, 64);
    _tile_dpbsud(0, 4, 2);
    _tile_dpbsud(1, 5, 3);
  } else {
    _tile_loadd(2, codes0, 64);
    _tile_loadd(3, codes1, 64);
    _tile_dpbssd(0, 4, 2);
    _tile_dpbssd(1, 5, 3);
  }
  _tile_stored(0, out0, 64);
  _tile_stored(1, out1, 64);
  memory_barrier();
}

// one block's (a group's last when its count is odd)
template <int BITS>
inline void amx_dots1(const uint8_t* codes, const int8_t* x, int64_t K, int32_t* out) {
  memory_barrier();
  _tile_zero(0);
  _tile_loadd(4, x, K);
  if constexpr (BITS == 4) {
    alignas(64) uint8_t b[512];
    amx_unpack4(codes, b);
    memory_barrier();
    _tile_loadd(2, b, 64);
    _tile_dpbsud(0, 4, 2);
  } else {
    _tile_loadd(2, codes, 64);
    _tile_dpbssd(0, 4, 2);
  }
  _tile_stored(0, out, 64);
  memory_barrier();
}

}  // namespace spk
