"""Tool calls parsed out of a model's streamed output text.

What a family writes for a call (Qwen's `<tool_call>{json}</tool_call>`, Mistral's `[TOOL_CALLS]`,
Gemma's, GLM's, Kimi's, ...) is mlx-lm's knowledge, inferred from the chat template when the
tokenizer loads: `tool_call_start`, `tool_call_end` and `tool_parser` of its TokenizerWrapper. The
text is split at those markers with mlx-lm's own TextStateMachine and each call's text handed to
the family's parser, as mlx-lm's server does. (The request side, tools rendered through the chat
template and refused for a model without a format, is in requests.py.)
"""

import json
import uuid

from mlx_lm.generate import TextStateMachine


class ToolCallText:
    """Splits streamed output text into content and tool calls.

    Text that may still be the start of a call's marker is held back until the next piece
    decides (as StopText does for stop strings); a call is returned once its end marker arrives,
    whole (OpenAI's streamed tool-call delta, with all its arguments at once). A call whose text
    does not parse (cut off by max_tokens, malformed JSON) is returned as the text it was, markers
    included, rather than dropped."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
        self.parser, self.tools = tokenizer.tool_parser, tools
        edges = {"normal": [(self.start, "tool")],
                 "tool": [(self.end, "normal")] if self.end else []}
        self._state = TextStateMachine(edges).make_state("normal")
        self._call: str | None = None  # the text of the call being read, None outside one
        self.made_call = False  # a call was returned: the finish reason is "tool_calls"

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) that `text` completed."""
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self) -> tuple[str, list[dict]]:
        """What is left when the output ends: held text, and a call no end marker closed
        (formats without one, Mistral's, end their calls here)."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        content, calls = self._collect([(state, rest)])
        if self._call is not None:
            closed, more = self._close(end="")
            content, calls = content + closed, calls + more
        return content, calls

    def _collect(self, segments) -> tuple[str, list[dict]]:
        content, calls = "", []
        for state, text in segments:
            if state == "tool":
                self._call = (self._call or "") + text
                continue
            if self._call is not None:  # the end marker closed it
                closed, more = self._close(end=self.end)
                content, calls = content + closed, calls + more
            content += text
        return content, calls

    def _close(self, *, end: str) -> tuple[str, list[dict]]:
        """The call just read: ("", its calls), or (its text, []) when it does not parse."""
        text, self._call = self._call, None
        calls = self._parse(text)
        if calls is None:
            return self.start + text + end, []
        self.made_call = True
        return "", calls

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.parser(text, self.tools)
        except Exception:  # noqa: BLE001  (each family's parser raises its own kinds)
            return None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        if not parsed or not all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                 for p in parsed):
            return None
        return [_openai_call(p) for p in parsed]


def _openai_call(parsed: dict) -> dict:
    """A parsed call in OpenAI's shape, its arguments as a JSON string."""
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments}}


__all__ = ["ToolCallText"]
