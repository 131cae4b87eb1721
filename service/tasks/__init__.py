"""Per task: the request's one validation (``validate_*``, called once by the servicer before any
tokenizing) and its pre- and post-processing (pure Python/numpy over the tokenizers of
`relserve.models.tokenization`).

`classify`: validate_classify; texts (and optional pairs) -> encodings; logits -> (label, score) list.
`qa`: validate_answer (windows come from ``Tokenizer.qa_windows``, answers from ``relserve.models.qa_spans``).
`translate`: validate_translate -> DecodeOptions; texts -> source ids (blank -> None); hypotheses ->
detokenized text, pieces and labelled alignments.
`text`: what counts as blank.
`limits`: the per-request size limits every task shares (``max_request_texts``, ``max_request_chars``).
"""
