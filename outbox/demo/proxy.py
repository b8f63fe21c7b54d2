"""A TCP proxy put between a relay and PostgreSQL or a broker, to cut the relay off without
touching the server (which other sessions share): the fault tests use it, and the
two-service demo (:mod:`outbox.demo.services`) cuts both services off NATS with it.

:class:`TcpProxy` listens on a free port of 127.0.0.1 and forwards each connection to the
server (a TCP address, or the Unix socket of the embedded server). :meth:`TcpProxy.stop`
closes the listening socket and every forwarded connection, so the relay sees its
connections break and new ones refused, as during a server restart; :meth:`TcpProxy.start`
listens on the same port again. :meth:`TcpProxy.freeze` keeps every connection open but
passes no byte either way until :meth:`TcpProxy.thaw` (a partition, or a stalled server,
that no socket error reveals); ``freeze(to_server=False)`` holds only the server's answers
(a broker that stores what it is sent and is slow to acknowledge it). Threads: one accept
loop, two pumps per connection.

For a database, :func:`database_target` says where its server listens (the embedded
server listens on a Unix socket only, named by ``?host=<dir>`` in its URL) and
:func:`through` gives the URL that reaches it by the proxy and by nothing else.
"""

from __future__ import annotations

import socket
import threading

from sqlalchemy.engine import URL


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``: ``(host, port)`` or a Unix socket path."""

    def __init__(self, target: tuple[str, int] | str) -> None:
        self.target = target
        self.port = 0  # chosen by the first start(), kept afterwards
        self.accepted = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Cleared by freeze(): the pumps of that direction hold their bytes.
        self._to_server = threading.Event()
        self._to_client = threading.Event()
        self._to_server.set()
        self._to_client.set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen (again, on the same port after a stop); returns once connections are accepted."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.05)  # the accept loop checks _stopping this often
        self.port = listener.getsockname()[1]
        self._stopping.clear()
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, args=(listener,), name="outbox-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and cut every forwarded connection (both sides see it close)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close(sock)

    def freeze(self, *, to_server: bool = True, to_client: bool = True) -> None:
        """Stop passing bytes on every connection, keeping them open (nothing is dropped:
        what arrives meanwhile is passed on after :meth:`thaw`): those toward the server,
        those toward the client, or (the default) both."""
        if to_server:
            self._to_server.clear()
        if to_client:
            self._to_client.clear()

    def thaw(self) -> None:
        self._to_server.set()
        self._to_client.set()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                if isinstance(self.target, str):
                    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    upstream.connect(self.target)
                else:
                    upstream = socket.create_connection(self.target, timeout=5)
                    upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            client.settimeout(None)
            with self._lock:
                if self._stopping.is_set():
                    _close(client)
                    _close(upstream)
                    return
                self._sockets |= {client, upstream}
                self.accepted += 1
            for src, dst, flowing in ((client, upstream, self._to_server), (upstream, client, self._to_client)):
                threading.Thread(target=_pump, args=(src, dst, flowing), name="test-proxy-pump",
                                 daemon=True).start()


def database_target(url: URL) -> tuple[str, int] | str:
    """Where the server of ``url`` listens, as :class:`TcpProxy` takes it: the path of its
    Unix socket (``<dir>/.s.PGSQL.<port>``) when the URL names a socket directory (a ``host``
    query parameter or a host starting with ``/``, as libpq reads them), else (host, port)."""
    socket_dir = url.query.get("host")
    if not isinstance(socket_dir, str):
        socket_dir = url.host if url.host and url.host.startswith("/") else None
    if socket_dir:
        return f"{socket_dir}/.s.PGSQL.{url.port or 5432}"
    return (url.host or "127.0.0.1", url.port or 5432)


def through(url: URL, proxy: TcpProxy) -> URL:
    """``url`` reaching its server by ``proxy`` only: host 127.0.0.1, the proxy's port, and no
    ``host`` query parameter (libpq would use it rather than the URL's host: the embedded
    server's socket directory would take the connection around the proxy)."""
    return url.difference_update_query(["host", "hostaddr", "port"]).set(host="127.0.0.1", port=proxy.port)


def _pump(src: socket.socket, dst: socket.socket, flowing: threading.Event) -> None:
    try:
        while data := src.recv(65536):
            flowing.wait()
            dst.sendall(data)
    except OSError:
        pass
    for sock in (src, dst):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
