"""Layer-streamed KV export: a request handed off to a decode instance sends its target KV layer by
layer while its prefill still computes the later layers.

In a step that carries prefill chunks of such requests, the model calls `after_layer(i)` once layer
i's forward (its KV write included) is queued. On a GPU the streamer then has a copy stream wait for
the compute stream there and copy that layer's blocks of each such request into the request's
page-locked host buffer, so that the copies run under the later layers' compute; a thread waits for
each layer's copy and hands the layer to the sink (the engine core sends it on to its worker). On
the CPU a layer is done when the call returns: it is copied and handed over at once.

A request's host buffer fills chunk by chunk: each step copies the blocks its chunk wrote (and any
before them not copied yet: prefix-cached ones, or all of them again after a preemption), and hands
over each layer's blocks that the chunk completed and no step handed over yet (the last chunk: the
rest), so a long prompt's earlier chunks go out while the later ones compute.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.kv_export import KVLayers
from shared.model.llama import KVCache


@dataclass
class HostKV:
    """A request's target KV on the host, filled chunk by chunk."""

    keys: torch.Tensor  # [num_layers, num_blocks, block_size, kv_heads, head_dim]
    values: torch.Tensor  # [num_layers, num_blocks, block_size, kv_heads, head_dim]
    num_tokens: int
    """Tokens the buffer holds once the request's prefill is done."""
    num_copied_tokens: int = 0
    """Tokens whose blocks a step copied (or is copying)."""
    num_sent_blocks: int = 0
    """Leading blocks handed over (each layer's)."""


@dataclass
class ChunkCopy:
    """What one step copies of one request: its blocks `block_ids` into its host blocks from
    `first_block` on; then it hands over host blocks `sent` of each layer."""

    request_id: str
    host: HostKV
    block_ids: list[int]
    first_block: int
    sent: slice


class LayerStreamer:
    """Copies the KV of requests to hand off to the host layer by layer as a step's forward passes
    each layer, and hands the blocks each chunk completed to `sink` (from a thread of its own on a
    GPU, once the layer's copy is done)."""

    def __init__(self, caches: list[KVCache], block_size: int, sink: Callable[[KVLayers], None]):
        self.caches = caches
        self.block_size = block_size
        self.sink = sink
        self.device = caches[0][0].device
        self.requests: dict[str, HostKV] = {}
        self.copies: list[ChunkCopy] = []
        """The step under way's copies (empty: the step streams nothing)."""
        self._block_ids: torch.Tensor | None = None  # [num_step_blocks] the copies' blocks, in order
        self._copy_stream: torch.cuda.Stream | None = None
        self._copied: queue.Queue[tuple[torch.cuda.Event, KVLayers] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
            self._thread = threading.Thread(target=self._hand_over_copied, name="kv-stream", daemon=True)
            self._thread.start()

    def open(self, request_id: str, num_tokens: int) -> None:
        """A host buffer for the request's `num_tokens` tokens (page-locked on a GPU)."""
        key_cache = self.caches[0][0]
        num_blocks = -(-num_tokens // self.block_size)
        shape = (len(self.caches), num_blocks, *key_cache.shape[1:])
        pinned = self.device.type == "cuda"
        self.requests[request_id] = HostKV(
            torch.empty(shape, dtype=key_cache.dtype, pin_memory=pinned),
            torch.empty(shape, dtype=key_cache.dtype, pin_memory=pinned),
            num_tokens,
        )

    def chunk(self, request_id: str, block_table: list[int], start: int, end: int) -> ChunkCopy:
        """The copy of a step computing the request's tokens [start, end): the blocks from the one
        holding the first token not copied yet (or `start`'s, where the chunk goes back: after a
        preemption) through the one holding token `end - 1`. It hands over the blocks the chunk
        completed that no chunk handed over yet (the last chunk: all the rest)."""
        host = self.requests[request_id]
        first_block = min(host.num_copied_tokens, start) // self.block_size
        end_block = -(-end // self.block_size)
        full_blocks = end_block if end >= host.num_tokens else end // self.block_size
        sent = slice(host.num_sent_blocks, max(host.num_sent_blocks, full_blocks))
        host.num_copied_tokens, host.num_sent_blocks = end, sent.stop
        return ChunkCopy(request_id, host, block_table[first_block:end_block], first_block, sent)

    def start_step(self, copies: list[ChunkCopy]) -> None:
        """The copies of the step about to be launched (none: it streams nothing)."""
        self.copies = copies
        self._block_ids = None
        if not copies:
            return
        block_ids = [block for copy in copies for block in copy.block_ids]
        self._block_ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self._copy_stream is not None:
            self._block_ids.record_stream(self._copy_stream)

    @property
    def active(self) -> bool:
        """Whether the step under way streams (its forward must then run layer by layer, eagerly)."""
        return bool(self.copies)

    def after_layer(self, index: int) -> None:
        """Layer `index` of the step's forward is queued: copy its blocks of the step's requests."""
        if not self.copies:
            return
        layers = self._layers(index)
        if self._copy_stream is None:
            self._copy(index)
            if layers.request_ids:
                self.sink(layers)
            return
        done = torch.cuda.Event(blocking=True)  # its waiter sleeps: the core's step keeps its CPU
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            self._copy(index)
            done.record()
        if layers.request_ids:
            self._copied.put((done, layers))

    def _layers(self, index: int) -> KVLayers:
        """The blocks of layer `index` the step hands over (views of the requests' host buffers)."""
        sending = [copy for copy in self.copies if copy.sent.stop > copy.sent.start]
        return KVLayers(
            index,
            [copy.request_id for copy in sending],
            [copy.sent.start for copy in sending],
            [copy.host.keys[index, copy.sent] for copy in sending],
            [copy.host.values[index, copy.sent] for copy in sending],
        )

    def _copy(self, index: int) -> None:
        """Layer `index`'s blocks of the step's requests into their host buffers (on the current stream)."""
        assert self._block_ids is not None
        key_cache, value_cache = self.caches[index]
        keys = key_cache.index_select(0, self._block_ids)  # [num_step_blocks, block_size, heads, head_dim]
        values = value_cache.index_select(0, self._block_ids)
        offset = 0
        for copy in self.copies:
            blocks = slice(copy.first_block, copy.first_block + len(copy.block_ids))
            step_blocks = slice(offset, offset + len(copy.block_ids))
            copy.host.keys[index, blocks].copy_(keys[step_blocks], non_blocking=True)
            copy.host.values[index, blocks].copy_(values[step_blocks], non_blocking=True)
            offset += len(copy.block_ids)

    def finish_step(self) -> None:
        """After the step's forward: every layer it streams is handed over, and later device work
        waits for its copies (blocks freed after the step must not be written before they are read).
        Raises what the sink raised."""
        if not self.copies:
            return
        self.copies = []
        if self._copy_stream is not None:
            self._copied.join()
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        error, self._error = self._error, None
        if error is not None:
            raise error

    def forget(self, request_id: str) -> None:
        """Drops the request's host buffer (it was handed off, or ended)."""
        self.requests.pop(request_id, None)

    def close(self) -> None:
        if self._thread is not None:
            self._copied.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def _hand_over_copied(self) -> None:
        """The thread: each queued layer to the sink once its copy is done (after a failed hand-over,
        the rest of the step's are dropped: `finish_step` raises)."""
        while (item := self._copied.get()) is not None:
            done, layers = item
            try:
                if self._error is None:
                    done.synchronize()
                    self.sink(layers)
            except BaseException as exc:  # noqa: BLE001 - raised again on the step's thread
                self._error = exc
            finally:
                self._copied.task_done()
        self._copied.task_done()
