"""Sampler: greedy, top-k/top-p, sampling distribution, seeds, banned tokens, logprobs.

Every check compares against a plain reference (argmax, a per-row python top-k/top-p,
softmax frequencies, torch.topk of log_softmax). CPU, float32.
"""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.runner.sampler import SamplingRows, _top_k_top_p, sample, token_logprobs


def rows(n, temperature=1.0, top_k=0, top_p=1.0, generators=None, banned=None) -> SamplingRows:
    """SamplingRows with per-row values (scalars broadcast to all n rows)."""

    def per_row(v):
        return list(v) if isinstance(v, (list, tuple)) else [v] * n

    return SamplingRows(
        temperature=per_row(temperature),
        top_k=per_row(top_k),
        top_p=per_row(top_p),
        generators=list(generators) if generators is not None else [None] * n,
        banned=[list(b) for b in banned] if banned is not None else [[] for _ in range(n)],
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=gen(seed)) * scale


def reference_kept(logits_row: list[float], k: int, p: float) -> set[int]:
    """Per-row python top-k then top-p (vLLM): the token ids that stay samplable.

    top-k keeps the k largest (k <= 0 or k >= vocab: off). top-p, over the probabilities
    renormalised on the top-k set, keeps the smallest prefix of the most likely tokens
    whose cumulative probability reaches p; the most likely token is always kept.
    """
    order = sorted(range(len(logits_row)), key=lambda i: -logits_row[i])
    if 0 < k < len(order):
        order = order[:k]
    m = max(logits_row[i] for i in order)
    weights = [math.exp(logits_row[i] - m) for i in order]
    total = sum(weights)
    kept, cum = [], 0.0
    for i, w in zip(order, weights):
        if kept and cum >= p:
            break
        kept.append(i)
        cum += w / total
    return set(kept)


def top_p_is_ambiguous(logits_row: list[float], k: int, p: float, eps: float = 1e-5) -> bool:
    """True where a cumulative probability (before the last token) lies within eps of p < 1,
    so that float32 may round either way."""
    if p >= 1.0:
        return False
    order = sorted(range(len(logits_row)), key=lambda i: -logits_row[i])
    if 0 < k < len(order):
        order = order[:k]
    m = max(logits_row[i] for i in order)
    weights = [math.exp(logits_row[i] - m) for i in order]
    total = sum(weights)
    cum = 0.0
    for w in weights[:-1]:
        cum += w / total
        if abs(cum - p) < eps:
            return True
    return False


# -- greedy ----------------------------------------------------------------------------


def test_all_greedy_returns_argmax():
    """temperature 0 on every row: sample() is the row argmax, and consumes no randomness."""
    logits = random_logits(16, 50)
    expected = logits.argmax(-1)
    shared = gen(0)
    state = shared.get_state()
    out = sample(logits.clone(), rows(16, temperature=0.0), shared)
    assert out.dtype == torch.int64
    assert torch.equal(out, expected)
    assert torch.equal(shared.get_state(), state)


def test_greedy_ignores_top_k_top_p_and_temperature_below_threshold():
    """A row with temperature < 1e-5 is greedy even with top-k/top-p set on it."""
    logits = random_logits(4, 30, seed=1)
    out = sample(logits.clone(), rows(4, temperature=[0.0, 1e-6, 0.0, 0.0],
                                      top_k=[3, 0, 1, 5], top_p=[0.5, 0.1, 1.0, 0.9]), gen(0))
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    """In a batch mixing greedy and random rows, greedy rows are argmax; random rows vary."""
    n, vocab = 64, 40
    # Flat logits: random rows almost surely differ from argmax somewhere; greedy never.
    base = random_logits(n, vocab, seed=2, scale=0.1)
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(n)]
    greedy_rows = torch.tensor([t == 0.0 for t in temps])
    argmax = base.argmax(-1)
    differs = torch.zeros(n, dtype=torch.bool)
    shared = gen(3)
    for _ in range(10):
        out = sample(base.clone(), rows(n, temperature=temps), shared)
        assert torch.equal(out[greedy_rows], argmax[greedy_rows])
        assert ((out >= 0) & (out < vocab)).all()
        differs |= out != argmax
    assert not differs[greedy_rows].any()
    assert differs[~greedy_rows].sum() > n // 4


# -- top-k / top-p ---------------------------------------------------------------------


