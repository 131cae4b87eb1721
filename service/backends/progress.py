"""Load progress: one log line per model and load phase with its time, in one form whoever logs it (the server's
pre-bind file check, the runner's load and warm-up, the dtype decision, the ONNX graph cache), so that a start
can be followed and timed from the log: ``model 'qa': <phase> in 1.23 s[ (detail)]``."""

from __future__ import annotations

import logging

log = logging.getLogger("relserve.load")


def log_phase(model: str, phase: str, seconds: float, detail: str = "") -> None:
    """Log that ``model`` finished ``phase`` (plain words: "weights and tokenizer loaded") in ``seconds``."""
    log.info("model %r: %s in %.2f s%s", model, phase, seconds, f" ({detail})" if detail else "")
