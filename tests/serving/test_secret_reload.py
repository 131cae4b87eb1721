"""Reloadable secrets (service/secrets_watch.py) on a real server with TLS on the gRPC and HTTP ports and a
token file (fake models, free loopback ports, certificates from tests/fixtures/tls.py): a rotated certificate
is what the next handshake sees while connections already open keep working, a token removed from the file is
refused within about a second while the other keeps working, and a file that fails to load keeps the previous
one in force with one log line naming it. Issue 32 item 4."""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import socket
import ssl
import time

import grpc
import pytest

from fixtures.fake_serving import runner, server_config
from fixtures.server import Running
from fixtures.tls import make_pki
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

TOKENS = ("kept-token-0123456789", "removed-token-abcdefgh")
CLASSIFY = pb.ClassifyRequest(model="sentiment", texts=["good movie"])


def _replace(path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a rotation tool does: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _channel(ca, port: int) -> grpc.Channel:
    return grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()))


def _peer_certificate(port: int) -> bytes:
    """The DER certificate a new TLS handshake on ``port`` gets (not verified: which one it is, is the test)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with context.wrap_socket(sock) as tls:
            return tls.getpeercert(binary_form=True)


def _der(pem_path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem_path.read_text())


def _until(predicate, what: str, timeout: float = 5.0) -> float:
    """Seconds until ``predicate()`` holds (polled every 20 ms)."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("secrets")
    old, new = make_pki(root / "old"), make_pki(root / "new")
    served = root / "served"
    served.mkdir()
    cert, key, tokens = served / "tls.crt", served / "tls.key", served / "tokens"
    shutil.copy(old.server_cert, cert)
    shutil.copy(old.server_key, key)
    tokens.write_text("\n".join(TOKENS) + "\n")
    s = Running(server_config(metrics_port=None, tls_cert=cert, tls_key=key, auth_token_file=tokens, http_port=0),
                [runner("sentiment")])
    channel = _channel(old.ca_cert, s.port)
    _until(lambda: _serving(channel), "the server to serve", timeout=15)
    yield s, old, new, {"cert": cert, "key": key, "tokens": tokens}, channel
    channel.close()
    s.close()


def _serving(channel: grpc.Channel) -> bool:
    try:
        pb_grpc.InferenceStub(channel).Classify(CLASSIFY, metadata=_bearer(TOKENS[0]), timeout=2)
        return True
    except grpc.RpcError:
        return False


def _https(ca, port: int) -> http.client.HTTPSConnection:
    context = ssl.create_default_context(cafile=str(ca))
    return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)


def _models(conn: http.client.HTTPSConnection, token: str) -> int:
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {token}"})
    response = conn.getresponse()
    response.read()
    return response.status


def test_a_rotated_certificate_is_used_by_new_handshakes_while_open_connections_keep_theirs(srv, caplog):
    s, old, new, files, channel = srv
    http_port = s.server.http_port
    open_https = _https(old.ca_cert, http_port)
    assert _models(open_https, TOKENS[0]) == 200
    open_socket = open_https.sock
    assert _peer_certificate(s.port) == _der(old.server_cert)
    caplog.set_level(logging.INFO, logger="relserve.service.secrets_watch")

    # a key that is not the certificate's: the previous pair stays in force, one line names the files
    _replace(files["key"], new.server_key.read_bytes())
    _until(lambda: "kept the previous TLS" in caplog.text, "the mismatched key to be reported")
    refused = [r.getMessage() for r in caplog.records if "kept the previous TLS" in r.getMessage()]
    assert len(refused) == 1 and str(files["cert"]) in refused[0] and "not the certificate's" in refused[0], refused
    assert _peer_certificate(s.port) == _der(old.server_cert)
    assert _peer_certificate(http_port) == _der(old.server_cert)

    # the matching certificate arrives: new handshakes on both ports get it
    _replace(files["cert"], new.server_cert.read_bytes())
    _until(lambda: _peer_certificate(s.port) == _der(new.server_cert), "gRPC handshakes to get the new certificate")
    assert _peer_certificate(http_port) == _der(new.server_cert)
    with _channel(new.ca_cert, s.port) as fresh:
        assert _serving(fresh)
    assert _models(_https(new.ca_cert, http_port), TOKENS[0]) == 200
    # a client that trusts only the old CA cannot open a new connection any more
    with _channel(old.ca_cert, s.port) as stale:
        assert not _serving(stale)
    # connections opened before the rotation keep working, on their own handshake
    assert _serving(channel)
    assert _models(open_https, TOKENS[0]) == 200 and open_https.sock is open_socket
    open_https.close()


def test_a_removed_token_is_refused_and_a_broken_token_file_keeps_the_previous_tokens(srv, caplog):
    s, old, new, files, _ = srv
    ca = new.ca_cert if files["cert"].read_bytes() == new.server_cert.read_bytes() else old.ca_cert
    channel = _channel(ca, s.port)
    stub = pb_grpc.InferenceStub(channel)
    conn = _https(ca, s.server.http_port)
    try:
        assert stub.Classify(CLASSIFY, metadata=_bearer(TOKENS[1]), timeout=5).results

        def refused() -> bool:
            try:
                stub.Classify(CLASSIFY, metadata=_bearer(TOKENS[1]), timeout=5)
                return False
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                return True

        _replace(files["tokens"], f"# rotated\n{TOKENS[0]}\n".encode())
        _until(refused, "the removed token to be refused", timeout=3)
        assert stub.Classify(CLASSIFY, metadata=_bearer(TOKENS[0]), timeout=5).results
        assert _models(conn, TOKENS[1]) == 401 and _models(conn, TOKENS[0]) == 200  # the HTTP port's check too

        caplog.set_level(logging.INFO, logger="relserve.service.secrets_watch")
        _replace(files["tokens"], b"not a token\n")  # a space inside: not a valid line
        _until(lambda: "kept the previous auth_token_file" in caplog.text, "the broken token file to be reported")
        line = next(r.getMessage() for r in caplog.records if "kept the previous auth_token_file" in r.getMessage())
        assert str(files["tokens"]) in line and "line 1" in line, line
        assert stub.Classify(CLASSIFY, metadata=_bearer(TOKENS[0]), timeout=5).results  # the previous tokens
        assert refused()
    finally:
        conn.close()
        channel.close()
