// Greedy acceptance of a verify block, walked in plain C++: the engine's per-pass bookkeeping after
// the target's pass runs with every cache cold (the pass streamed ~100 MB through them), where a
// chain's walk in PyTorch ops took 245 us in situ against 44 called again at once (a 2-core Zen 4).
#pragma once

#include <cstdint>

namespace spk {

// One row of a verify block [root, node 0, ..., node N-1]: choice[t] is the target's argmax at block
// position t (position i + 1 judges node i's children). A chain (parents null: node i under node
// i - 1) accepts while node t carries choice[t]; a tree follows, from the root, the first real child
// carrying the argmax at its parent's position. Writes the accepted nodes to path[0..n) (-1 after,
// up to N) and returns n; the row's next token is choice[path[n - 1] + 1] (choice[0] for n = 0).
inline int64_t greedy_walk(const int64_t* choice, const int64_t* tokens, const int64_t* parents, int64_t length,
                           int64_t N, int64_t* path) {
  int64_t n = 0;
  if (parents == nullptr) {
    while (n < length && tokens[n] == choice[n]) path[n] = n, ++n;
  } else {
    for (int64_t node = -1; n < N;) {  // at most N deep (a malformed tree's cycle ends too)
      int64_t child = -1;
      for (int64_t c = 0; c < length && child < 0; ++c)
        if (parents[c] == node && tokens[c] == choice[node + 1]) child = c;
      if (child < 0) break;
      node = path[n++] = child;
    }
  }
  for (int64_t i = n; i < N; ++i) path[i] = -1;
  return n;
}

}  // namespace spk
