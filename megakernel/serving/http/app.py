"""The OpenAI HTTP API over the serving loop (FastAPI): ``build_app(State(options))``.

``GET /v1/models``; ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the model's chat
template), streamed as server-sent events ending with ``data: [DONE]`` when ``stream`` is true;
``GET /health`` (200 once the model is compiled, 503 before, or after the engine failed);
``GET /metrics`` (Prometheus text). Requests join the running batch (``serving.ServingLoop``),
waiting while its rows or KV pages are full; a client that disconnects cancels its sequence; a bad
request is a 400 with OpenAI's error body (``schemas``), and so is every error, unknown paths and
methods included.

Parameters as OpenAI's: ``max_tokens`` (chat: ``max_completion_tokens`` too; default 16 for completions,
the rest of the context for chat), ``temperature`` (default 1; 0 is greedy), ``top_p``, ``seed``,
``stop`` (a string or up to 4), ``logprobs`` (completions: how many most likely tokens; chat: true with
``top_logprobs``), ``stream_options.include_usage``; and vLLM's ``top_k`` and ``min_p``. One choice per
request (``n`` = 1). Log-probabilities are the model's, before temperature and filters. Tokenizing and
chat templates run in a thread of their own, off the event loop.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ...errors import GraphError
from ...models.serving_config import SERVER, ServingConfig
from ..engine import DecodeModel
from ..sampling_params import SamplingParams
from .. import loop
from ..loop import LATENCY_BUCKETS, ServingLoop
from ..text import Text
from .guards import BodyLimit
from .schemas import COMPLETION_MAX_TOKENS, Chat, Completion, Json, RequestError


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
    events, updates = asyncio.get_running_loop(), asyncio.Queue()
    request = loop.Request(prompt=ids, max_tokens=max_tokens, sampling=sampling, stop=stop,
                           emit=lambda update: events.call_soon_threadsafe(updates.put_nowait, update))
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
