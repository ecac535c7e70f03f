"""The adaptive γ controller: its decision function on synthetic α and costs, and its bookkeeping."""
import random

import pytest
import torch

from speculant.controller import (ChainGamma, CostModel, RowAlpha, StaticCosts, TreeGamma, VerifyTimes,
                                  choose_batch_gamma, choose_gamma, expected_tokens, expected_tokens_upto)


def flat(verify=1.0, draft=0.0):
    return StaticCosts(draft_per_token=draft, verify=lambda k: verify)


def test_expected_tokens_closed_form_and_per_position_agree():
    for a in (0.0, 0.3, 0.8, 1.0):
        for g in range(6):
            closed = expected_tokens(a, g)
            assert closed == pytest.approx(expected_tokens([a] * g, g))
            assert closed == pytest.approx(sum(a**i for i in range(g + 1)))
    assert expected_tokens([0.9, 0.5, 0.0], 5) == pytest.approx(1 + 0.9 + 0.45)


def test_expected_tokens_for_every_gamma_at_once_are_each_gammas_own():
    rng = random.Random(3)
    for length in (0, 1, 4, 15):
        alpha = [rng.random() for _ in range(length)]
        assert expected_tokens_upto(alpha, 15) == [expected_tokens(alpha, g) for g in range(16)]  # bit for bit


def test_a_decisions_costs_are_asked_of_the_verify_times_once_a_width():
    asked = []
    costs = StaticCosts(0.1, lambda k: asked.append(k) or 1.0 + 0.2 * k)
    choose_batch_gamma([[0.9] * 8, [0.5] * 8], costs, 8)
    assert sorted(asked) == list(range(1, 10))


@pytest.mark.parametrize("alpha,c", [(0.1, 0.2), (0.3, 0.5), (0.0, 0.01), (0.45, 0.5)])
def test_gamma_zero_when_alpha_below_cost_ratio(alpha, c):
    # drafting one token costs c of a target pass and earns α tokens: it never pays when α < c
    assert choose_gamma(alpha, flat(1.0, c), 8) == 0


@pytest.mark.parametrize("alpha,c", [(0.3, 0.2), (0.6, 0.5), (0.2, 0.01)])
def test_speculates_when_alpha_above_cost_ratio(alpha, c):
    assert choose_gamma(alpha, flat(1.0, c), 8) >= 1


def test_large_gamma_when_alpha_high_and_drafting_cheap():
    assert choose_gamma(0.95, flat(1.0, 0.01), 8) == 8
    assert choose_gamma(0.9, flat(1.0, 0.02), 16) >= 10


def test_verify_cost_growing_with_width_limits_gamma():
    cheap = choose_gamma(0.8, flat(1.0, 0.02), 12)
    growing = choose_gamma(0.8, StaticCosts(0.02, lambda k: 1.0 + 0.15 * (k - 1)), 12)
    assert 1 <= growing < cheap


def test_per_position_alpha_stops_where_acceptance_collapses():
    # positions 0-2 almost always accepted, later ones never: drafting past 3 only costs
    assert choose_gamma([0.95, 0.95, 0.95, 0.0], flat(1.0, 0.05), 8) == 3


def test_batch_rows_that_do_not_pay_are_off():
    gamma, on = choose_batch_gamma([0.9, 0.05], flat(1.0, 0.1), 8)
    assert gamma >= 2 and on == [True, False]
    gamma, on = choose_batch_gamma([0.05, 0.02], flat(1.0, 0.1), 8)
    assert gamma == 0 and on == [False, False]


def test_verify_times_interpolate_and_extrapolate():
    vt = VerifyTimes()
    vt.observe(1, 1.0)
    assert vt(1) == 1.0 and vt(5) > 1.0  # one point: prior slope
    vt.observe(5, 2.0)
    assert vt(3) == pytest.approx(1.5)
    assert vt(9) == pytest.approx(3.0)
    vt.observe(5, 4.0)  # EWMA, not replacement
    assert 2.0 < vt(5) < 4.0
    vt = VerifyTimes()
    for tokens, seconds in ((8, 7.0), (2, 2.0), (4, 3.0)):  # timed out of order: the nearest on each side
        vt.observe(tokens, seconds)
    assert [vt(t) for t in (1, 3, 6, 10)] == pytest.approx([1.5, 2.5, 5.0, 9.0])


def test_a_machine_that_slows_down_keeps_its_widths_costs_in_proportion():
    """Plain passes are timed every pass, wide ones now and then. When the machine slows by 20 % (a
    VM's neighbours), the widths timed before are scaled with it: verifying a draft still costs more
    than a plain pass, and a draft kept 7 % of the time is not worth it. Kept as absolute times, the
    plain pass's estimate rose above the stale ones of 2 and 3 rows and such drafts looked free."""
    vt = VerifyTimes()
    for tokens, seconds in ((1, 1.0), (2, 1.15), (3, 1.3)):
        vt.observe(tokens, seconds)
    for _ in range(50):
        vt.observe(1, 1.2)
    assert vt(1) == pytest.approx(1.2, rel=0.01)
    assert vt(2) / vt(1) == pytest.approx(1.15, rel=0.03) and vt(3) / vt(1) == pytest.approx(1.3, rel=0.03)
    assert choose_gamma(0.07, StaticCosts(0.0, vt), 2) == 0
    assert choose_gamma(0.5, StaticCosts(0.0, vt), 2) > 0  # a draft worth verifying still is


