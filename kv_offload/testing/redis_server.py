"""Throwaway Redis servers on loopback for tests, benchmarks and the demo.

Uses the ``redis-server`` binary (Debian package ``redis-server``; Valkey's
``valkey-server`` works too). Servers keep nothing on disk, listen on 127.0.0.1 only,
and evict with ``allkeys-lru`` like a production cache. ``RedisServer`` can be killed
and started again on the same port (a server restart); ``RedisCluster`` starts three
masters and joins them with ``redis-cli --cluster create``; ``SlowProxy`` makes a
healthy server slow (every reply held back for a while).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


def server_binary() -> str | None:
    """Path of redis-server or valkey-server, or None."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port(*, below: int = 65536) -> int:
    """A free loopback TCP port under ``below`` (cluster nodes also use port + 10000)."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < below:
            return port
    raise RuntimeError(f"no free port below {below}")


class RedisServer:
    """One server process on 127.0.0.1:``port`` with its files in ``workdir``."""

    def __init__(self, workdir: Path, *, port: int | None = None, maxmemory: str = "1gb",
                 cluster: bool = False) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port(below=55000 if cluster else 65536)
        self.maxmemory = maxmemory
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 10.0) -> RedisServer:
        if server_binary() is None:
            raise FileNotFoundError(
                "redis-server not found: install Debian's redis-server (or valkey-server)")
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see "
                                   f"{self.workdir / f'redis-{self.port}.log'}")
            if self.cli("ping", check=False).strip() == "PONG":
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING")

    def argv(self, *, daemonize: bool = False) -> list[str]:
        """The command line that starts this server (``daemonize``: returns at once, for
        a restart from another process; ``stop`` still shuts it down)."""
        binary = server_binary() or "redis-server"
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--maxmemory",
                self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no",
                "--logfile", str(self.workdir / f"redis-{self.port}.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.workdir / f"nodes-{self.port}.conf")]
        if daemonize:
            args += ["--daemonize", "yes"]
        return args

    def cli(self, *args: str, check: bool = True) -> str:
        """Run ``redis-cli`` against this server; its stdout."""
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli") or "redis-cli"
        proc = subprocess.run([cli, "-h", "127.0.0.1", "-p", str(self.port), *args],
                              capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {proc.stderr or proc.stdout}")
        return proc.stdout

    def kill(self) -> None:
        """SIGKILL the server (its data is gone: nothing is persisted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang, as with a stalled host."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server, also one started elsewhere from ``argv(daemonize=True)``."""
        self.resume()
        self.kill()
        with contextlib.suppress(Exception):
            self.cli("shutdown", "nosave", check=False)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class RedisCluster:
    """Three (or ``num_nodes``) cluster masters on loopback, no replicas."""

    def __init__(self, workdir: Path, *, num_nodes: int = 3) -> None:
        self.nodes = [RedisServer(Path(workdir) / f"node{i}", cluster=True)
                      for i in range(num_nodes)]

    @property
    def seeds(self) -> list[str]:
        return [n.address for n in self.nodes]

    def start(self, *, timeout_s: float = 30.0) -> RedisCluster:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> RedisCluster:
        for node in self.nodes:
            node.start()
        self.nodes[0].cli("--cluster", "create", *self.seeds, "--cluster-replicas", "0",
                          "--cluster-yes")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info", check=False)
                   for n in self.nodes):
                return self
            time.sleep(0.1)
        raise TimeoutError("the Redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SlowProxy:
    """A loopback TCP proxy in front of a server that holds every reply for
    ``delay_s`` (a (low, high) range: each reply draws its delay uniformly) before
    passing it on, in order: a healthy server on a slow path. Requests go through at
    once. ``delay_s`` may be changed while it runs; threads only, in this process.
    """

    def __init__(self, port: int, *, delay_s: tuple[float, float] = (0.05, 0.2),
                 seed: int = 0) -> None:
        self.upstream = ("127.0.0.1", port)
        self.delay_s = delay_s
        self._random = random.Random(seed)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> SlowProxy:
        threading.Thread(target=self._accept, name="slow-proxy", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, server]
            _spawn(self._forward, client, server)
            _spawn(self._delayed, server, client)

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        self._close_pair(src, dst)

    def _delayed(self, src: socket.socket, dst: socket.socket) -> None:
        """Receive replies; a sender thread passes each on once its delay is over."""
        queue: collections.deque = collections.deque()
        ready = threading.Condition()
        _spawn(self._send_due, queue, ready, dst)
        last_due = 0.0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                low, high = self.delay_s
                last_due = max(last_due, time.monotonic() + self._random.uniform(low, high))
                with ready:
                    queue.append((last_due, data))
                    ready.notify()
        with ready:
            queue.append((0.0, b""))  # end of stream
            ready.notify()

    def _send_due(self, queue: collections.deque, ready: threading.Condition,
                  dst: socket.socket) -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, data = queue.popleft()
            if not data:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                dst.sendall(data)
            except OSError:
                break
        self._close_pair(dst)

    def _close_pair(self, *socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._sockets = self._sockets, []
        self._close_pair(*socks)
        for sock in socks:
            sock.close()

    def __enter__(self) -> SlowProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _spawn(target: Callable[..., object], *args: object) -> None:
    threading.Thread(target=target, args=args, daemon=True).start()
