"""A drafter's distillation loss through its LM head, a chunk of rows at a time, the held-out
acceptance a trained drafter is judged by (``GreedyRuns``), and what every trainer's batched loss
shares (``as_batch``, ``mean_of_sequences``).

``head_kl`` is Σ_r w_r · KL(p_r ‖ softmax(x_r Wᵀ)) for the target's distributions p_r = softmax(f_r Tᵀ)
(its final normed states f, its LM head's rows T). Done the plain way, every step of training-time
test materialises [rows, vocabulary] logits in float32 and runs a dozen passes over them (cast,
log_softmax, kl_div, their backward), which on a CPU cost more than the matmuls. Here each chunk's
logits, target distribution and gradient (softmax(z) − p) are made and used while they are in cache,
and the gradients of x and W are computed in the forward: the backward only scales them.
"""
from __future__ import annotations

import torch

# rows at a time. On a CPU under bf16 autocast (AMX) a chunk's logits over an 8k draft vocabulary stay
# in cache (64-512 measured alike, 754 -> ~1200 tokens/s of training against the plain loss). In
# float32 (an AVX2 CPU) every chunk also reads and writes W's whole float32 gradient (19 MB for 8k x
# 576), so chunks must be large: 1,500 rows forward and backward took 3.4 s in chunks of 128, 2.3 s
# of 256, 1.6 s of 1,024, against 1.7 s for the plain loss. A GPU wants few, large kernels: chunks of
# ~256 MB of float32 logits (8k rows over an 8k vocabulary, 512 over 128k)
CHUNK = 128
CHUNK_FLOAT32 = 1024
GPU_CHUNK_ELEMENTS = 1 << 26


class _HeadKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, final, target_rows, row_weights, chunk, grads):
        dev = x.device.type  # matmuls in autocast's dtype where it is on, cast once rather than per chunk
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        w_head, t_head = weight.to(dtype), target_rows.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_w = None
        if grads:
            grad_x = torch.empty_like(x)
            if weight.requires_grad:  # a frozen head (the target's: MTP) needs no gradient of its own
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        for s in range(0, x.shape[0], chunk):
            xc, w = x[s : s + chunk].to(dtype), row_weights[s : s + chunk, None].float()
            z = (xc @ w_head.T).float()
            target_logp = (final[s : s + chunk].to(dtype) @ t_head.T).float().log_softmax(-1)
            p = target_logp.exp()
            logq = z.sub_(z.logsumexp(-1, keepdim=True))
            total += (w * target_logp.sub_(logq).mul_(p).sum(-1, keepdim=True)).sum()  # in place: 3 temporaries
            if not grads:
                continue
            g = logq.exp_().sub_(p).mul_(w).to(dtype)  # ∂KL/∂z = softmax(z) − p, times the row's weight
            grad_x[s : s + chunk] = g @ w_head
            if grad_w is not None:
                grad_w += (g.T @ xc).float()
        if grads:
            ctx.save_for_backward(grad_x, grad_w.to(weight.dtype) if grad_w is not None else torch.zeros(()))
            ctx.weight_grad = grad_w is not None
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        grad_w = grad_w * grad.to(grad_w.dtype) if ctx.weight_grad else None
        return grad_x * grad.to(grad_x.dtype), grad_w, None, None, None, None, None