def test_top_k_samples_only_among_k_most_likely():
    """With top-k, every draw (many) is one of the row's k largest logits."""
    n, vocab = 32, 100
    logits = random_logits(n, vocab, seed=4, scale=0.5)
    ks = [1 + (i % 7) for i in range(n)]
    allowed = [set(logits[i].topk(ks[i]).indices.tolist()) for i in range(n)]
    draws = 200  # each row repeated: 200 independent draws in one call
    out = sample(logits.repeat(draws, 1),
                 rows(n * draws, temperature=1.5, top_k=ks * draws), gen(5))
    out = out.view(draws, n)
    seen = [set(out[:, i].tolist()) for i in range(n)]
    for i in range(n):
        assert seen[i] <= allowed[i], (i, ks[i], seen[i] - allowed[i])
    # Flat-ish logits and 200 draws: every allowed token of small-k rows shows up.
    assert all(seen[i] == allowed[i] for i in range(n) if ks[i] <= 3)


def test_top_p_samples_only_within_nucleus():
    """With top-p, every draw lies in the reference nucleus of the row."""
    n, vocab = 16, 50
    logits = random_logits(n, vocab, seed=6)
    ps = [0.1 + 0.05 * i for i in range(n)]
    allowed = [reference_kept(logits[i].tolist(), 0, ps[i]) for i in range(n)]
    draws = 200
    out = sample(logits.repeat(draws, 1), rows(n * draws, top_p=ps * draws), gen(7)).view(draws, n)
    for i in range(n):
        seen = set(out[:, i].tolist())
        assert seen <= allowed[i], (i, ps[i], seen - allowed[i])
        assert len(allowed[i]) == 1 or len(seen) > 1


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_kept_set_matches_reference(seed):
    """_top_k_top_p keeps exactly the reference set per row (k=0 and p=1.0 mean off)."""
    n, vocab = 48, 64
    logits = random_logits(n, vocab, seed=100 + seed)
    g = gen(200 + seed)
    k_choices = [0, 1, 2, 5, 17, vocab - 1, vocab, vocab + 10]
    p_choices = [1.0, 0.99, 0.9, 0.5, 0.2, 0.01, 1e-6]
    ks = [k_choices[int(torch.randint(len(k_choices), (1,), generator=g))] for _ in range(n)]
    ps = [p_choices[int(torch.randint(len(p_choices), (1,), generator=g))] for _ in range(n)]
    ks[0], ps[0] = 0, 1.0  # a row with both off
    out = _top_k_top_p(logits.clone(), ks, ps)
    assert out.shape == logits.shape
    checked = 0
    for i in range(n):
        row = logits[i].tolist()
        if top_p_is_ambiguous(row, ks[i], ps[i]):
            continue
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == reference_kept(row, ks[i], ps[i]), (i, ks[i], ps[i])
        # Kept logits are unchanged.
        idx = sorted(kept)
        assert torch.equal(out[i, idx], logits[i, idx])
        checked += 1
    assert checked >= n - 2
    assert torch.isfinite(out[0]).all()


def test_top_p_one_is_off_in_a_mixed_batch():
    """A p=1.0 row keeps its whole vocabulary, tiny-probability tail included, even when
    another row of the batch turns top-p on (float32 cumsum reaches 1 before the tail)."""
    logits = random_logits(8, 64, seed=100)
    ps = [1.0, 0.5] * 4
    out = _top_k_top_p(logits.clone(), [0] * 8, ps)
    for i in range(0, 8, 2):
        assert torch.equal(out[i], logits[i])


def test_top_p_keeps_token_that_reaches_p():
    """top-p keeps the token whose mass crosses p, and stops right after it."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()

    def kept(p):
        out = _top_k_top_p(logits.clone(), [0], [p])[0]
        return torch.isfinite(out).nonzero().flatten().tolist()

    assert kept(0.4) == [0]
    assert kept(0.6) == [0, 1]
    assert kept(0.85) == [0, 1, 2]
    assert kept(0.96) == [0, 1, 2, 3]
    assert kept(1e-9) == [0]  # the first token is always kept


def test_top_p_applies_after_top_k_renormalisation():
    """top-p measures mass over the top-k set, renormalised (vLLM order: k, then p)."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log()
    # Over all four, 0.4 + 0.3 = 0.7 < 0.75: three tokens. Over top-2 renormalised,
    # 4/7 = 0.571 < 0.75 so both stay, and that is all top-k allows.
    out = _top_k_top_p(logits.clone(), [2], [0.75])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]
    # Over top-3 renormalised (0.444, 0.333, 0.222): 0.444 < 0.5, 0.778 >= 0.5: two.
    out = _top_k_top_p(logits.clone(), [3], [0.5])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 1]


# -- distribution ----------------------------------------------------------------------


