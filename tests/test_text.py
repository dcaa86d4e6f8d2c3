"""Text out of tokens as they come: what can be shown now, what is held back, where a stop string cuts."""
from megakernel.serving import Text


class Pieces:
    """A tokenizer whose token i is ``PIECES[i]``, bytes joined then decoded as UTF-8 (as byte-level BPE)."""

    PIECES = [b"Hel", b"lo", b" wor", b"ld", b"!", b"\xe2\x82", b"\xac", b" END", b"ING", b" E", b"ND"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def stream(tokens: list[list[int]], stop: list[str]) -> tuple[list[str], bool]:
    streamer = Text(Pieces(), frozenset()).streamer(stop)
    pieces = [streamer.add(chunk) for chunk in tokens]
    return pieces + [streamer.finish()], streamer.stopped


def test_text_comes_as_tokens_do_and_joins_to_the_whole():
    pieces, stopped = stream([[0], [1, 2], [3, 4]], [])
    assert pieces == ["Hel", "lo wor", "ld!", ""] and not stopped


def test_an_unfinished_character_waits_for_its_bytes():
    pieces, _ = stream([[0, 5], [6], [4]], [])
    assert pieces == ["Hel", "\u20ac", "!", ""]


def test_a_stop_string_ends_the_text_before_it_even_across_tokens():
    pieces, stopped = stream([[0, 1], [9], [10], [4]], [" END"])
    assert pieces == ["Hello", "", "", "", ""] and stopped  # " E" + "ND": the stop string, across two tokens
    pieces, stopped = stream([[0, 1], [9], [3]], ["ld"])
    assert "".join(pieces) == "Hello E" and stopped  # " E" then "ld": "Eld" holds the stop "ld"
    pieces, stopped = stream([[0, 1, 7, 8]], ["END"])
    assert pieces[0] == "Hello " and stopped


def test_what_could_begin_a_stop_string_is_held_back_until_it_cannot():
    pieces, stopped = stream([[0, 1], [9], [4]], [" END"])
    assert pieces == ["Hello", "", " E!", ""] and not stopped  # " E" held while " END" could follow
