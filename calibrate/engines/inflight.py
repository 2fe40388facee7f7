"""A server's requests in flight, and how an interrupt or a failed reply ends them at once.

urllib blocks a thread in a socket read until the server answers or `request_timeout` passes (600 s by
default), and a thread pool joins its threads on the way out: Ctrl-C, SIGTERM or one refused reply among
`concurrency` requests would otherwise wait for every request still in flight. So the socket of each request
is tracked while it is open, and `InFlight.cancel()` shuts them all down: every blocked read returns at once
(its request fails, and its result is dropped), and the server sees its client go (vLLM and SGLang abort a
request whose client disconnected, so a connected server does not go on generating for nobody).
`concurrently` runs one batch of requests on worker threads that way.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import socket
import threading
import urllib.request
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class InFlight:
    """The open sockets of one server's requests; `cancel` shuts them down, and refuses new ones until
    `resume` (a batch that ended early must not leave a request behind it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # a finished request's goes with it
        self._cancelled = False
        self._opener = urllib.request.build_opener(_HTTPHandler(self), _HTTPSHandler(self))

    def open(self, request: urllib.request.Request, timeout: float) -> Any:
        """urlopen, with the request's socket tracked while it is open."""
        return self._opener.open(request, timeout=timeout)

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._cancelled:
                self._sockets.add(sock)
                return
        sock.close()
        raise ConnectionAbortedError("cancelled: the batch it belonged to has ended")

    def cancel(self) -> None:
        """Shut down every socket still open: a read blocked on one returns at once."""
        with self._lock:
            self._cancelled = True
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):  # closed already: that request has finished
                sock.shutdown(socket.SHUT_RDWR)

    def resume(self) -> None:
        with self._lock:
            self._cancelled = False


def concurrently(fn: Callable[[T], R], jobs: Iterable[T], workers: int, inflight: InFlight) -> list[R]:
    """`fn` over `jobs` on `workers` threads, results in order. The first job to fail (a reply refused, an
    unreachable server) or an interrupt (Ctrl-C, SIGTERM) ends it: the requests in flight are cancelled and
    those not started dropped, so it raises at once, whichever job failed, and leaves no thread behind."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="calibrate-request")
    try:
        futures = [pool.submit(fn, job) for job in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f.exception() for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            raise failed
        return [f.result() for f in futures]
    except BaseException:
        inflight.cancel()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the cancelled requests return at once
        inflight.resume()


class _Tracked:
    """An http.client connection whose socket its InFlight tracks from the moment it connects."""

    def __init__(self, *args: Any, inflight: InFlight, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inflight = inflight

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.inflight.track(self.sock)  # type: ignore[attr-defined]


class _HTTPConnection(_Tracked, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Tracked, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, inflight: InFlight) -> None:
        super().__init__()
        self.inflight = inflight

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_HTTPConnection, inflight=self.inflight), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, inflight: InFlight) -> None:
        super().__init__()
        self.inflight = inflight

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_HTTPSConnection, inflight=self.inflight), req,
                            context=self._context)  # type: ignore[attr-defined]
