"""``megakernel serve``: a model behind the OpenAI HTTP API (``serving.http``), over continuous batching.

This module runs it: the model loaded and compiled in a thread while the server already answers
(``GET /health`` says 503 until it is ready), uvicorn with the bounds of ``serving.http.guards``, and the
ranks: with ``--tp N`` they are processes (``launch``): rank 0 serves HTTP and leads the others' engines
(``serving.follow``). SIGTERM (or Ctrl-C) ends the requests in flight with an error, then stops.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from functools import partial

import torch
import uvicorn

from ..backends import gpu_flavour
from ..bootstrap import Group, current_world
from ..errors import MAX_TIMEOUT
from ..launcher import launch
from ..serving import DecodeModel, ServingLoop, Text, follow, from_pretrained
from ..serving.http.app import Options, State, build_app
from ..serving.http.guards import uvicorn_config


def server_backend(backend: str) -> str:
    """``serve``'s backend for ``backend``: "auto" the GPU if there is one, else torch."""
    return (gpu_flavour() or "torch") if backend == "auto" else backend


def load_model(options: Options) -> DecodeModel:
    """This rank's ``DecodeModel`` of ``options.model``."""
    kernel = {"backend": options.backend} | ({"workers": options.workers} if options.workers else {})
    dtype = None if options.dtype == "auto" else getattr(torch, options.dtype)
    return from_pretrained(options.model, options.serving, dequantize=options.dequantize, dtype=dtype, **kernel)


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
    server = _server(uvicorn_config(build_app(state), options.max_connections, options.idle_timeout), state)
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
