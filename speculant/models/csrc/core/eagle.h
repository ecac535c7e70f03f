// EAGLE-3's drafting in one call, for a one-layer head beside a quantized target: the catch-up over
// each row's unfed (feature, token) pairs, then a chain of head steps, each fed the best token of
// the level before and that level's output state. Every level's K most probable draft tokens come
// back with their log-probabilities, so the caller can build a tree of the chain and its siblings.
// In PyTorch ops one head step cost ~0.4 ms of small calls around ~0.1 ms of kernels; here the
// whole proposal is one call. A row's values depend on that row alone (the layer, norm and LM head
// are the core's width-invariant kernels; the softmax and top-K run a row at a time).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "layer.h"

namespace spk {

struct EagleHead {  // a one-layer EAGLE-3 head over a target's embeddings
  LayerWeights layer;
  const float* hidden_norm;
  bool norm_before_residual;
  int64_t n_heads, n_kv, D;
  float scale;              // attention's
  const float* norm;        // the final norm's weight
  float norm_eps;
  bool norm_output;         // the state fed back is the normed one
  Linear lm_head;           // [Vd, H]
  const int64_t* d2t;       // [Vd]: target id = draft id + d2t[id]; null where the vocabularies are one
  const uint8_t* outside;   // [Vd]: draft ids the target cannot emit (never proposed); null for none
  const float* embed;       // the target's input embeddings [vocab, H]
  int64_t vocab;
};

struct ChainCatchUp {  // the catch-up block: W rows a batch row, padding rows written where they harm nothing
  const float* feats;            // [B, W, F]: the target's tapped states, side by side
  const int64_t* tokens;         // [B, W]: the token after each
  int64_t F;
  const float* input_norm;       // [F]: the norm before fc (null: none)
  Linear fc;                     // [H, F]
  const float *cos, *sin;        // [B, W, D]
  const int64_t* write_at;       // [B, W]
  const int64_t* count;          // [B, W]: keys each query sees (slots 0..count-1)
  const int64_t* last;           // [B]: the row whose state drafts
};

struct ChainSteps {  // level j > 0 runs at position base + j - 1, written at slot base + j - 1
  const float *cos, *sin;  // [levels - 1, B, D]
  const int64_t* base;     // [B]
  int64_t levels, K;
  float min_score;  // stop once every row's chain is less likely than this
};

// log-softmax of a row's logits (outside ids at -inf), and its K largest (ties: the lower id first)
inline void top_log_probs(const float* logits, int64_t V, const uint8_t* outside, int64_t K, int64_t* ids,
                          float* lp) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i)
    if (!(outside && outside[i])) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < V; ++i)
    if (!(outside && outside[i])) sum += std::exp(static_cast<double>(logits[i] - mx));
  const float lse = mx + static_cast<float>(std::log(sum));
  int64_t n = 0;  // ids[0..n) sorted by logit, descending
  for (int64_t i = 0; i < V; ++i) {
    if (outside && outside[i]) continue;
    const float x = logits[i];
    if (n == K && !(x > logits[ids[K - 1]])) continue;
    int64_t j = std::min(n, K - 1);
    while (j > 0 && x > logits[ids[j - 1]]) {
      ids[j] = ids[j - 1];
      --j;
    }
    ids[j] = i;
    n = std::min(n + 1, K);
  }
  for (int64_t j = 0; j < K; ++j) lp[j] = j < n ? logits[ids[j]] - lse : -std::numeric_limits<float>::infinity();
  for (int64_t j = n; j < K; ++j) ids[j] = 0;
}