def test_verify_times_follow_their_points_and_kept_coverage_resets_with_new_points():
    # estimates follow each observation; coverage, kept once true, starts over with new points
    vt = VerifyTimes()
    vt.observe(1, 1.0)
    vt.observe(5, 2.0)
    assert vt(3) == pytest.approx(1.5) and not vt.covers(16) and not vt.covers_all((1, 16))
    vt.observe(9, 5.0)
    assert vt(7) == pytest.approx(3.5) and vt(3) == pytest.approx(1.5)
    vt.observe(5, 3.0)  # EWMA: 0.7 * 2 + 0.3 * 3, 90 % of the move (in ratio) taken as the machine's
    assert vt(5) == pytest.approx(2.3) and vt(1) == pytest.approx(1.15 ** 0.9)
    assert vt(3) == pytest.approx((1.15 ** 0.9 + 2.3) / 2)
    vt.observe(16, 8.0)
    assert vt.covers(16) and vt.covers_all((1, 16)) and vt.covers_all((1, 16))
    vt.points = {1: 1.0}
    assert vt(3) == pytest.approx(1.1) and not vt.covers(16) and not vt.covers_all((1, 16))


def test_row_alpha_learns_and_unseen_positions_inherit():
    ra = RowAlpha(prior_mean=0.5)
    for _ in range(40):
        ra.observe(drafted=4, accepted=1)  # position 0 accepted, position 1 rejected, 2-3 unjudged
    prof = ra.profile(4)
    assert prof[0] > 0.9 and prof[1] < 0.1
    assert prof[2] == pytest.approx(prof[1], abs=0.05)


def test_controller_switches_off_and_retries():
    ctl = ChainGamma(rows=1, gamma_max=8, retry_every=16)
    costs = {1: 1.0}
    chosen = []
    for _ in range(80):
        g, caps, retry = ctl.choose(room=50)
        chosen.append(g)
        width = max(caps) + 1
        # a useless drafter: nothing accepted; drafting costs 0.3 of a pass per token
        ctl.observe(g, width, caps, [0], draft_seconds=0.3 * g, verify_seconds=costs.get(width, 1.0 + 0.05 * width),
                    retry=retry)
    late = chosen[10:]
    assert late.count(0) > 0.85 * len(late), late
    assert any(g > 0 for g in late), "never retried"


def test_controller_speculates_with_a_good_cheap_drafter():
    ctl = ChainGamma(rows=2, gamma_max=8)
    for _ in range(40):
        g, caps, retry = ctl.choose(room=50)
        ctl.observe(g, max(caps) + 1, caps, [c for c in caps], draft_seconds=0.01 * g, verify_seconds=1.0, retry=retry)
    g, caps, retry = ctl.choose(room=50)
    assert g == 8 and caps == [8, 8]
    assert ctl.choose(room=3)[0] <= 3


def test_controller_shrinking_batch_keeps_row_estimates():
    ctl = ChainGamma(rows=3)
    ctl.observe(4, 5, [0, 0, 4], [0, 0, 4], 0.0, 1.0, grades=[0, 0, 3])
    ctl.select([2])
    assert len(ctl.alphas) == 1 and ctl.alphas[0][3].accepted[0] == 1.0


def test_failed_retries_back_off():
    ctl = ChainGamma(rows=1, gamma_max=8, retry_every=16)
    chosen = []
    for _ in range(400):
        g, caps, retry = ctl.choose(room=50)
        chosen.append(g)
        ctl.observe(g, max(caps) + 1, caps, [0], draft_seconds=0.3 * g, verify_seconds=1.0 + 0.05 * (max(caps) + 1),
                    retry=retry)
    late = [g for g in chosen[200:] if g > 0]
    assert 1 <= len(late) <= 200 // 64, late  # waits grew from 16 to 128 passes
    assert all(g == 1 for g in late)


def _run(ctl, passes, accept, verify_cost, draft_per_token=0.0, room=50):
    """Drive a controller with a synthetic drafter: row accepts accept(caps) tokens; returns γs chosen."""
    chosen = []
    for _ in range(passes):
        g, caps, retry = ctl.choose(room=room)
        chosen.append(g)
        width = max(caps) + 1
        ctl.observe(g, width, caps, accept(caps), draft_seconds=draft_per_token * g,
                    verify_seconds=verify_cost(width), retry=retry)
    return chosen


def test_first_passes_measure_narrowest_and_widest_blocks():
    ctl = ChainGamma(rows=1, gamma_max=8)
    chosen = _run(ctl, 3, lambda caps: [0], lambda k: 1.0)
    assert chosen == [0, 8, 4]


