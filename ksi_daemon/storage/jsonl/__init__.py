"""The JSONL backend: append-only files under `var/logs` and small state files under `var/state`
(the default; one daemon per var dir, kept by a lock file)."""
