// The PyTorch binding of the kernel core (core/: plain C++, no PyTorch): tensors are checked and
// handed to it as pointers, and at::parallel_for gives it PyTorch's threads. One module holds every
// CPU kernel (attention, quantized linears, a decoder layer), built once per machine.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/accept.h"
#include "core/eagle.h"
#include "core/gguf.h"
#include "core/layer.h"

namespace {

void torch_parallel(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { body(begin, end); });
}
const spk::ParallelFor PARALLEL = torch_parallel;

// fn(parallel) with all its loops in one parallel region of PyTorch's threads (core/parallel.h):
// for the calls that run many small loops (every layer of a pass, an EAGLE head's chain)
template <typename F>
void in_one_region(F&& fn) {
  spk::in_one_region(PARALLEL, at::get_num_threads(), std::forward<F>(fn));
}

// run() without Python's GIL (a long prefill takes seconds: the server's other threads answer
// meanwhile), a std::out_of_range of the core as a Python error
template <typename F>
void out_of_range_as_error(F&& run) {
  try {
    pybind11::gil_scoped_release unlocked;
    run();
  } catch (const std::out_of_range& e) {
    TORCH_CHECK(false, e.what());
  }
}

const at::Tensor& rows_of_float(const at::Tensor& t, int64_t width) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(-1) == width, "expected contiguous float32 [..., ",
              width, "]");
  return t;
}

// A quantized linear's tensors from Python: (packed weight, bias [N], zeros for none), or for int8
// weights of several kinds side by side (q/k/v of a GGUF whose tensors differ in type) (packed,
// packed, ..., bias), up to three, every part but the last a whole number of groups of 16 outputs.
// ``bits``: what the packed weights are: 32 or 16, a float32 model's own weight [N, K] or its
// bfloat16 values (core/quant.h); 4 or 8, a [groups of 4, blocks, 4, record] layout for float32
// activations (core/quant.h); otherwise the q8 kind of each part (core/q8.h), the first's in its
// low byte, the next's in the byte above. A direct q8 kind's size says whether its scales are
// float32 or float16.
spk::Linear linear_of(const std::vector<at::Tensor>& t, int64_t bits, int64_t K) {
  TORCH_CHECK(t.size() >= 2 && t.size() <= 4 && K % spk::BLOCK == 0,
              "a kernel linear is (packed, ..., bias) of up to three packed weights; in_features a multiple of 32");
  const at::Tensor& bias = t.back();
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.dim() == 1, "bias: float32 [N]");
  const int64_t blocks = K / spk::BLOCK, N = bias.numel();
  const at::Tensor& p = t[0];
  if (bits == 32 || bits == 16) {
    const bool f32 = bits == 32;
    TORCH_CHECK(t.size() == 2 && p.scalar_type() == (f32 ? at::kFloat : at::kBFloat16) && p.is_contiguous() &&
                    p.dim() == 2 && p.size(0) == N && p.size(1) == K,
                f32 ? "float32" : "bfloat16", " weight: contiguous [", N, ", ", K, "]");
    return {{static_cast<const uint8_t*>(p.data_ptr()), N, K, static_cast<int>(bits)}, bias.data_ptr<float>(), false};
  }
  for (const at::Tensor& part : t)
    TORCH_CHECK(&part == &bias || (part.scalar_type() == at::kByte && part.is_contiguous()),
                "packed weight: contiguous uint8");
  if ((bits == 4 || bits == 8) && p.dim() == 4) {  // float32 activations (quant.h)
    const int64_t record = spk::record_bytes(static_cast<int>(bits)), groups = (N + spk::GROUP - 1) / spk::GROUP;
    TORCH_CHECK(t.size() == 2 && p.size(0) == groups && p.size(1) == blocks && p.size(2) == spk::GROUP &&
                    p.size(3) == record,
                "packed weight: uint8 [", groups, ", ", blocks, ", ", spk::GROUP, ", ", record, "]");
    return {{p.data_ptr<uint8_t>(), N, K, static_cast<int>(bits)}, bias.data_ptr<float>(), false};
  }
  const int64_t parts = static_cast<int64_t>(t.size()) - 1;
  TORCH_CHECK(bits >> (8 * parts) == 0, "linear: a q8 kind for each packed weight, no more");
  spk::Q8Weights w[3];
  int64_t before = 0;
  for (int64_t i = 0; i < parts; ++i) {
    const int kind = static_cast<int>((bits >> (8 * i)) & 255);
    TORCH_CHECK(spk::q8_kind_known(kind), "linear: ", kind, " is not a q8 kind");
    TORCH_CHECK(!spk::q8_super(kind) || K % (spk::Q8_SUPER * spk::BLOCK) == 0,
                "linear: a super-block kind needs in_features a multiple of 256");
    const at::Tensor& q = t[i];
    const int64_t groups = q.dim() ? q.size(0) : 0;
    const int64_t n = i + 1 < parts ? groups * spk::Q8_GROUP : N - before;
    TORCH_CHECK(n > 0 && groups == (n + spk::Q8_GROUP - 1) / spk::Q8_GROUP,
                "linear: part ", i, "'s groups do not hold its ", n, " outputs");
    const int64_t half_bytes = groups * spk::q8_group_bytes(kind, true, K);
    const bool half = q.numel() == half_bytes;
    TORCH_CHECK(half || (!spk::q8_super(kind) && q.numel() == groups * spk::q8_group_bytes(kind, false, K)),
                "int8 packed weight of kind ", kind, ": ", groups, " groups of ", spk::q8_group_bytes(kind, true, K),
                spk::q8_super(kind) ? "" : " or " + std::to_string(spk::q8_group_bytes(kind, false, K)), " bytes");
    w[i] = {q.data_ptr<uint8_t>(), n, K, kind, half};
    before += n;
  }
  spk::Linear l{{w[0].packed, w[0].N, K, w[0].kind}, bias.data_ptr<float>(), true, w[0].half};
  l.n_more = static_cast<int>(parts - 1);
  for (int64_t i = 1; i < parts; ++i) l.more[i - 1] = w[i];
  return l;
}

template <typename T, typename A>
spk::Strided4<T> strided(const at::Tensor& t) {
  return {reinterpret_cast<T*>(t.data_ptr<A>()), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// queries and output of T (A: its ATen type), keys and values of C (CA)
template <typename T, typename A, typename C = T, typename CA = A>
void attend_as(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
               const at::Tensor& count, double scale, at::Tensor& out) {
  const spk::AttentionShape sh{q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(2),
                               slots.numel() ? slots.size(2) : 0};
  spk::attend(sh, strided<const T, A>(q), strided<const C, CA>(k), strided<const C, CA>(v),
                 slots.numel() ? slots.data_ptr<int64_t>() : nullptr, count.data_ptr<int64_t>(),
                 static_cast<float>(scale), strided<T, A>(out), PARALLEL);
}

}  // namespace

// q [B, H, T, D]; k, v [B, Hkv, S, D] with contiguous rows, of q's dtype or float16 beside float32
// queries (q8's cache); slots [B, T, W] int64 (query t's key x is slot slots[b, t, x]), or empty
// where key x is slot x; count [B, T]: keys each query sees.
at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots, at::Tensor count, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(), "attend: q [B, H, T, D], k and v [B, Hkv, S, D]");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attend: keys and values need contiguous rows");
  const bool half_cache = q.scalar_type() == at::kFloat && k.scalar_type() == at::kHalf;
  TORCH_CHECK((q.scalar_type() == k.scalar_type() || half_cache) && k.scalar_type() == v.scalar_type(),
              "attend: q, k and v of one dtype, or float16 keys and values beside float32 queries");
  TORCH_CHECK(q.size(3) % spk::LANES == 0 && q.size(3) <= spk::MAX_D, "attend: head dims a multiple of 16, at most 256");
  auto out = at::empty(q.sizes(), q.options());
  auto c = count.to(at::kLong).contiguous();
  auto sl = slots.numel() ? slots.to(at::kLong).contiguous() : slots;
  if (half_cache) {
    attend_as<float, float, spk::f16, at::Half>(q, k, v, sl, c, scale, out);
  } else if (q.scalar_type() == at::kFloat) {
    attend_as<float, float>(q, k, v, sl, c, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_as<spk::bf16, at::BFloat16>(q, k, v, sl, c, scale, out);
  } else if (q.scalar_type() == at::kHalf) {
    attend_as<spk::f16, at::Half>(q, k, v, sl, c, scale, out);
  } else {
    TORCH_CHECK(false, "attend: float32, bfloat16 or float16 only");
  }
  return out;
}

// x: float32 [M, K]; w: (packed weight, bias). Returns float32 [M, N].
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& w, int64_t bits) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  rows_of_float(x, K);
  const spk::Linear l = linear_of(w, bits, K);
  auto y = torch::empty({M, l.N()}, x.options());
  if (M > 0) out_of_range_as_error([&] { spk::apply(l, x.data_ptr<float>(), M, y.data_ptr<float>(), PARALLEL); });
  return y;
}

// A decoder layer up to attention: norm, the q/k/v matmul and rotary on the first ``roped`` heads.
// h: [M, H]; cos, sin: [M, D]. Returns [M, heads * D] (q, k and v heads side by side).
at::Tensor layer_start(const at::Tensor& h, const at::Tensor& ln, double eps, const std::vector<at::Tensor>& qkv,
                       int64_t bits, const at::Tensor& cos, const at::Tensor& sin, int64_t roped, int64_t D) {
  const int64_t H = h.size(-1), M = h.numel() / H;
  TORCH_CHECK(H % spk::LANES == 0 && D % 2 == 0, "hidden size a multiple of 16");
  rows_of_float(h, H), rows_of_float(ln, H), rows_of_float(cos, D), rows_of_float(sin, D);
  const spk::Linear l = linear_of(qkv, bits, H);
  TORCH_CHECK(l.N() % D == 0 && roped * D <= l.N() && cos.numel() == M * D && sin.numel() == M * D, "heads");
  auto y = torch::empty({M, l.N()}, h.options());
  spk::layer_start(h.data_ptr<float>(), M, H, ln.data_ptr<float>(), static_cast<float>(eps), l, cos.data_ptr<float>(),
                   sin.data_ptr<float>(), roped, D, y.data_ptr<float>(), PARALLEL);
  return y;
}

// The rest of a decoder layer: h + o(attn), then + down(silu(gate) * up) of its norm. h: [M, H];
// attn: [M, heads * D]. Returns the new h [M, H].
at::Tensor layer_end(const at::Tensor& h, const at::Tensor& attn, const std::vector<at::Tensor>& o, int64_t o_bits,
                     const at::Tensor& ln, double eps, const std::vector<at::Tensor>& gate_up, int64_t gu_bits,
                     const std::vector<at::Tensor>& down, int64_t down_bits) {
  const int64_t H = h.size(-1), M = h.numel() / H, A = attn.size(-1);
  rows_of_float(h, H), rows_of_float(attn, A), rows_of_float(ln, H);
  TORCH_CHECK(attn.numel() == M * A && H % spk::LANES == 0, "attn rows");
  const spk::Linear lo = linear_of(o, o_bits, A), lg = linear_of(gate_up, gu_bits, H);
  const spk::Linear ld = linear_of(down, down_bits, lg.N() / 2);
  TORCH_CHECK(lo.N() == H && ld.N() == H && (lg.N() / 2) % spk::LANES == 0, "layer shapes");
  auto out = torch::empty({M, H}, h.options());
  spk::layer_end(h.data_ptr<float>(), attn.data_ptr<float>(), M, H, lo, ln.data_ptr<float>(), static_cast<float>(eps),
                 lg, ld, out.data_ptr<float>(), PARALLEL);
  return out;
}

namespace {

// A decoder layer's weights from Python: two norms, and (packed, bias) with its code bits per linear
spk::LayerWeights layer_weights(const at::Tensor& ln1, const at::Tensor& ln2, double eps, int64_t qkv_in,
                                const std::vector<at::Tensor>& qkv, int64_t qkv_bits, int64_t H, int64_t attn_width,
                                const std::vector<at::Tensor>& o, int64_t o_bits, const std::vector<at::Tensor>& gate_up,
                                int64_t gu_bits, const std::vector<at::Tensor>& down, int64_t down_bits) {
  rows_of_float(ln1, H), rows_of_float(ln2, H);
  const spk::Linear lq = linear_of(qkv, qkv_bits, qkv_in), lo = linear_of(o, o_bits, attn_width);
  const spk::Linear lg = linear_of(gate_up, gu_bits, H), ld = linear_of(down, down_bits, lg.N() / 2);
  TORCH_CHECK(lo.N() == H && ld.N() == H && (lg.N() / 2) % spk::LANES == 0, "layer shapes");
  return {ln1.data_ptr<float>(), ln2.data_ptr<float>(), static_cast<float>(eps), lq, lo, lg, ld};
}

// A block's attention from Python: the layer's caches, where the block writes, which keys each query sees
struct Attention {
  at::Tensor count, slots;
  spk::BlockAttention at;
};

// A layer's caches from Python: float32 or float16 [B, n_kv, S, D], keys and values alike, contiguous along D
spk::LayerCaches layer_caches(int64_t B, int64_t n_kv, int64_t D, at::Tensor& k_cache, at::Tensor& v_cache) {
  const bool half = k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || half) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.dim() == 4 &&
                  k_cache.size(0) == B && k_cache.size(1) == n_kv && k_cache.size(3) == D &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  k_cache.stride(3) == 1,
              "layer: caches float32 or float16 [B, n_kv, S, D] (keys and values alike) contiguous along D");
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
          k_cache.size(2), half};
}

