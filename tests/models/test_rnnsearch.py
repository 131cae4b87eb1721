"""RNNsearch maths against a loop-by-loop evaluation of the paper's equations (Bahdanau et al. 2014,
appendix A), padding and batch invariance, the step API, and beam-search rules (C09)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from relserve.models.decoding import (
    DecodeOptions,
    apply_step,
    beam_search,
    build_step,
    greedy_search,
    new_beam,
    start_beams,
    step,
)
from relserve.models.checkpoint import read_config, write_config
from relserve.models.rnnsearch import EncoderState, RNNSearch, RNNSearchConfig

PAD, BOS, EOS = 0, 1, 2


def tiny_config(**kw) -> RNNSearchConfig:
    base = dict(
        src_vocab_size=23, tgt_vocab_size=19, embedding_size=6, hidden_size=5, alignment_size=7, maxout_size=4,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    base.update(kw)
    return RNNSearchConfig(**base)


def tiny_model(seed: int = 0, eos_bias: float = 0.0, scale: float = 1.5, **kw) -> RNNSearch:
    torch.manual_seed(seed)
    model = RNNSearch(tiny_config(**kw))
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the default init: sharper, less uniform outputs
            p.mul_(scale)
        model.decoder.output_proj.bias[EOS] += eos_bias
    return model.eval()


def sources(lengths: list[int], seed: int = 1, vocab: int = 23) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded Long[B,S] ids (3..vocab-1, last real token EOS) and their mask."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.full((len(lengths), S), PAD, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        ids[b, n - 1] = EOS
        mask[b, :n] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------
# The paper's equations, one scalar loop at a time (float64)
# ---------------------------------------------------------------------------------------------------------


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def paper_gru(cell, x, h, c=None):
    """A.2.1/A.2.2: z = σ(W_z x + U_z h + C_z c), r = σ(W_r x + U_r h + C_r c),
    h̃ = tanh(W x + U[r∘h] + C c), h' = (1-z)∘h + z∘h̃ — element by element."""
    n = h.shape[0]
    W, b = _d(cell.input_proj.weight), _d(cell.input_proj.bias)
    W_z, W_r, W_ = W[:n], W[n : 2 * n], W[2 * n :]
    b_z, b_r, b_ = b[:n], b[n : 2 * n], b[2 * n :]
    U_g = _d(cell.state_gate_proj.weight)
    U_z, U_r, U = U_g[:n], U_g[n:], _d(cell.state_proj.weight)
    C = None if c is None else _d(cell.context_proj.weight)
    z, r = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for k in range(n):
        az = float(W_z[k] @ x + b_z[k] + U_z[k] @ h)
        ar = float(W_r[k] @ x + b_r[k] + U_r[k] @ h)
        if c is not None:
            az += float(C[k] @ c)
            ar += float(C[n + k] @ c)
        z[k], r[k] = _sigmoid(az), _sigmoid(ar)
    new = torch.zeros(n, dtype=torch.float64)
    for k in range(n):
        a = float(W_[k] @ x + b_[k] + U[k] @ (r * h))
        if c is not None:
            a += float(C[2 * n + k] @ c)
        new[k] = (1 - z[k]) * h[k] + z[k] * math.tanh(a)
    return new


def paper_encode(model, ids: list[int]):
    enc = model.encoder
    E = _d(enc.embeddings.weight)
    n = model.config.hidden_size
    fwd, bwd = [], [None] * len(ids)
    h = torch.zeros(n, dtype=torch.float64)
    for j in range(len(ids)):
        h = paper_gru(enc.forward_gru, E[ids[j]], h)
        fwd.append(h)
    h = torch.zeros(n, dtype=torch.float64)
    for j in reversed(range(len(ids))):
        h = paper_gru(enc.backward_gru, E[ids[j]], h)
        bwd[j] = h
    return [torch.cat([f, b]) for f, b in zip(fwd, bwd)]  # h_j = [→h_j; ←h_j]


