"""``megakernel serve``: a model behind the OpenAI HTTP API, over continuous batching (FastAPI + uvicorn).

``GET /v1/models``; ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the model's chat
template), streamed as server-sent events ending with ``data: [DONE]`` when ``stream`` is true;
``GET /health`` (200 once the model is compiled, 503 before, or after the engine failed);
``GET /metrics`` (Prometheus text). Requests join the running batch (``serving.ServingLoop``),
waiting while its rows or KV pages are full; a client that disconnects cancels its sequence; a bad
request is a 400 with OpenAI's error body. SIGTERM (or Ctrl-C) ends the requests in flight with an
error, then stops. With ``--tp N`` the ranks are processes (``launch``): rank 0 serves HTTP and leads
the others' engines (``serving.follow``).

Parameters as OpenAI's: ``max_tokens`` (chat: ``max_completion_tokens`` too; default 16 for completions,
the rest of the context for chat), ``temperature`` (default 1; 0 is greedy), ``top_p``, ``seed``,
``stop`` (a string or up to 4), ``logprobs`` (completions: how many most likely tokens; chat: true with
``top_logprobs``), ``stream_options.include_usage``; and vLLM's ``top_k`` and ``min_p``. One choice per
request (``n`` = 1). Log-probabilities are the model's, before temperature and filters.

Hostile clients meet bounds: a body over ``--max-request-bytes`` is a 413 before it is read whole; a
connection must send a request's headers within ``--idle-timeout`` seconds of opening (or of its last
response), and its body with no longer pause than that, or it is closed; past ``--max-connections``
a request gets a 503. Every error, unknown paths and methods included, has OpenAI's error body.
Tokenizing and chat templates run in a thread of their own, off the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import h11
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..backends import gpu_flavour
from ..bootstrap import Group, current_world
from ..errors import MAX_TIMEOUT, GraphError
from ..launcher import launch
from ..serving import SERVER, DecodeModel, SamplingParams, ServingConfig, ServingLoop, Text, follow, from_pretrained
from ..serving import Request as EngineRequest  # the serving loop's (``Request`` is FastAPI's: the handlers')
from ..serving.loop import LATENCY_BUCKETS

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # a stop string's length at most: each new token's text is matched against every stop
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def server_backend(backend: str) -> str:
    """``serve``'s backend for ``backend``: "auto" the GPU if there is one, else torch."""
    return (gpu_flavour() or "torch") if backend == "auto" else backend


@dataclass
class Options:
    """What ``megakernel serve`` was asked for (every rank gets a copy)."""

    model: str
    tp: int = 1
    ranks_per_node: int | None = None  # the tp ranks on nodes of this many (None: one node)
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"
    serving: ServingConfig = SERVER
    steps_per_launch: int = 4
    workers: int | None = None
    dequantize: bool = False
    dtype: str = "auto"  # the weights' and activations' float dtype: "auto" (as stored), float32, bfloat16, float16
    name: str | None = None
    max_request_bytes: int = 4 << 20  # a larger body is refused (413) before it is read whole
    max_connections: int = 512        # past it a request is refused (503): each connection holds a socket
    idle_timeout: float = 10.0        # seconds to send a request's headers, or between its body's reads

    @property
    def served_name(self) -> str:
        """The model's id in the API: ``--name``, else the file's stem or the folder's name."""
        path = Path(self.model)
        return self.name or (path.stem if path.suffix == ".gguf" else path.name)


def load_model(options: Options) -> DecodeModel:
    """This rank's ``DecodeModel`` of ``options.model``."""
    kernel = {"backend": options.backend} | ({"workers": options.workers} if options.workers else {})
    dtype = None if options.dtype == "auto" else getattr(torch, options.dtype)
    return from_pretrained(options.model, options.serving, dequantize=options.dequantize, dtype=dtype, **kernel)


