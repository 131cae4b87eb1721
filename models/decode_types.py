"""How to decode one text, and one decoded hypothesis: the two plain types every layer shares.

:class:`DecodeOptions` goes from the API's validation (``relserve.service.tasks.translate``) through the
decode loop and the step backends into the search (:mod:`relserve.models.decoding`) unchanged;
:class:`Hypothesis` comes back the same way, and the server's post-processing only adds the detokenized
``text`` and ``pieces``. Standard library only (no torch): the scheduler and the API layer import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecodeOptions:
    """Per-text decoding knobs (beam search as in fairseq; greedy is ``beam_size = n_best = 1``).

    Output length (target tokens, the final EOS included), resolved by :meth:`max_length_for`:
    ``max_length`` when it is set (a request's explicit limit), else
    ``min(int(max_len_a * source_length + max_len_b), max_len_cap)``; always at least 1. ``max_len_cap`` is
    the model's ``max_output_tokens`` on the server and bounds an explicit ``max_length`` too.

    Raises (constructor):
        ValueError: ``beam_size`` < 1, ``n_best`` outside ``1..beam_size``, ``max_len_cap`` < 1, or
            ``max_length`` outside ``0..max_len_cap``. The server checks requests first and names the field
            (INVALID_ARGUMENT); this guards direct callers.
    """

    beam_size: int = 5
    n_best: int = 1
    length_penalty: float = 1.0  # alpha in log_prob / len(tokens) ** alpha; 0 = the raw sum
    max_len_a: float = 2.0
    max_len_b: int = 10
    max_len_cap: int = 256
    max_length: int = 0  # an explicit limit; 0 = the max_len_a / max_len_b formula
    return_alignment: bool = False

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"n_best must be in [1, beam_size={self.beam_size}], got {self.n_best}")
        if self.max_len_cap < 1:
            raise ValueError(f"max_len_cap must be >= 1, got {self.max_len_cap}")
        if not 0 <= self.max_length <= self.max_len_cap:
            raise ValueError(f"max_length must be in [0, max_len_cap={self.max_len_cap}], got {self.max_length}")

    def max_length_for(self, source_length: int) -> int:
        """Target tokens (EOS included) a source of ``source_length`` tokens (pieces + EOS) may produce."""
        if self.max_length:
            return self.max_length
        return max(1, min(int(self.max_len_a * source_length + self.max_len_b), self.max_len_cap))


@dataclass(frozen=True)
class Hypothesis:
    """One output of a search: ``tokens`` end with exactly one EOS iff ``finished``; ``truncated`` = stopped
    by the length limit without EOS (a search result is one or the other; the server's empty answer to a
    blank text is neither).

    ``alignment`` (when asked for) is Float[len(tokens), source_length]: row i is α_i, the attention over
    the real source tokens when ``tokens[i]`` was produced — a torch tensor from
    :mod:`relserve.models.decoding`, a numpy array once a server backend returns it.
    ``text`` and ``pieces`` (one target piece per entry of ``tokens``) are filled in by the server's
    post-processing (``relserve.service.tasks.translate``); the search leaves them empty.
    """

    tokens: list[int]
    log_prob: float  # sum of the token log-probabilities (EOS included when produced)
    score: float  # log_prob / len(tokens) ** length_penalty: the ranking key
    finished: bool
    truncated: bool
    alignment: Any = None
    text: str = ""
    pieces: tuple[str, ...] = ()

    @property
    def output_tokens(self) -> list[int]:
        """``tokens`` without the final EOS (what detokenization and the API's ``token_ids`` carry)."""
        return list(self.tokens[:-1]) if self.finished else list(self.tokens)

    @property
    def output_pieces(self) -> tuple[str, ...]:
        """``pieces`` without the final EOS piece (the API's ``tokens``)."""
        return self.pieces[:-1] if self.finished and self.pieces else self.pieces
