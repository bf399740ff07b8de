"""Server-sent events (the text/event-stream of `…/events` and `…/logs?follow=true`), parsed
as the WHATWG HTML standard's "event stream interpretation" says."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    event: str
    data: str
    id: str | None


def events(lines: Iterable[bytes]) -> Iterator[Event]:
    """The events of a stream given line by line; comments (the server's keep-alives) and
    fields this client has no use for (`retry`) are skipped."""
    name = ""
    data: list[str] = []
    last_id: str | None = None
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield Event(name or "message", "\n".join(data), last_id)
            name, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            last_id = value