def test_step_shaped_verify_cost_still_picks_a_long_draft():
    # a CPU's cost curve: 2 tokens cost 1.6x one, 9 tokens barely more than 2. Interpolating from
    # the narrow widths alone would predict 9 tokens at ~5x and never draft long (α = 0.7: γ = 8 pays 1.7x).
    def cpu(k):
        return 1.0 if k == 1 else 1.6 + 0.02 * (k - 2)

    rng = random.Random(0)

    def bernoulli(caps, alpha=0.7):  # each draft token accepted with probability α, up to the first miss
        out = []
        for c in caps:
            n = 0
            while n < c and rng.random() < alpha:
                n += 1
            out.append(n)
        return out

    chosen = _run(ChainGamma(rows=1, gamma_max=8), 200, bernoulli, cpu)
    late = chosen[50:]
    assert sum(g >= 5 for g in late) > 0.8 * len(late), late


def test_costs_carry_over_to_the_next_request():
    costs = CostModel()
    _run(ChainGamma(rows=1, gamma_max=8, costs=costs), 10, lambda caps: list(caps), lambda k: 1.0 + 0.01 * k)
    second = ChainGamma(rows=1, gamma_max=8, costs=costs)
    assert second.choose(room=50)[0] >= 5  # no exploration (that would start at γ = 0): the prior α and the known costs decide at once


def test_one_slow_draft_pass_does_not_ruin_the_draft_cost():
    costs = CostModel()
    costs.observe_pass(4, 5, 0.4, 1.0)  # 0.1 s per token
    costs.observe_pass(4, 5, 40.0, 1.0)  # a pass that also prefilled the drafter
    assert costs.for_batch(1).draft_per_token < 0.2


def test_drafting_is_timed_per_batch_size():
    costs = CostModel()
    costs.observe_pass(4, 4, 0.4, 1.0, batch=1)
    costs.observe_pass(4, 64 * 5, 12.8, 9.0, batch=64)
    costs.observe_pass(0, 6, 1.0, 1.0, per_pass=True, batch=1)  # nothing drafted: nothing learnt
    assert costs.for_batch(1).draft_per_token == pytest.approx(0.1)
    assert costs.for_batch(64).draft_per_token == pytest.approx(3.2)
    assert costs.for_batch(32).draft_per_pass == 0.0


def test_a_batch_that_lost_a_row_is_not_measured_again():
    costs = CostModel()
    _run(ChainGamma(rows=64, gamma_max=8, costs=costs), 6, lambda caps: list(caps), lambda k: 1.0 + 0.01 * k)
    assert sorted(costs.verify.points) == [64, 576]  # widths 1 and 9; 5 (320 tokens) is interpolated
    smaller = ChainGamma(rows=62, gamma_max=8, costs=costs)
    assert smaller._unmeasured(8) is None
    half = ChainGamma(rows=40, gamma_max=8, costs=costs)  # 360 tokens: between 320 and 576, interpolated
    assert half._unmeasured(8) == 0  # only its plain pass (40 tokens) is new: cheap to time
    costs.verify.observe(40, 1.0)
    assert half._unmeasured(8) is None


def test_an_expensive_retry_waits_long_and_the_next_request_remembers():
    """A drafter whose retry (γ = 1) costs 5.6 plain passes and never hits: after a failed retry,
    no retry for >= 32 x 4.6 passes (its extra cost), in this request and the next."""
    costs = CostModel()
    ctl = ChainGamma(rows=1, gamma_max=8, retry_every=16, costs=costs)
    chosen = _run(ctl, 400, lambda caps: [0], lambda k: 1.0 if k == 1 else 1.6, draft_per_token=4.0)
    retries = [i for i, g in enumerate(chosen) if g > 0][2:]  # after the exploration passes (γ = 8, 4)
    assert len(retries) >= 2 and all(b - a >= 147 for a, b in zip(retries, retries[1:])), retries
    assert costs.retry_extra == pytest.approx(4.6)
    nxt = ChainGamma(rows=1, gamma_max=8, retry_every=16, costs=costs)
    later = _run(nxt, 140, lambda caps: [0], lambda k: 1.0 if k == 1 else 1.6, draft_per_token=4.0)
    assert not any(later), later


def test_a_tree_drafter_is_not_asked_to_draft_while_every_row_is_off():
    """Trees that never pay are cut to nothing; after that the controller stops asking for them
    (their drafting would be wasted) except for retries, which back off."""

    ctl = TreeGamma(rows=2, gamma_max=8, retry_every=16)
    asked = _run_trees(ctl, 300, lambda budget: [[0.02] * budget] * 2, lambda caps: [0, 0], 0.5,
                       lambda k: 1.0 if k == 1 else 1.0 + 0.2 * k)
    late = asked[50:]
    assert 1 <= sum(b > 0 for b in late) <= len(late) // 16, asked
    # a row whose tree pays (its trees yield 5 tokens a pass) keeps being asked every pass
    ctl.on, ctl.tree_tokens = [True, False], [5.0, 1.0]
    assert ctl.tree_budget(room=50) == 8 and ctl.tree_budget(room=3) == 3


