"""``load_tokenizer(dir)``: a DeBERTa tokenizer directory -> :class:`.tokenizer.Tokenizer` on the right backend.

``tokenizer.json`` is preferred (its normaliser, pre-tokenizer and model are used as they are; [CLS]/[SEP] ids
come from its TemplateProcessing post-processor, falling back to the vocabulary); else ``spm.model`` +
``tokenizer_config.json`` (normalised as ``spm_normalization`` says, logged at load); else DeBERTa v1's
``vocab.json`` + ``merges.txt``, built into the same ``tokenizers`` pipeline as transformers 5
``DebertaTokenizer`` builds. The backends are :mod:`.backends`. Special token strings,
``do_lower_case``, ``split_by_punct`` and ``model_max_length`` come from ``tokenizer_config.json`` /
``special_tokens_map.json``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

from .backends import _read_json, _SentencePieceBackend, _SpmNativeBackend, _TokenizersBackend
from .tokenizer import Tokenizer

# tokenizer configs without a real limit carry placeholders such as int(1e30)
_MAX_LENGTH_PLACEHOLDER = 1_000_000


def _token_str(v, default: str) -> str:
    if v is None:
        return default
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content", default)
    return str(v)


def _max_length(cfg: dict) -> int | None:
    v = cfg.get("model_max_length")
    if v is None:
        return None
    v = int(v)
    return None if v >= _MAX_LENGTH_PLACEHOLDER or v <= 0 else v


SPM_NORMALIZATIONS = ("spm", "transformers5")  # load_tokenizer(spm_normalization=...), the model key of that name


def _log_spm_normalization(path: str, mode: str, normalizer: str, lower: bool, punct: bool) -> None:
    """One INFO line at load: which normalisation an ``spm.model`` tokenizer applies, and why."""
    name = normalizer or "(unnamed)"
    if mode == "spm":
        what = (f"the model's own normaliser {name!r}, as sentencepiece and transformers 4 apply it "
                f"(spm_normalization: spm, the default)")
    else:
        what = (f"transformers 5's pipeline (whitespace runs -> ' ', NFC, strip right) instead of the model's own "
                f"normaliser {name!r}, because spm_normalization is transformers5")
    logging.getLogger(__package__).info("%s: tokenizing with %s; do_lower_case=%s split_by_punct=%s",
                                     path, what, lower, punct)


BPE_VOCAB, BPE_MERGES = "vocab.json", "merges.txt"


def _byte_level_bpe_backend(vocab_path: str, merges_path: str, cfg: dict,
                            specials: Sequence[str]) -> tuple["_TokenizersBackend", dict]:
    """DeBERTa v1's GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, built as transformers 5
    ``DebertaTokenizer`` builds it (``tokenization_deberta.py``): BPE without subword prefix or unknown token,
    no normaliser, ``ByteLevel(add_prefix_space)`` pre-tokenizer (``add_prefix_space`` from
    tokenizer_config.json, default false), ByteLevel decoder, the special tokens as added special tokens.
    Returns the backend and its serialised spec (for the cut pattern)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    try:
        bpe = models.BPE.from_file(vocab_path, merges_path, dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    except Exception as e:  # the Rust side reports unreadable / malformed files as plain exceptions
        raise ValueError(f"{vocab_path} / {merges_path}: cannot read the BPE vocabulary: {e}") from e
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(cfg.get("add_prefix_space", False)))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(specials)])
    spec = json.loads(tok.to_str())
    return _TokenizersBackend(vocab_path, spec, tok=tok), spec


