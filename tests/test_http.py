"""``megakernel serve``'s HTTP surface under hostile clients, with no model behind it: the app and its
uvicorn server in this process, on a socket of 127.0.0.1 (the model's part is ``test_server``'s). Every
error has OpenAI's body; a body past the limit is refused before it is read whole; connections that
send nothing are closed; past the connection limit a client is refused."""
import json
import socket
import threading
import time

import httpx
import pytest

from megakernel.serving.http.app import Options, State, build_app
from megakernel.serving.http.guards import uvicorn_config
from megakernel.tools.serve import listen

LIMIT_BYTES = 100_000
IDLE_SECONDS = 1.0
CONNECTIONS = 6


@pytest.fixture(scope="module")
def url():
    import uvicorn

    options = Options(model="no-model", port=0, max_request_bytes=LIMIT_BYTES, max_connections=CONNECTIONS,
                      idle_timeout=IDLE_SECONDS)
    sock = listen(options)
    server = uvicorn.Server(uvicorn_config(build_app(State(options)), options.max_connections, options.idle_timeout))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def openai_error(response: httpx.Response, status: int) -> str:
    """The message of ``response``, which must be OpenAI's error body with ``status``."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "server_error"), error
    assert set(error) >= {"message", "type", "param", "code"}, error
    return error["message"]


@pytest.mark.parametrize("method, path, body, status, says", [
    ("GET", "/v1/nothing", None, 404, "Invalid URL (GET /v1/nothing)"),
    ("GET", "/v1/completions", None, 405, "Method Not Allowed (GET /v1/completions)"),
    ("DELETE", "/health", None, 405, "Method Not Allowed"),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "parsing the body"),
    ("POST", "/v1/completions", b"[" * 49_000 + b"]" * 49_000, 400, "parsing the body"),  # JSON 49,000 deep
    ("POST", "/v1/completions", b"{not json", 400, "JSON"),
    ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, 400, "messages.0.content"),
    ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": ["a"]}]}]}, 400, "messages.0.content"),
    ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, 400, "needs its text"),
    ("POST", "/v1/completions", {"model": "m", "prompt": "x", "stop": "s" * 257}, 400, "stop"),
    ("POST", "/v1/completions", {"model": "m", "prompt": "x" * (LIMIT_BYTES + 1)}, 413, f"exceeds {LIMIT_BYTES}"),
])
def test_every_refusal_has_openai_error_body(url, method, path, body, status, says):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = httpx.request(method, url + path, content=content, timeout=30,
                             headers={"content-type": "application/json"} if content is not None else {})
    assert says in openai_error(response, status)


def test_a_body_past_the_limit_is_refused_before_it_is_sent_whole(url):
    """A client that declares 50 MB and sends 64 KB gets its 413 without sending the rest; one whose
    chunked body passes the limit is cut off there."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 50000000\r\n\r\n" + b" " * 65536)
        assert client.recv(4096).startswith(b"HTTP/1.1 413")

    def chunks():
        for _ in range(1000):
            yield b" " * 10_000
    response = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert f"exceeds {LIMIT_BYTES}" in openai_error(response, 413)


def test_connections_that_send_nothing_are_closed_and_the_server_goes_on(url):
    host, port = url.removeprefix("http://").split(":")
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(CONNECTIONS - 2)]
    stalled = socket.create_connection((host, int(port)), timeout=10)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers begun, never ended
    try:
        start = time.monotonic()
        for client in [*silent, stalled]:
            assert client.recv(1) == b"", "the server wrote to a connection that sent no request"
        assert time.monotonic() - start < IDLE_SECONDS + 5
    finally:
        for client in [*silent, stalled]:
            client.close()
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # loading: no model here


def test_past_the_connection_limit_a_client_is_refused_with_503(url):
    host, port = url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(CONNECTIONS + 2)]
    try:
        time.sleep(0.2)  # the server has taken them all
        with socket.create_connection((host, int(port)), timeout=10) as late:
            late.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert late.recv(4096).startswith(b"HTTP/1.1 503")
    finally:
        for client in held:
            client.close()
