"""Greedy and beam search over the RNNsearch step API, as plain data for iteration-level batching.

A decode step is schedule -> execute -> update:

    batch = build_step(beams, encoder)              # plan: which source row / token / state per hypothesis
    log_probs, new_hidden, alignment = model.decode_step(batch.encoder, batch.source_index,
                                                         batch.prev_tokens, batch.prev_hidden)
    retired = apply_step(batch, log_probs, new_hidden, alignment)  # per-request top-k; finished get .results

``step(model, beams)`` does the three. A server loop keeps a list of live ``BeamState`` (one per request),
appends new ones (``start_beams`` after ``model.encode``) and drops those with ``.done`` between steps
(``relserve.service.backends.translation_steps`` does this for the server). ``apply_step`` never touches
the model, so schedulers can be tested with fake log-probs. Options and results are the plain types of
:mod:`relserve.models.decode_types`.

Rules (the same for every request, whatever else is in the batch):

* Batch invariance: each request's candidates are selected from its own rows only; ties are broken by
  (hypothesis index, token id), lowest first, so a request decodes the same alone or with others.
* ``log_prob`` is the sum of token log-probabilities; ranking uses ``score = log_prob / len(tokens) **
  length_penalty`` (alpha, default 1.0 = per-token average; 0 = raw sum). ``len(tokens)`` counts the EOS.
* Output length limit: ``DecodeOptions.max_length_for(src_len)`` target tokens, EOS included (the request's
  explicit ``max_length``, else ``min(int(max_len_a * src_len + max_len_b), max_len_cap)``, at least 1);
  ``src_len`` = real source tokens.
* A hypothesis that selects EOS is finished: its ``tokens`` end with exactly one EOS and it never grows.
  ``pad_token_id`` and ``bos_token_id`` are never generated.
* Beam: each step takes the 2k best continuations; EOS ones ranked within the first k are finished, the
  best k non-EOS ones stay live (fairseq's rule). A request is done once it has k finished hypotheses,
  or when it reaches its length limit (its live hypotheses then become ``truncated``). Results: the best
  ``n_best`` finished ones; if fewer than ``n_best`` finished, truncated ones fill the list; the list is
  sorted by ``score`` and is never empty.
* Greedy is beam search with ``beam_size = n_best = 1``.

The model must be in eval mode (dropout off). Batch invariance is exact in the selection logic; the
step's arithmetic is row-independent but a BLAS may round a row differently for another batch shape, so
scores agree to ~1e-6 and only a near-exact tie could be resolved differently (not seen on CPU tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .decode_types import DecodeOptions, Hypothesis
from .rnnsearch import EncoderState, RNNSearch

__all__ = ["DecodeOptions", "Hypothesis", "BeamState", "StepBatch", "start_beams", "new_beam", "build_step",
           "apply_step", "step", "beam_search", "greedy_search"]


@dataclass
class BeamState:
    """Live decoding state of one request (k = live hypotheses, t = tokens generated so far)."""

    request_id: Any
    encoder: EncoderState  # this request's source only (one row, unpadded)
    options: DecodeOptions
    max_length: int
    eos_token_id: int
    banned_token_ids: tuple[int, ...]
    tokens: list[list[int]]  # k lists of the t token ids generated so far by the live hypotheses
    last_tokens: Tensor  # Long[k] y_{i-1} (bos at the start) (model device)
    scores: Tensor  # Float[k] summed log-probs (model device)
    hidden: Tensor  # Float[k,n] s_{i-1}
    alignment: Tensor | None  # Float[k,t,src_len] when options.return_alignment
    finished: list[Hypothesis] = field(default_factory=list)
    results: list[Hypothesis] | None = None  # set when done, sorted best first
    steps: int = 0

    @property
    def done(self) -> bool:
        return self.results is not None

    @property
    def num_live(self) -> int:
        return 0 if self.done else len(self.tokens)

    @property
    def source_length(self) -> int:
        return self.encoder.mask.shape[1]


def start_beams(
    model: RNNSearch, state: EncoderState, options: DecodeOptions | list[DecodeOptions], request_ids: list | None = None
) -> list[BeamState]:
    """One ``BeamState`` per source row of ``state`` (from ``model.encode``)."""
    cfg = model.config
    rows = state.split()
    opts = options if isinstance(options, list) else [options] * len(rows)
    ids = request_ids if request_ids is not None else list(range(len(rows)))
    if not len(opts) == len(ids) == len(rows):
        raise ValueError(f"{len(rows)} sources, {len(opts)} options, {len(ids)} request ids")
    banned = tuple(sorted({cfg.pad_token_id, cfg.bos_token_id} - {cfg.eos_token_id}))
    return [new_beam(rid, row, opt, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, banned_token_ids=banned)
            for rid, row, opt in zip(ids, rows, opts)]


def new_beam(
    request_id: Any,
    encoder: EncoderState,
    options: DecodeOptions,
    *,
    bos_token_id: int,
    eos_token_id: int,
    banned_token_ids: tuple[int, ...] = (),
) -> BeamState:
    """The start of one request's search: a single live hypothesis at y_0 = bos, s_0 = encoder.init_state."""
    if encoder.num_sources != 1:
        raise ValueError("new_beam takes a single-source EncoderState (see EncoderState.split)")
    src_len = int(encoder.mask.shape[1])
    device = encoder.init_state.device
    return BeamState(
        request_id=request_id,
        encoder=encoder,
        options=options,
        max_length=options.max_length_for(src_len),
        eos_token_id=eos_token_id,
        banned_token_ids=tuple(banned_token_ids),
        tokens=[[]],
        last_tokens=torch.full((1,), bos_token_id, dtype=torch.long, device=device),
        scores=torch.zeros(1, dtype=torch.float32, device=device),
        hidden=encoder.init_state,
        alignment=encoder.annotations.new_zeros(1, 0, src_len) if options.return_alignment else None,
    )