def assert_frequencies(tokens: torch.Tensor, probs: torch.Tensor, num_se: float = 5.0):
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    freq = counts / n
    se = (probs * (1 - probs) / n).sqrt()
    for t in range(probs.numel()):
        if probs[t] == 0:
            assert counts[t] == 0, t
        else:
            err = abs(freq[t] - probs[t])
            assert err <= num_se * se[t] + 1e-12, (t, float(freq[t]), float(probs[t]))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_frequencies_match_softmax(temperature):
    """20000 rows of one 4-token distribution: frequencies ≈ softmax(logits / T)."""
    n = 20000
    base = torch.tensor([1.0, 0.2, -0.5, -1.5])
    logits = base.repeat(n, 1)
    out = sample(logits, rows(n, temperature=temperature), gen(11))
    assert_frequencies(out, (base.double() / temperature).softmax(-1))


def test_sampling_frequencies_with_top_k_top_p():
    """Frequencies with top-k/top-p match the truncated, renormalised distribution."""
    n = 20000
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    probs = base.double().softmax(-1)
    for k, p in [(3, 1.0), (0, 0.7), (4, 0.8)]:
        kept = sorted(reference_kept(base.tolist(), k, p))
        expected = torch.zeros_like(probs)
        expected[kept] = probs[kept] / probs[kept].sum()
        out = sample(base.repeat(n, 1), rows(n, top_k=k, top_p=p), gen(12))
        assert_frequencies(out, expected)


def test_per_row_generators_sample_the_right_distribution():
    """Rows each with their own generator still draw from softmax(logits / T)."""
    n = 5000
    base = torch.tensor([0.5, 0.0, -1.0])
    gens = [gen(i) for i in range(n)]
    out = sample(base.repeat(n, 1), rows(n, temperature=0.8, generators=gens), gen(0))
    assert_frequencies(out, (base.double() / 0.8).softmax(-1))


# -- seeds -----------------------------------------------------------------------------


def test_seeded_row_independent_of_batch():
    """A seeded row draws the same tokens whatever the other rows are, and in any position."""
    vocab = 200
    target = random_logits(1, vocab, seed=20, scale=0.3)[0]  # flat: many plausible tokens

    def run(others: torch.Tensor, position: int, other_gens) -> list[int]:
        g = gen(1234)
        tokens = []
        for step in range(8):
            logits = torch.cat([others[:position], target[None], others[position:]])
            gens = list(other_gens[:position]) + [g] + list(other_gens[position:])
            n = logits.shape[0]
            temps = [1.0] * n
            temps[position] = 0.9
            ks = [0] * n
            ks[position] = 50
            out = sample(logits, rows(n, temperature=temps, top_k=ks, top_p=[1.0] * n,
                                      generators=gens), gen(step + 99 * position))
            tokens.append(int(out[position]))
        return tokens

    alone = run(torch.empty(0, vocab), 0, [])
    others = random_logits(5, vocab, seed=21)
    assert run(others, 0, [None] * 5) == alone
    assert run(others, 3, [None] * 5) == alone
    assert run(others, 5, [gen(7), None, gen(8), None, None]) == alone
    assert run(random_logits(2, vocab, seed=22), 1, [None, gen(3)]) == alone
    # And a different seed gives a different stream.
    g_other = gen(4321)
    other_rows = rows(1, temperature=0.9, top_k=50, generators=[g_other])
    other = [int(sample(target[None].clone(), other_rows, gen(0))[0]) for _ in range(8)]
    assert other != alone


def test_shared_generator_used_for_rows_without_their_own():
    """Rows whose generator is None draw from the shared one: same shared seed, same tokens."""
    n, vocab = 8, 100
    logits = random_logits(n, vocab, seed=30, scale=0.3)
    gens_a = [None, gen(1), None, None, gen(2), None, None, None]
    gens_b = [None, gen(1), None, None, gen(2), None, None, None]
    out_a = sample(logits.clone(), rows(n, generators=gens_a), gen(77))
    out_b = sample(logits.clone(), rows(n, generators=gens_b), gen(77))
    assert torch.equal(out_a, out_b)
    # Shared seed changes the None rows (over several draws), not the seeded ones.
    shared_c, shared_a = gen(78), gen(77)
    gens_c = [None, gen(1), None, None, gen(2), None, None, None]
    gens_a = [None, gen(1), None, None, gen(2), None, None, None]
    rows_a, rows_c = rows(n, generators=gens_a), rows(n, generators=gens_c)
    seq_a = torch.stack([sample(logits.clone(), rows_a, shared_a) for _ in range(5)])
    seq_c = torch.stack([sample(logits.clone(), rows_c, shared_c) for _ in range(5)])
    assert torch.equal(seq_a[:, [1, 4]], seq_c[:, [1, 4]])
    assert not torch.equal(seq_a[:, [0, 2, 3, 5, 6, 7]], seq_c[:, [0, 2, 3, 5, 6, 7]])
    # Rows without a generator advance the shared one; when every row has its own, the
    # shared generator is left untouched and each row's own one advances.
    shared = gen(5)
    before = shared.get_state()
    sample(logits[:2].clone(), rows(2, generators=[None, None]), shared)
    assert not torch.equal(shared.get_state(), before)
    shared = gen(5)
    g1, g2 = gen(9), gen(10)
    g1_before = g1.get_state()
    sample(logits[:2].clone(), rows(2, generators=[g1, g2]), shared)
    assert torch.equal(shared.get_state(), before)
    assert not torch.equal(g1.get_state(), g1_before)


