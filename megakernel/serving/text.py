"""Text in and out of a decode model: its tokenizer and chat template, and its tokens turned back into
text as they come, cut at stop strings.

The tokenizer is transformers' ``AutoTokenizer`` of the checkpoint directory, or of the GGUF file (which
keeps its vocabulary, merges and chat template in its metadata); the stop ids are the end-of-sequence
ids of the tokenizer and of the generation config, where there is one.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GraphError

_LOADING = threading.Lock()  # transformers' lazy imports are not thread-safe (models.hf.auto_classes)


@dataclass
class Text:
    """A model's tokenizer (``encode``, ``chat``, ``decode``) and the ids that end its sequences."""

    tokenizer: object
    stop_ids: frozenset[int]

    @classmethod
    def load(cls, path) -> "Text":
        """The tokenizer of a checkpoint directory or a GGUF file."""
        with _LOADING:
            from transformers import AutoTokenizer
        path = Path(path)
        gguf = path.suffix == ".gguf" and path.is_file()
        try:
            tokenizer = (AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True) if gguf
                         else AutoTokenizer.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise GraphError(f"{path}: no tokenizer transformers can read: {type(error).__name__}: {error}") from None
        stop = {tokenizer.eos_token_id} - {None}
        generation = path / "generation_config.json"
        if not gguf and generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            stop |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return cls(tokenizer, frozenset(stop))

    def encode(self, prompt: str) -> list[int]:
        """The ids of ``prompt`` as the tokenizer makes them (its special tokens included, a BOS for those
        that add one)."""
        _check_unicode(prompt, "prompt")
        return self.tokenizer(prompt)["input_ids"]

    def chat(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` ({"role", "content"} dicts) through the model's chat template, ending
        with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise GraphError("this model's tokenizer has no chat template: use /v1/completions with a prompt")
        for i, message in enumerate(messages):
            _check_unicode(message["content"], f"messages.{i}.content")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as error:  # the template is the model's own Jinja: anything it raises is the messages'
            raise GraphError(f"the chat template refused the messages: {type(error).__name__}: {error}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        """One token's own text (for log-probabilities: OpenAI's ``token``)."""
        return self.tokenizer.decode([token_id])

    def streamer(self, stop: list[str]) -> "Streamer":
        return Streamer(self, list(stop))


def _check_unicode(text: str, what: str) -> None:
    """Refuse what is no Unicode text (a lone surrogate, which JSON's ``\\ud800`` makes): the tokenizer
    would fail on it with a TypeError that names nothing."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise GraphError(f"{what}: not valid Unicode: a lone surrogate at character {error.start}") from None


@dataclass
class Streamer:
    """A sequence's text as its tokens come: ``add`` returns what can be shown now. Text that might still
    change (an unfinished UTF-8 character) or that ends with the beginning of a stop string is held back
    until it cannot be one; at a stop string the text ends before it (``stopped``). The pieces returned, with ``finish``'s,
    are the whole text."""

    text: Text
    stop: list[str]
    tokens: list[int] = field(default_factory=list)
    sent: int = 0          # characters of the decoded text already returned
    stopped: bool = False

    def add(self, tokens: list[int]) -> str:
        """The new text that ``tokens`` (the next ones of the sequence) make showable."""
        if self.stopped:
            return ""
        self.tokens += tokens
        full = self.text.decode(self.tokens)
        for stop in self.stop:
            at = full.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                self.stopped = True
                full = full[:at]
        showable = len(full)
        if not self.stopped:
            if full.endswith("\ufffd"):  # a character whose bytes are still coming
                showable -= 1
            shown = full[:showable]  # less what may begin a stop string (servers bound stops' lengths)
            showable -= max((n for stop in self.stop for n in range(1, len(stop)) if shown.endswith(stop[:n])),
                            default=0)
        piece = full[self.sent:max(self.sent, showable)]
        self.sent += len(piece)
        return piece

    def finish(self) -> str:
        """What was held back, once the sequence has ended."""
        if self.stopped:
            return ""
        piece = self.text.decode(self.tokens)[self.sent:]
        self.sent += len(piece)
        return piece