# -- the HTTP API ---------------------------------------------------------------------------------------

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class Sampling(BaseModel):
    """The fields both endpoints share (others OpenAI defines are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1)


class Completion(Sampling):
    """``POST /v1/completions``: a prompt as text, token ids, or a list of one text."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0)


class ContentPart(BaseModel):
    """A part of a message's content: the text ones count, the others (images, audio) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _has_text(self) -> "ContentPart":
        if self.type == "text" and self.text is None:
            raise ValueError("a part of type text needs its text (a string)")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart]


class Chat(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


class RequestError(Exception):
    """A request the server refuses: ``status`` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class State:
    """The server's side of the engine: set once the model is compiled."""

    options: Options
    serving_loop: ServingLoop | None = None
    text: Text | None = None
    model: DecodeModel | None = None
    engine: threading.Thread | None = None  # the serving loop's thread
    failure: str | None = None               # why the model did not load
    started: float = field(default_factory=time.time)
    # tokenizing and templating, off the event loop (a 4 MB prompt takes seconds); one thread, as a
    # tokenizer is not made to be called from several at once
    text_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="megakernel-text"))

    def ready(self) -> None:
        if self.failure or (self.serving_loop is not None and self.serving_loop.failure):
            raise RequestError(self.failure or self.serving_loop.failure, status=503, kind="server_error")
        if self.serving_loop is None:
            raise RequestError("the model is still being compiled: try again once GET /health says 200", status=503,
                               kind="server_error")