def test_new_rows_are_judged_at_the_full_budget_and_count_the_prior_yield():
    """A pass near a row's end (no room to draft) does not switch new rows off for good, and rows
    that join a paying batch count the prior's yield, not none."""
    costs = CostModel()
    costs.verify.observe(1, 1.0)
    costs.verify.observe(9, 1.1)
    costs.verify.observe(4, 1.05)
    costs.observe_pass(8, 9, 0.2, 1.1, per_pass=True, batch=1)
    ctl = TreeGamma(rows=2, gamma_max=8, costs=costs)
    assert ctl.tree_budget(room=0) == 0
    assert ctl.tree_budget(room=16) == 8 and ctl.on == [True, True]
    one = TreeGamma(rows=1, gamma_max=8, costs=costs)
    one.tree_width, one.tree_tokens = 9.0, [3.0]
    one.judged = [True]
    one.join(TreeGamma(rows=3, gamma_max=8, costs=costs))
    assert one.tree_budget(room=16) == 8 and all(one.on)


def _run_trees(ctl, passes, row_scores, accepted, draft_seconds, verify_cost):
    """Drive ``ctl`` as the engine does with a synthetic tree drafter: ``row_scores(budget)`` gives
    each row's nodes (a chain: depths 1, 2, ...) by score, and a row may have none;
    ``accepted(caps)`` the depth each row's verified nodes reach. Returns the budget asked each pass."""
    import torch

    asked = []
    for _ in range(passes):
        budget = ctl.tree_budget(room=50)
        asked.append(budget)
        rows = len(ctl.on)
        if budget == 0:  # what the engine does with no proposal
            ctl.observe(0, 1, [0] * rows, [0] * rows, draft_seconds=0.0, verify_seconds=verify_cost(1))
            continue
        nodes = row_scores(budget)
        lengths = [len(n) for n in nodes]
        scores = torch.tensor([n + [0.0] * (budget - len(n)) for n in nodes])
        depths = torch.arange(1, budget + 1).repeat(rows, 1)
        caps, retry = ctl.choose_tree(scores.tolist(), depths.tolist(), lengths, budget)
        caps = [min(c, n) for c, n in zip(caps, lengths)]
        width = max(caps) + 1
        if width == 1:  # cut to nothing: the engine verifies the plain block
            ctl.observe(0, 1, [0] * rows, [0] * rows, draft_seconds=draft_seconds, verify_seconds=verify_cost(1),
                        retry=retry)
        else:
            ctl.observe_tree(width, caps, accepted(caps), [n[:c] for n, c in zip(nodes, caps)],
                             draft_seconds=draft_seconds, verify_seconds=verify_cost(width), retry=retry)
    return asked


def _chain(score: float, rows: int):
    """Every row drafts a chain of nodes scoring score, score², ...; 2 of them are accepted."""
    return (lambda budget: [[score ** d for d in range(1, budget + 1)]] * rows,
            lambda caps: [min(c, 2) for c in caps])


def test_a_tree_drafters_cost_counts_against_its_trees():
    """The same trees (about 2 accepted tokens a pass) pay when drafting them is cheap, and are
    switched off, retried only rarely, when drafting costs more than they bring."""
    def verify(k):
        return 1.0 + 0.01 * k

    cheap = _run_trees(TreeGamma(rows=2, gamma_max=8), 200, *_chain(0.8, 2), 0.05, verify)
    dear = _run_trees(TreeGamma(rows=2, gamma_max=8), 200, *_chain(0.8, 2), 3.0, verify)
    assert sum(b > 0 for b in cheap[50:]) == 150
    assert sum(b > 0 for b in dear[50:]) <= 150 // 16, dear


def _shallow_tree_passes(ctl, passes: int, draft_seconds: float, score: float = 0.5, hits=lambda i: 1) -> list[int]:
    """Drive ``ctl`` with a head that only ever drafts 8 depth-1 nodes (budget 15) of this score, of
    which ``hits(i)`` (0 or 1) is accepted at pass i; returns the verified block width of each pass
    (0: no tree was asked for)."""
    import torch

    widths = []
    for i in range(passes):
        budget = ctl.tree_budget(room=50)
        if budget == 0:  # what the engine does with an empty proposal
            ctl.observe(0, 1, [0], [0], draft_seconds=0.0, verify_seconds=1.0)
            widths.append(0)
            continue
        scores = torch.full((1, 8), score)
        caps, retry = ctl.choose_tree(scores.tolist(), [[1] * 8], [8], budget)
        width = caps[0] + 1
        widths.append(width)
        if width == 1:  # as the engine does: a tree cut to nothing is a plain pass
            ctl.observe(0, 1, [0], [0], draft_seconds=draft_seconds, verify_seconds=1.0, retry=retry)
        else:
            ctl.observe_tree(width, caps, [hits(i)], [[score * caps[0]]], draft_seconds=draft_seconds,
                             verify_seconds=1.0 + 0.01 * width, retry=retry)
    return widths


def test_trees_smaller_than_the_budget_are_timed_at_their_own_size():
    """A head unsure past its first depth drafts fewer nodes than the budget. Its first passes time
    a block of the tree's own width and half of it, as for a full tree, rather than leave the choice
    to a cost extrapolated from the plain pass alone."""
    widths = _shallow_tree_passes(TreeGamma(rows=1, gamma_max=15), 6, draft_seconds=0.1)
    assert widths[:3] == [1, 9, 5], widths
    assert widths[3:] == [9, 9, 9], widths  # cheap to draft, one token a pass from 8 nodes: all verified