def paper_decode(model, annotations, tgt_in: list[int]):
    """Per target position i: (logits of y_i, α_i) from the paper's equations, teacher forced."""
    dec = model.decoder
    n = model.config.hidden_size
    E = _d(dec.embeddings.weight)
    W_s, b_s = _d(dec.init_state_proj.weight), _d(dec.init_state_proj.bias)
    W_a, b_a = _d(dec.alignment.state_proj.weight), _d(dec.alignment.state_proj.bias)
    U_a, v_a = _d(dec.alignment.annotation_proj.weight), _d(dec.alignment.energy.weight)[0]
    U_o, b_o = _d(dec.out_state_proj.weight), _d(dec.out_state_proj.bias)
    V_o, C_o = _d(dec.out_embedding_proj.weight), _d(dec.out_context_proj.weight)
    W_o, b_W = _d(dec.output_proj.weight), _d(dec.output_proj.bias)
    s = torch.tanh(W_s @ annotations[0][n:] + b_s)  # s_0 = tanh(W_s ←h_1)
    out = []
    for y_prev in tgt_in:
        e = [float(v_a @ torch.tanh(W_a @ s + b_a + U_a @ h_j)) for h_j in annotations]  # e_ij
        z = sum(math.exp(x) for x in e)
        alpha = [math.exp(x) / z for x in e]  # α_ij
        c = sum(a * h_j for a, h_j in zip(alpha, annotations))  # c_i
        Ey = E[y_prev]
        t_tilde = U_o @ s + b_o + V_o @ Ey + C_o @ c
        t = torch.tensor([max(float(t_tilde[2 * k]), float(t_tilde[2 * k + 1])) for k in range(len(t_tilde) // 2)],
                         dtype=torch.float64)  # maxout
        logits = W_o @ t + b_W
        out.append((logits, torch.tensor(alpha, dtype=torch.float64)))
        s = paper_gru(dec.gru, Ey, s, c)  # s_i = f(s_{i-1}, y_{i-1}, c_i)
    return out


def test_maths_match_paper_equations_loop_by_loop():
    model = tiny_model(seed=3)
    src, mask = sources([4, 7, 2], seed=5)
    g = torch.Generator().manual_seed(9)
    tgt_in = torch.randint(3, 19, (3, 5), generator=g)
    tgt_in[:, 0] = BOS
    with torch.no_grad():
        logits = model(src, mask, tgt_in)  # Float[B,T,V]
        state = model.encode(src, mask)
    for b in range(3):
        n = int(mask[b].sum())
        ann = paper_encode(model, src[b, :n].tolist())
        torch.testing.assert_close(state.annotations[b, :n].double(), torch.stack(ann), atol=1e-5, rtol=0)
        ref = paper_decode(model, ann, tgt_in[b].tolist())
        torch.testing.assert_close(logits[b].double(), torch.stack([r[0] for r in ref]), atol=1e-5, rtol=0)
        # The step API gives the same log-probs and α_i, one position at a time.
        hidden = state.init_state[b : b + 1]
        idx = torch.tensor([b])
        for i, (ref_logits, ref_alpha) in enumerate(ref):
            with torch.no_grad():
                lp, hidden, alpha = model.decode_step(state, idx, tgt_in[b, i : i + 1], hidden)
            torch.testing.assert_close(lp[0].double(), torch.log_softmax(ref_logits, -1), atol=1e-5, rtol=0)
            torch.testing.assert_close(alpha[0, :n].double(), ref_alpha, atol=1e-5, rtol=0)
            assert torch.all(alpha[0, n:] == 0)


def test_padding_invariance_encoder_and_decoder():
    model = tiny_model(seed=4)
    src, mask = sources([3, 11, 1, 6], seed=2)
    with torch.no_grad():
        batch = model.encode(src, mask)
        for b in range(4):
            n = int(mask[b].sum())
            solo = model.encode(src[b : b + 1, :n], mask[b : b + 1, :n])
            torch.testing.assert_close(batch.annotations[b : b + 1, :n], solo.annotations, atol=1e-6, rtol=0)
            torch.testing.assert_close(batch.init_state[b : b + 1], solo.init_state, atol=1e-6, rtol=0)
            assert torch.all(batch.annotations[b, n:] == 0)
            # Extra padding (a wider stacked state) changes nothing in a decoder step.
            wide = EncoderState.cat([solo, batch])
            prev = torch.tensor([BOS, 5])
            h = torch.cat([solo.init_state, solo.init_state])
            lp_solo, h_solo, a_solo = model.decode_step(solo, torch.tensor([0, 0]), prev, h)
            lp_wide, h_wide, a_wide = model.decode_step(wide, torch.tensor([0, 0]), prev, h)
            torch.testing.assert_close(lp_wide, lp_solo, atol=1e-6, rtol=0)
            torch.testing.assert_close(h_wide, h_solo, atol=1e-6, rtol=0)
            torch.testing.assert_close(a_wide[:, :n], a_solo, atol=1e-6, rtol=0)
            assert torch.all(a_wide[:, n:] == 0)
        # Teacher-forced logits of a padded batch equal the solo ones.
        tgt = torch.randint(3, 19, (4, 4), generator=torch.Generator().manual_seed(0))
        logits = model(src, mask, tgt)
        for b in range(4):
            n = int(mask[b].sum())
            torch.testing.assert_close(logits[b : b + 1], model(src[b : b + 1, :n], mask[b : b + 1, :n], tgt[b : b + 1]),
                                       atol=1e-5, rtol=0)


def test_source_mask_must_be_nonempty_right_padding():
    model = tiny_model()
    src, mask = sources([3, 2])
    with pytest.raises(ValueError, match="right-padded"):
        model.encode(src, mask.flip(1))
    mask[1] = 0
    with pytest.raises(ValueError, match="at least one token"):
        model.encode(src, mask)


def test_step_api_mixes_hypotheses_of_two_requests():
    model = tiny_model(seed=6)
    src, mask = sources([9, 2], seed=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        state = model.encode(src, mask)
        index = torch.tensor([1, 0, 0, 1, 0])
        prev = torch.randint(3, 19, (5,), generator=g)
        hidden = torch.randn(5, 5, generator=g)
        lp, h, a = model.decode_step(state, index, prev, hidden)
        for r, single in enumerate(state.split()):
            rows = (index == r).nonzero().squeeze(1)
            lp_r, h_r, a_r = model.decode_step(single, None, prev[rows], hidden[rows])
            n = single.mask.shape[1]
            torch.testing.assert_close(lp[rows], lp_r, atol=1e-6, rtol=0)
            torch.testing.assert_close(h[rows], h_r, atol=1e-6, rtol=0)
            torch.testing.assert_close(a[rows, :n], a_r, atol=1e-6, rtol=0)


def _assert_same_hyps(got, want):
    assert [h.tokens for h in got] == [h.tokens for h in want]
    assert [h.finished for h in got] == [h.finished for h in want]
    for x, y in zip(got, want):
        assert x.log_prob == pytest.approx(y.log_prob, abs=1e-5)


@pytest.mark.parametrize("eos_bias", [0.0, 0.5, 1.0])
def test_batch_invariance_greedy_and_beam(eos_bias):
    model = tiny_model(seed=7, eos_bias=eos_bias)
    lengths = [1, 23, 4, 40]
    src, mask = sources(lengths, seed=11)
    greedy_opts = DecodeOptions(max_len_cap=30)
    beam_opts = DecodeOptions(beam_size=4, n_best=3, max_len_cap=30, return_alignment=True)
    batch_greedy = greedy_search(model, src, mask, greedy_opts)
    batch_beam = beam_search(model, src, mask, beam_opts)
    for b, n in enumerate(lengths):
        solo_src, solo_mask = src[b : b + 1, :n], mask[b : b + 1, :n]
        _assert_same_hyps([batch_greedy[b]], greedy_search(model, solo_src, solo_mask, greedy_opts))
        solo = beam_search(model, solo_src, solo_mask, beam_opts)[0]
        _assert_same_hyps(batch_beam[b], solo)
        for x, y in zip(batch_beam[b], solo):
            assert x.alignment.shape == (len(x.tokens), n)
            torch.testing.assert_close(x.alignment, y.alignment, atol=1e-6, rtol=0)
            torch.testing.assert_close(x.alignment.sum(-1), torch.ones(len(x.tokens)), atol=1e-5, rtol=0)


def test_iteration_level_admission_equals_solo_decoding():
    """Request B joins after request A has run 3 steps; C joins later; each equals its solo decode."""
    model = tiny_model(seed=8, eos_bias=1.0)
    src, mask = sources([5, 17, 2], seed=4)
    opts = [DecodeOptions(beam_size=3, n_best=2), DecodeOptions(beam_size=1), DecodeOptions(beam_size=5, n_best=5)]
    solo = [beam_search(model, src[b : b + 1, : int(mask[b].sum())], mask[b : b + 1, : int(mask[b].sum())], opts[b])[0]
            for b in range(3)]
    with torch.inference_mode():
        state = model.encode(src, mask)
        beams = start_beams(model, state, opts, request_ids=["a", "b", "c"])
        live, waiting, done, t = [beams[0]], [beams[1], beams[2]], [], 0
        while live or waiting:
            if t in (3, 5) and waiting:
                live.append(waiting.pop(0))
            if live:
                done += step(model, live)
                live = [b for b in live if not b.done]
            t += 1
    assert sorted(b.request_id for b in done) == ["a", "b", "c"]
    for b in range(3):
        _assert_same_hyps(beams[b].results, solo[b])


def _check_hypothesis_rules(hyps, max_length, n_best):
    assert len(hyps) == n_best
    norm = [h.score for h in hyps]
    assert norm == sorted(norm, reverse=True)
    for h in hyps:
        assert 1 <= len(h.tokens) <= max_length
        assert h.finished != h.truncated
        assert h.tokens.count(EOS) == (1 if h.finished else 0)
        if h.finished:
            assert h.tokens[-1] == EOS
        assert PAD not in h.tokens and BOS not in h.tokens
        assert h.score == pytest.approx(h.log_prob / len(h.tokens))


@pytest.mark.parametrize("eos_bias, expect", [(0.0, "truncated"), (1.0, "mixed"), (4.0, "finished")])
def test_case_C09_beam5_nbest5_max_length3(eos_bias, expect):
    """C09: beam 5, n-best 5, max output length 3, 10-token sources: exactly 5 hypotheses of <= 3 tokens,
    sorted by normalised score, the ones without EOS flagged truncated — whether none, some or all finish."""
    model = tiny_model(seed=10, eos_bias=eos_bias)
    src, mask = sources([10, 10], seed=3)
    opts = DecodeOptions(beam_size=5, n_best=5, max_len_cap=3)
    results = beam_search(model, src, mask, opts)
    kinds = set()
    for hyps in results:
        _check_hypothesis_rules(hyps, 3, 5)
        assert all(h.truncated for h in hyps if h.tokens[-1] != EOS)
        kinds |= {h.finished for h in hyps}
    assert kinds == {"truncated": {False}, "mixed": {False, True}, "finished": {True}}[expect]


def test_eos_rules_and_length_limit_over_many_sources():
    model = tiny_model(seed=12, eos_bias=1.5)
    lengths = [1, 2, 3, 5, 8, 13]
    src, mask = sources(lengths, seed=6)
    opts = DecodeOptions(beam_size=3, n_best=3, max_len_a=1.0, max_len_b=2)
    for n, hyps in zip(lengths, beam_search(model, src, mask, opts)):
        _check_hypothesis_rules(hyps, n + 2, 3)
    for n, h in zip(lengths, greedy_search(model, src, mask, DecodeOptions(max_len_a=0.0, max_len_b=4))):
        _check_hypothesis_rules([h], 4, 1)


# ---------------------------------------------------------------------------------------------------------
# The update rules without a model (scripted log-probs)
# ---------------------------------------------------------------------------------------------------------


def _scripted_beam(options: DecodeOptions, src_len: int = 4, hidden: int = 2):
    enc = EncoderState(torch.zeros(1, src_len, 3), torch.zeros(1, src_len, 3), torch.ones(1, src_len, dtype=torch.bool),
                       torch.zeros(1, hidden))
    return new_beam("r", enc, options, bos_token_id=BOS, eos_token_id=EOS, banned_token_ids=(PAD, BOS))


def _run_scripted(beams, table):
    """table(step, prev_token) -> Float[V] log-probs."""
    t = 0
    while any(not b.done for b in beams):
        batch = build_step(beams)
        lp = torch.stack([table(t, int(y)) for y in batch.prev_tokens])
        apply_step(batch, lp, torch.zeros(batch.num_hypotheses, 2), torch.full((batch.num_hypotheses, 4), 0.25))
        t += 1


def test_scripted_greedy_eos_first_gives_single_eos_and_ties_break_low():
    V = 6
    eos_first = _scripted_beam(DecodeOptions(beam_size=1))
    uniform = _scripted_beam(DecodeOptions(beam_size=1, max_len_a=0, max_len_b=3))
    _run_scripted([eos_first], lambda t, y: torch.log_softmax(torch.tensor([9.0, 9, 9, 0, 0, 0]), 0))
    assert [h.tokens for h in eos_first.results] == [[EOS]] and eos_first.results[0].finished
    # Uniform scores except EOS: ties resolve to the lowest allowed token id (3), pad/bos never chosen.
    _run_scripted([uniform], lambda t, y: torch.tensor([0.0, 0, -5, 0, 0, 0]) - math.log(V))
    assert uniform.results[0].tokens == [3, 3, 3] and uniform.results[0].truncated


def test_scripted_beam_no_growth_after_eos_and_truncation_fill():
    # Step 0: EOS is best; afterwards EOS is worst. Beam 3 / n_best 3 / max length 2.
    def table(t, y):
        if t == 0:
            return torch.log_softmax(torch.tensor([0.0, 0, 5, 3, 2, 1]), 0)
        return torch.log_softmax(torch.tensor([0.0, 0, -9, 1, 2, 3]), 0)

    beam = _scripted_beam(DecodeOptions(beam_size=3, n_best=3, max_len_a=0, max_len_b=2, return_alignment=True))
    _run_scripted([beam], table)
    res = beam.results
    assert len(res) == 3
    assert res[0].tokens == [EOS] and res[0].finished and res[0].alignment.shape == (1, 4)
    assert all(h.truncated and len(h.tokens) == 2 and EOS not in h.tokens for h in res[1:])
    assert all(h.alignment.shape == (2, 4) for h in res[1:])
    norm = [h.score for h in res]
    assert norm == sorted(norm, reverse=True)


def _oracle_pick(rows: list[list[float]], count: int) -> tuple[list[int], list[float]]:
    """The selection rule in plain Python: the ``count`` best finite candidates of one beam (flat index =
    hypothesis * V + token), best first, ties by the lower flat index."""
    flat = [(v, i) for i, v in enumerate(x for row in rows for x in row) if math.isfinite(v)]
    best = sorted(flat, key=lambda t: (-t[0], t[1]))[:count]
    return [i for _, i in best], [v for v, _ in best]


@pytest.mark.parametrize("seed", range(6))
def test_batched_candidate_selection_equals_one_beam_at_a_time(seed):
    """apply_step selects every beam's 2k candidates with one padded top-k; coarse values make ties (also
    across the boundary of what a beam may take) and -inf entries (banned tokens, beams with fewer finite
    candidates than wanted) common. Each beam's pick must equal the plain-Python rule on its own rows."""
    from relserve.models.decoding import _select_all

    g = torch.Generator().manual_seed(seed)
    V = 7
    live = [1, 5, 3, 5, 2, 5, 1]
    spans, start = [], 0
    for k in live:
        spans.append((start, start + k))
        start += k
    cand = torch.randint(-4, 1, (start, V), generator=g).float() / 2  # few distinct values: many ties
    cand[torch.rand(start, V, generator=g) < 0.3] = float("-inf")
    cand[0, :] = float("-inf")
    cand[0, 3] = -1.0  # a beam with a single finite candidate
    counts = [min(2 * b, k * V) for b, k in zip([3, 5, 4, 1, 5, 2, 6], live)]
    got = _select_all(cand, spans, counts)
    for (lo, hi), count, (idx, vals) in zip(spans, counts, got):
        assert (idx, vals) == _oracle_pick(cand[lo:hi].tolist(), count)
    # the view fast path (every beam with the same number of rows, in order) gives the same
    uniform = [(5 * r, 5 * r + 5) for r in range(3)]
    cand5 = torch.randint(-3, 1, (15, V), generator=g).float()
    for (lo, hi), (idx, vals) in zip(uniform, _select_all(cand5, uniform, [10, 4, 35])):
        assert (idx, vals) == _oracle_pick(cand5[lo:hi].tolist(), min(10 if lo == 0 else 4 if lo == 5 else 35, 35))


# ---------------------------------------------------------------------------------------------------------
# Config and the decoder as a head over another encoder
# ---------------------------------------------------------------------------------------------------------


def test_config_round_trip(tmp_path):
    cfg = tiny_config(dropout=0.1)
    write_config(cfg.to_dict(), tmp_path)
    again = RNNSearchConfig.from_dict(read_config(tmp_path)[1])
    assert again == cfg and again.to_dict()["model_type"] == "rnnsearch"
    assert again.alignment_size == 7 and again.annotation_size == 10 and again.init_state == "backward_first"
    with pytest.raises(ValueError):
        RNNSearchConfig.from_dict({**cfg.to_dict(), "model_type": "deberta-v2"})
    default = RNNSearchConfig()
    assert (default.embedding_size, default.hidden_size, default.alignment_size, default.maxout_size) == (620, 1000, 1000, 500)


class _ToyEncoder(nn.Module):
    """A non-recurrent encoder (stand-in for a DeBERTa-style one): annotations = W emb."""

    def __init__(self, vocab: int, size: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, size)
        self.proj = nn.Linear(size, size)

    def forward(self, src_ids, src_mask):
        return torch.tanh(self.proj(self.embeddings(src_ids)))


def test_decoder_head_over_external_encoder_mean_init_is_padding_invariant():
    torch.manual_seed(2)
    cfg = tiny_config(encoder_type="external", annotation_size=8)
    assert cfg.init_state == "mean"
    model = RNNSearch(cfg, encoder=_ToyEncoder(23, 8)).eval()
    src, mask = sources([2, 9], seed=8)
    with torch.no_grad():
        batch = model.encode(src, mask)
        solo = model.encode(src[:1, :2], mask[:1, :2])
    torch.testing.assert_close(batch.init_state[:1], solo.init_state, atol=1e-6, rtol=0)
    results = beam_search(model, src, mask, DecodeOptions(beam_size=2, n_best=2, max_len_cap=6))
    assert [len(r) for r in results] == [2, 2]
    _assert_same_hyps(results[0], beam_search(model, src[:1, :2], mask[:1, :2],
                                              DecodeOptions(beam_size=2, n_best=2, max_len_cap=6))[0])


# ---------------------------------------------------------------------------------------------------------
# The server's stepper: a sequence whose rows go NaN fails alone
# ---------------------------------------------------------------------------------------------------------


def test_stepper_fails_only_the_sequence_with_nan_rows_and_the_rest_decode_as_alone():
    """One source token's embedding is NaN, so every decoder row of the sequence holding it is NaN. The
    stepper drops that sequence with an error; the others share the same steps and must decode exactly as
    they do alone (the batch handed to apply_step then leaves the NaN rows out)."""
    from relserve.service.backends.base import StartItem, StepPlan
    from relserve.service.backends.translation_steps import BeamStepper
    from relserve.service.errors import Internal

    poison = 9
    model = tiny_model(seed=5, eos_bias=0.5)
    with torch.no_grad():
        model.encoder.embeddings.weight[poison] = float("nan")
    good = [[4, 5, 6, EOS], [7, 3, EOS], [8, 10, 11, 12, EOS]]
    sources_ids = [good[0], [3, poison, 4, EOS], good[1], good[2]]
    opts = [DecodeOptions(beam_size=3, n_best=2), DecodeOptions(beam_size=2), DecodeOptions(beam_size=4, n_best=4),
            DecodeOptions(beam_size=1)]
    stepper = BeamStepper("nan", model, "cpu")
    stepper.start([StartItem(i, ids, o) for i, (ids, o) in enumerate(zip(sources_ids, opts))])
    live, results, failed = [0, 1, 2, 3], {}, {}
    while live:
        ups = stepper.step(StepPlan(tuple(live), tuple(stepper.beams[i].num_live for i in live)))
        for sid, up in zip(list(live), ups):
            if isinstance(up, Exception):
                failed[sid] = up
                live.remove(sid)
            elif up.results is not None:
                results[sid] = up.results
                live.remove(sid)
    assert list(failed) == [1] and isinstance(failed[1], Internal) and "NaN" in str(failed[1])
    for sid, ids in zip((0, 2, 3), good):
        src = torch.tensor([ids])
        solo = beam_search(model, src, torch.ones_like(src), opts[sid])[0]
        _assert_same_hyps(results[sid], solo)