# -- banned tokens ---------------------------------------------------------------------


def test_banned_tokens_never_sampled_even_if_argmax():
    """Banned tokens (min_tokens) are never returned, greedy or random, even as argmax."""
    n, vocab = 40, 10
    logits = torch.zeros(n, vocab)
    logits[:, 3] = 10.0  # overwhelmingly likely
    logits[:, 7] = 8.0
    banned = [[3, 7] if i % 2 == 0 else [] for i in range(n)]
    temps = [0.0 if i % 4 < 2 else 1.0 for i in range(n)]
    shared = gen(40)
    for _ in range(50):
        out = sample(logits.clone(), rows(n, temperature=temps, banned=banned), shared).tolist()
        for i, t in enumerate(out):
            if banned[i]:
                assert t not in (3, 7)
            elif temps[i] == 0.0:
                assert t == 3
    # All greedy: the fast path also honours bans.
    out = sample(logits.clone(), rows(n, temperature=0.0, banned=banned), shared)
    assert all(int(out[i]) not in (3, 7) for i in range(0, n, 2))
    assert all(int(out[i]) == 3 for i in range(1, n, 2))


def test_banned_tokens_with_top_k():
    """Bans apply before top-k: top-1 of a banned argmax row picks the best allowed token."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]]).repeat(100, 1)
    out = sample(logits, rows(100, top_k=1, banned=[[0]] * 100), gen(0))
    assert (out == 1).all()


# -- logprobs --------------------------------------------------------------------------


def test_token_logprobs_match_log_softmax():
    """chosen = log_softmax gathered; rank = 1 + #strictly greater; top = topk(log_softmax)."""
    n, vocab, k = 12, 30, 5
    logits = random_logits(n, vocab, seed=50)
    logits[0, :] = 0.0  # all tied: rank 1 for any token
    logits[1, 4] = logits[1, 9] = logits[1].max() + 1  # tie at the top
    chosen = torch.randint(vocab, (n,), generator=gen(51))
    chosen[1] = 9
    lp = logits.log_softmax(-1)
    res = token_logprobs(logits, chosen, k)
    assert torch.allclose(res.chosen, lp[torch.arange(n), chosen])
    assert res.chosen.shape == (n,) and res.rank.shape == (n,)
    ref_rank = [1 + sum(1 for v in lp[i].tolist() if v > lp[i, chosen[i]].item()) for i in range(n)]
    assert res.rank.tolist() == ref_rank
    assert res.rank[0] == 1 and res.rank[1] == 1
    top = lp.topk(k, dim=-1)
    assert torch.allclose(res.top_values, top.values)
    assert torch.equal(res.top_ids[2:], top.indices[2:])  # rows 0 and 1 have ties
    assert torch.allclose(lp.gather(-1, res.top_ids), res.top_values)
    assert res.top_ids.dtype == torch.int64 and res.rank.dtype == torch.int64


def test_token_logprobs_are_raw_even_with_extreme_logits():
    """Logprobs of a near-one-hot row are finite and exact (log_softmax, no temperature)."""
    logits = torch.tensor([[50.0, 0.0, -50.0]])
    res = token_logprobs(logits, torch.tensor([2]), 3)
    assert torch.allclose(res.chosen, torch.tensor([-100.0]), atol=1e-3)
    assert res.rank.tolist() == [3]
    assert res.top_ids.tolist() == [[0, 1, 2]]


