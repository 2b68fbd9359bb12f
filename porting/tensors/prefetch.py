"""Producing items on a second thread ahead of their consumer, with the bytes in flight bounded.

The writer reads (or dequantizes) the next pieces while the main thread writes the last ones; file reads, hashlib,
numpy and torch all release the GIL, so the threads really run at the same time.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

__all__ = ["prefetched", "ByteBudget"]


def prefetched(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """`items`, produced on a second thread up to `depth` ahead. The producer's error is raised in the consumer;
    a consumer that stops early (an error, Ctrl-C) stops the producer."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(end)
        except BaseException as e:  # handed to the consumer
            put(e)

    thread = threading.Thread(target=produce, name="flux-port-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = buffer.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


class ByteBudget:
    """At most `limit` bytes handed out at a time, except that one piece of any size passes when none is out.

    The producer takes before it hands a piece on and the consumer gives back once the piece is written, so the
    memory held ahead of the writer stays at about `limit` whatever the pieces' sizes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.closed = False
        self._cond = threading.Condition()

    def take(self, n: int) -> bool:
        """Wait until `n` bytes fit; False once `close()` was called (the consumer is gone)."""
        with self._cond:
            while not self.closed and self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n
            return not self.closed

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
