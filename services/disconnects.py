"""Notice at once when the peer of a waiting request closes its connection.

A pull that waits server-side (BSP: for the step's last commit) blocks its connection's thread on
the job's condition; nothing reads the socket meanwhile, so without help a client that went away
would keep that thread and socket until the wait timed out. ``DisconnectWatcher`` keeps one epoll
set (one thread per node) of the sockets whose requests wait, watching only for hang-ups
(EPOLLRDHUP/EPOLLHUP/EPOLLERR, never for data: a client may send its next frame early), and calls
the request's ``on_disconnect`` when one fires.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Callable

log = logging.getLogger("shardline.ps.disconnects")

_HANGUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR


class DisconnectWatcher:
    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._closed = False
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="dataplane-hangups", daemon=True)
        self._thread.start()

    def watch(self, sock, on_disconnect: Callable[[], None]) -> int | None:
        """Call ``on_disconnect`` (once, from the watcher thread) if ``sock``'s peer hangs up before
        :meth:`unwatch`. Returns a handle for unwatch; None if ``sock`` cannot be watched."""
        try:
            fd = sock.fileno()
        except (AttributeError, OSError):
            return None
        if fd < 0:
            return None
        with self._lock:
            if self._closed:
                return None
            self._callbacks[fd] = on_disconnect
            try:
                self._epoll.register(fd, _HANGUP)
            except OSError:
                del self._callbacks[fd]
                return None
        return fd

    def unwatch(self, handle: int | None) -> None:
        if handle is None:
            return
        with self._lock:
            if self._callbacks.pop(handle, None) is not None and not self._closed:
                try:
                    self._epoll.unregister(handle)
                except OSError:
                    pass

    def _run(self) -> None:
        while True:
            try:
                events = self._epoll.poll()
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return
            fired = []
            with self._lock:
                if self._closed:
                    return
                for fd, _mask in events:
                    if fd == self._wake_r:
                        continue
                    callback = self._callbacks.pop(fd, None)
                    if callback is not None:
                        try:
                            self._epoll.unregister(fd)
                        except OSError:
                            pass
                        fired.append(callback)
            for callback in fired:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - one request's cancel must not stop the watcher
                    log.exception("cancelling a waiting request failed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