def test_token_logprobs_num_top_zero_and_clamped():
    """num_top=0 gives empty [N, 0] tensors; num_top > vocab is clamped to vocab."""
    n, vocab = 4, 6
    logits = random_logits(n, vocab, seed=60)
    chosen = torch.tensor([0, 1, 2, 3])
    res = token_logprobs(logits, chosen, 0)
    assert res.top_values.shape == (n, 0) and res.top_ids.shape == (n, 0)
    assert res.top_values.dtype == torch.float32 and res.top_ids.dtype == torch.int64
    assert torch.allclose(res.chosen, logits.log_softmax(-1)[torch.arange(n), chosen])
    res = token_logprobs(logits, chosen, vocab + 5)
    assert res.top_values.shape == (n, vocab) and res.top_ids.shape == (n, vocab)
    top = logits.log_softmax(-1).topk(vocab, dim=-1)
    assert torch.allclose(res.top_values, top.values)
    assert torch.equal(res.top_ids, top.indices)


def test_rows_with_only_a_temperature_take_the_fused_race():
    """Given per-row seeds, rows without top-k / top-p / banned tokens are drawn by
    ops.race_sample (keyed by the seeds); any truncation sends the step down the torch
    path, whose draws come from the generators."""
    from loraplex import ops

    logits = random_logits(4, 50, seed=9)
    plain = rows(4, temperature=[1.0, 0.0, 0.5, 1.0])
    plain.seeds = [3, 4, 5, 6]
    want = ops.race_sample(logits, torch.tensor(plain.temperature), torch.tensor(plain.seeds))
    assert torch.equal(sample(logits.clone(), plain, gen(0)), want)
    assert sample(logits.clone(), plain, gen(1)).tolist() == want.tolist()  # the generator is unused

    truncated = rows(4, temperature=1.0, top_k=[0, 5, 0, 0])
    truncated.seeds = [3, 4, 5, 6]
    first = sample(logits.clone(), truncated, gen(0))
    assert torch.equal(first, sample(logits.clone(), truncated, gen(0)))
    assert logits[1].topk(5).indices.tolist().count(first[1].item()) == 1


def test_modifies_logits_tells_when_the_logits_survive():
    """The runner scores logprobs on the logits it sampled from unless sample() says it
    writes into them: whenever modifies_logits() is False they must come back unchanged."""
    logits = random_logits(3, 40, seed=2)
    cases = [rows(3, temperature=[1.0, 0.3, 0.0]), rows(3, temperature=0.0),
             rows(3, temperature=0.0, banned=[[1], [], []]), rows(3, top_k=[0, 4, 0]),
             rows(3, temperature=0.9)]
    cases[0].seeds = [1, 2, 3]
    for case in cases:
        got = logits.clone()
        sample(got, case, gen(0))
        if not case.modifies_logits(40):
            assert torch.equal(got, logits), case
    assert [c.modifies_logits(40) for c in cases] == [False, False, True, True, True]


def test_logit_rules_follow_their_formulas():
    """logit_bias, then repetition (prompt and output), frequency and presence penalties,
    checked against the formulas written out per row; a pending token (the step in
    flight's, on the device) counts as output."""
    from loraplex.runner.logit_rules import LogitRules, apply_rules

    vocab = 50
    logits = random_logits(4, vocab, seed=3)
    last_ids = torch.tensor([7, 11])  # the previous step's sampled ids; row 1 of it is row 2's
    rules = [
        LogitRules(logit_bias={3: 5.0, 9: -2.5}),
        None,
        LogitRules(repetition=1.5, frequency=0.5, presence=0.25, prompt_ids=[1, 2, 3],
                   output_ids=[4, 4, 2], pending_row=1),
        LogitRules(logit_bias={4: 1.0}, repetition=0.8, output_ids=[4]),
    ]
    got = logits.clone()
    apply_rules(got, rules, last_ids)
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 9] -= 2.5
    for row, rule, pending in ((2, rules[2], [11]), (3, rules[3], [])):
        for t, b in rule.logit_bias.items():
            want[row, t] += b
        out = rule.output_ids + pending
        for t in range(vocab):
            count = out.count(t)
            if t in rule.prompt_ids or count:
                v = want[row, t]
                want[row, t] = v / rule.repetition if v > 0 else v * rule.repetition
            want[row, t] -= rule.frequency * count + rule.presence * (count > 0)
    torch.testing.assert_close(got, want)


def test_min_p_keeps_tokens_near_the_most_likely():
    from loraplex.runner.logit_rules import LogitRules

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    r = rows(1, temperature=1.0)
    r.rules = [LogitRules(min_p=0.35)]  # keeps p >= 0.175: tokens 0 and 1
    draws = {int(sample(logits.clone(), r, gen(i))) for i in range(200)}
    assert draws == {0, 1}
