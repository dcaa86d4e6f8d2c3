"""The OpenAI HTTP server over the serving loop (FastAPI and uvicorn: the ``serve`` extra, imported by
``megakernel serve`` only): the request bodies and error body (``schemas``), the application
(``app``), the bounds on hostile clients (``guards``)."""
