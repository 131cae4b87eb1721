"""Each task end to end, one module per task: the request's one validation (``validate_*``, called once by
a frontend before any tokenizing), admission (places reserved in the model's scheduler), tokenization (in
the model's own threads), submission to the runner's scheduler, and post-processing into plain result
types (dataclasses) that every frontend encodes. Tokenizers are `relserve.models.tokenization`'s.

`classify`: validate_classify / validate_function; :func:`classify.classify` -> ``ClassifyItem`` per text.
`qa`: validate_answer / validate_for; :func:`qa.answer` / :func:`qa.answer_all` -> ``AnswerResult`` (windows
from ``Tokenizer.qa_windows``, answers from ``relserve.models.qa_spans``).
`translate`: validate_translate -> DecodeOptions; :func:`translate.translate` -> ``TranslationItem`` per text,
:func:`translate.translate_stream` -> ``StreamEvent``s.
`zero_shot`: validate_zero_shot; :func:`zero_shot.zero_shot` -> ``ZeroShotItem`` per text (NLI pairs).
`rerank`: validate_rerank; :func:`rerank.rerank` -> ``RerankItem`` per kept text ((query, text) pairs).
`timings`: the per-request ``Timings`` a result carries. `text`: what counts as blank.
`limits`: the per-request size limits every task shares (``max_request_texts``, ``max_request_chars``).

Task names (``TASK_CLASSIFICATION``, ``TASK_QA``, ``TASK_TRANSLATION``) live in
``relserve.service.backends.base``: the backends need them too, and backends never import tasks.
"""
