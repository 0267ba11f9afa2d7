"""Generated token ids to text, incrementally, with stop strings (`TextAssembler`)."""

from __future__ import annotations

from typing import Any


class TextAssembler:
    """Generated token ids to text deltas, incrementally, held back at stops and split characters.

    As vLLM's detokenizer and transformers' `TextStreamer` do: each step decodes only a
    short window (the tokens since the last emitted text, after a few tokens of context for
    tokenizers that render a token differently at the start), and text that ends inside a
    multi-byte character (U+FFFD) is held back until the character is complete. A character
    still incomplete when the request ends is dropped, never sent as U+FFFD: a client that
    resends the history must get the same tokens back. Also holds back text that could still
    become a stop string, and ends the text at a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context already in text
        self.read_offset = 0
        self.text = ""
        self.sent = 0  # characters handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """The text one more token adds that can be sent now (maybe none)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""  # nothing new yet, or a character split across tokens: wait
        start = len(self.text)
        self.text += window[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stops:
            i = self.text.find(s, max(0, min(self.sent, start) - len(s)))
            if i >= 0:
                self.stopped = True
                self.text = self.text[:i]
                return self._take(len(self.text))
        return self._take(len(self.text) - self.hold)

    def flush(self) -> str:
        """The rest of the text, once the request is over.

        Without an incomplete character at the end."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent:upto]
        self.sent = upto
        return out
