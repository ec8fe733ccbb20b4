"""Every output token of a request reaches its client once and in order, or the request fails.

Delivery on the bus is at-least-once: a worker repeats a publish whose answer it lost, and a
re-dispatched request resumes from its delivered record, which can be shorter than what this
gateway already has (a Redis restart that lost its last writes). So rows can repeat tokens, and a
lost write can leave a hole. Each row says where it ends (`TokenEvent.num_output_tokens`: the
request's output tokens so far, across a resume), so its start position is known:

- start == received: the next tokens, delivered.
- start < received: a duplicate, dropped, if its tokens are those already delivered. One that
  disagrees, or runs past them (partly new: its text delta cannot be cut at a token), is another
  continuation of the request: it fails.
- start > received: a gap. The row is held until the missing ones come (a replay), for at most
  `replay_timeout_s`; then the request fails. A finish is never delivered over a gap.

An event carrying an error ends the request whatever its position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.protocol import ErrorInfo, TokenEvent

DEFAULT_REPLAY_TIMEOUT_S = 30.0
"""How long a gap in a request's output may stay open before the request fails."""


@dataclass
class Continuity:
    """One request's delivered tokens and the rows held behind a gap."""

    request_id: str
    replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S
    received: list[int] = field(default_factory=list)
    """Token ids delivered to the client, in order."""
    held: list[TokenEvent] = field(default_factory=list)
    """Rows that start past `received`, in arrival order."""
    gap_since: float | None = None
    """When a gap opened (time.monotonic), while one is open."""

    def accept(self, event: TokenEvent) -> list[TokenEvent]:
        """The events to deliver now, in order (none while a gap is open); the last one may end
        the request (finished, or an error)."""
        if event.error is not None:
            return [event]
        self.held.append(event)
        ready: list[TokenEvent] = []
        while (row := self._next_held()) is not None:
            delivered = self._take(row)
            if delivered is not None:
                ready.append(delivered)
                if delivered.finished or delivered.error is not None:
                    return ready
        if self.held and self.gap_since is None:
            self.gap_since = time.monotonic()
        elif not self.held:
            self.gap_since = None
        return ready

    def accept_all(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """`accept` of each in turn, up to the event that ends the request."""
        ready: list[TokenEvent] = []
        for event in events:
            ready += self.accept(event)
            if ready and (ready[-1].finished or ready[-1].error is not None):
                break
        return ready

    def wait_s(self, idle_timeout_s: float) -> float:
        """How long to wait for the next row: `idle_timeout_s`, or less while a gap is open."""
        if self.gap_since is None:
            return idle_timeout_s
        return max(0.0, min(idle_timeout_s, self.gap_since + self.replay_timeout_s - time.monotonic()))

    def timeout_error(self) -> TokenEvent | None:
        """The error to end the request with once a wait timed out over an open gap (None if none
        is open: the caller's own idle timeout applies)."""
        if not self.held:
            return None
        first_held = min(self._start(row) for row in self.held)
        return self._error(
            f"output tokens {len(self.received)} to {first_held - 1} of request {self.request_id} "
            f"were lost in the mesh and not replayed within {self.replay_timeout_s:g} s"
        )

    def _next_held(self) -> TokenEvent | None:
        """The held row that starts first, if it starts at or before what was delivered."""
        if not self.held:
            return None
        row = min(self.held, key=self._start)
        if self._start(row) > len(self.received):
            return None
        self.held.remove(row)
        return row

    def _take(self, row: TokenEvent) -> TokenEvent | None:
        """The row to deliver (it starts where the client is), None for a duplicate, or an error
        for a row that contradicts what was delivered."""
        start, end = self._start(row), row.num_output_tokens
        if start == len(self.received):
            self.received += row.token_ids
            return row
        if end <= len(self.received) and self.received[start:end] == row.token_ids:
            return None
        return self._error(
            f"the mesh sent tokens {start} to {end - 1} of request {self.request_id}, which differ "
            f"from the {len(self.received)} already streamed"
        )

    @staticmethod
    def _start(row: TokenEvent) -> int:
        return row.num_output_tokens - len(row.token_ids)

    def _error(self, message: str) -> TokenEvent:
        error = ErrorInfo(code=500, type="server_error", message=message)
        return TokenEvent(request_id=self.request_id, finished=True, finish_reason="error", error=error)
