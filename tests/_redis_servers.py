"""Real ``redis-server`` processes on loopback ports for the remote-tier tests.

Two topologies, each a small object with the same interface so a test can be
parametrized over both:

* ``RedisNode``: one ``redis-server`` (``url`` is ``redis://127.0.0.1:port/0``).
* ``RedisClusterNodes``: three ``redis-server --cluster-enabled yes`` nodes
  joined with ``redis-cli --cluster create ... --cluster-replicas 0``
  (``url`` is ``redis+cluster://127.0.0.1:port``).

Both have ``kill()`` (SIGKILL every process; the ports stay reserved),
``pause()``/``resume()`` (SIGSTOP/SIGCONT: a hung server),
``restart()`` (the same ports again; a cluster node rejoins from its
``nodes.conf``), ``flush()`` and ``raw()`` (a plain redis-py client for
writing bad bytes). Nothing is persisted: a restarted server starts empty.

Fixtures skip with a stated reason only when no ``redis-server`` binary
exists (``.ci/run`` installs the Debian package ``redis-server``).
"""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS_REASON = (
    "no redis-server binary on PATH (install the Debian package 'redis-server'; .ci/run does)"
)

_START_TIMEOUT_S = 10.0
_ATTEMPTS = 3  # a free port can be taken by another process before redis-server binds it
_RUNNING: set["_Server"] = set()


@atexit.register
def _kill_leftovers() -> None:
    """Kill servers a crashed test left running (fixtures normally stop them)."""
    for server in list(_RUNNING):
        server.kill()


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int, *, bus: bool = False) -> list[int]:
    """``n`` distinct free ports; with ``bus`` each also has ``port + 10000`` free
    (Redis Cluster's default bus port, kept for tools that assume it)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p in ports or (bus and (p + 10000 > 65535 or not _port_is_free(p + 10000))):
            continue
        ports.append(p)
    return ports


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up, with or without a password
    except OSError:
        return False


class _Server:
    """One ``redis-server`` process on ``port`` with its working directory ``dir``."""

    def __init__(self, port: int, workdir: Path, extra: list[str], bind: str = "127.0.0.1"):
        self.port = port
        self.dir = workdir
        self.extra = extra
        self.bind = bind
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", *self.bind.split(),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--protected-mode", "no",
            "--maxmemory-policy", "allkeys-lru",
            *self.extra,
        ]
        log = open(self.dir / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        _RUNNING.add(self)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        _RUNNING.discard(self)


class RedisNode:
    """A single ``redis-server`` on a loopback port."""

    kind = "single"

    def __init__(self, workdir: Path, port: int | None = None, *, bind: str = "127.0.0.1",
                 password: str | None = None):
        extra = ["--requirepass", password] if password is not None else []
        for attempt in range(1 if port is not None else _ATTEMPTS):
            p = port if port is not None else _free_ports(1)[0]
            self._server = _Server(p, Path(workdir) / f"node-{p}", extra, bind)
            try:
                self._server.start()
                break
            except RuntimeError:
                if port is not None or attempt == _ATTEMPTS - 1:
                    raise
        self.ports = [p]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def raw(self):
        """A plain redis-py client (no retries) for inspecting or corrupting values."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.ports[0], db=0, socket_timeout=2)

    def flush(self) -> None:
        with self.raw() as r:
            r.flushall()

    def kill(self) -> None:
        self._server.kill()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing is answered."""
        self._server.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._server.signal(signal.SIGCONT)

    def restart(self) -> None:
        self._server.kill()
        self._server.start()

    def stop(self) -> None:
        self._server.kill()


class RedisClusterNodes:
    """A three-primary Redis Cluster on loopback ports (no replicas)."""

    kind = "cluster"

    def __init__(self, workdir: Path, n: int = 3):
        if REDIS_CLI is None:
            raise RuntimeError("redis-cli not found next to redis-server")
        ports = _free_ports(n, bus=True)
        self.ports = ports
        self._servers = [
            _Server(
                p,
                Path(workdir) / f"cluster-{p}",
                [
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "5000",
                    "--cluster-require-full-coverage", "no",
                ],
            )
            for p in ports
        ]
        try:
            for s in self._servers:
                s.start()
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=30,
            )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _wait_ok(self) -> None:
        """Wait until every node reports ``cluster_state:ok``."""
        import redis

        deadline = time.monotonic() + _START_TIMEOUT_S
        for p in self.ports:
            with redis.Redis(host="127.0.0.1", port=p, socket_timeout=2) as r:
                while b"cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {p} never reached cluster_state:ok")
                    time.sleep(0.05)

    def raw(self):
        """A redis-py cluster client (no retries) for inspecting or corrupting values."""
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=2)

    def flush(self) -> None:
        import redis

        for p in self.ports:
            with redis.Redis(host="127.0.0.1", port=p, socket_timeout=2) as r:
                r.flushall()

    def slot_owner(self, slot: int) -> int:
        """The port of the primary that serves ``slot``."""
        import redis

        with redis.Redis(host="127.0.0.1", port=self.ports[0], socket_timeout=2) as r:
            for lo, hi, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return int(primary[1])
        raise RuntimeError(f"slot {slot} has no owner")

    def kill(self) -> None:
        for s in self._servers:
            s.kill()

    def pause(self) -> None:
        """SIGSTOP every node (keep it shorter than the 5 s cluster-node-timeout)."""
        for s in self._servers:
            s.signal(signal.SIGSTOP)

    def resume(self) -> None:
        for s in self._servers:
            s.signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill and start every node on its port; they rejoin from ``nodes.conf``."""
        self.kill()
        for s in self._servers:
            s.start()
        self._wait_ok()

    def stop(self) -> None:
        self.kill()


def require_redis() -> None:
    """Skip the calling test when no ``redis-server`` binary exists."""
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS_REASON)


def start(kind: str, workdir: Path):
    """A running ``RedisNode`` (``kind="single"``) or ``RedisClusterNodes`` (``"cluster"``)."""
    require_redis()
    if kind == "single":
        return RedisNode(workdir)
    if kind == "cluster":
        for attempt in range(_ATTEMPTS):
            try:
                return RedisClusterNodes(Path(workdir) / f"attempt-{attempt}")
            except (RuntimeError, subprocess.CalledProcessError):
                if attempt == _ATTEMPTS - 1:
                    raise
    raise ValueError(f"start: kind={kind!r}, must be 'single' or 'cluster'")


@pytest.fixture(scope="module", params=["single", "cluster"])
def redis_shared(request, tmp_path_factory):
    """A server (single node, then a three-node cluster) shared by a module's tests;
    flushed before each use by ``redis_server``."""
    servers = start(request.param, tmp_path_factory.mktemp(f"redis-{request.param}"))
    yield servers
    servers.stop()


@pytest.fixture
def redis_server(redis_shared):
    """The module's shared server, flushed."""
    redis_shared.flush()
    return redis_shared


@pytest.fixture(params=["single", "cluster"])
def redis_own(request, tmp_path):
    """A server of its own (the test may kill and restart it)."""
    servers = start(request.param, tmp_path / "redis")
    yield servers
    servers.stop()


__all__ = [
    "REDIS_SERVER",
    "NO_REDIS_REASON",
    "RedisNode",
    "RedisClusterNodes",
    "start",
    "require_redis",
    "free_port",
    "redis_shared",
    "redis_server",
    "redis_own",
]
