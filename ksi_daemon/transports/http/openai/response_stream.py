"""The server-sent events of one response, in the order the official SDKs accumulate, each with
its `sequence_number`. The numbers follow from the answer's chunks alone (four opening events,
one delta per chunk, then the closing ones), so a stream read again from a background response's
kept chunks numbers every event as the first reading did, and `starting_after` means the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ksi_daemon.transports.http.openai.shapes import message_item, output_text

OPENING = 4  # response.created, response.in_progress, output_item.added, content_part.added
CLOSING_DONE = 4  # output_text.done, content_part.done, output_item.done, response.completed
CLOSING_FAILED = 1  # response.failed

# a Response status at its end -> the event that says so
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed", "cancelled": "response.failed"}


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def last_sequence(chunks: int, succeeded: bool) -> int:
    """The sequence number of the last event of a stream that ended after `chunks` chunks."""
    return OPENING + chunks + (CLOSING_DONE if succeeded else CLOSING_FAILED) - 1


def chunks_before(starting_after: int) -> int:
    """How many chunks a client that saw every event up to `starting_after` has seen."""
    return max(0, starting_after - OPENING + 1)


@dataclass(slots=True)
class ResponseEvents:
    """The numbered events of the response `response_id` (its KSI id)."""

    response_id: str

    def _where(self) -> dict[str, Any]:
        return {"item_id": f"msg_{self.response_id}", "output_index": 0, "content_index": 0}

    def opening(self, created: dict[str, Any], in_progress: dict[str, Any]) -> list[dict[str, Any]]:
        """Events 0 to 3, given the Response object as created and as running."""
        return [
            {"type": "response.created", "sequence_number": 0, "response": created},
            {"type": "response.in_progress", "sequence_number": 1, "response": in_progress},
            {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
             "item": message_item(self.response_id, "", status="in_progress")},
            {"type": "response.content_part.added", "sequence_number": 3, **self._where(), "part": output_text("")},
        ]

    def delta(self, index: int, text: str) -> dict[str, Any]:
        """The event of chunk `index` (counting the non-empty chunks from 0)."""
        return {"type": "response.output_text.delta", "sequence_number": OPENING + index, **self._where(),
                "delta": text, "logprobs": []}

    def closing(self, chunks: int, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The events after `chunks` chunks, given the final Response object."""
        number = OPENING + chunks
        status = final["status"]
        if status not in ("completed", "incomplete"):
            return [{"type": FINAL_EVENTS.get(status, "response.failed"), "sequence_number": number,
                     "response": final}]
        text = "".join(part["text"] for item in final["output"] for part in item.get("content") or [])
        where = self._where()
        return [
            {"type": "response.output_text.done", "sequence_number": number, **where, "text": text, "logprobs": []},
            {"type": "response.content_part.done", "sequence_number": number + 1, **where,
             "part": output_text(text)},
            {"type": "response.output_item.done", "sequence_number": number + 2, "output_index": 0,
             "item": message_item(self.response_id, text, status=final["output"][0]["status"])},
            {"type": FINAL_EVENTS[status], "sequence_number": number + 3, "response": final},
        ]
