"""``relserve call`` (also ``python -m relserve.client``): one relserve.v1 call from the command line, the
reply printed as JSON, so trying a server needs neither code nor grpcurl.

    relserve call models    [COMMON]
    relserve call health    [COMMON] [--service NAME]
    relserve call classify  [COMMON] --model NAME --text TEXT [--text TEXT ...] [--text-pair TEXT ...]
                            [--top-k K] [--function-to-apply softmax|sigmoid|none]
    relserve call answer    [COMMON] --model NAME --question Q --context C [--top-k K] [--max-answer-len N]
                            [--doc-stride N] [--allow-impossible] [--null-threshold X] [--[no-]align-to-words]
    relserve call translate [COMMON] --model NAME --text TEXT [--text TEXT ...] [--beam-size B] [--n-best N]
                            [--max-length N] [--return-alignment] [--stream]
    relserve call zero-shot [COMMON] --model NAME --text TEXT [--text ...] --label LABEL [--label ...]
                            [--hypothesis-template T] [--multi-label]
    relserve call classify-tokens [COMMON] --model NAME --text TEXT [--text ...] [--aggregation-strategy S]
                            [--ignore-label LABEL ... | --no-ignore] [--stride N]
    relserve call rerank    [COMMON] --model NAME --query Q --text TEXT [--text ...] [--top-n N] [--raw-scores]
                            [--return-text] [--[no-]truncate]
    relserve call repository [COMMON] index [--ready] | load --model NAME [--config JSON] | unload --model NAME
                            (the model repository API of KServe v2 / Triton: --token must be an admin token)
    Each model sub-command also takes [--model-version V] (a loaded version; default: the one serving it).
    COMMON: [--address HOST:PORT] [--timeout S] [--tls] [--tls-ca PEM] [--tls-cert PEM --tls-key PEM]
            [--tls-server-name NAME] [--token TOKEN | --token-file PATH]

Each sub-command is one :class:`relserve.client.Client` method; its flags are the method's keyword options
(``--top-k`` is ``top_k``). The reply goes to stdout in protobuf's JSON mapping of the reply message with every
field printed (the JSON of the HTTP ``/v1`` routes: ``numTokens``, ``isImpossible``); ``health`` prints
``{"status": "SERVING"}`` (grpc.health.v1's reply); ``translate --stream`` (one ``--text``) prints each stream
message as it arrives, one JSON object per line.

Exit codes: 0 the reply was printed (``health``: and the status is SERVING); 1 the call failed, with
``{"code": "NOT_FOUND", "details": "..."}`` (the gRPC status) on stderr: UNAVAILABLE as soon as the connection
is refused when nothing listens at ``--address`` (the call does not wait for the server to appear), or
``health`` printed a status other than SERVING; 2 a usage error: argparse's, or a value the client refuses
before sending anything (``--top-k -1``, an unreadable ``--token-file`` or ``--tls-ca``), with the usage line.

Imports only what :mod:`relserve.client` does, plus the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from importlib import metadata
from typing import Any, Callable, Sequence

from google.protobuf import json_format

from . import Client, ClientError, ClientUsageError

__all__ = ["main", "build_parser", "package_version", "DEFAULT_ADDRESS", "DEFAULT_TIMEOUT_S"]

DEFAULT_ADDRESS = "127.0.0.1:50051"  # relserve serve's default gRPC port, on this machine
DEFAULT_TIMEOUT_S = 30.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Client parameters whose flag is not ``--`` + the name with dashes, for messages of refused values.
_FLAGS = {"texts": "--text", "text_pairs": "--text-pair", "text": "--text", "target": "--address",
          "candidate_labels": "--label", "ignore_labels": "--ignore-label",
          "root_certificates": "--tls-ca", "client_cert": "--tls-cert", "client_key": "--tls-key"}
# A client message starts with the parameter it refuses and may name another of the connection's.
_LEADING_NAME = re.compile(r"^[a-z]+(?:_[a-z]+)*")
_OTHER_NAME = re.compile(r"\b(?:client_cert|client_key|root_certificates|token_file)\b")


def package_version() -> str:
    """The installed relserve distribution's version ("unknown" when run from a checkout never installed)."""
    try:
        return metadata.version("relserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_tls_and_token_flags(p: argparse.ArgumentParser, address_flag: str) -> None:
    """The flags that say how to reach a server securely: ``--tls``, ``--tls-ca``, ``--tls-cert``, ``--tls-key``,
    ``--tls-server-name`` and ``--token`` / ``--token-file`` (exclusive). ``address_flag`` names the flag that
    holds the server's address, for the help text. Shared by ``relserve call`` and ``relserve loadtest``."""
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS, trusting the system's CAs (implied by --tls-ca / --tls-cert)")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate that signed the server's certificate (TLS)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate for mTLS servers (with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="the client certificate's private key (with --tls-cert)")
    p.add_argument("--tls-server-name", metavar="NAME",
                   help=f"name to check the server's certificate against instead of the {address_flag} host")
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", help="bearer token sent as 'authorization: Bearer <token>' on every call "
                                       "(visible in the process list: prefer --token-file)")
    token.add_argument("--token-file", metavar="PATH",
                       help="file holding the token (the server's auth_token_file format, one token)")