Attention block_attention(int64_t B, int64_t T, int64_t n_kv, int64_t D, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& write_at, const at::Tensor& slots, const at::Tensor& count, double scale) {
  TORCH_CHECK(write_at.scalar_type() == at::kLong && write_at.is_contiguous() && write_at.size(0) == B &&
                  write_at.size(1) == T,
              "layer: write_at [B, T]");
  TORCH_CHECK(D % spk::LANES == 0 && D <= spk::MAX_D, "layer: head sizes a multiple of 16, at most 256");
  Attention a{count.to(at::kLong).contiguous(), slots.numel() ? slots.to(at::kLong).contiguous() : slots, {}};
  TORCH_CHECK(a.count.numel() == B * T && (!a.slots.numel() || (a.slots.size(0) == B && a.slots.size(1) == T)),
              "layer: count [B, T], slots [B, T, W]");
  a.at = {layer_caches(B, n_kv, D, k_cache, v_cache),
          write_at.data_ptr<int64_t>(),
          a.slots.numel() ? a.slots.data_ptr<int64_t>() : nullptr,
          a.slots.numel() ? a.slots.size(2) : 0,
          a.count.data_ptr<int64_t>(),
          static_cast<float>(scale)};
  return a;
}

}  // namespace

// A whole decoder layer for the passes after the prefill, in one call (core/layer.h).
// h: [B, T, H]; cos, sin: [B, T, D]; caches: [B, n_kv, S, D]; write_at, count: [B, T].
at::Tensor layer(const at::Tensor& h, const at::Tensor& ln1, double eps, const std::vector<at::Tensor>& qkv,
                 int64_t qkv_bits, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads, int64_t n_kv, int64_t D,
                 at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write_at, const at::Tensor& slots,
                 const at::Tensor& count, double scale, const std::vector<at::Tensor>& o, int64_t o_bits,
                 const at::Tensor& ln2, const std::vector<at::Tensor>& gate_up, int64_t gu_bits,
                 const std::vector<at::Tensor>& down, int64_t down_bits) {
  TORCH_CHECK(h.dim() == 3, "layer: h [B, T, H]");
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2);
  TORCH_CHECK(H % spk::LANES == 0, "layer: hidden size a multiple of 16");
  rows_of_float(h, H), rows_of_float(cos, D), rows_of_float(sin, D);
  TORCH_CHECK(cos.numel() == B * T * D && sin.numel() == B * T * D, "layer: cos, sin [B, T, D]");
  const spk::LayerWeights w = layer_weights(ln1, ln2, eps, H, qkv, qkv_bits, H, n_heads * D, o, o_bits, gate_up,
                                            gu_bits, down, down_bits);
  TORCH_CHECK(w.qkv.N() == (n_heads + 2 * n_kv) * D, "layer: q/k/v heads");
  const Attention a = block_attention(B, T, n_kv, D, k_cache, v_cache, write_at, slots, count, scale);
  auto out = torch::empty({B, T, H}, h.options());
  out_of_range_as_error([&] {
    spk::layer(h.data_ptr<float>(), B, T, H, w, cos.data_ptr<float>(), sin.data_ptr<float>(), n_heads, n_kv, D, a.at,
               out.data_ptr<float>(), PARALLEL);
  });
  return out;
}

namespace {

// A model's decoder layers bound once (bind_layers): their weights checked and held here, so a pass
// runs them all in one call (run_layers) instead of one call a layer, each converting and checking
// its ~25 arguments again (~10 µs a layer, a tenth of a one-token step of a 135M model).
struct BoundLayers {
  std::vector<at::Tensor> keep;  // the tensors the layers' pointers read
  std::vector<spk::LayerWeights> layers;
  int64_t H, n_heads, n_kv, D;
  // the model's ends (bind_ends), for run_pass: input embeddings [vocab, H], final norm, LM head
  bool ends = false;
  const float* embed = nullptr;  // a float32 table, or
  spk::Q8Weights embed_q{};      // the embeddings' own blocks (a GGUF's, read straight into the kernels)
  int64_t vocab = 0;
  const float* norm = nullptr;
  float norm_eps = 0.f;
  spk::Linear head{};
};
// by handle; an unbound one is null (a pass that runs meanwhile, without the GIL, keeps its own reference)
std::vector<std::shared_ptr<BoundLayers>> bound_layers;
std::mutex bound_mutex;

}  // namespace

// norms: (ln1, ln2) a layer; linears: the (packed, ..., bias) of q/k/v, o, gate_up and down a layer;
// bits: their kinds (linear_of). Returns the handle run_layers takes.
int64_t bind_layers(const std::vector<at::Tensor>& norms, double eps, const std::vector<std::vector<at::Tensor>>& linears,
                    const std::vector<int64_t>& bits, int64_t n_heads, int64_t n_kv, int64_t D) {
  const size_t L = norms.size() / 2;
  TORCH_CHECK(L > 0 && norms.size() == 2 * L && linears.size() == 4 * L && bits.size() == 4 * L,
              "bind_layers: per layer (ln1, ln2), four (packed, ..., bias) and their four kinds");
  const int64_t H = norms[0].numel();
  TORCH_CHECK(H % spk::LANES == 0, "bind_layers: hidden size a multiple of 16");
  auto b = std::make_shared<BoundLayers>(BoundLayers{{}, {}, H, n_heads, n_kv, D});
  for (size_t l = 0; l < L; ++l) {
    const auto& lin = linears.begin() + 4 * l;
    b->layers.push_back(layer_weights(norms[2 * l], norms[2 * l + 1], eps, H, lin[0], bits[4 * l], H, n_heads * D,
                                      lin[1], bits[4 * l + 1], lin[2], bits[4 * l + 2], lin[3], bits[4 * l + 3]));
    TORCH_CHECK(b->layers.back().qkv.N() == (n_heads + 2 * n_kv) * D, "bind_layers: q/k/v heads");
  }
  b->keep = norms;
  for (const auto& lin : linears) b->keep.insert(b->keep.end(), lin.begin(), lin.end());
  std::lock_guard<std::mutex> lock(bound_mutex);
  bound_layers.push_back(std::move(b));
  return static_cast<int64_t>(bound_layers.size()) - 1;
}

// Gives a handle's weights back (their tensors may be freed).
void unbind_layers(int64_t handle) {
  std::lock_guard<std::mutex> lock(bound_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(bound_layers.size()), "unbind_layers: no such handle");
  bound_layers[handle].reset();
}

