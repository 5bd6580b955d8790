"""Output text and stop strings."""

from __future__ import annotations

from batchgen.engine.request import Request


class Detokenizer:
    """Turns output tokens into text and finds stop strings in it.

    For a request with stop strings, the text is re-decoded after each token and
    searched from where the previous search could no longer match; others are decoded
    once, when they finish.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, req: Request) -> str:
        return self.tokenizer.decode(
            req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens
        )

    def find_stop(self, req: Request) -> str | None:
        """Search the new text for a stop string; on a hit, cut req.text and return it."""
        stops = req.params.stop_strings
        if not stops:
            return None
        text = self.decode(req)
        longest = max(len(s) for s in stops)
        begin = max(0, len(req.text) - longest + 1)
        req.text = text
        hit: tuple[int, str] | None = None
        for s in stops:
            at = text.find(s, begin)
            if at >= 0 and (hit is None or at < hit[0]):
                hit = (at, s)
        if hit is None:
            return None
        at, s = hit
        req.text = text[: at + len(s)] if req.params.include_stop_str_in_output else text[:at]
        return s

    def finalize(self, req: Request) -> None:
        """Set the final text of a request not cut by a stop string."""
        if req.stop_reason is None or not isinstance(req.stop_reason, str):
            req.text = self.decode(req)
