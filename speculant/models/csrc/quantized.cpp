// The quantized fast path's CPU kernels: linear layers over GGUF blocks, and a whole decoder layer
// in one call (norms, rotary, cache writes, attention, SiLU, residuals), or in two around attention.
//
// A weight [N, K] is kept as GGUF keeps it: blocks of 32 inputs, each w = scale * q + min with a
// float32 scale and min per block and 4-bit (two to a byte: byte i holds inputs i and 16 + i) or
// 8-bit signed codes. Q4_0, Q4_1, Q4_K and Q8_0 all map onto it exactly (quantized.py repacks).
//
// Width invariance by construction: every value of a row is computed by operations whose order
// depends on nothing but that row (no sum crosses rows, none is split by how many rows a call
// holds), so a row gets the same bits in a one-token step, a verify block, a tree or a batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vector.h"

// the attention kernel itself, built without contraction as attention.cpp is (every operation a plain
// IEEE one), for a layer in one call (``layer``)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#include "attention.cpp"
#pragma GCC pop_options

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;
#if defined(__AVX512F__)
constexpr int64_t OUTS = 4;  // outputs a tile takes together (their codes widened once for its rows)
#else
constexpr int64_t OUTS = 2;  // 16-float vectors are two registers each: fewer outputs a tile
#endif
constexpr int64_t ROWS = 4;  // rows of x a tile takes together
typedef uint8_t vu8 __attribute__((vector_size(LANES)));

inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// 16 bytes -> 16 floats, widened in vector registers (GCC's generic conversion goes byte by byte)
template <bool SIGNED>
inline vf widen(const void* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512 f = _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  vf v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m128i c = _mm_srli_si128(b, 8);
  const __m256 lo = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c));
  vf v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
#else
  vf v;
  for (int i = 0; i < LANES; ++i)
    v[i] = SIGNED ? float(static_cast<const int8_t*>(p)[i]) : float(static_cast<const uint8_t*>(p)[i]);
  return v;
#endif
}

// the codes of one block of 32 inputs as floats (exact: small integers)
template <int BITS>
inline void codes(const uint8_t* q, vf& lo, vf& hi) {
  if (BITS == 4) {  // low nibbles: inputs 0..15 of the block, high nibbles: 16..31
    vu8 bytes, part;
    std::memcpy(&bytes, q, 16);
    part = bytes & 15;
    lo = widen<false>(&part);
    part = bytes >> 4;
    hi = widen<false>(&part);
  } else {
    lo = widen<true>(q);
    hi = widen<true>(q + 16);
  }
}

inline float lanes_sum(vf v) {  // a fixed tree: 16 -> 8 -> 4 -> 2 -> 1
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// A weight repacked for streaming (quantized.py, ``QuantLinear``): outputs in groups of OUTS, and
// per group block after block, each output's record: float32 scale, float32 min, its codes. A tile
// of outputs then reads one contiguous stream (separate arrays of codes, scales and mins made 12
// streams a tile, more than the prefetchers follow: Q8_0 ran at half the speed).
struct Weights {
  const uint8_t* packed;
  int64_t blocks, record;
};

inline int64_t record_bytes(int bits) { return 8 + (bits == 4 ? 16 : 32); }

// one block of one output's weights, dequantized: w = q * scale + min (one rounding: the dequantised
// model's very weights, as GGUF's own dequantisation computes them)
template <int BITS>
inline void weights_of(const Weights& w, int64_t n, int64_t b, vf& lo, vf& hi) {
  const uint8_t* r = w.packed + (((n / OUTS) * w.blocks + b) * OUTS + n % OUTS) * w.record;
  float scale, min;
  std::memcpy(&scale, r, 4);
  std::memcpy(&min, r + 4, 4);
#if defined(__AVX512F__)
  if constexpr (BITS == 4) {  // the 16 values a code can take, one FMA; each code looks its value up
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(scale), _mm512_set1_ps(min));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 8)));
    const __m512 a = _mm512_permutexvar_ps(bytes, table);  // the index's low 4 bits: the low nibble
    const __m512 c = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    std::memcpy(&lo, &a, sizeof lo);
    std::memcpy(&hi, &c, sizeof hi);
    return;
  }
#endif
  codes<BITS>(r + 8, lo, hi);
  const vf s = (vf){} + scale, m = (vf){} + min;
  lo = lo * s + m;
  hi = hi * s + m;
}