def head_kl(x: torch.Tensor, weight: torch.Tensor, final: torch.Tensor, target_rows: torch.Tensor,
            row_weights: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Σ_r row_weights[r] · KL(softmax(final[r] target_rowsᵀ) ‖ softmax(x[r] weightᵀ)) for x [R, H]
    (the drafter's normed states), weight [V, H] (its LM head), final [R, Ht] and target_rows [V, Ht]
    (the target's, no gradient): a scalar with gradients for x and weight (none are computed under
    ``torch.no_grad()`` or when neither needs one: a held-out loss costs the forward only)."""
    if chunk is None and x.device.type == "cpu":
        chunk = CHUNK if torch.is_autocast_enabled("cpu") or x.dtype != torch.float32 else CHUNK_FLOAT32
    chunk = chunk or max(256, GPU_CHUNK_ELEMENTS // weight.shape[0])
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _HeadKL.apply(x, weight, final, target_rows.detach(), row_weights.detach(), chunk, grads)


class GreedyRuns:
    """Held-out acceptance of a drafter's top-1 guesses under greedy verification: per slot, how
    often its guess is the target's token given the slots before it were right (α), and τ = 1 +
    the mean run of right guesses."""

    def __init__(self, slots: int, d2t: torch.Tensor | None):
        self.reached, self.accepted, self.runs, self.d2t = torch.zeros(slots), torch.zeros(slots), [], d2t

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """logits [N, slots, V or draft V], the target's tokens [N, slots]."""
        pick = logits.argmax(-1)
        if self.d2t is not None:
            pick = pick + self.d2t.to(pick.device)[pick]
        self.add_picks(pick, labels)

    def add_picks(self, pick: torch.Tensor, labels: torch.Tensor) -> None:
        """The drafter's guesses as target ids [N, slots], the target's tokens [N, slots]."""
        match = (pick.to(labels.device) == labels).long()
        run = match.cumprod(1).sum(1)
        self.runs += run.tolist()
        for j in range(match.shape[1]):
            alive = run >= j
            self.reached[j] += alive.sum()
            self.accepted[j] += (alive & (match[:, j] == 1)).sum()

    def result(self, unit: str) -> dict:
        alpha = (self.accepted / self.reached.clamp_min(1)).tolist()
        return {"tau": 1 + sum(self.runs) / max(1, len(self.runs)), "alpha_by_slot": [round(a, 3) for a in alpha],
                unit: len(self.runs)}


def mean_of_sequences(values: torch.Tensor, weights: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The mean over sequences of each one's weighted mean: ``values`` and ``weights`` [N, ...] (a
    row's weighted losses and weights), ``seq`` [N] the sequence of each row. So a batch's loss is the
    mean of its sequences' own losses, however many rows each has."""
    B = int(seq.max()) + 1
    num = values.new_zeros(B).index_add_(0, seq, values.flatten(1).sum(1))
    den = weights.new_zeros(B, dtype=values.dtype).index_add_(0, seq, weights.flatten(1).sum(1).to(values.dtype))
    present = torch.zeros(B, dtype=torch.bool, device=seq.device)
    present[seq] = True
    return (num / den.clamp_min(1e-6))[present].mean()


def as_batch(f, device) -> tuple:
    """One sequence's features (trained/data.py's Features) as a batch of one: the arguments of every
    trainer's ``loss_batch`` (ids [1, T], tapped states [1, T, taps, H], final normed states [1, T, H]
    or None, answer start [1], length [1], the target's choices [1, T])."""
    final = f.final[None].to(device) if f.final is not None else None
    return (f.ids[None].to(device), f.hidden[None].to(device), final, torch.tensor([f.loss_from], device=device),
            torch.tensor([len(f.ids)], device=device), f.labels[None].to(device))


def judged_steps(n: int, loss_from: torch.Tensor, lengths: torch.Tensor, steps: int, decay: float) -> list | None:
    """Which rows a test-time-training step judges, and their weights, over B right-padded
    sequences (``lengths`` real tokens, learnt from ``loss_from``; ``n``: rows with a next token):
    per step k, (sequence b, row i, weight) where row i is judged on the target at i + 1 + k; each
    sequence counts equally, each step within it ``decay``^k, its rows share their step's part.
    None where no row has a token to learn."""
    first, last = (loss_from - 1).clamp_min(0), lengths - 1  # rows < last - k have a token for step k
    if int((last - first).max()) < 1:
        return None
    rows = torch.arange(n, device=lengths.device)[None]
    live = [((rows >= first[:, None]) & (rows < (last - k)[:, None]))[:, : n - k] for k in range(steps)]
    counts = [x.sum(1) for x in live]
    weight = sum(decay ** k * (c > 0) for k, c in enumerate(counts))
    some = weight > 0
    share = some / weight.clamp_min(1e-12) / some.sum()  # each sequence's part of the mean
    out = []
    for k in range(steps):
        b, i = live[k].nonzero(as_tuple=True)
        out.append((b, i, (decay ** k * share / counts[k].clamp_min(1))[b]))
    return out


def answer_rows(loss_from: torch.Tensor, lengths: torch.Tensor) -> int:
    """The rows a batch of sequences learns from."""
    return int((lengths - 1 - (loss_from - 1).clamp_min(0)).clamp_min(0).sum())
