"""The OpenAI API as the server reads and answers it: the request bodies (pydantic, strict: a field of
the wrong type is a 400, not coerced), OpenAI's error body, and JSON that cannot fail to encode."""
from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # a stop string's length at most: each new token's text is matched against every stop
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

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


class Json(JSONResponse):
    """JSON with non-ASCII characters escaped: text from a client (a lone surrogate in an error message
    that quotes it) cannot fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()