namespace {

std::shared_ptr<const BoundLayers> bound(int64_t handle, const char* who) {
  std::lock_guard<std::mutex> lock(bound_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(bound_layers.size()) && bound_layers[handle], who,
              ": no such handle");
  return bound_layers[handle];
}

// The layers of a pass, for run_layers and run_pass: the block's rows h [B, T, H] (cos, sin [B, T, D])
// through every bound layer (each as ``layer`` computes it), the inputs of the layers ``taps`` copied
// into tapped [B, T, n_taps, H] at their place in ``taps`` (other values are not layers' and are left
// to the caller). Returns the last layer's output: x or y.
float* run_bound(const BoundLayers& b, const float* h, int64_t B, int64_t T, const float* cos, const float* sin,
                 std::vector<at::Tensor>& k_caches, std::vector<at::Tensor>& v_caches, Attention& a,
                 const std::vector<int64_t>& taps, float* tapped, float* x, float* y, const spk::ParallelFor& parallel) {
  const int64_t H = b.H, n_taps = static_cast<int64_t>(taps.size());
  const float* src = h;
  for (size_t l = 0; l < b.layers.size(); ++l) {
    for (int64_t j = 0; j < n_taps; ++j)
      if (taps[j] == static_cast<int64_t>(l))
        for (int64_t r = 0; r < B * T; ++r) std::memcpy(tapped + (r * n_taps + j) * H, src + r * H, H * sizeof(float));
    a.at.caches = layer_caches(B, b.n_kv, b.D, k_caches[l], v_caches[l]);
    spk::layer(src, B, T, H, b.layers[l], cos, sin, b.n_heads, b.n_kv, b.D, a.at, x, parallel);
    src = x;
    std::swap(x, y);
  }
  return const_cast<float*>(src);
}

void check_caches(const BoundLayers& b, const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                  const char* who) {
  TORCH_CHECK(k_caches.size() == b.layers.size() && v_caches.size() == b.layers.size(), who,
              ": one key and one value cache a layer");
}

}  // namespace

// Every bound layer in turn, each as ``layer`` computes it (the same bits). h: [B, T, H]; cos, sin:
// [B, T, D]; k_caches, v_caches: one [B, n_kv, S, D] a layer; write_at, count: [B, T]; taps: layers
// whose input comes back too (an EAGLE head's features). Returns (the last layer's output [B, T, H],
// the tapped inputs [B, T, len(taps), H]).
std::vector<at::Tensor> run_layers(int64_t handle, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                                   std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                   const at::Tensor& write_at, const at::Tensor& slots, const at::Tensor& count,
                                   double scale, const std::vector<int64_t>& taps) {
  const auto held = bound(handle, "run_layers");
  const BoundLayers& b = *held;
  check_caches(b, k_caches, v_caches, "run_layers");
  TORCH_CHECK(h.dim() == 3 && h.size(2) == b.H, "run_layers: h [B, T, H]");
  const int64_t B = h.size(0), T = h.size(1), H = b.H, D = b.D;
  rows_of_float(h, H), rows_of_float(cos, D), rows_of_float(sin, D);
  TORCH_CHECK(cos.numel() == B * T * D && sin.numel() == B * T * D, "run_layers: cos, sin [B, T, D]");
  Attention a = block_attention(B, T, b.n_kv, D, k_caches[0], v_caches[0], write_at, slots, count, scale);
  at::Tensor x = torch::empty({B, T, H}, h.options()), y = torch::empty({B, T, H}, h.options());
  for (int64_t t : taps)
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(b.layers.size()), "run_layers: a tap outside the layers");
  at::Tensor tapped = torch::empty({B, T, static_cast<int64_t>(taps.size()), H}, h.options());
  float* last = nullptr;
  out_of_range_as_error([&] { in_one_region([&](const spk::ParallelFor& parallel) {
    last = run_bound(b, h.data_ptr<float>(), B, T, cos.data_ptr<float>(), sin.data_ptr<float>(), k_caches, v_caches, a,
                     taps, tapped.data_ptr<float>(), x.data_ptr<float>(), y.data_ptr<float>(), parallel);
  }); });
  return {last == x.data_ptr<float>() ? x : y, tapped};
}

// A bound model's ends, for run_pass: embed, its input embeddings float32 [vocab, H], or empty with
// embed_q their int8 kernels' blocks (packed, zeros [vocab]) of kind embed_bits (a row is looked up
// dequantized); norm [H] and eps, its final norm; head (packed, ..., bias) and its kinds, its LM head
// over H inputs.
void bind_ends(int64_t handle, const at::Tensor& embed, const std::vector<at::Tensor>& embed_q, int64_t embed_bits,
               const at::Tensor& norm, double eps, const std::vector<at::Tensor>& head, int64_t head_bits) {
  std::lock_guard<std::mutex> lock(bound_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(bound_layers.size()) && bound_layers[handle],
              "bind_ends: no such handle");
  BoundLayers& b = *bound_layers[handle];
  rows_of_float(norm, b.H);
  if (embed_q.empty()) {
    TORCH_CHECK(embed.dim() == 2, "bind_ends: embed [vocab, H]");
    rows_of_float(embed, b.H);
    b.embed = embed.data_ptr<float>(), b.vocab = embed.size(0);
    b.keep.push_back(embed);
  } else {
    const spk::Linear e = linear_of(embed_q, embed_bits, b.H);
    TORCH_CHECK(e.int8 && e.n_more == 0, "bind_ends: quantized embeddings of one q8 kind");
    b.embed_q = {e.w.packed, e.w.N, e.w.K, e.w.bits, e.half}, b.vocab = e.N();
    b.keep.insert(b.keep.end(), embed_q.begin(), embed_q.end());
  }
  b.head = linear_of(head, head_bits, b.H);
  b.norm = norm.data_ptr<float>(), b.norm_eps = static_cast<float>(eps), b.ends = true;
  b.keep.push_back(norm);
  b.keep.insert(b.keep.end(), head.begin(), head.end());
}

