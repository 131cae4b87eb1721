"""Tokenizers for DeBERTa-style encoders (with character offsets) and for translation models.

:func:`load_tokenizer` reads a DeBERTa tokenizer directory: ``tokenizer.json`` (the Hugging Face ``tokenizers``
pipeline as written), ``spm.model`` + ``tokenizer_config.json`` (``spm_normalization``: the model's own
normaliser, the default, or transformers 5's pipeline), or DeBERTa v1's byte-level BPE ``vocab.json`` +
``merges.txt``. Every serialisation gives the DeBERTa template ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]``
with token type ids 0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``. :class:`TranslationTokenizer` wraps a
translation checkpoint's ``source.spm`` / ``target.spm``.

Units: all lengths are in tokens including special tokens unless said otherwise; all offsets are Python
``str`` indices (code points), end exclusive.

One module per concern, in import order (each imports only those above it):

* ``text``: ``Offset``, Unicode whitespace, the one definition of blank text (``is_blank``);
* ``prefix``: the backend interface and bounded tokenization (``leading_tokens``, cut patterns);
* ``spm_normalize``: transformers 5's DeBERTa-v2 normaliser with alignment, the punctuation split;
* ``backends``: ``tokenizers`` and ``sentencepiece`` backends;
* ``qa_windows``: QA windows with character offsets, ``doc_stride`` and window-count limits;
* ``tokenizer``: ``Tokenizer`` (template, longest-first truncation, ``qa_windows``);
* ``loading``: ``load_tokenizer``;
* ``translation``: ``TranslationTokenizer``.

The training recipes that write such tokenizers are in :mod:`relserve.models.training.tokenizer`.
"""

from .loading import SPM_NORMALIZATIONS, load_tokenizer
from .prefix import SPACE_CUT, WORD_CUT, Leading, leading_tokens, safe_cut
from .qa_windows import DocStrideTooLarge, QAWindow, TooManyWindows, qa_window_count
from .text import INVISIBLE, Offset, is_blank, is_blank_char
from .tokenizer import Encoding, Tokenizer
from .translation import SOURCE_SPM, SPECIAL_IDS, TARGET_SPM, TokenizerError, TranslationTokenizer

__all__ = [
    "DocStrideTooLarge", "Encoding", "INVISIBLE", "Leading", "Offset", "QAWindow", "SOURCE_SPM", "SPACE_CUT",
    "SPECIAL_IDS", "SPM_NORMALIZATIONS", "TARGET_SPM", "TokenizerError", "TooManyWindows", "Tokenizer",
    "TranslationTokenizer", "WORD_CUT", "is_blank", "is_blank_char", "leading_tokens", "load_tokenizer",
    "qa_window_count", "safe_cut",
]
