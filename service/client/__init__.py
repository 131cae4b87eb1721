"""``relserve.client``: a thin blocking client for the relserve.v1 Inference API.

Importing it loads grpcio, protobuf and the generated relserve.v1 and KServe v2 stubs only (no torch, numpy or tokenizer
libraries; tests/serving/test_client.py checks it in a fresh interpreter), so applications that only call
the server need not install what the server runs on. Modelled on the Triton and TEI Python clients: one
object per server holding one channel, one method per RPC, keyword options named as the request fields.

Example::

    from relserve.client import Client, ClientError

    with Client("127.0.0.1:50051", timeout=10) as client:
        reply = client.classify("sentiment", ["A gripping, beautifully shot film."])
        print(reply.results[0].labels[0].label)

Replies are the RPC's protobuf reply messages (``ClassifyResponse``, ``AnswerResponse``,
``TranslateResponse``, ``TranslateStreamResponse``, ``ListModelsResponse``; fields as documented in
proto/relserve/v1/inference.proto; the model repository calls' are KServe v2's, proto/kserve/v2), not
copies: the schema lives in one place. Every failure raises :class:`ClientError` carrying a gRPC status code
and a message: the server's, or, for what is refused before anything is sent (an argument of the wrong type or
out of its field's range, a closed client), a :class:`ClientUsageError` naming the parameter.

The command line over this client (``relserve call ...`` / ``python -m relserve.client ...``) is in
:mod:`relserve.client.cli`.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import grpc
from google.protobuf.descriptor import FieldDescriptor

from relserve.service._proto import grpc_predict_v2_pb2 as v2
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc
from relserve.service.auth import resolve_token  # the server's token rules (grpc and the stdlib only)

__all__ = ["Client", "ClientError", "ClientUsageError", "pb"]

Pem = bytes | str | os.PathLike
# The method relserve's server checks (service/auth.py): gRPC metadata ``authorization: Bearer <token>``.
_AUTH_KEY = "authorization"
# grpc turns a timeout into an int64 count of nanoseconds from now: past about 9.2e9 s it wraps and the call
# fails at once with DEADLINE_EXCEEDED, so a larger (or infinite) timeout is refused up front.
MAX_TIMEOUT_S = 1e9


class ClientError(Exception):
    """A call that ended with a non-OK gRPC status (raised from the ``grpc.RpcError``, kept as ``__cause__``).

    Attributes:
        code: the :class:`grpc.StatusCode`, e.g. ``INVALID_ARGUMENT`` (bad input; the message names the field
            or limit), ``NOT_FOUND`` (unknown model), ``FAILED_PRECONDITION`` (wrong task for the model),
            ``RESOURCE_EXHAUSTED`` (queue full), ``DEADLINE_EXCEEDED``, ``UNAVAILABLE`` (not ready, draining,
            or not reachable), ``UNAUTHENTICATED`` (token missing or wrong).
        details: the status message.
        trailing_metadata: the call's trailers as ``(key, value)`` pairs (e.g. ``retry-after-ms`` with a
            queue-full refusal).
    """

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata)

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "ClientError":
        """The :class:`ClientError` for a failed call (``UNKNOWN`` when grpc gives no status)."""
        code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else None
        trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(err), tuple(trailers or ()))


class ClientUsageError(ClientError, ValueError):
    """Refused by the client before anything was sent: an argument of the wrong type or out of its protobuf
    field's range (``top_k=-1`` for a uint32), an unreadable certificate or token file, a bad target or
    timeout (``code`` INVALID_ARGUMENT), or a call on a closed client (FAILED_PRECONDITION).

    ``details`` names the parameter (and the item, for a list); ``str()`` is that message alone. A
    ``ValueError`` too, as these failures were before they became :class:`ClientError`; ``__cause__`` is
    the protobuf or grpc exception it replaces, if any.
    """

    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(code, details)
        self.args = (details,)

    def __str__(self) -> str:
        return self.details


# What a request field accepts, for the messages of refused arguments (protobuf's own name only the value).
_FIELD_KINDS = {
    FieldDescriptor.TYPE_UINT32: "an int in 0..4294967295",
    FieldDescriptor.TYPE_INT32: "an int in -2147483648..2147483647",
    FieldDescriptor.TYPE_UINT64: "an int in 0..18446744073709551615",
    FieldDescriptor.TYPE_INT64: "an int in -9223372036854775808..9223372036854775807",
    FieldDescriptor.TYPE_FLOAT: "a number",
    FieldDescriptor.TYPE_DOUBLE: "a number",
    FieldDescriptor.TYPE_BOOL: "a bool",
    FieldDescriptor.TYPE_STRING: "a str (UTF-8 encodable)",
}


def _show(value: Any) -> str:
    """A short repr for a message (a long list or text is cut)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _request(cls, **fields: Any):
    """``cls(**fields)`` with None fields left unset (the server's default).

    Raises:
        ClientUsageError: a value protobuf refuses (wrong type, a negative or too large int for the field),
            naming the field and, in a list, the item; protobuf's own TypeError / ValueError names neither.
    """
    request = cls()
    for name, value in fields.items():
        if value is None:
            continue
        try:
            if cls.DESCRIPTOR.fields_by_name[name].is_repeated:
                getattr(request, name).extend(value)
            else:
                setattr(request, name, value)
        except (TypeError, ValueError) as exc:
            raise ClientUsageError(_field_problem(cls, name, value, exc)) from exc
    return request


