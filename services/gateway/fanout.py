"""One HTTP request's choices as one stream: its sub-requests' events merged in arrival order.

Each sub-request (one per choice) is followed by its own pump task; events reach the handler
tagged with the choice index, in order within a choice. A request of one choice (most) is
followed by the handler itself, with no task between. Leaving the `async with` (normally, on an
error, or because the client went away and the handler was cancelled) cancels, in the mesh, every
sub-request that has not finished, so workers free their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from types import TracebackType

from services.gateway.backend import MeshBackend, error_event
from shared.bus import stop_tasks
from shared.protocol import GenerateRequest, TokenEvent

logger = logging.getLogger(__name__)


class FanOut:
    """`async with FanOut(backend, requests) as fanout:` then `await fanout.next()` until None."""

    def __init__(self, backend: MeshBackend, requests: list[GenerateRequest]):
        self.backend = backend
        self.requests = requests
        self.cancel_reason = "client disconnected"
        self._queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self._pumps: list[asyncio.Task[None]] = []
        self._events: AsyncGenerator[tuple[int, TokenEvent], None] | None = None
        """One choice: its events, which `next` reads itself (no task and queue between)."""
        self._unfinished = set(range(len(requests)))

    async def __aenter__(self) -> FanOut:
        followers = [self._follow(index, request) for index, request in enumerate(self.requests)]
        if len(followers) == 1:
            self._events = followers[0]
            return self
        self._pumps = [
            asyncio.create_task(self._pump(events), name=f"follow-{request.request_id}")
            for events, request in zip(followers, self.requests)
        ]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Shielded: the handler may itself be being cancelled (client gone); the cancels must go out.
        await asyncio.shield(self._close())

    async def next(self) -> tuple[int, TokenEvent] | None:
        """The next (choice index, event), in order within a choice; None once every choice has
        finished or failed."""
        if not self._unfinished:
            return None
        if self._events is not None:
            index, event = await anext(self._events)
        else:
            index, event = await self._queue.get()
        if event.finished or event.error is not None:
            self._unfinished.discard(index)
        return index, event

    async def _pump(self, events: AsyncGenerator[tuple[int, TokenEvent], None]) -> None:
        async for item in events:
            self._queue.put_nowait(item)

    async def _follow(
        self, index: int, request: GenerateRequest
    ) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """One sub-request's events to its end, then an error event where the backend's iterator
        ended before the request did or failed; cancelled or closed, it stops following."""
        ended = False
        events = self.backend.submit(request)
        try:
            async for event in events:
                ended = event.finished or event.error is not None
                yield index, event
            message = "the mesh ended the request's event stream before it finished"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("following %s failed", request.request_id)
            message = f"following the request failed: {type(exc).__name__}"
        finally:
            await events.aclose()
        if not ended:
            yield index, error_event(request.request_id, 500, "server_error", message)

    async def _close(self) -> None:
        """Stops following every choice, and cancels in the mesh those that have not finished."""
        await stop_tasks(self._pumps)
        if self._events is not None:
            await self._events.aclose()
        await asyncio.gather(
            *(self.backend.cancel(self.requests[i].request_id, self.cancel_reason) for i in self._unfinished),
            return_exceptions=True,
        )