def test_shallow_trees_too_costly_to_draft_are_switched_off():
    """Drafting is weighed once the widths a head's trees reach are timed, even if its trees never
    fill the budget (the budget's own width is then never timed)."""
    widths = _shallow_tree_passes(TreeGamma(rows=1, gamma_max=15), 200, draft_seconds=20.0)
    late = widths[50:]
    assert sum(w > 0 for w in late) <= len(late) // 8, widths  # off but for the retries


def test_an_answers_first_misses_do_not_switch_its_drafting_off():
    """The head misses an answer's first tokens, then predicts well. Its calibration falls and its
    trees are cut, but the row keeps drafting and verifies at least its best node: only the yields
    its trees measure switch drafting off, and the calibration goes on learning, so the whole tree
    is verified again once the head comes right."""
    widths = _shallow_tree_passes(TreeGamma(rows=1, gamma_max=15), 40, draft_seconds=0.1, score=0.3,
                                  hits=lambda i: int(i >= 12))
    assert 0 not in widths, widths  # a tree was asked for every pass (0: the row had been switched off)
    assert widths[-5:] == [9] * 5, widths  # and verified whole once the head came right


def test_trees_that_never_pay_switch_drafting_off():
    """A row whose trees never pay (nothing accepted, drafting half a pass's cost) must not go on
    paying for drafting every pass: its measured yields switch it off."""
    widths = _shallow_tree_passes(TreeGamma(rows=1, gamma_max=15), 200, draft_seconds=0.5, score=0.001,
                                  hits=lambda i: 0)
    late = widths[50:]
    assert sum(w > 0 for w in late) <= len(late) // 8, widths  # off but for the retries


def test_a_row_with_no_nodes_goes_off_while_another_row_drafts():
    """A model-free tree drafter (suffix) may have no node for a row. That row goes off (it is
    re-tried later), rather than stay on with a yield it never measures."""

    ctl = TreeGamma(rows=2, gamma_max=8)
    _run_trees(ctl, 30, lambda budget: [[0.5] * budget, []], lambda caps: [1, 0], 0.1,
               lambda k: 1.0 if k == 1 else 1.0 + 0.02 * k)
    assert ctl.on == [True, False], ctl.on


def _graded_run(ctl, passes, rng, accept_by_grade, verify_cost, room=50):
    """Drive a controller that sees drafts first: each pass a 15-token draft of grade 1 or 3 (half
    each); a draft of grade g has each token accepted with probability accept_by_grade[g] up to the
    first miss. Returns (grade, cap) per pass."""
    chosen = []
    for _ in range(passes):
        grade = rng.choice([1, 3])
        g, caps, retry = ctl.choose(room, [15], [grade])
        n = 0
        while n < caps[0] and rng.random() < accept_by_grade[grade]:
            n += 1
        chosen.append((grade, caps[0]))
        ctl.observe(g, caps[0] + 1, caps, [n], draft_seconds=0.0, verify_seconds=verify_cost(caps[0] + 1),
                    retry=retry, grades=[grade])
    return chosen


def cpu_like(k):
    return 1.0 + 0.12 * (k - 1)  # each extra row ~12% of a one-token pass (q8 on a CPU)


def test_drafts_seen_first_are_verified_by_their_grade():
    """Prompt lookup's 1-token matches are rarely followed, its 3-token matches mostly: with α kept
    per grade, weak drafts go unverified and strong ones run long, in the same row."""
    rng = random.Random(1)
    ctl = ChainGamma(rows=1, gamma_max=15, sees_drafts=True)
    chosen = _graded_run(ctl, 400, rng, {1: 0.1, 3: 0.9}, cpu_like)[100:]
    weak = [cap for grade, cap in chosen if grade == 1]
    strong = [cap for grade, cap in chosen if grade == 3]
    assert sum(c == 0 for c in weak) > 0.8 * len(weak), weak
    assert sum(c >= 4 for c in strong) > 0.8 * len(strong), strong
    # one α for both (no grades): the controller cannot tell them apart, so both get the same γ
    blind = ChainGamma(rows=1, gamma_max=15, sees_drafts=True)
    for _ in range(300):
        g, caps, retry = blind.choose(50, [15], None)
        grade = rng.choice([1, 3])
        n = 0
        while n < caps[0] and rng.random() < {1: 0.1, 3: 0.9}[grade]:
            n += 1
        blind.observe(g, caps[0] + 1, caps, [n], 0.0, cpu_like(caps[0] + 1), retry=retry)
    assert blind.choose(50, [15], None)[1] == blind.choose(50, [15], None)[1]


def test_a_seen_draft_is_not_verified_past_its_length_and_none_is_not_retried():
    costs = CostModel()
    for k in (1, 2, 4, 8, 16):
        costs.verify.observe(k, cpu_like(k))
    ctl = ChainGamma(rows=2, gamma_max=15, costs=costs, sees_drafts=True)
    for _ in range(30):
        ctl.observe(15, 16, [15, 0], [15, 0], 0.0, cpu_like(16), grades=[3, 0])  # grade 3: always accepted
    gamma, caps, retry = ctl.choose(50, [3, 0], [3, 0])
    assert caps == [3, 0] and not retry
    ctl.off_for, ctl.on = [100, 100], [False, False]  # both long off: due for a retry, but row 1 has no draft
    gamma, caps, retry = ctl.choose(50, [0, 0], [0, 0])
    assert caps == [0, 0] and not retry