class Json(JSONResponse):
    """JSON with non-ASCII characters escaped: text from a client (a lone surrogate in an error message
    that quotes it) cannot fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def build_app(state: State) -> FastAPI:
    """The FastAPI application over ``state``."""
    app = FastAPI(title="megakernel", default_response_class=Json)
    too_large = RequestError(f"the request body exceeds {state.options.max_request_bytes} bytes "
                             "(--max-request-bytes)", status=413)
    app.add_middleware(BodyLimit, limit=state.options.max_request_bytes, refusal=too_large)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        # the deepest error: of a union (content: text or parts), the branch the value went furthest in
        deepest = max(error.errors(), key=lambda e: len(e.get("loc", ())))
        param = ".".join(str(p) for p in deepest.get("loc", ())[1:] if not _union_branch(p)) or None
        message = f"{param}: {deepest.get('msg')}" if param else deepest.get("msg", "invalid request")
        return Json(RequestError(message, param).body(), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(_, error: RequestError):
        return Json(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)  # routing's 404 and 405, a body too large or not parseable
    async def http_error(request: Request, error: HTTPException):
        where = f"({request.method} {request.url.path})"
        message = {404: f"Invalid URL {where}", 405: f"Method Not Allowed {where}", 413: str(too_large)}
        cause = error.__cause__  # what the body's parser raised (RecursionError, UnicodeDecodeError)
        text = message.get(error.status_code) or (f"{error.detail}: {type(cause).__name__}: {cause}" if cause
                                                 else str(error.detail))
        kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
        return Json(RequestError(text, status=error.status_code, kind=kind).body(), status_code=error.status_code,
                    headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)  # a bug: still OpenAI's body (the error is logged too)
    async def failed(_, error: Exception):
        return Json(RequestError(f"internal error: {type(error).__name__}: {error}", status=500,
                                 kind="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        try:
            state.ready()
        except RequestError as error:
            return Json(error.body(), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.options.served_name, "object": "model",
                                            "created": int(state.started), "owned_by": "megakernel",
                                            "max_model_len": state.options.serving.max_seq_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(state), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: Completion, request: Request):
        state.ready()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise RequestError("prompt: one prompt per request", "prompt")
            prompt = prompt[0]
        ids = await _text(state, state.text.encode, prompt) if isinstance(prompt, str) else list(prompt)
        top = body.logprobs or 0
        run = _start(state, body, ids, COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens, top)
        kind, name = "text_completion", "cmpl"
        if body.stream:
            return StreamingResponse(_stream(state, run, body, request, kind, name, top, chat=False),
                                     media_type="text/event-stream")
        updates = await _collect(state, run, request)
        text = "".join(u.text for u in updates)
        logprobs = _completion_logprobs(state, updates, top) if body.logprobs is not None else None
        return _response(state, run, kind, name, [{"index": 0, "text": text, "logprobs": logprobs,
                                                   "finish_reason": updates[-1].finish}], updates)

    @app.post("/v1/chat/completions")
    async def chat(body: Chat, request: Request):
        state.ready()
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(part.text for part in m.content if part.type == "text")}
                    for m in body.messages]
        ids = await _text(state, state.text.chat, messages)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        if body.top_logprobs and not body.logprobs:
            raise RequestError("top_logprobs: needs logprobs true", "top_logprobs")
        max_tokens = next((n for n in (body.max_completion_tokens, body.max_tokens) if n is not None),
                          max(1, state.options.serving.max_seq_len - len(ids)))  # the rest of the context
        run = _start(state, body, ids, max_tokens, top)
        kind, name = "chat.completion", "chatcmpl"
        if body.stream:
            return StreamingResponse(_stream(state, run, body, request, kind + ".chunk", name, top, chat=True,
                                             logprobs=body.logprobs), media_type="text/event-stream")
        updates = await _collect(state, run, request)
        logprobs = {"content": _chat_logprobs(state, updates, top)} if body.logprobs else None
        message = {"role": "assistant", "content": "".join(u.text for u in updates)}
        return _response(state, run, kind, name, [{"index": 0, "message": message, "logprobs": logprobs,
                                                   "finish_reason": updates[-1].finish}], updates)

    return app


@dataclass
class Run:
    """A request in the engine, as its handler sees it: the engine's ``Request`` and the queue its
    updates arrive in (put there from the engine's thread)."""

    request: Any
    updates: asyncio.Queue
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _union_branch(loc) -> bool:
    """A step of a validation error's location that names a branch of a union type ("str", "list[ContentPart]")
    rather than a field or an index."""
    return isinstance(loc, str) and (loc in ("str", "int", "float", "bool", "list", "dict") or "[" in loc
                                     or loc[:1].isupper())


class BodyLimit:
    """ASGI middleware: a request body of more than ``limit`` bytes is refused (``refusal``, a 413) as
    soon as that is known: at once from its Content-Length, before any of it is read; else (chunked)
    when the parts read so far pass the limit."""

    def __init__(self, app, limit: int, refusal: RequestError):
        self.app, self.limit, self.refusal = app, limit, refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            return await Json(self.refusal.body(), status_code=413)(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:  # raised in the body's reading: the app answers it (http_error)
                raise HTTPException(413)
            return message
        await self.app(scope, counted, send)


def _checked(function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except GraphError as error:
        raise RequestError(str(error)) from None


async def _text(state: State, function, *args):
    """``function(*args)`` of the text (a tokenizer's work) in its thread, off the event loop: a 400 for
    what it refuses."""
    return await asyncio.get_running_loop().run_in_executor(state.text_thread, _checked, function, *args)


def _start(state: State, body, ids: list[int], max_tokens: int, top: int) -> Run:
    """Check a request's numbers against the model and hand it to the engine."""
    options, serving, vocab = state.options, state.options.serving, state.model.config.vocab
    if body.model != options.served_name:
        raise RequestError(f"model: this server serves {options.served_name!r}, not {body.model!r}", "model", 404,
                           "not_found_error")
    if not ids:
        raise RequestError("prompt: empty", "prompt")
    if any(not 0 <= token < vocab for token in ids):
        raise RequestError(f"prompt: token ids must be in [0, {vocab})", "prompt")
    if max_tokens < 1:
        raise RequestError(f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
    if len(ids) + max_tokens > serving.max_seq_len:
        raise RequestError(f"max_tokens: the prompt's {len(ids)} tokens and {max_tokens} new ones exceed the "
                           f"context of {serving.max_seq_len} tokens", "max_tokens")
    pool = state.model.pool
    if pool.pages_for(len(ids) + max_tokens - 1) > pool.pages:  # it would wait for pages forever
        raise RequestError(f"max_tokens: the prompt's {len(ids)} tokens and {max_tokens} new ones need "
                           f"{pool.pages_for(len(ids) + max_tokens - 1)} KV pages; the pool has {pool.pages} "
                           f"(--kv-pages)", "max_tokens")
    if top > serving.max_logprobs:
        raise RequestError(f"logprobs: at most {serving.max_logprobs} most likely tokens (--max-logprobs)", "logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = _checked(SamplingParams, temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                        min_p=body.min_p, seed=body.seed)
    loop, updates = asyncio.get_running_loop(), asyncio.Queue()
    request = EngineRequest(prompt=ids, max_tokens=max_tokens, sampling=sampling, stop=stop,
                            emit=lambda update: loop.call_soon_threadsafe(updates.put_nowait, update))
    run = Run(request, updates)
    state.serving_loop.submit(request)
    return run


async def _next(state: State, run: Run, client) -> Any:
    """The run's next update; None once the client is gone (its sequence cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(run.updates.get(), timeout=0.5)
        except (asyncio.TimeoutError, TimeoutError):
            if await client.is_disconnected():
                state.serving_loop.cancel(run.request)
                return None


async def _collect(state: State, run: Run, client) -> list:
    updates = []
    while not updates or not (updates[-1].finish or updates[-1].error):
        update = await _next(state, run, client)
        if update is None:
            raise RequestError("the client disconnected", status=499)
        updates.append(update)
    if updates[-1].error:
        raise RequestError(updates[-1].error, status=503, kind="server_error")
    return updates


async def _stream(state: State, run: Run, body, client, kind: str, name: str, top: int, chat: bool,
                  logprobs: bool = False):
    """Server-sent events: a chunk per update with text (or log-probabilities), the last with the finish
    reason, usage when asked, then ``[DONE]``; an error as an error event."""
    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def chunk(choice: dict, usage=None) -> dict:
        return {"id": f"{name}-{run.id}", "object": kind, "created": run.created, "model": state.options.served_name,
                "choices": [choice] if choice else [], **({"usage": usage} if usage is not None else {})}

    updates, finished = [], False
    try:
        if chat:
            yield event(chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}))
        while True:
            update = await run.updates.get()
            if update.error:
                yield event(RequestError(update.error, status=503, kind="server_error").body())
                finished = True
                break
            updates.append(update)
            if update.text or update.finish or (top or logprobs) and update.tokens:
                if chat:
                    content = {"content": _chat_logprobs(state, [update], top)} if logprobs else None
                    choice = {"index": 0, "delta": {"content": update.text} if update.text or not update.finish else {},
                              "logprobs": content, "finish_reason": update.finish}
                else:
                    content = _completion_logprobs(state, [update], top) if body.logprobs is not None else None
                    choice = {"index": 0, "text": update.text, "logprobs": content, "finish_reason": update.finish}
                yield event(chunk(choice))
            if update.finish:
                finished = True
                break
        if (body.stream_options or {}).get("include_usage"):
            yield event(chunk({}, _usage(run, updates)))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream: its slot and pages go back
            state.serving_loop.cancel(run.request)


def _usage(run: Run, updates: list) -> dict:
    made = sum(len(u.tokens) for u in updates)
    return {"prompt_tokens": len(run.request.prompt), "completion_tokens": made,
            "total_tokens": len(run.request.prompt) + made}


def _response(state: State, run: Run, kind: str, name: str, choices: list, updates: list) -> dict:
    return {"id": f"{name}-{run.id}", "object": kind, "created": run.created, "model": state.options.served_name,
            "choices": choices, "usage": _usage(run, updates)}


def _completion_logprobs(state: State, updates: list, top: int) -> dict:
    """OpenAI's completions log-probabilities: tokens, their log-probabilities, the most likely ones'."""
    token = state.text.token
    tokens = [t for u in updates for t in u.tokens]
    pieces = [token(t) for t in tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": [p for u in updates for p in u.logprobs],
            "top_logprobs": [{token(i): p for i, p in alternatives[:top]} for u in updates for alternatives in u.top]
            if top else None, "text_offset": offsets}


def _chat_logprobs(state: State, updates: list, top: int) -> list:
    """OpenAI's chat log-probabilities: per token its text, bytes, log-probability and the most likely ones'."""
    token = state.text.token

    def entry(token_id: int, logprob: float) -> dict:
        piece = token(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    out = []
    for u in updates:
        alternatives = u.top or [[] for _ in u.tokens]
        for token_id, logprob, others in zip(u.tokens, u.logprobs, alternatives):
            out.append(entry(token_id, logprob) | {"top_logprobs": [entry(i, p) for i, p in others[:top]]})
    return out


def prometheus(state: State) -> str:
    """The server's metrics in Prometheus' text format."""
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP megakernel_{name} {help}", f"# TYPE megakernel_{name} {kind}"])
        lines.extend(f"megakernel_{name}{labels} {value}" for labels, value in samples)

    serving_loop = state.serving_loop
    if serving_loop is None:
        metric("ready", "gauge", "1 once the model is compiled.", [("", 0)])
        return "\n".join(lines) + "\n"
    m, pool = serving_loop.metrics, state.model.pool
    metric("ready", "gauge", "1 once the model is compiled.", [("", 0 if serving_loop.failure else 1)])
    metric("requests_total", "counter", "Requests ended, by outcome.",
           [(f'{{outcome="{outcome}"}}', n) for outcome, n in m.requests.items()])
    metric("prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.", [("", m.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", m.generated_tokens)])
    metric("requests_waiting", "gauge", "Requests queued for a batch row or KV pages.", [("", serving_loop.queued)])
    metric("requests_running", "gauge", "Requests in the batch.", [("", len(serving_loop.running))])
    metric("kv_pages_in_use", "gauge", "KV cache pages held by sequences.", [("", pool.pages - len(pool.free))])
    metric("kv_pages", "gauge", "KV cache pages in the pool.", [("", pool.pages)])
    metric("launch_seconds", "histogram", "Time of one launch of the batch (one or more decode steps).",
           [(f'_bucket{{le="{bound}"}}', n) for bound, n in zip(LATENCY_BUCKETS, m.launch_buckets)]
           + [('_bucket{le="+Inf"}', m.launches), ("_sum", m.launch_seconds), ("_count", m.launches)])
    metric("time_to_first_token_seconds", "summary", "From a request's arrival to its first token.",
           [("_sum", m.first_token_seconds), ("_count", m.first_tokens)])
    return "\n".join(lines) + "\n"


# -- processes, ranks and signals -------------------------------------------------------------------------

def serve(options: Options) -> None:
    """Run the server until SIGTERM or Ctrl-C: in this process, or over ``options.tp`` process ranks. Backend
    "auto" is the GPU where there is one, else torch (tiles as torch code: the fast path on a CPU; the
    Triton interpreter, "cpu", only when asked for)."""
    options = replace(options, backend=server_backend(options.backend))
    if options.tp == 1:
        return serve_rank(options)

    def forward(signum, _frame):  # rank 0 stops the others once its requests have ended
        for process in multiprocessing.active_children():
            if process.name == "megakernel-rank-0":
                os.kill(process.pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        launch(partial(serve_rank, options), world_size=options.tp, backend=options.backend, timeout=MAX_TIMEOUT,
               ranks_per_node=options.ranks_per_node)
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve_rank(options: Options) -> None:
    """One rank's part: rank 0 serves HTTP, the others follow its engine."""
    world, rank = current_world()
    if rank > 0:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 says when to stop
            signal.signal(sig, signal.SIG_IGN)
        model = load_model(options)
        try:
            follow(model, Group(world, rank))
        finally:
            model.close()
        return
    sock = listen(options)  # before anything loads: a bad or busy address fails in a second, not after
    state = State(options)
    server = _server(uvicorn_config(options, build_app(state)), state)
    loader = threading.Thread(target=_load, args=(state, server, Group(world, rank), sock.getsockname()[1]),
                              name="megakernel-load")
    loader.start()
    try:
        with sock:
            server.run(sockets=[sock])
    finally:
        server.should_exit = True  # (however the server ended) a loader still compiling starts no engine
        loader.join()
        server.stop_engine()
        if state.engine is not None:
            state.engine.join()
        if state.model is not None:
            state.model.close()
    if state.failure:
        raise RuntimeError(state.failure)


def listen(options: Options) -> socket.socket:
    """The server's listening socket on ``options.host`` and ``options.port``; an ``OSError`` naming the
    address where it cannot be had (in use, no such host, a port out of range)."""
    sock = socket.socket(socket.AF_INET6 if ":" in options.host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait
        sock.bind((options.host, options.port))
        sock.listen(2048)
    except (OSError, OverflowError) as error:
        sock.close()
        raise OSError(f"cannot listen on {options.host}:{options.port}: {getattr(error, 'strerror', None) or error}"
                      ) from None
    return sock


def uvicorn_config(options: Options, app):
    """uvicorn's configuration of the server: its bounds on connections (see the module docstring)."""
    return uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30,
                          limit_concurrency=options.max_connections, http=_protocol(options.idle_timeout))


def _protocol(timeout: float):
    """uvicorn's HTTP/1.1 protocol (h11), which closes a connection that has not sent a request's headers
    within ``timeout`` seconds of opening or of its last response, or whose body pauses longer (uvicorn
    itself waits for headers forever: a few hundred silent clients would hold every socket)."""
    class Protocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.SEND_BODY:  # the body's parts: each within the timeout
                self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            super().connection_lost(exc)
            if self.deadline is not None:
                self.deadline.cancel()

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(timeout, self._expire)

        def _expire(self) -> None:
            # headers not (all) there, or a body stalled; a request received whole is the app's to answer
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def _load(state: State, server, group, port: int) -> None:
    """Compile the model and start its serving loop (a thread), or say why not and stop the server."""
    try:
        state.model = load_model(state.options)  # first: it says what is wrong with a path that is not a model
        state.text = Text.load(state.options.model)
    except Exception as error:  # anything: the server must stop and say why
        state.failure = f"the model did not load: {type(error).__name__}: {error}"
        server.should_exit = True
        return
    if server.should_exit:  # a signal came while the model compiled: serve_rank closes it
        return
    start_engine(state, group)
    host = f"[{state.options.host}]" if ":" in state.options.host else state.options.host
    print(f"megakernel serve: {state.options.served_name} on http://{host}:{port}",
          file=sys.stderr, flush=True)


def start_engine(state: State, group=None) -> None:
    """Start the serving loop over ``state``'s model and text, in a thread: the server is ready."""
    serving_loop = ServingLoop(state.model, state.text, state.options.steps_per_launch, group)
    state.engine = threading.Thread(target=serving_loop.run, name="megakernel-engine")
    state.engine.start()
    state.serving_loop = serving_loop


def _server(config, state: State):
    """uvicorn's server, whose SIGTERM / Ctrl-C first ends the requests in flight (with an error), so that
    its graceful shutdown does not wait for them to finish, and then returns (uvicorn would raise the
    signal again once shut down, killing the process before the engine and its workers are closed)."""
    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):  # the serving loop's lock is reentrant: safe in a signal handler
            self.stop_engine()
            super().handle_exit(sig, frame)

        def stop_engine(self):
            if state.serving_loop is not None:
                state.serving_loop.stop()

    return Server(config)