@dataclass
class StepBatch:
    """Plan of one decoder step over live requests: hypotheses of beam r are rows ``spans[r]``."""

    beams: list[BeamState]
    encoder: EncoderState  # Float[R,S_max,...]: the live requests' sources stacked
    source_index: Tensor  # Long[N] row of ``encoder`` each hypothesis reads
    prev_tokens: Tensor  # Long[N]
    prev_hidden: Tensor  # Float[N,n]
    spans: list[tuple[int, int]]

    @property
    def num_hypotheses(self) -> int:
        return int(self.source_index.shape[0])


def build_step(beams: list[BeamState], encoder: EncoderState | None = None) -> StepBatch:
    """Plan one step for the live (not done) beams. ``encoder``: a cached ``EncoderState.cat`` of exactly
    these beams' encoders (rebuild it when the set of live requests changes); stacked here when omitted."""
    beams = [b for b in beams if not b.done]
    if not beams:
        raise ValueError("build_step: no live beams")
    if encoder is None:
        encoder = EncoderState.cat([b.encoder for b in beams])
    elif encoder.num_sources != len(beams):
        raise ValueError(f"encoder has {encoder.num_sources} rows for {len(beams)} live beams")
    counts = [b.num_live for b in beams]
    spans, start = [], 0
    for k in counts:
        spans.append((start, start + k))
        start += k
    device = encoder.annotations.device
    return StepBatch(
        beams=beams,
        encoder=encoder,
        source_index=torch.repeat_interleave(torch.arange(len(beams)), torch.tensor(counts)).to(device),
        prev_tokens=torch.cat([b.last_tokens for b in beams]),
        prev_hidden=torch.cat([b.hidden for b in beams]),
        spans=spans,
    )


def _normalize(score: float, length: int, alpha: float) -> float:
    return score / (max(length, 1) ** alpha) if alpha else score


def _select_candidates(candidates: Tensor, count: int) -> tuple[list[int], list[float]]:
    """The ``count`` best finite entries of Float[k,V] as flat indices (best first; ties: lowest index)."""
    flat = candidates.reshape(-1)
    count = min(count, flat.numel())
    threshold = torch.topk(flat, count).values[-1]
    if torch.isinf(threshold) and threshold < 0:
        keep = torch.nonzero(torch.isfinite(flat)).squeeze(1)
    else:
        keep = torch.nonzero(flat >= threshold).squeeze(1)  # ascending index; includes every tie
    values = flat[keep]
    order = torch.sort(values, descending=True, stable=True).indices[:count]
    return keep[order].tolist(), values[order].tolist()


