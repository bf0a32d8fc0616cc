"""Stop strings across a resumed stream's seam.

vLLM matches a request's ``stop`` strings in the text its own detokenizer made, and holds the last
``longest − 1`` characters of a stream back until they cannot begin one (unless the stop string
is to be included in the output). A continuation's detokenizer begins at the seam, so a stop
string whose first characters came before it — ``"END"`` as ``"E"`` then ``"ND"`` — never
matched: the answer went on past it, and the replay handed the client the characters the first
stream had held back (a stop string's start included).

``SeamStops`` does what the uninterrupted stream's detokenizer would have: the replay keeps the
same characters back (``held``), and the continuation's first outputs are held too while a stop
string that begins before the seam could still complete. One that does ends the stream there —
finish reason ``stop``, the text cut as vLLM cuts it, the engine request aborted by the caller —
and once none can, the held characters go out and the engine's outputs pass through untouched
(vLLM matches the rest within its own text).
"""

from collections.abc import Callable
from typing import Any


class SeamStops:
    """One resumed stream's watch over the stop strings that may span its seam."""

    def __init__(self, stops: list[str], include: bool, min_tokens: int, tail_text: str,
                 decode: Callable[[int], str]):
        self.stops, self.include, self.min_tokens, self.decode = stops, include, min_tokens, decode
        longest = max(len(s) for s in stops)
        # Where a stop string spanning the seam may begin: the tail's last longest − 1 characters.
        self.before = tail_text[max(0, len(tail_text) - (longest - 1)):]
        # What the first stream held back of them, as vLLM does: the replay holds them too.
        self.held = 0 if include else len(self.before)
        # A stop string beginning before the seam has all its characters in the window once the
        # continuation has this many: then none can come.
        self.reach = longest - 1
        # The continuation's text while a match may still span the seam: as vLLM sent it (behind
        # by what its own detokenizer holds back), and decoded here token by token (``decode``,
        # going on from the tail), which is what vLLM matches stop strings in.
        self.sent = self.decoded = ""
        self.tokens = 0
        self.checked_from = 0  # where in ``decoded`` min_tokens was reached: a match must end past it
        self.open = bool(self.before)

    @classmethod
    def of(cls, params: Any, tail_text: str, decode: Callable[[int], str]) -> "SeamStops | None":
        """The watch for a request's sampling ``params`` (the continuation's: ``min_tokens`` is
        what is left of it), or None when it has no stop string."""
        stop = getattr(params, "stop", None)
        stops = [stop] if isinstance(stop, str) else [s for s in stop or () if s]
        if not stops:
            return None
        return cls(stops, bool(getattr(params, "include_stop_str_in_output", False)),
                   getattr(params, "min_tokens", 0) or 0, tail_text, decode)

    def see(self, output: Any) -> bool:
        """One engine output after the seam (a delta of one choice), changed in place to what the
        uninterrupted stream would have sent. True when a stop string spanning the seam ended the
        stream with it: the caller stops the engine."""
        if not self.open or len(output.outputs) != 1:
            return False
        choice = output.outputs[0]
        self.sent += choice.text
        released = len(self.before) - self.held  # what of the window the client has already
        # vLLM does not decode a last token the engine stopped on (EOS, a stop token id) unless
        # stop strings are included: its text completes no stop string.
        stopped_on_token = (output.finished and choice.finish_reason == "stop"
                            and not isinstance(choice.stop_reason, str))
        for i, token in enumerate(choice.token_ids):  # vLLM's rule, token by token
            if stopped_on_token and not self.include and i == len(choice.token_ids) - 1:
                break
            self.decoded += self.decode(token)
            self.tokens += 1
            if self.tokens <= self.min_tokens:
                self.checked_from = len(self.decoded)
                continue
            if (match := self._match()) is not None:
                stop, start = match
                window = self.before + self.decoded
                choice.text = window[released : start + len(stop) if self.include else start]
                choice.token_ids = choice.token_ids[: i + 1]  # vLLM keeps none after the one completing it
                choice.finish_reason, choice.stop_reason = "stop", stop
                output.finished = True
                self.open = False
                return True
        if output.finished or len(self.decoded) >= self.reach:
            choice.text = (self.before + self.sent)[released:]
            self.open = False
        else:
            choice.text = ""  # held: a stop string's start may be in it
        return False

    def _match(self) -> tuple[str, int] | None:
        """vLLM's choice among the stop strings that end in the continuation's text past
        ``checked_from`` — the one completing earliest, ties to the first listed — with where it
        begins, if it begins before the seam (one that begins after it is the engine's to match)."""
        seam, best = len(self.before), None
        window = self.before + self.decoded
        for stop in self.stops:
            start = window.find(stop, max(0, seam + self.checked_from - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[1] + len(best[0])):
                best = (stop, start)
        return best if best is not None and best[1] < seam else None
