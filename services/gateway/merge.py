"""Several async iterators as one, items tagged with their iterator's index, in the order
they come. An error in one ends them all (raised to the reader); leaving early closes every
iterator (so each runs its own clean-up, e.g. aborting its request)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def merged(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(source) as items:  # type: ignore[type-var]
                async for item in items:
                    queue.put_nowait((index, item))
        except Exception as exc:  # handed to the reader, raised there
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