// A whole pass of a bound model in one call (bind_ends): each token's embedding, rotary rows from
// the tables at its position, every layer as run_layers runs them, the final norm and the LM head
// over each row (last_only: each batch row's last). tokens, positions, write_at, count: int64 [B, T];
// cos_table, sin_table: float32 [N, D], rows by position; taps as run_layers', where the layer count
// stands for the final norm's output. Returns (logits [B, T or 1, vocab out], tapped [B, T, len(taps), H]).
std::vector<at::Tensor> run_pass(int64_t handle, const at::Tensor& tokens, const at::Tensor& positions,
                                 const at::Tensor& cos_table, const at::Tensor& sin_table,
                                 std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                 const at::Tensor& write_at, const at::Tensor& slots, const at::Tensor& count,
                                 double scale, const std::vector<int64_t>& taps, bool last_only) {
  const auto held = bound(handle, "run_pass");
  const BoundLayers& b = *held;
  TORCH_CHECK(b.ends, "run_pass: the model's ends are not bound (bind_ends)");
  check_caches(b, k_caches, v_caches, "run_pass");
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  positions.sizes() == tokens.sizes() && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "run_pass: tokens and positions int64 [B, T]");
  const int64_t B = tokens.size(0), T = tokens.size(1), H = b.H, D = b.D, L = static_cast<int64_t>(b.layers.size());
  TORCH_CHECK(cos_table.dim() == 2 && sin_table.sizes() == cos_table.sizes(), "run_pass: cos and sin tables [N, D]");
  rows_of_float(cos_table, D), rows_of_float(sin_table, D);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) {
    TORCH_CHECK(tok[i] >= 0 && tok[i] < b.vocab, "run_pass: token id ", tok[i], " outside the vocabulary (",
                b.vocab, ")");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_table.size(0), "run_pass: position ", pos[i], " outside the rotary table");
  }
  bool normed_tap = false;
  for (int64_t t : taps) {
    TORCH_CHECK(t >= 0 && t <= L, "run_pass: a tap outside the layers");
    normed_tap |= t == L;
  }
  Attention a = block_attention(B, T, b.n_kv, D, k_caches[0], v_caches[0], write_at, slots, count, scale);
  const auto options = cos_table.options();
  at::Tensor h = torch::empty({B, T, H}, options), cs = torch::empty({B, T, D}, options), sn = torch::empty({B, T, D}, options);
  for (int64_t i = 0; i < B * T; ++i) {
    if (b.embed)
      std::memcpy(h.data_ptr<float>() + i * H, b.embed + tok[i] * H, H * sizeof(float));
    else
      spk::q8_dequantize_row(b.embed_q, tok[i], h.data_ptr<float>() + i * H);
    std::memcpy(cs.data_ptr<float>() + i * D, cos_table.data_ptr<float>() + pos[i] * D, D * sizeof(float));
    std::memcpy(sn.data_ptr<float>() + i * D, sin_table.data_ptr<float>() + pos[i] * D, D * sizeof(float));
  }
  at::Tensor x = torch::empty({B, T, H}, options), y = torch::empty({B, T, H}, options);
  const int64_t n_taps = static_cast<int64_t>(taps.size()), rows = last_only ? 1 : T;
  at::Tensor tapped = torch::empty({B, T, n_taps, H}, options);
  at::Tensor normed = torch::empty({B, rows, H}, options), logits = torch::empty({B, rows, b.head.N()}, options);
  out_of_range_as_error([&] { in_one_region([&](const spk::ParallelFor& parallel) {
    float* last = run_bound(b, h.data_ptr<float>(), B, T, cs.data_ptr<float>(), sn.data_ptr<float>(), k_caches,
                            v_caches, a, taps, tapped.data_ptr<float>(), x.data_ptr<float>(), y.data_ptr<float>(),
                            parallel);
    float* out = normed.data_ptr<float>();
    for (int64_t r = 0; r < B; ++r)  // the head's rows: each batch row's last, or all
      spk::rms_norm(last + (r * T + T - rows) * H, rows, H, b.norm, b.norm_eps, out + r * rows * H, parallel);
    if (normed_tap) {  // the final norm's output of every row, as the head's rows get it
      float* all = x.data_ptr<float>() == last ? y.data_ptr<float>() : x.data_ptr<float>();
      spk::rms_norm(last, B * T, H, b.norm, b.norm_eps, all, parallel);
      for (int64_t j = 0; j < n_taps; ++j)
        if (taps[j] == L)
          for (int64_t r = 0; r < B * T; ++r)
            std::memcpy(tapped.data_ptr<float>() + (r * n_taps + j) * H, all + r * H, H * sizeof(float));
    }
    spk::apply(b.head, out, B * rows, logits.data_ptr<float>(), parallel);
  }); });
  return {logits, tapped};
}

// EAGLE-3's first layer in one call (core/layer.h): q/k/v over [ln1(embeds), hidden_norm(hidden)].
// embeds, hidden: [B, T, H]; the rest as ``layer``.
at::Tensor eagle_layer(const at::Tensor& embeds, const at::Tensor& hidden, const at::Tensor& ln1,
                       const at::Tensor& hidden_norm, double eps, bool norm_before_residual,
                       const std::vector<at::Tensor>& qkv, int64_t qkv_bits, const at::Tensor& cos, const at::Tensor& sin,
                       int64_t n_heads, int64_t n_kv, int64_t D, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& write_at, const at::Tensor& slots, const at::Tensor& count, double scale,
                       const std::vector<at::Tensor>& o, int64_t o_bits, const at::Tensor& ln2,
                       const std::vector<at::Tensor>& gate_up, int64_t gu_bits, const std::vector<at::Tensor>& down,
                       int64_t down_bits) {
  TORCH_CHECK(hidden.dim() == 3 && embeds.sizes() == hidden.sizes(), "eagle_layer: embeds and hidden [B, T, H]");
  const int64_t B = hidden.size(0), T = hidden.size(1), H = hidden.size(2);
  TORCH_CHECK(H % spk::LANES == 0, "eagle_layer: hidden size a multiple of 16");
  rows_of_float(embeds, H), rows_of_float(hidden, H), rows_of_float(hidden_norm, H);
  rows_of_float(cos, D), rows_of_float(sin, D);
  TORCH_CHECK(cos.numel() == B * T * D && sin.numel() == B * T * D, "eagle_layer: cos, sin [B, T, D]");
  const spk::LayerWeights w = layer_weights(ln1, ln2, eps, 2 * H, qkv, qkv_bits, H, n_heads * D, o, o_bits, gate_up,
                                            gu_bits, down, down_bits);
  TORCH_CHECK(w.qkv.N() == (n_heads + 2 * n_kv) * D, "eagle_layer: q/k/v heads");
  const Attention a = block_attention(B, T, n_kv, D, k_cache, v_cache, write_at, slots, count, scale);
  auto out = torch::empty({B, T, H}, hidden.options());
  out_of_range_as_error([&] {
    spk::eagle_layer(embeds.data_ptr<float>(), hidden.data_ptr<float>(), B, T, H, w, hidden_norm.data_ptr<float>(),
                     norm_before_residual, cos.data_ptr<float>(), sin.data_ptr<float>(), n_heads, n_kv, D, a.at,
                     out.data_ptr<float>(), PARALLEL);
  });
  return out;
}

// A chain's levels as a proposal's tree (core/eagle.h, chain_best_first): ids int64, lp float32 [B,
// L, K]: each level's K draft ids and log-probabilities; d2t [Vd] int64 (or empty: one vocabulary).
// Returns the min(budget, L * K) most probable nodes a row, parents first: (target ids int64 [B, n],
// lengths [B], parents int64 [B, n], probabilities float32 [B, n]).
std::vector<at::Tensor> chain_tree(const at::Tensor& ids, const at::Tensor& lp, int64_t budget, const at::Tensor& d2t) {
  TORCH_CHECK(ids.dim() == 3 && ids.scalar_type() == at::kLong && ids.is_contiguous() && lp.sizes() == ids.sizes() &&
                  lp.scalar_type() == at::kFloat && lp.is_contiguous() && budget >= 1,
              "chain_tree: ids int64 and lp float32 [B, L, K], contiguous; budget >= 1");
  TORCH_CHECK(!d2t.numel() || (d2t.scalar_type() == at::kLong && d2t.is_contiguous()), "chain_tree: d2t int64 [Vd]");
  const int64_t B = ids.size(0), L = ids.size(1), K = ids.size(2), n = std::min(budget, L * K);
  const int64_t* d = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(d[i] >= 0 && (!d2t.numel() || d[i] < d2t.numel()), "chain_tree: a draft id outside d2t");
  const auto longs = ids.options();
  auto tokens = torch::empty({B, n}, longs), parents = torch::empty({B, n}, longs);
  auto probs = torch::empty({B, n}, lp.options());
  for (int64_t b = 0; b < B; ++b)
    spk::chain_best_first(d + b * L * K, lp.data_ptr<float>() + b * L * K, L, K, n,
                          d2t.numel() ? d2t.data_ptr<int64_t>() : nullptr, tokens.data_ptr<int64_t>() + b * n,
                          parents.data_ptr<int64_t>() + b * n, probs.data_ptr<float>() + b * n);
  return {tokens, torch::full({B}, n, longs), parents, probs};
}

