"""Token ids to text as they are accepted, with OpenAI's stop strings: what a server streams.

A step can accept several tokens, and a token can end a character (or a stop string) that an earlier
one began, so the whole output is decoded each time and only text that can no longer change is sent:
trailing U+FFFD (an unfinished UTF-8 sequence: byte-fallback tokenizers show one per pending byte) and a tail that could still grow into a stop string
are held back. When a stop string appears, the text ends before it (it is not returned, as in OpenAI's
API) and the tokens counted are those up to the one that completed it.
"""

from __future__ import annotations


class TextStream:
    """One request's output text, fed token ids step by step."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far (cut at the stop string once it appeared)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string ended the output

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, new_tokens: list[int]) -> str:
        """Take a step's new tokens; returns the text that is now final (maybe "")."""
        if self.stopped:
            return ""
        if not self.stop:
            self.tokens.extend(new_tokens)
            self.text = self._decode(self.tokens)
            return self._release(len(self.text.rstrip("\ufffd")))
        longest = max(len(s) for s in self.stop)
        for token in new_tokens:  # token by token: the count of tokens kept ends at the stop string
            self.tokens.append(token)
            text = self._decode(self.tokens)
            # A stop string ends after the text already sent (a held-back tail may begin it).
            where = [i for i in (text.find(s, max(0, self.sent - longest + 1)) for s in self.stop) if i >= 0]
            if where:
                self.text, self.stopped = text[: min(where)], True
                return self._release(len(self.text))
            self.text = text
        end = len(self.text.rstrip("\ufffd"))
        # Hold back the longest tail that is the beginning of a stop string.
        for size in range(min(longest - 1, end - self.sent), 0, -1):
            tail = self.text[end - size : end]
            if any(s.startswith(tail) for s in self.stop):
                end -= size
                break
        return self._release(end)

    def finish(self) -> str:
        """The output ended (EOS or length): whatever was held back."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece
