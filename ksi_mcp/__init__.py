"""KSI's conversations, consortia and agents as MCP tools and resources, for any MCP client.

One implementation of the tools serves two doors: `ksi mcp` over stdio (a client of the daemon's
socket) and streamable HTTP at `/mcp` inside the daemon. Both reach KSI through a `Caller`.
"""