def _select_all(candidates: Tensor, spans: list[tuple[int, int]], counts: list[int]) -> list[tuple[list[int], list[float]]]:
    """:func:`_select_candidates` for every beam at once: ``candidates`` Float[N,V] (beam r owns rows
    ``spans[r]``), ``counts[r]`` entries wanted from beam r -> per beam (flat indices into its own rows, values).

    One padded top-k over all beams, re-sorted by (value desc, index asc); a beam whose selection boundary
    falls inside a run of equal values (more entries tie with its last pick than it may take) is redone
    exactly by :func:`_select_candidates`, so the result is identical to selecting beam by beam."""
    N, V = candidates.shape
    R, K = len(spans), max(hi - lo for lo, hi in spans)
    pad_row = N  # an all -inf row for beams with fewer than K live hypotheses
    if N == R * K and all(span == (r * K, (r + 1) * K) for r, span in enumerate(spans)):
        flat = candidates.reshape(R, K * V)  # every beam has K rows, in order: a view, no copy
    else:
        rows: list[int] = []
        for lo, hi in spans:
            rows.extend(range(lo, hi))
            rows.extend([pad_row] * (K - (hi - lo)))
        padded = torch.cat([candidates, candidates.new_full((1, V), float("-inf"))])
        flat = padded.index_select(0, torch.tensor(rows, dtype=torch.long, device=candidates.device)).reshape(R, K * V)
    take = min(max(counts) + 1, K * V)  # one beyond the largest count: shows a tie across the boundary
    values, index = torch.topk(flat, take, dim=1)
    index, order = torch.sort(index, dim=1)
    values = values.gather(1, order)
    values, order = torch.sort(values, dim=1, descending=True, stable=True)
    index = index.gather(1, order)
    values_l, index_l = values.tolist(), index.tolist()
    out = []
    for r, count in enumerate(counts):
        vals, idx = values_l[r], index_l[r]
        threshold = vals[count - 1]
        if threshold == float("-inf"):  # fewer finite entries than wanted: all of them, as one by one
            n = next((i for i, v in enumerate(vals) if v == float("-inf")), len(vals))
            out.append((idx[:n], vals[:n]))
        elif count < len(vals) and vals[count] == threshold:
            lo, hi = spans[r]
            out.append(_select_candidates(candidates[lo:hi], count))
        else:
            out.append((idx[:count], vals[:count]))
    return out


def _finish(beam: BeamState, truncated: list[Hypothesis]) -> None:
    n_best, key = beam.options.n_best, (lambda h: -h.score)
    results = sorted(beam.finished, key=key)[:n_best]  # sorted() is stable: earlier-finished wins ties
    if len(results) < n_best:
        results = sorted(results + sorted(truncated, key=key)[: n_best - len(results)], key=key)
    beam.results = results
    beam.hidden = beam.hidden[:0]
    beam.tokens = []


