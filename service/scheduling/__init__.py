"""Scheduling: what runs when, on which cores (no torch, no numpy).

* :mod:`.base` — the scheduler base: queue, deadlines, cancellation, admission, pushback, the worker task and
  the backend call;
* :mod:`.batcher` — its encoder policy (dynamic batches of sequences);
* :mod:`.decode_loop` — its translation policy (iteration-level decoding);
* :mod:`.cores` — how the models of one process share its cores (the compute slot, thread shares and the
  :class:`relserve.service.backends.base.CallBudget` every backend call is given);
* :mod:`.cost_model` — what a backend call costs, and how a formed batch is cut into the calls that cost least;
* :mod:`.pushback` — retry guidance for queue-full refusals.

Imports go one way: frontends and tasks -> scheduling -> backends (their contracts) -> models.
"""