def test_the_engine_remembers_acceptance_per_grade_for_new_requests():
    """A new request's rows start from what this engine's earlier rows accepted at each grade."""
    costs = CostModel()
    rng = random.Random(2)
    _graded_run(ChainGamma(rows=1, gamma_max=15, costs=costs, sees_drafts=True), 300, rng, {1: 0.05, 3: 0.95},
                cpu_like)
    nxt = ChainGamma(rows=1, gamma_max=15, costs=costs, sees_drafts=True)
    assert nxt.choose(50, [15], [1])[1][0] <= 1  # the few grade-1 drafts verified (all missed) dent its prior
    assert nxt.choose(50, [15], [3])[1][0] >= 6
    assert costs.prior(1, 1)[0] < 0.3 < 0.9 < costs.prior(3, 1)[0]
    fresh = CostModel()  # the same costs, no drafts seen: the 0.6 prior drafts short
    fresh.verify.points = dict(costs.verify.points)
    assert 1 <= ChainGamma(rows=1, gamma_max=15, costs=fresh, sees_drafts=True).choose(50, [15], [3])[1][0] < 6


def test_a_hybrid_drafts_its_lookup_alone_while_its_trees_do_not_pay():
    """X+ngram: with a head that costs more than its trees bring, the passes draft the lookup's
    chains alone (chosen as ChainGamma chooses them: long, where they keep being accepted), and the
    head's trees are re-tried now and then."""
    import torch

    from speculant.controller import HybridGamma
    from speculant.drafters.base import Proposal, tree_proposal
    from speculant.engine import _cap

    ctl = HybridGamma(rows=1, gamma_max=8)
    kinds, lookup_caps = [], []

    def propose(budget, lookup=False):
        kinds.append("lookup" if lookup else "tree")
        if lookup:  # a chain the text always confirms
            return Proposal(torch.arange(10, 10 + budget)[None], torch.tensor([budget]), grades=[3])
        chain = ([5] * budget, list(range(-1, budget - 1)), [0.8 ** d for d in range(1, budget + 1)])
        return tree_proposal([chain], torch.device("cpu"))

    for _ in range(300):
        plan = ctl.plan(50, propose)
        prop = _cap(plan.prop, plan.caps)
        drafted = int(prop.lengths[0])
        if plan.lookup:
            lookup_caps.append(drafted)
        accepted = [drafted if plan.lookup else min(2, drafted)]
        width = prop.tokens.shape[1] + 1
        ctl.learn(prop, plan, accepted, 0.0 if plan.lookup else 3.0, 1.0 + 0.01 * width)  # a head of 3 passes
    later = kinds[100:]
    assert later.count("lookup") > 180 and 0 < later.count("tree") < 20, later
    assert sum(c >= 6 for c in lookup_caps[-100:]) > 90, lookup_caps[-100:]


def test_a_hybrids_lookup_is_not_charged_its_heads_drafting():
    """X+ngram beside a head that costs 3 passes a proposal (its trees off): the lookup's chains are
    in hand when their γ is chosen, so only verifying them counts. Charged the head's drafting (the
    engine's cost per proposal, learnt from the tree passes), a chain accepted 60 % a token never
    paid, and the lookup drafted nothing (2026-11-28, q8 on an AVX2 Zen 3: RAG 1.11x plain against ngram's 1.24x)."""
    import torch

    from speculant.controller import HybridGamma
    from speculant.drafters.base import Proposal, tree_proposal
    from speculant.engine import _cap

    rng = random.Random(3)
    ctl = HybridGamma(rows=1, gamma_max=8)
    lookup_caps = []

    def propose(budget, lookup=False):
        if lookup:
            return Proposal(torch.arange(10, 10 + budget)[None], torch.tensor([budget]), grades=[3])
        return tree_proposal([([5], [-1], [0.3])], torch.device("cpu"))  # a weak head: its trees go off

    for _ in range(300):
        plan = ctl.plan(50, propose)
        prop = _cap(plan.prop, plan.caps)
        drafted = int(prop.lengths[0])
        n = 0
        while n < drafted and rng.random() < (0.6 if plan.lookup else 0.3):
            n += 1
        if plan.lookup:
            lookup_caps.append(drafted)
        width = prop.tokens.shape[1] + 1
        ctl.learn(prop, plan, [n], 0.0 if plan.lookup else 3.0, 1.0 + 0.05 * (width - 1))
    assert len(lookup_caps) > 250
    assert sum(c >= 1 for c in lookup_caps[-100:]) > 80, lookup_caps[-100:]


