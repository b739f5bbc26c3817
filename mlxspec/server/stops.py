"""Stop strings over streamed text: honoured across token boundaries and inside accepted blocks.

Text arrives in pieces (one per committed token; several tokens of an accepted block arrive
one after another). A stop string may start in one piece and end in a later one, so the tail
of the text that could still be the start of a stop string is held back until the next piece
decides; what is emitted never contains a stop string or anything after it.
"""


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text safe to emit after `piece` arrived ("" once a stop string was seen)."""
        if self.stopped:
            return ""
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held back when the text ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