// R rows of x against O outputs. Per output and row, whatever else the call computes: over the
// blocks in order, acc += w_lo * x_lo, then acc += w_hi * x_hi (16 lanes, one FMA each); y = the
// lanes' sum in a fixed tree. A block's weights are dequantized in registers once for the R rows
// (measured: faster than a scratch of them dequantized once for all rows, up to 32 rows and more).
template <int BITS, int O, int R>
inline void tile(const float* x, int64_t K, const Weights& w, int64_t n0, float* y, int64_t ldy) {
  vf acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = (vf){};
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int o = 0; o < O; ++o) {
      vf lo, hi;
      weights_of<BITS>(w, n0 + o, b, lo, hi);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + b * BLOCK;
        acc[o][r] = lo * vload(xr) + acc[o][r];
        acc[o][r] = hi * vload(xr + LANES) + acc[o][r];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) y[r * ldy + o] = lanes_sum(acc[o][r]);
}

// all M rows against O outputs, in tiles of up to RT rows (the remainder in one smaller tile)
template <int BITS, int O, int RT>
inline void rows_of(const float* x, int64_t M, int64_t K, const Weights& w, int64_t n0, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + RT <= M; m += RT) tile<BITS, O, RT>(x + m * K, K, w, n0, y + m * N + n0, N);
  const float* xm = x + m * K;
  float* ym = y + m * N + n0;
  switch (M - m) {
    case 7: if constexpr (RT > 7) tile<BITS, O, 7>(xm, K, w, n0, ym, N); break;
    case 6: if constexpr (RT > 6) tile<BITS, O, 6>(xm, K, w, n0, ym, N); break;
    case 5: if constexpr (RT > 5) tile<BITS, O, 5>(xm, K, w, n0, ym, N); break;
    case 4: if constexpr (RT > 4) tile<BITS, O, 4>(xm, K, w, n0, ym, N); break;
    case 3: tile<BITS, O, 3>(xm, K, w, n0, ym, N); break;
    case 2: tile<BITS, O, 2>(xm, K, w, n0, ym, N); break;
    case 1: tile<BITS, O, 1>(xm, K, w, n0, ym, N); break;
    default: break;
  }
}

template <int BITS>
void linear_kernel(const float* x, int64_t M, int64_t K, const Weights& w, int64_t N, float* y) {
  const int64_t tiles = (N + OUTS - 1) / OUTS;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * OUTS, outs = std::min<int64_t>(OUTS, N - n0);
      if (outs < OUTS) {  // the last few outputs, one at a time
        for (int64_t o = 0; o < outs; ++o) rows_of<BITS, 1, ROWS>(x, M, K, w, n0 + o, y, N);
      } else if (M < 2 * ROWS || OUTS % 2) {
        rows_of<BITS, OUTS, ROWS>(x, M, K, w, n0, y, N);
      } else {  // many rows: tiles of half the outputs and twice the rows (a block dequantized for more rows)
        for (int64_t o = 0; o < OUTS; o += OUTS / 2) rows_of<BITS, OUTS / 2, 2 * ROWS>(x, M, K, w, n0 + o, y, N);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// the rest of a decoder layer

// HF's RMSNorm over rows of H (a multiple of 16): out = w * (x / sqrt(mean(x^2) + eps))
void rms_norm(const float* x, int64_t M, int64_t H, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * H;
    vf ss = (vf){};
    for (int64_t i = 0; i < H; i += LANES) ss = vload(xr + i) * vload(xr + i) + ss;
    const float inv = 1.0f / std::sqrt(lanes_sum(ss) / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; i += LANES) vstore(out + r * H + i, vload(w + i) * (vload(xr + i) * inv));
  }
}

// silu(g) = g / (1 + exp(-g)), from e = exp(-|g|) <= 1 (the vector exp takes arguments <= 0)
inline vf silu(vf g) {
  const vf zero = g - g;
  const vf e = exp_vector(g < zero ? g : zero - g);
  const vf one = zero + 1.0f;
  return g * (g < zero ? e : one) / (one + e);
}

struct Linear {  // a quantized linear's tensors from Python: the packed weight and its bias (zeros for none)
  Weights w;
  const float* bias;
  int64_t N;
  int bits;
};

Linear linear_of(const std::vector<at::Tensor>& t, int64_t bits, int64_t K) {
  TORCH_CHECK(t.size() == 2 && K % BLOCK == 0, "a quantized linear is (packed, bias); in_features a multiple of 32");
  TORCH_CHECK(t[1].scalar_type() == at::kFloat && t[1].is_contiguous() && t[1].dim() == 1, "bias: float32 [N]");
  const int64_t blocks = K / BLOCK, record = record_bytes(static_cast<int>(bits));
  const at::Tensor& p = t[0];
  TORCH_CHECK(p.scalar_type() == at::kByte && p.is_contiguous() && p.dim() == 4 && p.size(1) == blocks &&
                  p.size(2) == OUTS && p.size(3) == record,
              "packed weight: uint8 [groups, ", blocks, ", ", OUTS, ", ", record, "]");
  const int64_t N = t[1].numel();
  TORCH_CHECK(p.size(0) == (N + OUTS - 1) / OUTS, "packed weight: ", (N + OUTS - 1) / OUTS, " groups for ", N, " outputs");
  return {{p.data_ptr<uint8_t>(), blocks, record}, t[1].data_ptr<float>(), N, static_cast<int>(bits)};
}

void apply(const Linear& l, const float* x, int64_t M, int64_t K, float* y) {
  if (l.bits == 4)
    linear_kernel<4>(x, M, K, l.w, l.N, y);
  else
    linear_kernel<8>(x, M, K, l.w, l.N, y);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t n = 0; n < l.N; ++n) y[r * l.N + n] += l.bias[n];
}

at::Tensor rows_of_float(const at::Tensor& t, int64_t width) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(-1) == width, "expected contiguous float32 [..., ",
              width, "]");
  return t;
}

}  // namespace

// x: float32 [M, K]; w: (packed weight, bias). Returns float32 [M, N].
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& w, int64_t bits) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  rows_of_float(x, K);
  const Linear l = linear_of(w, bits, K);
  auto y = torch::empty({M, l.N}, x.options());
  if (M > 0) apply(l, x.data_ptr<float>(), M, K, y.data_ptr<float>());
  return y;
}

// A decoder layer up to attention: norm, the q/k/v matmul and rotary on the first ``roped`` heads.
// h: [M, H]; cos, sin: [M, D]. Returns [M, heads * D] (q, k and v heads side by side).
at::Tensor layer_start(const at::Tensor& h, const at::Tensor& ln, double eps, const std::vector<at::Tensor>& qkv,
                       int64_t bits, const at::Tensor& cos, const at::Tensor& sin, int64_t roped, int64_t D) {
  const int64_t H = h.size(-1), M = h.numel() / H;
  TORCH_CHECK(H % LANES == 0 && D % 2 == 0, "hidden size a multiple of 16");
  rows_of_float(h, H), rows_of_float(ln, H), rows_of_float(cos, D), rows_of_float(sin, D);
  const Linear l = linear_of(qkv, bits, H);
  TORCH_CHECK(l.N % D == 0 && roped * D <= l.N && cos.numel() == M * D && sin.numel() == M * D, "heads");
  std::vector<float> x(M * H);
  rms_norm(h.data_ptr<float>(), M, H, ln.data_ptr<float>(), static_cast<float>(eps), x.data());
  auto y = torch::empty({M, l.N}, h.options());
  float* yp = y.data_ptr<float>();
  apply(l, x.data(), M, H, yp);
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const int64_t half = D / 2;
  std::vector<float> head(D);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < roped; ++k) {  // x * cos + rotate_half(x) * sin, element by element
      float* p = yp + r * l.N + k * D;
      std::memcpy(head.data(), p, D * sizeof(float));
      for (int64_t i = 0; i < D; ++i) {
        const float rot = i < half ? -head[i + half] : head[i - half];
        p[i] = head[i] * c[r * D + i] + rot * s[r * D + i];
      }
    }
  return y;
}

