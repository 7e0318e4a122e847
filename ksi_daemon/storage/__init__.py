"""Storage: the ports services use (`ports.py`, in domain types from `models.py`) and their
backends (`jsonl/`, the `var/logs` layout; `postgres/`), chosen by name in `backends.py`."""