// A one-layer EAGLE-3 head's whole proposal in one call (core/eagle.h). The catch-up block: feats
// [B, W, F], the target's tapped states, normed by input_norm [F] (or empty: none) and projected
// by fc (packed, bias); tokens (B * W): the token after each; row b's first counts[b] pairs at
// positions and cache slots starts[b] + j, its padding written at slot `spare`, each query seeing
// the slots up to its position; the row's last pair drafts (its first where it has none). Then up
// to ``levels`` levels of a chain, level j > 0 at slot and position starts[b] + counts[b] + j - 1.
// cos_table, sin_table [P, D]: the head's rotary values by position. The head's layer as
// ``eagle_layer`` takes it; norm, its LM head (packed, bias) over the draft vocabulary; d2t [Vd]
// int64 (or empty: one vocabulary); outside [Vd] bool (or empty); embed: the target's input
// embeddings [vocab, H]. The chain stops once every row's is less likely than min_score. Returns
// the L levels computed (draft ids int64 [B, L, K], log-probabilities float32 [B, L, K]) and the
// proposal's tree, as ``chain_tree`` makes it of them (4 tensors).
std::vector<at::Tensor> eagle_chain(
    const at::Tensor& feats, const std::vector<int64_t>& tokens, const std::vector<int64_t>& starts,
    const std::vector<int64_t>& counts, int64_t spare, const at::Tensor& cos_table, const at::Tensor& sin_table,
    int64_t levels, int64_t budget, const at::Tensor& input_norm, const std::vector<at::Tensor>& fc, int64_t fc_bits,
    int64_t K, double min_score, const at::Tensor& ln1, const at::Tensor& hidden_norm, double eps,
    bool norm_before_residual, const std::vector<at::Tensor>& qkv, int64_t qkv_bits, int64_t n_heads, int64_t n_kv,
    int64_t D, at::Tensor k_cache, at::Tensor v_cache, double scale, const std::vector<at::Tensor>& o, int64_t o_bits,
    const at::Tensor& ln2, const std::vector<at::Tensor>& gate_up, int64_t gu_bits, const std::vector<at::Tensor>& down,
    int64_t down_bits, const at::Tensor& norm_w, double norm_eps, bool norm_output,
    const std::vector<at::Tensor>& lm_head, int64_t lm_bits, const at::Tensor& d2t, const at::Tensor& outside,
    const at::Tensor& embed) {
  TORCH_CHECK(feats.dim() == 3, "eagle_chain: feats [B, W, F]");
  const int64_t B = feats.size(0), W = feats.size(1), F = feats.size(2), H = norm_w.numel();
  TORCH_CHECK(static_cast<int64_t>(tokens.size()) == B * W && static_cast<int64_t>(starts.size()) == B &&
                  static_cast<int64_t>(counts.size()) == B,
              "eagle_chain: tokens (B * W), starts and counts (B)");
  TORCH_CHECK(H % spk::LANES == 0 && F % spk::LANES == 0 && levels >= 1 && K >= 1 && budget >= 1,
              "eagle_chain: hidden and feature widths multiples of 16, levels, K and budget >= 1");
  rows_of_float(feats, F), rows_of_float(hidden_norm, H), rows_of_float(norm_w, H);
  if (input_norm.numel()) rows_of_float(input_norm, F);
  const spk::Linear fcl = linear_of(fc, fc_bits, F);
  TORCH_CHECK(fcl.N() == H, "eagle_chain: fc [H, F]");
  rows_of_float(cos_table, D), rows_of_float(sin_table, D), rows_of_float(embed, H);
  TORCH_CHECK(sin_table.sizes() == cos_table.sizes(), "eagle_chain: cos_table, sin_table [P, D]");
  const spk::LayerWeights w = layer_weights(ln1, ln2, eps, 2 * H, qkv, qkv_bits, H, n_heads * D, o, o_bits, gate_up,
                                            gu_bits, down, down_bits);
  TORCH_CHECK(w.qkv.N() == (n_heads + 2 * n_kv) * D, "eagle_chain: q/k/v heads");
  const spk::Linear head = linear_of(lm_head, lm_bits, H);
  const int64_t V = head.N(), P = cos_table.size(0);
  TORCH_CHECK(K <= V, "eagle_chain: K at most the draft vocabulary");
  // each position's slot and view, the rows that draft, and where the chain goes on
  const auto longs = feats.options().dtype(at::kLong);
  auto write_at = torch::empty({B, W}, longs), count = torch::empty({B, W}, longs);
  std::vector<int64_t> last(B), base(B);
  std::vector<float> cos(B * W * D), sin(B * W * D), step_cos((levels - 1) * B * D), step_sin(step_cos.size());
  auto rotary = [&](int64_t position, float* c, float* s) {
    TORCH_CHECK(position >= 0 && position < P, "eagle_chain: a position past the rotary table");
    std::memcpy(c, cos_table.data_ptr<float>() + position * D, D * 4);
    std::memcpy(s, sin_table.data_ptr<float>() + position * D, D * 4);
  };
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(counts[b] >= 0 && counts[b] <= W && starts[b] >= 0, "eagle_chain: counts within 0..W, starts >= 0");
    for (int64_t j = 0; j < W; ++j) {
      const int64_t i = b * W + j, position = starts[b] + j;
      write_at.data_ptr<int64_t>()[i] = j < counts[b] ? position : spare;
      count.data_ptr<int64_t>()[i] = position + 1;
      rotary(position, cos.data() + i * D, sin.data() + i * D);
    }
    last[b] = std::max<int64_t>(counts[b] - 1, 0);
    base[b] = starts[b] + counts[b];
    for (int64_t j = 0; j + 1 < levels; ++j)
      rotary(base[b] + j, step_cos.data() + (j * B + b) * D, step_sin.data() + (j * B + b) * D);
  }
  at::Tensor d2 = d2t.numel() ? d2t.to(at::kLong).contiguous() : d2t;
  at::Tensor out_ids = outside.numel() ? outside.to(at::kByte).contiguous() : outside;
  TORCH_CHECK(!d2.numel() || d2.numel() == V, "eagle_chain: d2t [Vd]");
  TORCH_CHECK(!out_ids.numel() || out_ids.numel() == V, "eagle_chain: outside [Vd]");
  const Attention a = block_attention(B, W, n_kv, D, k_cache, v_cache, write_at, at::empty({0}, longs), count, scale);
  const spk::EagleHead e{w, hidden_norm.data_ptr<float>(), norm_before_residual, n_heads, n_kv, D,
                         static_cast<float>(scale), norm_w.data_ptr<float>(), static_cast<float>(norm_eps), norm_output,
                         head, d2.numel() ? d2.data_ptr<int64_t>() : nullptr, out_ids.numel() ? out_ids.data_ptr<uint8_t>() : nullptr,
                         embed.data_ptr<float>(), embed.size(0)};
  const spk::ChainCatchUp c{feats.data_ptr<float>(), tokens.data(), F,
                            input_norm.numel() ? input_norm.data_ptr<float>() : nullptr,
                            fcl, cos.data(), sin.data(), a.at.write_at, a.at.count, last.data()};
  const spk::ChainSteps s{step_cos.data(), step_sin.data(), base.data(), levels, K, static_cast<float>(min_score)};
  auto ids = torch::zeros({B, levels, K}, longs);
  auto lp = torch::empty({B, levels, K}, feats.options());
  int64_t done = 0;
  out_of_range_as_error([&] {
    in_one_region([&](const spk::ParallelFor& parallel) {
      done = spk::eagle_chain(e, a.at.caches, B, W, H, c, s, ids.data_ptr<int64_t>(), lp.data_ptr<float>(), parallel);
    });
  });
  ids = ids.narrow(1, 0, done).contiguous(), lp = lp.narrow(1, 0, done).contiguous();
  std::vector<at::Tensor> out{ids, lp};
  for (const at::Tensor& t : chain_tree(ids, lp, budget, d2)) out.push_back(t);
  return out;
}