// The rest of a decoder layer: h + o(attn), then + down(silu(gate) * up) of its norm. h: [M, H];
// attn: [M, heads * D]. Returns the new h [M, H].
at::Tensor layer_end(const at::Tensor& h, const at::Tensor& attn, const std::vector<at::Tensor>& o, int64_t o_bits,
                     const at::Tensor& ln, double eps, const std::vector<at::Tensor>& gate_up, int64_t gu_bits,
                     const std::vector<at::Tensor>& down, int64_t down_bits) {
  const int64_t H = h.size(-1), M = h.numel() / H, A = attn.size(-1);
  rows_of_float(h, H), rows_of_float(attn, A), rows_of_float(ln, H);
  TORCH_CHECK(attn.numel() == M * A && H % LANES == 0, "attn rows");
  const Linear lo = linear_of(o, o_bits, A), lg = linear_of(gate_up, gu_bits, H);
  const int64_t I = lg.N / 2;
  const Linear ld = linear_of(down, down_bits, I);
  TORCH_CHECK(lo.N == H && ld.N == H && I % LANES == 0, "layer shapes");
  auto out = torch::empty({M, H}, h.options());
  float* hp = out.data_ptr<float>();
  apply(lo, attn.data_ptr<float>(), M, A, hp);
  const float* h0 = h.data_ptr<float>();
  for (int64_t i = 0; i < M * H; ++i) hp[i] = h0[i] + hp[i];
  std::vector<float> x(M * H), gu(M * 2 * I), act(M * I), d(M * H);
  rms_norm(hp, M, H, ln.data_ptr<float>(), static_cast<float>(eps), x.data());
  apply(lg, x.data(), M, H, gu.data());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < I; i += LANES)
      vstore(act.data() + r * I + i, silu(vload(gu.data() + r * 2 * I + i)) * vload(gu.data() + r * 2 * I + I + i));
  apply(ld, act.data(), M, I, d.data());
  for (int64_t i = 0; i < M * H; ++i) hp[i] += d[i];
  return out;
}

// A whole decoder layer for the passes after the prefill, in one call: layer_start; the new keys and
// values written into the cache at (row, write_at); attention (attention.cpp's kernel: each query over
// its ``count`` keys, gathered by ``slots`` for a tree, or slots 0.. for a chain); layer_end.
// h: [B, T, H]; cos, sin: [B, T, D]; caches: [B, n_kv, S, D]; write_at, count: [B, T].
at::Tensor layer(const at::Tensor& h, const at::Tensor& ln1, double eps, const std::vector<at::Tensor>& qkv,
                 int64_t qkv_bits, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, int64_t n_kv, int64_t D,
                 at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write_at, const at::Tensor& slots,
                 const at::Tensor& count, double scale, const std::vector<at::Tensor>& o, int64_t o_bits,
                 const at::Tensor& ln2, const std::vector<at::Tensor>& gate_up, int64_t gu_bits,
                 const std::vector<at::Tensor>& down, int64_t down_bits) {
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2), heads = n_heads + 2 * n_kv;
  TORCH_CHECK(h.dim() == 3 && k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                  k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == n_kv && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  write_at.scalar_type() == at::kLong && write_at.size(0) == B && write_at.size(1) == T,
              "layer: caches float32 [B, n_kv, S, D] contiguous along D, write_at [B, T]");
  at::Tensor y = layer_start(h, ln1, eps, qkv, qkv_bits, cos, sin, n_heads + n_kv, D).view({B, T, heads, D});
  const auto wa = write_at.accessor<int64_t, 2>();
  const float* yp = y.data_ptr<float>();
  float *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t S = k_cache.size(2);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = wa[b][t];
      TORCH_CHECK(slot >= 0 && slot < S, "layer: write_at outside the cache");
      for (int64_t j = 0; j < n_kv; ++j) {
        const float* src = yp + ((b * T + t) * heads + n_heads + j) * D;
        std::memcpy(kp + b * k_cache.stride(0) + j * k_cache.stride(1) + slot * k_cache.stride(2), src, D * sizeof(float));
        std::memcpy(vp + b * v_cache.stride(0) + j * v_cache.stride(1) + slot * v_cache.stride(2), src + n_kv * D,
                    D * sizeof(float));
      }
    }
  at::Tensor a = attend(y.narrow(2, 0, n_heads).transpose(1, 2), k_cache, v_cache, slots, count, scale);
  a = a.transpose(1, 2).contiguous().view({B * T, n_heads * D});
  return layer_end(h, a, o, o_bits, ln2, eps, gate_up, gu_bits, down, down_bits).view({B, T, H});
}

// Outputs a group of the packed layout holds on this CPU.
int64_t group_size() { return OUTS; }

// The final norm: [M, H] -> [M, H].
at::Tensor norm(const at::Tensor& h, const at::Tensor& ln, double eps) {
  const int64_t H = h.size(-1), M = h.numel() / H;
  rows_of_float(h, H), rows_of_float(ln, H);
  TORCH_CHECK(H % LANES == 0, "hidden size a multiple of 16");
  auto out = torch::empty({M, H}, h.options());
  rms_norm(h.data_ptr<float>(), M, H, ln.data_ptr<float>(), static_cast<float>(eps), out.data_ptr<float>());
  return out;
}