def apply_step(
    batch: StepBatch, log_probs: Tensor, new_hidden: Tensor, alignment: Tensor | None = None
) -> list[BeamState]:
    """Update each beam of ``batch`` from its own rows of the step outputs (``log_probs`` Float[N,V],
    ``new_hidden`` Float[N,n], ``alignment`` Float[N,S_max]); returns the beams that finished in this step
    (their ``results`` are set). Rows of other requests are never read: this is what makes decoding
    batch invariant.

    The tensor work is batched over all beams (one banned-token mask, one top-k, one gather of the surviving
    hidden states); only the choice among each beam's 2k candidates is a Python loop. Results are identical
    to updating each beam alone (:func:`_select_all`). ``batch.spans`` may leave rows of the outputs out (the
    server drops the beams whose rows are NaN and updates the others from the same outputs)."""
    beams, spans = batch.beams, batch.spans
    if not beams:
        return []
    vocab = log_probs.shape[1]
    # the beams' rows, packed: a batch may leave rows out (a caller drops the beams whose rows went NaN)
    packed, start = [], 0
    for lo, hi in spans:
        packed.append((start, start + hi - lo))
        start += hi - lo
    if packed == spans and start == log_probs.shape[0]:
        rows_lp = log_probs
    else:
        rows = torch.tensor([i for lo, hi in spans for i in range(lo, hi)], dtype=torch.long, device=log_probs.device)
        rows_lp = log_probs.index_select(0, rows)
    scores = torch.cat([b.scores for b in beams]).float()
    candidates = scores.unsqueeze(1) + rows_lp.float()  # Float[packed rows,V]
    for ids in {b.banned_token_ids for b in beams} - {()}:  # -inf either way: masked after the sum
        cols = torch.tensor(list(ids), dtype=torch.long, device=candidates.device)
        hit = [i for b, (lo, hi) in zip(beams, packed) if b.banned_token_ids == ids for i in range(lo, hi)]
        if len(hit) == candidates.shape[0]:
            candidates[:, cols] = float("-inf")
        else:
            candidates[torch.tensor(hit, device=candidates.device)[:, None], cols] = float("-inf")
    counts = [min(2 * b.options.beam_size, (hi - lo) * vocab) for b, (lo, hi) in zip(beams, spans)]
    picks = _select_all(candidates, packed, counts)

    keep_rows: list[int] = []  # rows of the step outputs that stay live, beam after beam
    keep_tokens: list[int] = []
    keep_scores: list[float] = []
    kept: list[int] = []  # live hypotheses kept per beam
    retired = []
    for beam, (lo, hi), (flat_index, values) in zip(beams, spans, picks):
        opts, eos, k = beam.options, beam.eos_token_id, beam.options.beam_size
        length = len(beam.tokens[0]) + 1
        step_alignment = None if alignment is None or beam.alignment is None else alignment[lo:hi, : beam.source_length]
        live_rows, live_tokens, live_scores = [], [], []
        for rank, (idx, score) in enumerate(zip(flat_index, values)):
            row, token = divmod(idx, vocab)
            if token == eos:
                if rank < k:
                    align = None
                    if step_alignment is not None:
                        align = torch.cat([beam.alignment[row], step_alignment[row : row + 1]]).cpu()
                    beam.finished.append(Hypothesis(
                        tokens=beam.tokens[row] + [eos], log_prob=score,
                        score=_normalize(score, length, opts.length_penalty),
                        finished=True, truncated=False, alignment=align))
            elif len(live_rows) < k:
                live_rows.append(row)
                live_tokens.append(token)
                live_scores.append(score)
        beam.steps += 1
        if live_rows:
            if step_alignment is not None:
                rows_dev = torch.tensor(live_rows, dtype=torch.long, device=step_alignment.device)
                beam.alignment = torch.cat(
                    [beam.alignment.index_select(0, rows_dev), step_alignment.index_select(0, rows_dev)[:, None]], dim=1)
            beam.tokens = [beam.tokens[row] + [token] for row, token in zip(live_rows, live_tokens)]
            keep_rows.extend(lo + row for row in live_rows)
            keep_tokens.extend(live_tokens)
            keep_scores.extend(live_scores)
        kept.append(len(live_rows))
        if len(beam.finished) >= k or not live_rows:
            _finish(beam, [])
        elif length >= beam.max_length:
            truncated = [
                Hypothesis(tokens=list(beam.tokens[i]), log_prob=s, score=_normalize(s, length, opts.length_penalty),
                           finished=False, truncated=True,
                           alignment=None if beam.alignment is None else beam.alignment[i].cpu())
                for i, s in enumerate(live_scores)
            ]
            _finish(beam, truncated)
        if beam.done:
            retired.append(beam)

    if keep_rows:  # one gather for every beam's surviving states, then per-beam views
        device = batch.prev_tokens.device
        hidden = new_hidden.index_select(0, torch.tensor(keep_rows, dtype=torch.long, device=new_hidden.device))
        last = torch.tensor(keep_tokens, dtype=torch.long, device=device)
        new_scores = torch.tensor(keep_scores, dtype=torch.float32, device=device)
        for beam, h, y, s in zip(beams, hidden.split(kept), last.split(kept), new_scores.split(kept)):
            if not beam.done:
                beam.hidden, beam.last_tokens, beam.scores = h, y, s
    return retired


def step(model: RNNSearch, beams: list[BeamState], encoder: EncoderState | None = None) -> list[BeamState]:
    """One schedule -> execute -> update step over the live beams; returns the beams retired by it."""
    batch = build_step(beams, encoder)
    log_probs, new_hidden, alignment = model.decode_step(
        batch.encoder, batch.source_index, batch.prev_tokens, batch.prev_hidden
    )
    return apply_step(batch, log_probs, new_hidden, alignment)


@torch.inference_mode()
def beam_search(
    model: RNNSearch, src_ids: Tensor, src_mask: Tensor, options: DecodeOptions | None = None
) -> list[list[Hypothesis]]:
    """Decode a batch of sources to completion; per source, its ``n_best`` hypotheses (best first)."""
    options = options or DecodeOptions()
    beams = start_beams(model, model.encode(src_ids, src_mask), options)
    live = list(beams)
    encoder = None
    while live:
        if encoder is None:
            encoder = EncoderState.cat([b.encoder for b in live])
        retired = step(model, live, encoder)
        if retired:
            live = [b for b in live if not b.done]
            encoder = None  # membership changed: restack
    return [b.results for b in beams]


def greedy_search(
    model: RNNSearch, src_ids: Tensor, src_mask: Tensor, options: DecodeOptions | None = None
) -> list[Hypothesis]:
    """Greedy decoding (beam search with beam_size = n_best = 1); one hypothesis per source."""
    opts = dataclasses.replace(options or DecodeOptions(), beam_size=1, n_best=1)
    return [hyps[0] for hyps in beam_search(model, src_ids, src_mask, opts)]