// The final norm: [M, H] -> [M, H].
at::Tensor norm(const at::Tensor& h, const at::Tensor& ln, double eps) {
  const int64_t H = h.size(-1), M = h.numel() / H;
  rows_of_float(h, H), rows_of_float(ln, H);
  TORCH_CHECK(H % spk::LANES == 0, "hidden size a multiple of 16");
  auto out = torch::empty({M, H}, h.options());
  spk::rms_norm(h.data_ptr<float>(), M, H, ln.data_ptr<float>(), static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

// x: float32 [..., V], rows contiguous. Returns int64 [...]: each row's argmax as PyTorch's
// max(-1).indices (the first of equal values; the first NaN): a 49k-logit row in ~8 us, 5x faster.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "argmax: x [..., V], V > 0");
  const int64_t V = x.size(-1), M = x.numel() / V;
  rows_of_float(x, V);
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / V), [&](int64_t begin, int64_t end) {  // 64k values a thread
    for (int64_t r = begin; r < end; ++r) o[r] = spk::argmax(p + r * V, V);
  });
  return out;
}

// A token tree's key layout (invariant.key_layout of the visibility FastLlama.forward builds): the
// block of w nodes written from slot start[b], query t seeing every slot before the block and the
// block slots s where tree[b, t, s]. Returns (order int64 [B, w, width]: each query's visible slots
// in slot order, then the others in slot order; count int64 [B, w]: its visible slots), where the
// PyTorch ops it replaces (a gather, a sort of every query's width slots) took ~0.3 ms a tree pass
// run cold after the pass's stream.
std::vector<at::Tensor> tree_layout(const at::Tensor& start, const at::Tensor& tree, int64_t width) {
  TORCH_CHECK(tree.dim() == 3 && tree.size(1) == tree.size(2) && tree.scalar_type() == at::kBool,
              "tree_layout: tree bool [B, w, w]");
  const int64_t B = tree.size(0), w = tree.size(1);
  const at::Tensor st = start.to(at::kLong).contiguous(), t = tree.contiguous();
  TORCH_CHECK(st.numel() == B, "tree_layout: start [B]");
  const int64_t* s0 = st.data_ptr<int64_t>();
  const bool* vis = t.data_ptr<bool>();
  auto order = torch::empty({B, w, width}, st.options()), count = torch::empty({B, w}, st.options());
  int64_t *o = order.data_ptr<int64_t>(), *c = count.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(s0[b] >= 0 && s0[b] + w <= width, "tree_layout: the block past the width");
    for (int64_t q = 0; q < w; ++q) {
      int64_t* row = o + (b * w + q) * width;
      const bool* seen = vis + (b * w + q) * w;
      int64_t n = 0;
      for (int64_t slot = 0; slot < s0[b]; ++slot) row[n++] = slot;
      for (int64_t j = 0; j < w; ++j)
        if (seen[j]) row[n++] = s0[b] + j;
      c[b * w + q] = n;
      for (int64_t j = 0; j < w; ++j)
        if (!seen[j]) row[n++] = s0[b] + j;
      for (int64_t slot = s0[b] + w; slot < width; ++slot) row[n++] = slot;
    }
  }
  return {order, count};
}

// Greedy acceptance in one call: each block position's argmax (as ``argmax``), then each row's walk
// (core/accept.h). scores: float32 [B, N + 1, V]; tokens [B, N], parents [B, N] (empty: chains),
// lengths [B], all int64. Returns (accepted n [B], next token [B], path [B, N]) as int64.
std::vector<at::Tensor> greedy_accept(const at::Tensor& scores, const at::Tensor& tokens, const at::Tensor& parents,
                                      const at::Tensor& lengths) {
  TORCH_CHECK(scores.dim() == 3 && scores.size(2) > 0, "greedy_accept: scores [B, N + 1, V], V > 0");
  const int64_t B = scores.size(0), N = scores.size(1) - 1;
  const bool chains = parents.numel() == 0;
  for (const at::Tensor* t : {&tokens, &parents, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "greedy_accept: int64 contiguous ids");
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) == B && tokens.size(1) == N && lengths.numel() == B &&
              (chains || parents.sizes() == tokens.sizes()), "greedy_accept: tokens/parents [B, N], lengths [B]");
  const at::Tensor choice = ::argmax(scores);  // this file's (at::argmax is a candidate too)
  auto n = torch::empty({B}, lengths.options()), next = torch::empty({B}, lengths.options());
  auto path = torch::empty({B, N}, lengths.options());
  const int64_t *c = choice.data_ptr<int64_t>(), *tok = tokens.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* par = chains ? nullptr : parents.data_ptr<int64_t>();
  int64_t *n_out = n.data_ptr<int64_t>(), *next_out = next.data_ptr<int64_t>(), *p = path.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t k = spk::greedy_walk(c + b * (N + 1), tok + b * N, chains ? nullptr : par + b * N,
                                       std::min(len[b], N), N, p + b * N);
    n_out[b] = k;
    next_out[b] = c[b * (N + 1) + (k ? p[b * N + k - 1] + 1 : 0)];
  }
  return {n, next, path};
}

