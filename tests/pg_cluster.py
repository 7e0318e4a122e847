"""A throwaway PostgreSQL cluster made from the installed server binaries, for tests and benchmarks.

`initdb` and `pg_ctl` on a temporary directory, a free TCP port on 127.0.0.1 (password
authentication, so URLs carry a real secret) and a private socket directory (trust, for the
administrator). Run as the `postgres` user when we are root: the server refuses to run as root.
For tests the cluster's own durability is off (fsync, full pages): they kill daemons, never the
server; benchmarks ask for a durable one.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

ROLE = "ksi"
PASSWORD = "pw-" + uuid.uuid4().hex[:16]  # a real secret, so tests can check it never shows


class ClusterError(RuntimeError):
    pass


def server_bin_dir() -> Path:
    """The newest installed PostgreSQL server's bin directory."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not found:
        found = [p for p in (shutil.which("initdb"),) if p]
    if not found:
        raise ClusterError("no PostgreSQL server binaries (initdb) found; install the postgresql package")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ThrowawayCluster:
    """One cluster on a temporary directory; `start()`, `url(db)`, `stop()`, `remove()`."""

    def __init__(self, durable: bool = False) -> None:
        self.durable = durable  # benchmarks: fsync and synchronous commit on, as in production
        self.bin = server_bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="ksi-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "s"
        self.port = 0
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            self.root.chmod(0o755)
            shutil.chown(self.root, "postgres", "postgres")

    # -- commands ---------------------------------------------------------------
    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = list(args)
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if check and done.returncode != 0:
            raise ClusterError(f"{args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return done

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run SQL as the administrator over the private socket; returns unaligned output."""
        done = self._run(str(self.bin / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                         "-h", str(self.sockets), "-p", str(self.port), "-U", "postgres", "-d", database,
                         "-c", sql)
        return done.stdout.strip()

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> None:
        """Start the server; a restart keeps its port, so URLs handed out stay valid."""
        if not (self.data / "PG_VERSION").exists():
            self._init()
        keep = self.port
        for _attempt in range(5):  # a port taken between probing and binding: try another
            self.port = keep or _free_port()
            done = self._pg_ctl_start()
            if done.returncode == 0:
                return
            if keep or "could not bind" not in self.log_tail():
                break
        raise ClusterError(f"pg_ctl start failed: {done.stderr.strip()}\n{self.log_tail()}")

    def _pg_ctl_start(self) -> subprocess.CompletedProcess[str]:
        return self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                         "-w", "-t", "60", "-o", f"-p {self.port}", "start", check=False)

    def _init(self) -> None:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-E", "UTF8",
                  "--locale=C", "--no-sync", "--auth-local=trust", "--auth-host=scram-sha-256")
        self.sockets.mkdir(exist_ok=True)
        if self._as_postgres:
            shutil.chown(self.sockets, "postgres", "postgres")
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.sockets}'",
            "max_connections": "300",
            "shared_buffers": "32MB",
            "fsync": "on" if self.durable else "off",
            "synchronous_commit": "on" if self.durable else "off",
            "full_page_writes": "on" if self.durable else "off",
            "log_min_messages": "warning",
        }
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
        self.start_only_for_setup()

    def start_only_for_setup(self) -> None:
        """First start: make the application role (its password is only ever in URLs)."""
        self.port = _free_port()
        done = self._pg_ctl_start()
        if done.returncode != 0:
            raise ClusterError(f"pg_ctl start failed: {done.stderr.strip()}\n{self.log_tail()}")
        self.psql(f"CREATE ROLE {ROLE} LOGIN CREATEDB PASSWORD '{PASSWORD}'")
        self.stop()
        self.port = 0

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.root / "server.log").read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    # -- databases --------------------------------------------------------------
    def url(self, database: str, password: str | None = PASSWORD) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{ROLE}{secret}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database owned by the application role; returns its name."""
        name = name or "t_" + uuid.uuid4().hex[:12]
        self.psql(f"CREATE DATABASE {name} OWNER {ROLE} TEMPLATE template0")
        return name

    def drop_database(self, name: str) -> None:
        self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