def _field_problem(cls, name: str, value: Any, exc: Exception) -> str:
    """Why ``value`` does not fit field ``name`` of ``cls``, naming the first bad item of a list."""
    field = cls.DESCRIPTOR.fields_by_name[name]
    want = _FIELD_KINDS.get(field.type, "a value of the field's type")
    if field.is_repeated:
        for i, item in enumerate(value):
            try:
                getattr(cls(), name).append(item)
            except (TypeError, ValueError) as item_exc:
                return f"{name}[{i}] must be {want}, got {_show(item)} ({item_exc})"
    return f"{name} must be {want}, got {_show(value)} ({exc})"


def _seconds(value: Any, name: str) -> float | None:
    """A timeout in seconds as grpc takes it (None: no deadline; zero or negative: already expired).

    Raises:
        ClientUsageError: not a number, NaN, or over :data:`MAX_TIMEOUT_S` (infinity included).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ClientUsageError(f"{name} must be a number of seconds or None, got {_show(value)}")
    if math.isnan(value) or value > MAX_TIMEOUT_S:
        raise ClientUsageError(f"{name} must be at most {MAX_TIMEOUT_S:g} seconds (None: no deadline), "
                               f"got {_show(value)}")
    return float(value)


def _pem(value: Pem | None, name: str) -> bytes | None:
    """PEM bytes as given, or read from a path.

    Raises:
        ClientUsageError: neither bytes nor a path, a file that cannot be read, or data that is not PEM
            (grpc would only fail each call UNAVAILABLE, logging TSI errors on stderr).
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, (str, os.PathLike)):
        try:
            data = Path(value).read_bytes()
        except OSError as exc:
            raise ClientUsageError(f"{name}: cannot read {str(value)!r}: {exc.strerror or exc}") from None
    else:
        raise ClientUsageError(f"{name} must be PEM bytes or a path, got {type(value).__name__}")
    if b"-----BEGIN " not in data:
        raise ClientUsageError(f"{name} is not PEM (no '-----BEGIN ' line)"
                               + (f": {str(value)!r}" if not isinstance(value, bytes) else ""))
    return data