// Returns the levels computed (<= s.levels); ids, lp [B, s.levels, K]: draft ids and log-probabilities.
inline int64_t eagle_chain(const EagleHead& e, const LayerCaches& caches, int64_t B, int64_t W, int64_t H,
                           const ChainCatchUp& c, const ChainSteps& s, int64_t* ids, float* lp,
                           const ParallelFor& parallel) {
  const int64_t V = e.lm_head.N(), K = s.K;
  std::vector<float> out(B * W * H), state(B * H), normed(B * H), logits(B * V), emb(B * H);
  std::vector<float> embeds(B * W * H), hidden(B * W * H), fin(c.input_norm ? B * W * c.F : 0);
  for (int64_t r = 0; r < B * W; ++r) {
    const int64_t t = c.tokens[r];
    if (t < 0 || t >= e.vocab) throw std::out_of_range("eagle_chain: a token outside the vocabulary");
    std::memcpy(embeds.data() + r * H, e.embed + t * H, H * 4);
  }
  if (c.input_norm) rms_norm(c.feats, B * W, c.F, c.input_norm, e.layer.eps, fin.data(), parallel);
  apply(c.fc, c.input_norm ? fin.data() : c.feats, B * W, hidden.data(), parallel);
  const BlockAttention up{caches, c.write_at, nullptr, 0, c.count, e.scale};
  eagle_layer(embeds.data(), hidden.data(), B, W, H, e.layer, e.hidden_norm, e.norm_before_residual, c.cos, c.sin, e.n_heads,
              e.n_kv, e.D, up, out.data(), parallel);
  for (int64_t b = 0; b < B; ++b) std::memcpy(state.data() + b * H, out.data() + (b * W + c.last[b]) * H, H * 4);
  std::vector<double> chain(B, 0.0);  // each row's chain log-probability so far
  std::vector<int64_t> write_at(B), count(B);
  for (int64_t j = 0; j < s.levels; ++j) {
    rms_norm(state.data(), B, H, e.norm, e.norm_eps, normed.data());
    apply(e.lm_head, normed.data(), B, logits.data(), parallel);
    double best = -std::numeric_limits<double>::infinity();
    for (int64_t b = 0; b < B; ++b) {
      int64_t* row_ids = ids + (b * s.levels + j) * K;
      float* row_lp = lp + (b * s.levels + j) * K;
      top_log_probs(logits.data() + b * V, V, e.outside, K, row_ids, row_lp);
      chain[b] += row_lp[0];
      best = std::max(best, chain[b]);
    }
    if (j + 1 == s.levels || std::exp(best) < s.min_score) return j + 1;
    for (int64_t b = 0; b < B; ++b) {  // the next level reads the best token and this level's state
      const int64_t d = ids[(b * s.levels + j) * K], t = e.d2t ? d + e.d2t[d] : d;
      if (t < 0 || t >= e.vocab) throw std::out_of_range("eagle_chain: a draft id maps outside the vocabulary");
      std::memcpy(emb.data() + b * H, e.embed + t * H, H * 4);
      write_at[b] = s.base[b] + j;
      count[b] = s.base[b] + j + 1;
    }
    if (e.norm_output) state.swap(normed);
    const BlockAttention step{caches, write_at.data(), nullptr, 0, count.data(), e.scale};
    eagle_layer(emb.data(), state.data(), B, 1, H, e.layer, e.hidden_norm, e.norm_before_residual,
                s.cos + j * B * e.D, s.sin + j * B * e.D, e.n_heads, e.n_kv, e.D, step, out.data(), parallel);
    std::memcpy(state.data(), out.data(), B * H * 4);
  }
  return s.levels;
}

// A proposal's tree from a row's chain (eagle_chain's ids and lp, [L, K]): the `n` most probable of
// the chain's nodes and their siblings, parents first. Level l's candidate 0 is the chain's node
// (every candidate of level l + 1 is its child); a candidate's score is the chain's log-probability
// to the level above (a running sum accumulated in double and rounded to float32, as PyTorch's
// cumsum does) plus its own. Sorted by score, ties to the shallower candidate, then the earlier:
// EagleDrafter._best_first's order, key for key. Writes the target's ids (d2t: draft id +
// d2t[id]; null: the same ids), each node's parent (its index in the order; -1: the root) and its
// probability exp(score).
inline void chain_best_first(const int64_t* ids, const float* lp, int64_t L, int64_t K, int64_t n,
                             const int64_t* d2t, int64_t* tokens, int64_t* parents, float* probs) {
  const int64_t C = L * K;
  std::vector<float> score(C);
  std::vector<double> key(C);
  double chain = 0.0;  // the chain's log-probability to level l - 1, as a double running sum
  float above = 0.0f;  // ... rounded to float32 (cumsum's output)
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t k = 0; k < K; ++k) {
      score[l * K + k] = above + lp[l * K + k];
      key[l * K + k] = static_cast<double>(l + 1) * 1e-9 - static_cast<double>(score[l * K + k]);
    }
    chain += lp[l * K];
    above = static_cast<float>(chain);
  }
  std::vector<int64_t> order(C), at(C, -1);
  for (int64_t c = 0; c < C; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  for (int64_t j = 0; j < n; ++j) at[order[j]] = j;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t c = order[j], level = c / K, d = ids[c];
    tokens[j] = d2t ? d + d2t[d] : d;
    parents[j] = level ? at[(level - 1) * K] : -1;
    probs[j] = std::exp(score[c]);
  }
}

}  // namespace spk
