"""The HTTP front: one Starlette app served by uvicorn on the daemon's loop, composed of route
groups (the OpenAI-compatible API, MCP, the console). Importing this package stays light:
starlette and uvicorn load only from the modules that serve."""