def _texts(value: str | Sequence[str], name: str) -> list[str]:
    """A list of texts; a lone string is one text (not a sequence of characters).

    Raises:
        ClientUsageError: bytes, None or something that is not a sequence.
    """
    if isinstance(value, str):
        return [value]
    if value is None or isinstance(value, (bytes, bytearray)):
        raise ClientUsageError(f"{name} must be a str or a sequence of str, got {type(value).__name__}")
    try:
        return list(value)
    except TypeError:
        raise ClientUsageError(f"{name} must be a str or a sequence of str, got {type(value).__name__}") from None


class Client:
    """A connection to one relserve server (one gRPC channel; thread-safe, reuse it).

    Args:
        target: ``host:port`` (any gRPC target, e.g. ``dns:///relserve:50051``).
        tls: use TLS. Implied when ``root_certificates`` or ``client_cert`` is given.
        root_certificates: PEM bytes or a path of the CA that signed the server's certificate; None means the
            system's trust store.
        client_cert, client_key: PEM bytes or paths of the client certificate and its key, for servers with
            ``tls_client_ca`` (mTLS); both or neither.
        token: bearer token, sent as ``authorization: Bearer <token>`` metadata on every call (server key
            ``auth_token_file``). Surrounding whitespace is stripped (so ``open(path).read()`` works). Sent
            over plaintext too if ``tls`` is off: use TLS where the network is not trusted.
        token_file: instead of ``token``: a file in the server's ``auth_token_file`` format (one token per
            line, blank and ``#`` lines skipped, whitespace stripped) that holds exactly one token.
        timeout: default deadline of each call in seconds (None: no deadline); each method's ``timeout``
            overrides it. For ``translate_stream`` it bounds the whole stream.
        options: extra gRPC channel arguments, e.g. ``[("grpc.service_config", json_text)]`` for the retry
            policy in deploy/client/service_config.json, or ``("grpc.ssl_target_name_override", name)``.

    Raises:
        ClientUsageError: (a ``ValueError``) an empty or non-str ``target``; only one of ``client_cert`` /
            ``client_key``; PEM that cannot be read or is not PEM; both ``token`` and ``token_file``; a token
            that is empty or not printable ASCII without spaces (gRPC metadata cannot carry it; the message
            names the parameter, never the token); a ``token_file`` that cannot be read or does not hold
            exactly one token; a ``timeout`` that is not a number of seconds up to :data:`MAX_TIMEOUT_S`;
            ``options`` grpc refuses.

    Nothing connects here: a server that is not there fails the first call UNAVAILABLE as soon as the
    connection is refused (calls do not wait for the channel to become ready), not after the deadline.

    Use as a context manager (or call :meth:`close`) so the channel is closed.
    """

    def __init__(self, target: str, *, tls: bool = False, root_certificates: Pem | None = None,
                 client_cert: Pem | None = None, client_key: Pem | None = None, token: str | None = None,
                 token_file: str | os.PathLike | None = None, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        if not isinstance(target, str) or not target.strip():
            raise ClientUsageError(f"target must be a non-empty str such as '127.0.0.1:50051', got {_show(target)}")
        if (client_cert is None) != (client_key is None):
            raise ClientUsageError("client_cert and client_key go together (mTLS needs both)")
        self.target = target
        self.timeout = _seconds(timeout, "timeout")
        try:
            token = resolve_token(token, token_file)
        except ValueError as exc:  # its messages name the parameter, never the token
            raise ClientUsageError(str(exc)) from None
        self._metadata = ((_AUTH_KEY, f"Bearer {token}"),) if token is not None else None
        credentials = None
        if tls or root_certificates is not None or client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(root_certificates, "root_certificates"),
                private_key=_pem(client_key, "client_key"),
                certificate_chain=_pem(client_cert, "client_cert"))
        try:
            self.channel = (grpc.insecure_channel(target, options=list(options)) if credentials is None else
                            grpc.secure_channel(target, credentials, options=list(options)))
        except (TypeError, ValueError) as exc:
            raise ClientUsageError(f"options must be (name, value) pairs of gRPC channel arguments: {exc}") from exc
        self._stub = pb_grpc.InferenceStub(self.channel)
        self._v2 = v2_grpc.GRPCInferenceServiceStub(self.channel)  # the model repository calls

    # ------------------------------------------------------------------ plumbing

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self.channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        """This call's deadline in seconds: its own, else the client's."""
        return self.timeout if timeout is None else _seconds(timeout, "timeout")

    def _call(self, method, request, timeout: float | None):
        timeout = self._timeout(timeout)
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise ClientError.from_rpc_error(err) from err
        except ValueError as exc:  # grpc's "Cannot invoke RPC on closed channel!"
            raise ClientUsageError(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from exc

    # ------------------------------------------------------------------ RPCs

    def list_models(self, *, timeout: float | None = None) -> pb.ListModelsResponse:
        """The models the server has loaded (``models``: name, task, backend, device, dtype, limits, labels).

        Raises:
            ClientError: the call failed (e.g. UNAVAILABLE: server not reachable).
        """
        return self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)

    def classify(self, model: str, texts: str | Sequence[str], text_pairs: Sequence[str] | None = None, *,
                 top_k: int = 0, function_to_apply: str | None = None,
                 model_version: str | None = None, timeout: float | None = None) -> pb.ClassifyResponse:
        """Classify texts (or text pairs, NLI-style): ``results[i].labels`` for ``texts[i]``, best first.

        Args:
            model: a classification model's name.
            texts: the texts (a single string is one text).
            text_pairs: second segments, one per text.
            top_k: labels per text; 0 returns all.
            function_to_apply: "softmax" | "sigmoid" | "none" (scores are then logits); None leaves the
                request field unset, i.e. the model's default.
            model_version: a loaded version of the model (ListModels' rows); None: the version that
                serves it.
            timeout: deadline in seconds for this call (default: the client's).

        Raises:
            ClientError: INVALID_ARGUMENT (empty or too many texts, pairs not one per text, top_k over the
                label count, ...), NOT_FOUND, FAILED_PRECONDITION, DEADLINE_EXCEEDED, ...
            ClientUsageError: refused before sending (``top_k=-1``, a text that is not a str, ...).
        """
        request = _request(pb.ClassifyRequest, model=model, texts=_texts(texts, "texts"), top_k=top_k,
                           text_pairs=None if text_pairs is None else _texts(text_pairs, "text_pairs"),
                           function_to_apply=function_to_apply, model_version=model_version)
        return self._call(self._stub.Classify, request, timeout)

    def answer(self, model: str, question: str, context: str, *, top_k: int = 0, max_answer_len: int = 0,
               doc_stride: int = 0, allow_impossible: bool = False, null_threshold: float | None = None,
               align_to_words: bool | None = None,
               model_version: str | None = None, timeout: float | None = None) -> pb.AnswerResponse:
        """Extractive question answering: ``answers`` best first, ``text == context[start:end]`` (code points).

        Args:
            model: a question-answering model's name.
            question, context: the question and the text to find the answer in (any length: the server
                splits it into windows).
            top_k: answers returned; 0 means 1.
            max_answer_len: longest answer in tokens; 0 means the server's default (30).
            doc_stride: token overlap between windows; 0 means the model's default.
            allow_impossible: allow the no-answer result (SQuAD 2.0).
            null_threshold: no answer when null score - best span score exceeds it (logits); None leaves it
                unset (0.0).
            align_to_words: snap spans to whole words; None leaves the field unset (the model's default).
            model_version: a loaded version of the model (ListModels' rows); None: the version that
                serves it.
            timeout: deadline in seconds for this call (default: the client's).

        Raises:
            ClientError: INVALID_ARGUMENT (empty question or context, doc_stride over the limit, too many
                windows or characters; the message names it), NOT_FOUND, FAILED_PRECONDITION, ...
            ClientUsageError: refused before sending (a negative ``top_k``, a question that is not a str, ...).
        """
        request = _request(pb.AnswerRequest, model=model, question=question, context=context, top_k=top_k,
                           max_answer_len=max_answer_len, doc_stride=doc_stride, allow_impossible=allow_impossible,
                           null_threshold=null_threshold, align_to_words=align_to_words,
                           model_version=model_version)
        return self._call(self._stub.Answer, request, timeout)

    def zero_shot_classify(self, model: str, texts: str | Sequence[str], candidate_labels: str | Sequence[str], *,
                           hypothesis_template: str | None = None, multi_label: bool = False,
                           model_version: str | None = None,
                           timeout: float | None = None) -> pb.ZeroShotClassifyResponse:
        """Zero-shot classification on an NLI model: ``results[i].labels`` (every candidate label with its
        score, best first) for ``texts[i]``, as transformers' zero-shot-classification pipeline.

        Args:
            model: a classification model whose labels include an entailment label.
            texts: the texts (a single string is one text).
            candidate_labels: the labels to score (a single string is one label), 1..``max_candidate_labels``.
            hypothesis_template: the hypothesis with one ``{}`` for the label; None: "This example is {}.".
            multi_label: score each label on its own (entailment vs contradiction) instead of a softmax over
                the labels.
            model_version: a loaded version of the model (ListModels' rows); None: the version that
                serves it.
            timeout: deadline in seconds for this call (default: the client's).

        Raises:
            ClientError: INVALID_ARGUMENT (no texts or labels, a blank one, too many, a template without
                ``{}``, a model without an entailment label; the message names the field), NOT_FOUND,
                FAILED_PRECONDITION (not a classification model), DEADLINE_EXCEEDED, ...
            ClientUsageError: refused before sending (a text that is not a str, ...).
        """
        request = _request(pb.ZeroShotClassifyRequest, model=model, texts=_texts(texts, "texts"),
                           candidate_labels=_texts(candidate_labels, "candidate_labels"),
                           hypothesis_template=hypothesis_template, multi_label=multi_label,
                           model_version=model_version)
        return self._call(self._stub.ZeroShotClassify, request, timeout)

    def classify_tokens(self, model: str, texts: str | Sequence[str], *, aggregation_strategy: str | None = None,
                        ignore_labels: Sequence[str] | None = None, stride: int | None = None,
                        model_version: str | None = None, timeout: float | None = None) -> pb.ClassifyTokensResponse:
        """Token classification (NER, PII): ``results[i].entities`` for ``texts[i]``, in text order, each with
        its label (``entity_group``, or ``entity`` and ``index`` for aggregation "none"), ``score``, ``word``
        == ``text[start:end]`` (code points), as transformers' token-classification pipeline.

        Args:
            model: a token-classification model's name.
            texts: the texts (a single string is one text); a long one runs as overlapping windows.
            aggregation_strategy: "none" | "simple" | "first" | "average" | "max"; None: "none".
            ignore_labels: labels whose entities are dropped; None: ["O"]; [] drops none.
            stride: tokens shared by consecutive windows; None: the model's default.
            model_version: a loaded version of the model (ListModels' rows); None: the version that
                serves it.
            timeout: deadline in seconds for this call (default: the client's).

        Raises:
            ClientError: INVALID_ARGUMENT (no texts, a blank one, an unknown strategy, a stride over the
                limit, too many windows; the message names the field), NOT_FOUND, FAILED_PRECONDITION (not a
                token-classification model), DEADLINE_EXCEEDED, ...
            ClientUsageError: refused before sending (a negative ``stride``, a label that is not a str, ...).
        """
        request = _request(pb.ClassifyTokensRequest, model=model, texts=_texts(texts, "texts"),
                           aggregation_strategy=aggregation_strategy, stride=stride, model_version=model_version)
        if ignore_labels is not None:
            labels = _texts(ignore_labels, "ignore_labels")
            request.ignore_labels.SetInParent()  # set, also when empty: "drop none" differs from unset
            try:
                request.ignore_labels.labels.extend(labels)
            except (TypeError, ValueError) as exc:
                raise ClientUsageError(_field_problem(pb.IgnoreLabels, "labels", labels, exc)) from exc
        return self._call(self._stub.ClassifyTokens, request, timeout)

    def rerank(self, model: str, query: str, texts: str | Sequence[str], *, top_n: int = 0, raw_scores: bool = False,
               return_text: bool = False, truncate: bool | None = None,
               model_version: str | None = None, timeout: float | None = None) -> pb.RerankResponse:
        """Rank ``texts`` by relevance to ``query`` with a cross-encoder: ``results`` {index, score, text} best
        first (ties: the lower index first).

        Args:
            model: a classification model (a one-label cross-encoder, or a head with a relevance label).
            query: the query.
            texts: the texts to rank (a single string is one text), 1..``max_rerank_texts``.
            top_n: results returned; 0 returns all.
            raw_scores: the logit instead of the probability.
            return_text: each result carries its text.
            truncate: cut over-long pairs (None leaves the field unset: true); False refuses them.
            model_version: a loaded version of the model (ListModels' rows); None: the version that
                serves it.
            timeout: deadline in seconds for this call (default: the client's).

        Raises:
            ClientError: INVALID_ARGUMENT (a blank query or text, too many texts, a model without a relevance
                label, an over-long pair with ``truncate=False``), NOT_FOUND, FAILED_PRECONDITION, ...
            ClientUsageError: refused before sending (``top_n=-1``, a text that is not a str, ...).
        """
        request = _request(pb.RerankRequest, model=model, query=query, texts=_texts(texts, "texts"), top_n=top_n,
                           raw_scores=raw_scores, return_text=return_text, truncate=truncate,
                           model_version=model_version)
        return self._call(self._stub.Rerank, request, timeout)

    def translate(self, model: str, texts: str | Sequence[str], *, beam_size: int = 0, n_best: int = 0,
                  max_length: int = 0, return_alignment: bool = False,
                  model_version: str | None = None, timeout: float | None = None) -> pb.TranslateResponse:
        """Translate texts: ``results[i].hypotheses`` (n-best, best first) for ``texts[i]``.

        Args:
            model: a translation model's name.
            texts: the source texts (a single string is one text).
            beam_size: 1..16; 0 means the model's default (5). 1 is greedy.
            n_best: hypotheses per text, 1..beam_size; 0 means 1.
            max_length: output tokens per hypothesis (EOS included); 0 means the server's length formula.
            return_alignment: attach each hypothesis's attention weights.
            model_version: a loaded version of the model (ListModels' rows); None: the version that
                serves it.
            timeout: deadline in seconds for this call (default: the client's).

        Raises:
            ClientError: INVALID_ARGUMENT (out-of-range options, a source over max_source_tokens, ...),
                NOT_FOUND, FAILED_PRECONDITION, DEADLINE_EXCEEDED, ...
            ClientUsageError: refused before sending (a negative ``beam_size``, a text that is not a str, ...).
        """
        request = _request(pb.TranslateRequest, model=model, texts=_texts(texts, "texts"), beam_size=beam_size,
                           n_best=n_best, max_length=max_length, return_alignment=return_alignment,
                           model_version=model_version)
        return self._call(self._stub.Translate, request, timeout)

    def translate_stream(self, model: str, text: str, *, beam_size: int = 0, n_best: int = 0,
                         max_length: int = 0, return_alignment: bool = False, model_version: str | None = None,
                         timeout: float | None = None) -> Iterator[pb.TranslateStreamResponse]:
        """Translate one text, yielding the best hypothesis so far after each decoder step; the last message
        has ``final`` set and ``result`` holding what :meth:`translate` returns for the text.

        Options as :meth:`translate`; ``timeout`` bounds the whole stream. Leaving the loop early (``break``,
        an exception, or dropping the iterator) cancels the call, so the server stops decoding.

        Raises:
            ClientUsageError: here, not while iterating: an argument refused before sending (as
                :meth:`translate`).
            ClientError: while iterating, as :meth:`translate`.
        """
        request = _request(pb.TranslateStreamRequest, model=model, text=text, beam_size=beam_size, n_best=n_best,
                           max_length=max_length, return_alignment=return_alignment, model_version=model_version)
        return self._stream(request, self._timeout(timeout))

    def _stream(self, request, timeout: float | None) -> Iterator[pb.TranslateStreamResponse]:
        # A generator, so that the call starts only when iterated and errors surface as ClientError there.
        try:
            call = self._stub.TranslateStream(request, timeout=timeout, metadata=self._metadata)
        except ValueError as exc:  # grpc's "Cannot invoke RPC on closed channel!"
            raise ClientUsageError(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from exc
        try:
            yield from call
        except grpc.RpcError as err:
            raise ClientError.from_rpc_error(err) from err
        finally:
            call.cancel()  # no-op once the stream has ended; stops the server's work when left early

    # ------------------------------------------------------------------ the model repository (KServe v2, Triton's)

    def repository_index(self, *, ready: bool = False, timeout: float | None = None) -> v2.RepositoryIndexResponse:
        """The model repository's index (``inference.GRPCInferenceService/RepositoryIndex``): ``models``, each
        ``{name, version, state, reason}``; ``ready``: READY rows only. The client's token must be an admin token
        (server key ``admin_token_file``).

        Raises:
            ClientError: UNAUTHENTICATED (no token), PERMISSION_DENIED (not an admin token), ...
        """
        return self._call(self._v2.RepositoryIndex, _request(v2.RepositoryIndexRequest, ready=ready), timeout)

    def load_model(self, name: str, *, config: str | None = None,
                   timeout: float | None = None) -> v2.RepositoryModelLoadResponse:
        """Load or reload repository model ``name`` (``RepositoryModelLoad``); returns once it serves. ``config``:
        JSON text of model keys overriding its ``relserve.yaml``. An admin token, as :meth:`repository_index`.

        Raises:
            ClientError: INVALID_ARGUMENT (a name that is a path, a bad config), FAILED_PRECONDITION (the server's
                control mode is not explicit), NOT_FOUND, UNAVAILABLE (the load failed), as the token's.
        """
        request = _request(v2.RepositoryModelLoadRequest, model_name=name)
        if config is not None:
            if not isinstance(config, str):
                raise ClientUsageError(f"config must be a str of JSON, got {type(config).__name__}")
            request.parameters["config"].string_param = config
        return self._call(self._v2.RepositoryModelLoad, request, timeout)

    def unload_model(self, name: str, *, timeout: float | None = None) -> v2.RepositoryModelUnloadResponse:
        """Drain and unload every version of repository model ``name`` (``RepositoryModelUnload``).

        Raises:
            ClientError: as :meth:`load_model` (no UNAVAILABLE).
        """
        request = _request(v2.RepositoryModelUnloadRequest, model_name=name)
        return self._call(self._v2.RepositoryModelUnload, request, timeout)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The grpc.health.v1 status of ``service`` ("" = the whole server): "SERVING", "NOT_SERVING", ...

        Needs the ``grpcio-health-checking`` package (imported here only, so importing this module does not).

        Raises:
            ClientError: the call failed (NOT_FOUND for an unknown service name); FAILED_PRECONDITION when
                grpcio-health-checking is not installed.
            ClientUsageError: ``service`` is not a str.
        """
        try:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
        except ImportError as exc:
            raise ClientError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"health() needs the grpcio-health-checking package ({exc})") from exc

        reply = self._call(health_pb2_grpc.HealthStub(self.channel).Check,
                           _request(health_pb2.HealthCheckRequest, service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
