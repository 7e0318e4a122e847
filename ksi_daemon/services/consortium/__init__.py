"""Consortium: saved member sets, parallel member calls, the arbiter and run traces."""