def load_tokenizer(directory: str | os.PathLike, spm_normalization: str = "spm", log_choice: bool = True) -> Tokenizer:
    """Load ``tokenizer.json`` (preferred), ``spm.model`` or ``vocab.json`` + ``merges.txt`` (DeBERTa v1's
    byte-level BPE, :func:`_byte_level_bpe_backend`) from a checkpoint/tokenizer directory.

    ``tokenizer_config.json`` (optional with tokenizer.json) supplies special token strings,
    ``do_lower_case`` and ``split_by_punct`` (spm only) and ``model_max_length`` (None when absent or a
    placeholder >= 1e6). Raises FileNotFoundError when neither file is present.

    ``spm_normalization`` (one of ``SPM_NORMALIZATIONS``; only for an ``spm.model`` without
    ``tokenizer.json``): ``"spm"`` applies the model's own normaliser as sentencepiece and transformers 4
    do (:class:`_SpmNativeBackend`; what hub fine-tunes of deberta-v3 / mdeberta were trained with);
    ``"transformers5"`` reproduces transformers 5, which drops it (:class:`_SentencePieceBackend`). The
    choice and its reason are logged at INFO (unless ``log_choice`` is false: a second load of the same
    directory, e.g. the server's copy of a worker process's tokenizer). Raises ValueError for another value.
    """
    if spm_normalization not in SPM_NORMALIZATIONS:
        raise ValueError(f"spm_normalization {spm_normalization!r}: expected one of {list(SPM_NORMALIZATIONS)}")
    directory = os.fspath(directory)
    cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    smap = _read_json(os.path.join(directory, "special_tokens_map.json"))

    def tok_name(key: str, default: str) -> str:
        return _token_str(cfg.get(key, smap.get(key)), default)

    names = {k: tok_name(f"{k}_token", f"[{k.upper()}]") for k in ("cls", "sep", "pad", "unk", "mask")}
    json_path = os.path.join(directory, "tokenizer.json")
    spm_path = os.path.join(directory, "spm.model")
    vocab_path, merges_path = os.path.join(directory, BPE_VOCAB), os.path.join(directory, BPE_MERGES)
    bpe = (not os.path.isfile(json_path) and not os.path.isfile(spm_path)
           and os.path.isfile(vocab_path) and os.path.isfile(merges_path))
    if os.path.isfile(json_path) or bpe:
        if bpe:
            backend, spec = _byte_level_bpe_backend(vocab_path, merges_path, cfg, list(names.values()))
        else:
            spec = _read_json(json_path)
            backend = _TokenizersBackend(json_path, spec)
        tok = backend.tok
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        ids = {k: tok.token_to_id(v) for k, v in names.items()}
        post = spec.get("post_processor") or {}
        if post.get("type") == "TemplateProcessing":
            st = post.get("special_tokens", {})
            for k in ("cls", "sep"):
                if names[k] in st and st[names[k]].get("ids"):
                    ids[k] = st[names[k]]["ids"][0]
        source = vocab_path if bpe else json_path
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        special_ids = frozenset(tok.token_to_id(s) for s in specials if tok.token_to_id(s) is not None)
    elif os.path.isfile(spm_path):
        lower, punct = bool(cfg.get("do_lower_case", False)), bool(cfg.get("split_by_punct", False))
        spm_backend = _SpmNativeBackend if spm_normalization == "spm" else _SentencePieceBackend
        backend = spm_backend(spm_path, lower, punct)
        if log_choice:
            _log_spm_normalization(spm_path, spm_normalization, backend.model_normalizer, lower, punct)
        sp = backend.sp
        vocab_size = sp.get_piece_size()

        def piece_id(piece: str) -> int | None:
            i = sp.piece_to_id(piece)
            return None if i == sp.unk_id() and piece != sp.id_to_piece(sp.unk_id()) else i

        ids = {k: piece_id(v) for k, v in names.items()}
        source = spm_path
        special_ids = frozenset(i for i in range(vocab_size) if sp.is_control(i) or sp.is_unknown(i))
    else:
        raise FileNotFoundError(f"{directory}: neither tokenizer.json nor spm.model found (nor DeBERTa v1's "
                                f"vocab.json + merges.txt)")
    for k in ("cls", "sep"):
        if ids[k] is None:
            raise ValueError(f"{source}: special token {names[k]!r} ({k}_token) is not in the vocabulary")
    return Tokenizer(
        backend=backend,
        cls_token_id=ids["cls"],
        sep_token_id=ids["sep"],
        pad_token_id=ids["pad"] if ids["pad"] is not None else 0,
        unk_token_id=ids["unk"],
        model_max_length=_max_length(cfg),
        source=source,
        vocab_size=vocab_size,
        special_token_ids=special_ids,
        cls_token=names["cls"],
        sep_token=names["sep"],
    )
