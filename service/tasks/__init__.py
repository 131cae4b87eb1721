"""Pre- and post-processing per task (pure Python/numpy over `relserve.models.tokenization.Tokenizer`).

`classify`: texts (and optional pairs) -> encodings; logits -> (label, score) list.
`qa`: question + context -> stride windows; start/end logits -> answer spans with character offsets.
"""