def _deepening_passes(ctl, passes: int, draft_cost, verify_cost, score: float, accept, rng):
    """Drive ``ctl`` (a TreeGamma for a drafter whose cost grows with the nodes asked, an EAGLE chain
    on the CPU kernels) through the engine's calls: each proposal a chain of the nodes asked, scoring
    score, score², ...; each verified node accepted with probability ``accept`` up to the first miss.
    Returns (nodes asked, nodes verified) per pass (0: no tree asked for)."""
    import torch

    from speculant.drafters.base import tree_proposal
    from speculant.engine import _cap

    out = []

    def propose(budget):
        chain = ([5] * budget, list(range(-1, budget - 1)), [score ** d for d in range(1, budget + 1)])
        return tree_proposal([chain], torch.device("cpu"))

    for _ in range(passes):
        plan = ctl.plan(50, lambda budget: propose(budget) if budget else _no_tree())
        prop = _cap(plan.prop, plan.caps)
        verified = int(prop.lengths[0])
        n = 0
        while n < verified and rng.random() < accept:
            n += 1
        out.append((plan.asked if plan.prop.parents is not None else 0, verified))
        ctl.learn(prop, plan, [n], draft_cost(plan.asked) if plan.asked else 0.0, verify_cost(verified + 1))
    return out


def _no_tree():
    import torch

    from speculant.drafters.base import Proposal

    return Proposal(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def q8_verify(k):  # a q8 pass by width on a Zen 4 (ms): rows 2-3 cheap, the fourth dear
    return {1: 4.1, 2: 4.5, 3: 4.7, 4: 5.6}.get(k, 5.6 + 1.2 * (k - 4))


def test_a_deepening_drafter_is_timed_at_narrow_widths_and_asked_for_what_its_trees_verify():
    """An EAGLE chain on the CPU kernels costs a head step a level (here 0.6 ms + 0.35 a node). Its
    first passes time the widths of 2 and 1 nodes, not the 15-node budget's (a q8 pass of 16 rows
    costs ~5 of one); then it is asked for the nodes its trees verify, and one more every
    PROBE_EVERY passes, so the levels beyond what is verified are not drafted every pass."""
    ctl = TreeGamma(rows=1, gamma_max=15, deepens=True)
    passes = _deepening_passes(ctl, 80, lambda asked: 0.6 + 0.35 * asked, q8_verify, 0.7, 0.7, random.Random(1))
    assert max(asked for asked, _ in passes) <= 3, passes
    assert max(ctl.cost_model.verify.points) <= 4, ctl.cost_model.verify.points  # never the budget's 16 rows
    late = [asked for asked, _ in passes[20:]]
    assert all(a >= 1 for a in late), passes  # these trees pay: drafting stays on
    verified = [v for _, v in passes[20:]]
    assert sum(a > v for a, v in zip(late, verified)) <= len(late) // 3, passes  # few levels drafted for nothing
    # the cost model keeps a proposal's cost by the nodes asked, not one mean over all of them
    assert ctl.cost_model.draft_asked(1) < ctl.cost_model.draft_asked(2)


def test_a_deepening_drafters_rows_start_on_when_its_narrow_trees_pay():
    """Judged by what its wide timing proposals cost (15 nodes: ~4 ms), a head whose one-node trees pay
    (0.9 ms, 70 % accepted) had every new request's rows start off and never drafted again (q8 on a
    Zen 4: `eagle` γ auto 0.97x plain where γ 1 ran 1.11x). Judged at what it is asked for, the next
    request's rows draft from its first pass."""
    costs = CostModel()
    first = TreeGamma(rows=1, gamma_max=15, costs=costs, deepens=True)
    _deepening_passes(first, 40, lambda asked: 0.6 + 0.3 * asked, q8_verify, 0.8, 0.7, random.Random(2))
    costs.draft_pass.points = {1: 4.0}  # what a mean over every proposal may say after wide ones
    nxt = TreeGamma(rows=1, gamma_max=15, costs=costs, deepens=True)
    passes = _deepening_passes(nxt, 10, lambda asked: 0.6 + 0.3 * asked, q8_verify, 0.8, 0.7, random.Random(3))
    assert all(asked >= 1 for asked, _ in passes), passes


def test_a_deepening_drafter_that_does_not_pay_goes_off_and_new_rows_learn_it_sooner():
    """The same head on text it rarely predicts (10 % accepted): its trees are switched off, and the
    yield this engine's trees have had is where the next request's rows start, so they go off in
    fewer passes than the first request's did."""
    costs = CostModel()
    first = _deepening_passes(TreeGamma(rows=1, gamma_max=15, costs=costs, deepens=True), 120,
                              lambda asked: 0.6 + 0.3 * asked, q8_verify, 0.8, 0.1, random.Random(4))
    assert sum(asked > 0 for asked, _ in first[60:]) <= 60 // 8, first  # off but for the retries
    assert costs.tree_tokens < 2.0
    nxt = _deepening_passes(TreeGamma(rows=1, gamma_max=15, costs=costs, deepens=True), 40,
                            lambda asked: 0.6 + 0.3 * asked, q8_verify, 0.8, 0.1, random.Random(5))
    on_first = next(i for i, (asked, _) in enumerate(first[3:]) if asked == 0)
    on_next = next(i for i, (asked, _) in enumerate(nxt) if asked == 0)
    assert on_next < on_first, (on_first, on_next)


def test_a_hybrids_trees_go_off_where_its_lookup_alone_yields_more():
    """X+ngram where the lookup's chains alone yield ~3 tokens a pass and the head's trees ~2.5 at
    1.5 passes' cost: the trees beat plain passes (1.7x) but lose to the lookup's (2.9x), so the
    passes draft the lookup alone, the trees re-tried now and then. Judged against plain passes,
    the trees had stayed on."""
    import torch

    from speculant.controller import HybridGamma
    from speculant.drafters.base import Proposal, tree_proposal
    from speculant.engine import _cap

    ctl = HybridGamma(rows=1, gamma_max=8)
    kinds = []

    def propose(budget, lookup=False):
        kinds.append("lookup" if lookup else "tree")
        if lookup:
            return Proposal(torch.arange(10, 10 + budget)[None], torch.tensor([budget]), grades=[3])
        chain = ([5] * budget, list(range(-1, budget - 1)), [0.8 ** d for d in range(1, budget + 1)])
        return tree_proposal([chain], torch.device("cpu"))

    rng = random.Random(4)
    for _ in range(300):
        plan = ctl.plan(50, propose)
        prop = _cap(plan.prop, plan.caps)
        drafted = int(prop.lengths[0])
        accepted = [min(drafted, 2 if plan.lookup else rng.choice([1, 2]))]
        width = prop.tokens.shape[1] + 1
        ctl.learn(prop, plan, accepted, 0.0 if plan.lookup else 0.5, 1.0 + 0.01 * width)
    later = kinds[100:]
    assert later.count("lookup") > 150 and later.count("tree") < 30, later


def test_cap_keeps_a_proposal_verified_whole_and_empties_one_verified_not_at_all():
    from speculant.drafters.base import Proposal
    from speculant.engine import _cap

    prop = Proposal(torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([3, 2]), grades=[2, 1])
    assert _cap(prop, [3, 5]) is prop  # nothing cut: the same proposal, no new tensors
    none = _cap(prop, [0, 0])
    assert none.tokens.shape == (2, 0) and none.lengths.tolist() == [0, 0] and none.grades == [2, 1]
    cut = _cap(prop, [1, 2])
    assert cut.tokens.tolist() == [[5, 6], [8, 9]] and cut.lengths.tolist() == [1, 2]
    assert prop.lengths.tolist() == [3, 2]  # the drafter's own tensors untouched


def test_listed_chains_make_their_tensors_only_when_verified():
    from speculant.drafters.base import ListedChains, Proposal
    from speculant.engine import _cap

    listed = ListedChains([[5, 6, 7], [8]], 4, torch.device("cpu"), grades=[3, 1])
    nothing = Proposal(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))  # the engine's, made once
    none = _cap(listed, [0, 0], None, lambda: nothing)
    assert listed._tensors is None and none.tokens.shape == (2, 0) and none.grades == [3, 1]
    assert _cap(listed, [9, 9], lambda width: 4) is listed and listed._tensors is None
    assert listed.tokens.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]] and listed.lengths.tolist() == [3, 1]
    cut = _cap(ListedChains([[5, 6, 7], [8]], 4, torch.device("cpu")), [1, 1])
    assert cut.tokens.tolist() == [[5], [8]] and cut.lengths.tolist() == [1, 1]