// Row b's cache slots src[b, j] copied to dst[b, j] (all read before any is written, as an indexed
// copy does) in every cache of ``caches`` ([B, kv heads, slots, head dim], one dtype each, rows
// of head dim contiguous): a token tree's accepted nodes moved next to its root (keep_path) in one
// call where an indexed copy a layer's keys and values took 60 calls, ~0.6 ms run cold.
void move_slots(const std::vector<at::Tensor>& caches, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.dim() == 2 &&
                  src.sizes() == dst.sizes() && src.is_contiguous() && dst.is_contiguous(),
              "move_slots: src, dst int64 [B, W]");
  const int64_t B = src.size(0), W = src.size(1);
  const int64_t *from = src.data_ptr<int64_t>(), *to = dst.data_ptr<int64_t>();
  std::vector<char> held;
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.dim() == 4 && c.size(0) >= B && c.stride(3) == 1,
                "move_slots: caches [B, kv heads, slots, head dim]");
    const int64_t H = c.size(1), S = c.size(2), es = c.element_size(), row = c.size(3) * es;
    for (int64_t i = 0; i < B * W; ++i)
      TORCH_CHECK(from[i] >= 0 && from[i] < S && to[i] >= 0 && to[i] < S, "move_slots: a slot outside the cache");
    char* base = static_cast<char*>(c.data_ptr());
    auto at = [&](int64_t b, int64_t h, int64_t slot) {
      return base + (b * c.stride(0) + h * c.stride(1) + slot * c.stride(2)) * es;
    };
    held.resize(static_cast<size_t>(B * W * H * row));
    for (int64_t i = 0; i < B * W; ++i)  // i = b * W + j
      for (int64_t h = 0; h < H; ++h) std::memcpy(held.data() + (i * H + h) * row, at(i / W, h, from[i]), row);
    for (int64_t i = 0; i < B * W; ++i)
      for (int64_t h = 0; h < H; ++h) std::memcpy(at(i / W, h, to[i]), held.data() + (i * H + h) * row, row);
  }
}

// Outputs a group of the packed layout holds (every ISA).
int64_t group_size() { return spk::GROUP; }

// x [M, K] float32 quantized as the int8 kernels quantize each row: (codes int8 [M, K], d float32
// [M, K / 32], sum of the codes int32 [M, K / 32]), for the tests' reference.
std::vector<at::Tensor> q8_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % spk::BLOCK == 0, "x: [M, K], K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  rows_of_float(x, K);
  spk::Q8Rows a;
  spk::quantize_rows(x.data_ptr<float>(), M, K, a);
  auto q = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, K / spk::BLOCK}, x.options());
  auto sum = torch::empty({M, K / spk::BLOCK}, x.options().dtype(at::kInt));
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), M * K);
  std::memcpy(d.data_ptr<float>(), a.d.data(), d.numel() * 4);
  std::memcpy(sum.data_ptr<int32_t>(), a.sum.data(), sum.numel() * 4);
  return {q, d, sum};
}

// A GGUF tensor's blocks (raw uint8 [N, bytes a row], rows of K inputs, ggml type id ``type``)
// repacked for the int8 kernels (core/gguf.h): uint8 [groups of 16 outputs, bytes a group] of kind
// gguf_q8_kind(type), written into ``out`` (or, empty, a new tensor).
at::Tensor gguf_pack(const at::Tensor& raw, int64_t type, int64_t K, at::Tensor out) {
  const int kind = spk::gguf_q8_kind(static_cast<int>(type));
  const spk::GGUFBlock blk = spk::gguf_block(static_cast<int>(type));
  TORCH_CHECK(kind >= 0, "gguf_pack: ggml type ", type, " has no q8 kind");
  TORCH_CHECK(K > 0 && K % blk.inputs == 0 && K % spk::BLOCK == 0, "gguf_pack: rows of ", K,
              " inputs are not whole blocks of ", blk.inputs);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2 &&
                  raw.size(1) == K / blk.inputs * blk.bytes,
              "gguf_pack: raw uint8 [N, ", K / blk.inputs * blk.bytes, "]");
  const int64_t N = raw.size(0), groups = (N + spk::Q8_GROUP - 1) / spk::Q8_GROUP;
  if (!out.numel()) out = torch::empty({groups, spk::q8_group_bytes(kind, true, K)}, raw.options());
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 && out.size(0) == groups &&
                  out.size(1) == spk::q8_group_bytes(kind, true, K),
              "gguf_pack: out uint8 [", groups, ", ", spk::q8_group_bytes(kind, true, K), "]");
  bool ok = false;
  {
    pybind11::gil_scoped_release unlocked;  // seconds for a big model's tensors: other threads go on
    ok = spk::gguf_pack_q8(static_cast<int>(type), raw.data_ptr<uint8_t>(), N, K, out.data_ptr<uint8_t>(), PARALLEL);
  }
  TORCH_CHECK(ok, "gguf_pack: a block's values have no exact form in the int8 kernels' layout");
  return out;
}

// The q8 kind (core/q8.h) a ggml type repacks to (core/gguf.h), or -1.
int64_t gguf_kind(int64_t type) { return spk::gguf_q8_kind(static_cast<int>(type)); }

// Bytes a group of 16 outputs of a ggml type's tensor of K inputs takes repacked (gguf_pack).
int64_t gguf_group_bytes(int64_t type, int64_t K) {
  const int kind = spk::gguf_q8_kind(static_cast<int>(type));
  TORCH_CHECK(kind >= 0, "gguf_group_bytes: ggml type ", type, " has no q8 kind");
  return spk::q8_group_bytes(kind, true, K);
}

// Rows ``rows`` (int64) of a q8 weight (packed, zeros [N]) of kind ``bits`` over K inputs, dequantized:
// float32 [len(rows), K] (each value fma(code, scale, min): the file's own dequantisation).
at::Tensor q8_dequantize(const std::vector<at::Tensor>& w, int64_t bits, int64_t K, const at::Tensor& rows) {
  const spk::Linear l = linear_of(w, bits, K);
  TORCH_CHECK(l.int8 && l.n_more == 0, "q8_dequantize: one q8 weight");
  const spk::Q8Weights q{l.w.packed, l.w.N, K, l.w.bits, l.half};
  const at::Tensor r = rows.to(at::kLong).contiguous();
  auto out = torch::empty({r.numel(), K}, w.back().options());
  const int64_t* id = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.numel(); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < q.N, "q8_dequantize: row ", id[i], " of ", q.N);
  at::parallel_for(0, r.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) spk::q8_dequantize_row(q, id[i], out.data_ptr<float>() + i * K);
  });
  return out;
}

// The ISA branch this build compiled (core/simd.h): "avx512-vnni", "avx512", "avx2", "neon-dotprod",
// "neon" or "generic".
std::string isa() { return spk::ISA; }
