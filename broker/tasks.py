"""A tracked set of tasks: every background task of the broker has this owner."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    """Spawns tasks, keeps a strong reference until they finish, logs failures, cancels them on shutdown.

    Done-callbacks ignore cancellation and log any other exception, so no error disappears with an
    unreferenced task (the aiokafka/uvicorn pattern).
    """

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start coro as a task owned by this set."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error("task %s failed: %r", task.get_name(), exc, exc_info=exc)

    async def cancel_all(self, msg: str) -> None:
        """Cancel every task (except the caller) and wait until they are done."""
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel(msg)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
