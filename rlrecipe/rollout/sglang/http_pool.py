"""Many concurrent HTTP POSTs to many servers from one thread: an asyncio loop running aiohttp.

The SGLang engine keeps thousands of `/generate` requests open at the 7B recipe's scale (512
prompts x 16 samples over 64 servers). One thread and one connection pool serve them all; a
semaphore per server bounds what is open on each, and every request has its own read timeout, so
a server that stops answering fails its requests instead of holding them forever. (aiohttp, not
httpx: httpx's connection pool slows down quadratically with the connections open; figures in
docs/performance.md.)

Requests are handed in from any thread with `submit`, which returns a `concurrent.futures.Future`.
A request still waiting for its server's semaphore can be withdrawn (`withdraw`); once sent it
cannot, because only the server can end it with a partial answer (an abort).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import aiohttp

from rlrecipe.rollout.sglang.api_key import client_headers

CONNECT_TIMEOUT_S = 30.0


class PostFailed(Exception):
    """The server did not answer: refused, reset, or silent past the read timeout (`timed_out`)."""

    def __init__(self, server: int, err: Exception, timed_out: bool):
        super().__init__(str(err) or type(err).__name__)
        self.server, self.err, self.timed_out = server, err, timed_out


@dataclass(eq=False)
class Post:
    """One request: where it goes, what it carries, how long its answer may take."""

    server: int
    url: str
    body: dict
    read_timeout_s: float
    sent: bool = False
    withdrawn: bool = False
    future: Future | None = field(default=None, repr=False)


class HttpPool:
    def __init__(self, num_servers: int, max_concurrency: int, key: str | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-pool", daemon=True)
        self._thread.start()
        self._claims = threading.Lock()  # `sent` vs `withdrawn`: decided once, from either thread

        async def make():
            # the session and semaphores belong to the loop they are made on
            connector = aiohttp.TCPConnector(limit=num_servers * max_concurrency, limit_per_host=max_concurrency)
            return (aiohttp.ClientSession(connector=connector, headers=client_headers(key)),
                    [asyncio.Semaphore(max_concurrency) for _ in range(num_servers)])

        self._client, self._sems = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        self._tasks: list[set[asyncio.Task]] = [set() for _ in range(num_servers)]  # loop thread only
        self._down: set[int] = set()  # loop thread only
        self._closed = False

    def submit(self, post: Post) -> Future:
        """Send when the server has room; the future holds (status code, body text) or PostFailed."""
        post.future = asyncio.run_coroutine_threadsafe(self._send(post), self._loop)
        return post.future

    def open_requests(self) -> int:
        """Requests submitted and not answered yet, sent or waiting for room (read from any thread)."""
        return sum(len(tasks) for tasks in list(self._tasks))

    def withdraw(self, post: Post) -> bool:
        """Withdraw a request not sent yet (its future then holds None); False once it was sent."""
        with self._claims:
            if post.sent:
                return False
            post.withdrawn = True
            return True

    async def _send(self, post: Post) -> tuple[int, str] | None:
        task = asyncio.current_task()
        self._tasks[post.server].add(task)
        try:
            async with self._sems[post.server]:
                if post.server in self._down:
                    raise PostFailed(post.server, ConnectionError("server left out"), timed_out=False)
                with self._claims:
                    if post.withdrawn:
                        return None
                    post.sent = True
                # sock_read: the longest silence allowed while the answer is awaited
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                                sock_read=post.read_timeout_s)
                try:
                    async with self._client.post(post.url, json=post.body, timeout=timeout) as r:
                        return r.status, await r.text()
                except (TimeoutError, aiohttp.ServerTimeoutError) as err:
                    connect = isinstance(err, aiohttp.ConnectionTimeoutError)
                    raise PostFailed(post.server, err, timed_out=not connect) from None
                except aiohttp.ClientError as err:
                    raise PostFailed(post.server, err, timed_out=False) from None
        except asyncio.CancelledError:
            if post.server in self._down:  # cut short by mark_down: the caller sends it elsewhere
                raise PostFailed(post.server, ConnectionError("server left out"), timed_out=False) from None
            raise
        finally:
            self._tasks[post.server].discard(task)

    def mark_down(self, server: int) -> None:
        """Fail every request to `server`, sent or waiting, now and from now on."""
        def cut():
            self._down.add(server)
            for task in list(self._tasks[server]):
                task.cancel()
        self._loop.call_soon_threadsafe(cut)

    def mark_up(self, server: int) -> None:
        """Send to `server` again (it was taken back after `mark_down`)."""
        self._loop.call_soon_threadsafe(self._down.discard, server)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await self._client.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing: nothing left to report to
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