def build_parser(prog: str = "relserve call") -> argparse.ArgumentParser:
    """The parser: one sub-command per RPC, each with the connection flags and its method's options."""
    parser = argparse.ArgumentParser(prog=prog, description="Call a running relserve server (relserve.v1 over "
                                     "gRPC) and print the reply as JSON. Exit codes: 0 ok, 1 the call failed "
                                     "(the gRPC status as JSON on stderr), 2 usage.")
    parser.add_argument("--version", action="version", version=f"relserve {package_version()}")
    sub = parser.add_subparsers(dest="rpc", required=True, metavar="{classify,answer,translate,zero-shot,"
                                "classify-tokens,rerank,models,health,repository}")

    def command(name: str, run: Callable[[Client, argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(run=run, parser=p)  # p: errors found after parsing print this sub-command's usage
        p.add_argument("--address", default=DEFAULT_ADDRESS, metavar="HOST:PORT",
                       help=f"the server's gRPC address (default {DEFAULT_ADDRESS})")
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                       help=f"deadline of the call in seconds (default {DEFAULT_TIMEOUT_S:g}); a server that is not "
                            "there fails at once, not after it")
        add_tls_and_token_flags(p, address_flag="--address")
        return p

    command("models", _models, "list the loaded models (ListModels)")
    health = command("health", _health, "grpc.health.v1 Check; exit 1 unless SERVING")
    health.add_argument("--service", default="", help="service name (default '': the whole server)")

    classify = command("classify", _classify, "classify texts or text pairs (Classify)")
    classify.add_argument("--model", required=True, help="a classification model's name")
    classify.add_argument("--text", action="append", required=True, help="a text (repeat for a batch)")
    classify.add_argument("--text-pair", action="append", metavar="TEXT",
                          help="second segment of each text, NLI-style (repeat: one per --text)")
    classify.add_argument("--top-k", type=int, default=0, metavar="K", help="labels per text (default 0: all)")
    classify.add_argument("--function-to-apply", metavar="FN",
                          help="softmax | sigmoid | none (logits); default: the model's")

    answer = command("answer", _answer, "extractive question answering (Answer)")
    answer.add_argument("--model", required=True, help="a question-answering model's name")
    answer.add_argument("--question", required=True)
    answer.add_argument("--context", required=True, help="the text to find the answer in (any length)")
    answer.add_argument("--top-k", type=int, default=0, metavar="K", help="answers returned (default 0: one)")
    answer.add_argument("--max-answer-len", type=int, default=0, metavar="N",
                        help="longest answer in tokens (default 0: the server's, 30)")
    answer.add_argument("--doc-stride", type=int, default=0, metavar="N",
                        help="token overlap between context windows (default 0: the model's)")
    answer.add_argument("--allow-impossible", action="store_true", help="allow the no-answer result (SQuAD 2.0)")
    answer.add_argument("--null-threshold", type=float, metavar="X",
                        help="no answer when null score - best span score exceeds it (logits; default 0)")
    answer.add_argument("--align-to-words", action=argparse.BooleanOptionalAction, default=None,
                        help="snap spans to whole words (default: the model's)")

    translate = command("translate", _translate, "translate texts (Translate; --stream: TranslateStream)")
    translate.add_argument("--model", required=True, help="a translation model's name")
    translate.add_argument("--text", action="append", required=True, help="a source text (repeat for a batch)")
    translate.add_argument("--beam-size", type=int, default=0, metavar="B",
                           help="1..16; 1 is greedy (default 0: the model's, 5)")
    translate.add_argument("--n-best", type=int, default=0, metavar="N", help="hypotheses per text (default 1)")
    translate.add_argument("--max-length", type=int, default=0, metavar="N",
                           help="output tokens per hypothesis, EOS included (default 0: the length formula)")
    translate.add_argument("--return-alignment", action="store_true", help="attach the attention weights")
    translate.add_argument("--stream", action="store_true",
                           help="TranslateStream: one JSON line per decoder step, the last with final true "
                                "(one --text)")

    zero_shot = command("zero-shot", _zero_shot, "zero-shot classification on an NLI model (ZeroShotClassify)")
    zero_shot.add_argument("--model", required=True, help="a classification model with an entailment label")
    zero_shot.add_argument("--text", action="append", required=True, help="a text (repeat for a batch)")
    zero_shot.add_argument("--label", action="append", required=True, metavar="LABEL", dest="candidate_labels",
                           help="a candidate label (repeat for each)")
    zero_shot.add_argument("--hypothesis-template", metavar="TEMPLATE",
                           help="the hypothesis with one {} for the label (default: 'This example is {}.')")
    zero_shot.add_argument("--multi-label", action="store_true", help="score each label on its own")

    tokens = command("classify-tokens", _classify_tokens, "token classification, e.g. NER (ClassifyTokens)")
    tokens.add_argument("--model", required=True, help="a token-classification model's name")
    tokens.add_argument("--text", action="append", required=True, help="a text (repeat for a batch)")
    tokens.add_argument("--aggregation-strategy", metavar="S",
                        help="none | simple | first | average | max (default: none)")
    tokens.add_argument("--ignore-label", action="append", metavar="LABEL", dest="ignore_labels",
                        help="drop entities with this label (repeat; default: O)")
    tokens.add_argument("--no-ignore", action="store_true", help="drop no entities (not even O)")
    tokens.add_argument("--stride", type=int, metavar="N", help="tokens shared by windows (default: the model's)")

    rerank = command("rerank", _rerank, "rank texts by relevance to a query (Rerank)")
    rerank.add_argument("--model", required=True, help="a cross-encoder (classification) model's name")
    rerank.add_argument("--query", required=True)
    rerank.add_argument("--text", action="append", required=True, help="a text to rank (repeat for each)")
    rerank.add_argument("--top-n", type=int, default=0, metavar="N", help="results returned (default 0: all)")
    rerank.add_argument("--raw-scores", action="store_true", help="logits instead of probabilities")
    rerank.add_argument("--return-text", action="store_true", help="each result carries its text")
    rerank.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=None,
                        help="cut over-long pairs (default) or refuse them (--no-truncate)")
    repository = command("repository", _repository, "the model repository: index, load or unload a model "
                         "(KServe v2 RepositoryIndex / RepositoryModelLoad / RepositoryModelUnload; an admin token)")
    repository.add_argument("action", choices=("index", "load", "unload"))
    repository.add_argument("--model", help="load / unload: the repository model's name")
    repository.add_argument("--ready", action="store_true", help="index: READY rows only")
    repository.add_argument("--config", metavar="JSON", help="load: model keys overriding its relserve.yaml")
    for p in (classify, answer, translate, zero_shot, tokens, rerank):
        p.add_argument("--model-version", metavar="V",
                       help="a loaded version of the model ('models' lists them; default: the one serving it)")
    return parser


def _dump(message, *, indent: int | None = 2) -> str:
    """``message`` in protobuf's JSON mapping, every field printed (as the HTTP /v1 routes answer)."""
    return json.dumps(json_format.MessageToDict(message, always_print_fields_with_no_presence=True),
                      indent=indent, ensure_ascii=False)


def _models(client: Client, args: argparse.Namespace) -> int:
    print(_dump(client.list_models()))
    return EXIT_OK


def _health(client: Client, args: argparse.Namespace) -> int:
    status = client.health(args.service)
    print(json.dumps({"status": status}, indent=2))
    return EXIT_OK if status == "SERVING" else EXIT_FAILED


def _classify(client: Client, args: argparse.Namespace) -> int:
    print(_dump(client.classify(args.model, args.text, args.text_pair, top_k=args.top_k,
                                function_to_apply=args.function_to_apply, model_version=args.model_version)))
    return EXIT_OK


def _answer(client: Client, args: argparse.Namespace) -> int:
    print(_dump(client.answer(args.model, args.question, args.context, top_k=args.top_k,
                              max_answer_len=args.max_answer_len, doc_stride=args.doc_stride,
                              allow_impossible=args.allow_impossible, null_threshold=args.null_threshold,
                              align_to_words=args.align_to_words, model_version=args.model_version)))
    return EXIT_OK


def _translate(client: Client, args: argparse.Namespace) -> int:
    options = dict(beam_size=args.beam_size, n_best=args.n_best, max_length=args.max_length,
                   return_alignment=args.return_alignment, model_version=args.model_version)
    if not args.stream:
        print(_dump(client.translate(args.model, args.text, **options)))
        return EXIT_OK
    for message in client.translate_stream(args.model, args.text[0], **options):
        print(_dump(message, indent=None), flush=True)  # JSON lines: each step as it arrives
    return EXIT_OK


def _zero_shot(client: Client, args: argparse.Namespace) -> int:
    print(_dump(client.zero_shot_classify(args.model, args.text, args.candidate_labels,
                                          hypothesis_template=args.hypothesis_template,
                                          multi_label=args.multi_label, model_version=args.model_version)))
    return EXIT_OK


def _classify_tokens(client: Client, args: argparse.Namespace) -> int:
    ignore = [] if args.no_ignore else args.ignore_labels
    print(_dump(client.classify_tokens(args.model, args.text, aggregation_strategy=args.aggregation_strategy,
                                       ignore_labels=ignore, stride=args.stride,
                                       model_version=args.model_version)))
    return EXIT_OK


def _rerank(client: Client, args: argparse.Namespace) -> int:
    print(_dump(client.rerank(args.model, args.query, args.text, top_n=args.top_n, raw_scores=args.raw_scores,
                              return_text=args.return_text, truncate=args.truncate,
                              model_version=args.model_version)))
    return EXIT_OK


def _repository(client: Client, args: argparse.Namespace) -> int:
    if args.action == "index":
        print(_dump(client.repository_index(ready=args.ready)))
        return EXIT_OK
    if not args.model:
        args.parser.error(f"repository {args.action} needs --model NAME")
    if args.action == "load":
        print(_dump(client.load_model(args.model, config=args.config)))
    else:
        print(_dump(client.unload_model(args.model)))
    return EXIT_OK


def _flag(match: re.Match) -> str:
    name = match.group(0)
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _flag_message(details: str) -> str:
    """A client message reworded for the command line: the parameters it names become their flags
    ("top_k must be ..." -> "--top-k must be ...")."""
    return _LEADING_NAME.sub(_flag, _OTHER_NAME.sub(_flag, details), count=1)


def main(argv: Sequence[str] | None = None, prog: str = "relserve call") -> int:
    """Run one call; returns the exit code (0 ok, 1 the call failed, 2 usage; argparse exits 2 itself)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    usage: argparse.ArgumentParser = args.parser
    if getattr(args, "stream", False) and len(args.text) != 1:
        usage.error(f"--stream translates one text, got {len(args.text)} --text")
    options: list[tuple[str, Any]] = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    try:
        client = Client(args.address, tls=args.tls, root_certificates=args.tls_ca, client_cert=args.tls_cert,
                        client_key=args.tls_key, token=args.token, token_file=args.token_file,
                        timeout=args.timeout, options=options)
    except ClientUsageError as exc:
        usage.error(_flag_message(exc.details))
    try:
        with client:
            return args.run(client, args)
    except ClientUsageError as exc:
        usage.error(_flag_message(exc.details))
    except ClientError as exc:
        print(json.dumps({"code": exc.code.name, "details": exc.details}, ensure_ascii=False), file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C during a long stream: no traceback
        return 130
    except BrokenPipeError:  # stdout piped into a reader that left (| head): no traceback, as other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return EXIT_FAILED
    return EXIT_USAGE  # pragma: no cover - usage.error exits


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
