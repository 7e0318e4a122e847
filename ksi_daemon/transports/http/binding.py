"""Where the HTTP front listens and whether that address may be served without an explicit token."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


class UnsafeHttpBind(RuntimeError):
    """A bind the daemon refuses: a bad address, or a non-loopback one without an explicit token."""


class HttpBindFailed(RuntimeError):
    """An address the daemon cannot serve: taken by another program, or not this machine's."""


@dataclass(frozen=True, slots=True)
class HttpBinding:
    host: str
    port: int

    @classmethod
    def parse(cls, addr: str) -> HttpBinding:
        """`PORT`, `HOST:PORT` or `[V6HOST]:PORT`; the host defaults to 127.0.0.1."""
        text = addr.strip()
        host, _, port_text = text.rpartition(":")
        if not host:
            host = "127.0.0.1"
        host = host.removeprefix("[").removesuffix("]")
        try:
            port = int(port_text)
        except ValueError:
            raise UnsafeHttpBind(f"KSI_HTTP_ADDR {addr!r} is not [HOST:]PORT") from None
        if not 0 <= port <= 65535:
            raise UnsafeHttpBind(f"KSI_HTTP_ADDR {addr!r}: port out of range")
        return cls(host, port)

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name could resolve anywhere


class NoHttpFront:
    """The HTTP front when KSI_HTTP_ADDR is unset: the same lifecycle, doing nothing."""

    url: str | None = None
    token = ""

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