def test_a_cost_models_state_comes_back_as_it_was_through_json():
    """What ``speculant generate`` keeps for its next run (tools/kept_costs.py): the pass times at
    every width, the machine's running speed, acceptance per grade, the retry and tree yields."""
    import json

    costs = CostModel()
    for tokens, seconds in ((1, 1.0), (4, 1.5), (16, 3.0), (1, 1.2)):
        costs.verify.observe(tokens, seconds)
    costs.draft_token.observe(1, 0.01)
    for grade, drafted, accepted in ((1, 3, 0), (2, 4, 3), (2, 4, 4)):
        costs.observe_acceptance(grade, drafted, accepted)
    costs.observe_retry(0.3)
    costs.observe_tree_tokens(3)
    fresh = CostModel()
    fresh.restore(json.loads(json.dumps(costs.state())))
    assert [fresh.verify(k) for k in (1, 2, 4, 9, 16, 20)] == [costs.verify(k) for k in (1, 2, 4, 9, 16, 20)]
    assert fresh.for_batch(1).seconds(3) == costs.for_batch(1).seconds(3)
    assert fresh.prior(1, 4) == costs.prior(1, 4) and fresh.prior(2, 4) == costs.prior(2, 4)
    assert (fresh.retry_extra, fresh.tree_tokens) == (costs.retry_extra, costs.tree_tokens)
    fresh.observe_acceptance(2, 4, 0)  # and it goes on learning as the one it came from
    costs.observe_acceptance(2, 4, 0)
    assert fresh.prior(2, 4) == costs.prior(2, 4)
    for bad in ({}, {**costs.state(), "retry_extra": "x"},
                {**costs.state(), "times": {**costs.state()["times"], "verify": {"points": {"1": -1.0}, "speed": 1.0}}},
                {**costs.state(), "acceptance": {"1": {"accepted": [2.0], "drafted": [1.0]}}}):
        kept = CostModel()
        with pytest.raises((ValueError, TypeError, KeyError)):
            kept.restore(bad)
        assert kept.verify.points == {} and kept.acceptance == {}  # nothing half taken
