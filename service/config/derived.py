"""Values derived from configuration keys rather than declared by them: the default ONNX cache directory and
the largest QA ``doc_stride`` a window of ``max_seq_len`` tokens allows. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ..errors import ConfigError


def default_onnx_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/relserve/onnx``, or ``$HOME/.cache/relserve/onnx`` when XDG_CACHE_HOME is unset or not
    an absolute path (the XDG Base Directory spec ignores relative values): the user's own cache, never a
    world-writable place such as /tmp, where another user could plant graphs.

    Raises:
        ConfigError: neither XDG_CACHE_HOME nor a home directory is known (set one, or onnx_cache_dir).
    """
    import os

    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or ""
    if os.path.isabs(base):
        return Path(base) / "relserve" / "onnx"
    try:
        home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    except (RuntimeError, KeyError) as exc:  # no HOME and no passwd entry (an arbitrary container uid)
        raise ConfigError("no onnx_cache_dir is set and neither XDG_CACHE_HOME nor a home directory is known; "
                          "set onnx_cache_dir or XDG_CACHE_HOME") from exc
    return home / ".cache" / "relserve" / "onnx"


def doc_stride_limit(max_seq_len: int) -> int:
    """The largest ``doc_stride`` a model with ``max_seq_len`` accepts: ``(max_seq_len - 4) // 2``."""
    return (max_seq_len - 4) // 2


def check_doc_stride(where: str, doc_stride: int, max_seq_len: int) -> None:
    """The default QA overlap must fit the shortest question: at most half the context room of a window with a
    one-token question, ``(max_seq_len - 4) // 2`` (longer questions lower it at request time, see
    ``Tokenizer.qa_windows(clamp_stride=True)``). Called by the validation for an explicit ``max_seq_len`` and by
    the runner once the model's is known.

    Raises:
        ConfigError: naming the model, doc_stride, the limit and how it is computed.
    """
    limit = doc_stride_limit(max_seq_len)
    if doc_stride > limit:
        raise ConfigError(
            f"{where}: doc_stride {doc_stride} is over the limit of {limit} tokens for max_seq_len {max_seq_len}: "
            f"the overlap between QA windows may be at most half a window's context room ((max_seq_len - 3 "
            f"special tokens - 1 question token) // 2)"
        )
