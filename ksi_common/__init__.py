"""Code shared by the `ksi` client and the daemon: errors, ids, wire format, readers."""

__version__ = "0.1.0"
