"""KSI inside the `llm` command-line tool: `llm -m ksi/MODEL`, `ksi/consortium/NAME`, `ksi/agent/ID`."""
