"""The web console: server-rendered pages and live streams over the daemon's events."""

from ksi_daemon.transports.console.routes import console_routes

__all__ = ["console_routes"]
