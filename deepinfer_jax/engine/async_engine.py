"""``AsyncEngine``: one engine thread owns an ``EngineCore``; asyncio code streams from it.

    aengine = AsyncEngine(llm.engine, max_queued=256)
    aengine.start()
    stream = await aengine.add_request(ids, SamplingParams(max_tokens=16))   # validated, admitted
    async for delta in stream:          # RequestOutput deltas (engine.streaming), the last finished
        ...
    aengine.abort(stream.request_id)    # from any thread; the stream ends with finish_reason "abort"
    aengine.stop()

The engine is single-threaded: only the engine thread calls into the ``EngineCore``. Other threads
hand it work through a thread-safe inbox (add, abort, ``call``); it steps while any request is
unfinished and otherwise sleeps on a condition variable (no busy wait). After each step it hands
each request's delta to that request's asyncio queue with ``loop.call_soon_threadsafe``.

Back-pressure: at most ``max_queued`` requests are admitted at once (running, waiting for a slot,
or still in the inbox); one more raises ``EngineOverloaded`` at once instead of queueing without
bound. ``abort`` frees the request's blocks on the engine thread's next turn (before its next
step); blocks it wrote and registered in the prefix cache stay valid for later requests.
Validation (``EngineCore.validate``: ``RequestError`` naming the field) runs on the engine thread,
and ``add_request`` raises it to the caller before any delta.

An exception from ``step()`` ends every request with it (their streams raise it) and leaves the
engine failed (``error``; ``add_request`` raises ``EngineDead``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from concurrent.futures import Future

from deepinfer_jax.engine.sampling_params import SamplingParams
from deepinfer_jax.engine.streaming import DeltaTracker

__all__ = ["AsyncEngine", "EngineDead", "EngineOverloaded", "RequestStream"]

_log = logging.getLogger(__name__)
_END = object()


class EngineOverloaded(RuntimeError):
    """``max_queued`` requests are already admitted; retry later."""


class EngineDead(RuntimeError):
    """The engine thread stopped (``stop()``) or a step failed."""


class RequestStream:
    """The deltas of one admitted request (an async iterator); ``abort()`` ends it early."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.request_id, self._engine, self._queue = request_id, engine, queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it has finished (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class _Entry:
    __slots__ = ("loop", "queue", "tracker")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.tracker = loop, queue, None

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody listens any more
            pass


class AsyncEngine:
    """Runs ``engine`` (an ``EngineCore``) on its own thread; see the module docstring."""

    def __init__(self, engine, max_queued: int = 256, name: str = "engine") -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.engine, self.max_queued = engine, max_queued
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._admitted = 0  # requests in the inbox or in the engine (guarded by _cv)
        self._active: dict[str, _Entry] = {}  # engine thread only
        self._ids = itertools.count()
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.steps = 0  # engine steps run by the thread
        self.aborted = 0  # requests ended by abort() before they finished

    # ---- lifetime ----
    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what runs, end the thread (the ``EngineCore`` is usable from this thread again)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not yet finished (the back-pressure count)."""
        return self._admitted

    # ---- requests ----
    async def add_request(self, prompt_ids, params: SamplingParams, prompt: str | None = None) -> RequestStream:
        """Admit a request; returns its ``RequestStream`` once the engine thread validated it.
        Raises ``EngineOverloaded`` (full), ``RequestError`` (invalid), ``EngineDead``."""
        loop = asyncio.get_running_loop()
        entry = _Entry(loop, asyncio.Queue())
        rid = f"{next(self._ids)}"
        accepted: asyncio.Future = loop.create_future()
        self._submit(("add", rid, list(prompt_ids), params, prompt, entry, accepted), admit=True)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        return RequestStream(self, rid, entry.queue)

    def abort(self, request_id: str) -> None:
        """End a request (thread-safe); its stream gets a last delta with finish_reason "abort"."""
        with self._cv:
            if self._thread is not None:
                self._inbox.append(("abort", request_id))
                self._cv.notify()

    def call(self, fn) -> Future:
        """Run ``fn()`` on the engine thread between two steps (e.g. read ``LLM.stats``); a Future."""
        fut: Future = Future()
        self._submit(("call", fn, fut), admit=False)
        return fut

    def _submit(self, cmd: tuple, admit: bool) -> None:
        with self._cv:
            if self._thread is None or self._stopping or self.error is not None:
                raise EngineDead("the engine is not running" if self.error is None else f"the engine failed: "
                                 f"{self.error!r}")
            if admit:
                if self._admitted >= self.max_queued:
                    raise EngineOverloaded(f"the engine is at capacity ({self.max_queued} requests admitted); "
                                           "retry later")
                self._admitted += 1
            self._inbox.append(cmd)
            self._cv.notify()

    # ---- the engine thread ----
    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not engine.has_unfinished and not self._stopping:
                    self._cv.wait()
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for cmd in commands:
                self._handle(cmd)
            if stopping:
                self._shutdown()
                return
            if not engine.has_unfinished:
                continue
            try:
                engine.step()
            except BaseException as e:  # noqa: BLE001 - every waiting stream must learn it
                _log.exception("engine step failed")
                self._fail(e)
                return
            self.steps += 1
            self._publish()

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, prompt, entry, accepted = cmd
            try:
                self.engine.add_request(ids, params, prompt=prompt, request_id=rid)
            except Exception as e:  # noqa: BLE001 - RequestError (or anything else) goes to the caller
                self._release()
                entry.loop.call_soon_threadsafe(_settle, accepted, e)
                return
            entry.tracker = DeltaTracker(self.engine.requests[rid])
            self._active[rid] = entry
            entry.loop.call_soon_threadsafe(_settle, accepted, None)
        elif kind == "abort":
            if cmd[1] in self._active:
                self.aborted += not self.engine.requests[cmd[1]].finished
                self.engine.abort(cmd[1])
                self._publish_one(cmd[1])
        else:
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():  # the caller gave up waiting
                return
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)

    def _publish(self) -> None:
        for rid in list(self._active):
            self._publish_one(rid)

    def _publish_one(self, rid: str) -> None:
        entry = self._active[rid]
        out = entry.tracker.delta()
        if out is None:
            return
        if out.finished:  # released before the consumer sees the end: it may add a request at once
            del self._active[rid]
            self.engine.requests.pop(rid, None)
            self._release()
        entry.put(out)

    def _release(self) -> None:
        with self._cv:
            self._admitted -= 1

    def _fail(self, error: BaseException) -> None:
        with self._cv:
            self.error = error
            pending = list(self._inbox)
            self._inbox.clear()
        for cmd in pending:
            if cmd[0] == "add":
                cmd[5].loop.call_soon_threadsafe(_settle, cmd[6], EngineDead(f"the engine failed: {error!r}"))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(EngineDead(f"the engine failed: {error!r}"))
        for entry in self._active.values():
            entry.put(EngineDead(f"the engine failed: {error!r}"))
        self._active.clear()

    def _shutdown(self) -> None:
        """Abort every admitted request and finish the step in flight."""
        for rid in list(self._active):
            self.engine.abort(rid)
            self._publish_one(rid)
        try:
            self.engine.drain() if hasattr(self.engine, "drain") else None
        except Exception:  # noqa: BLE001 - shutting down anyway
            _log.exception("draining the engine failed")


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
