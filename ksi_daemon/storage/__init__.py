"""Storage: append-only JSONL logs, the conversation index, state files. Blocking calls;
services run them in a worker thread."""
