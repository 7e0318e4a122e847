"""The MCP server: KSI's tools and resources on the SDK's low-level `Server` (the schemas are
written by hand so the tool list stays small), served over stdio or streamable HTTP."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.server import InitializationOptions, NotificationOptions, Server, ServerRequestContext
from mcp.server.subscriptions import ListenHandler
from mcp.shared.exceptions import MCPError

from ksi_common import __version__
from ksi_common.errors import ErrorCode, KsiError
from ksi_common.events import CONVERSATION_LIST
from ksi_mcp.caller import Caller
from ksi_mcp.resources import LIST_URI, RECENT, TEMPLATE, ResourceWatch, read
from ksi_mcp.schemas import BY_NAME, TOOLS
from ksi_mcp.tools import OUTPUT_LIMIT, Progress, Tools, conversation_uri, error_text

log = logging.getLogger("ksi.mcp")

INSTRUCTIONS = ("KSI keeps every conversation on disk. A reply's continuation_id continues it from any tool, "
                "from the ksi CLI (ksi ask --conversation ID) or the HTTP API; `conversations` finds lost ids.")


def tool_error(error: KsiError) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=error_text(error.code, error.message, error.details))],
        structured_content={"error": error.to_wire()}, is_error=True)


class KsiMcp:
    """One MCP server over one `Caller`; its `server` may serve many sessions at once."""

    def __init__(self, caller: Caller, *, base_dir: Path | None = None, output_limit: int = OUTPUT_LIMIT) -> None:
        self.caller = caller
        self.tools = Tools(caller, base_dir=base_dir, output_limit=output_limit)
        self.watch = ResourceWatch(caller)
        self._tool_list = [types.Tool.model_validate(tool) for tool in TOOLS]
        self.server: Server[Any] = Server(
            "ksi", version=__version__, instructions=INSTRUCTIONS,
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            on_list_resources=self._list_resources, on_list_resource_templates=self._list_templates,
            on_read_resource=self._read_resource,
            on_subscribe_resource=self._subscribe, on_unsubscribe_resource=self._unsubscribe,
            on_subscriptions_listen=ListenHandler(self.watch.bus),
        )

    def initialization_options(self) -> InitializationOptions:
        return self.server.create_initialization_options(NotificationOptions())

    async def close(self) -> None:
        await self.watch.close()

    # -- tools ------------------------------------------------------------------
    async def _list_tools(self, _ctx: ServerRequestContext[Any], _params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self._tool_list)

    async def _call_tool(self, ctx: ServerRequestContext[Any],
                         params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in BY_NAME:  # a protocol error, not a tool's: the spec's -32602
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r}; tools: {', '.join(BY_NAME)}")
        try:
            reply = await self.tools.call(params.name, params.arguments, _progress_of(ctx))
        except KsiError as error:
            return tool_error(error)
        except Exception:  # a bug must not end the session: the client gets a tool error
            log.exception("tool %s failed", params.name)
            return tool_error(KsiError(ErrorCode.INTERNAL_ERROR, f"internal error in tool {params.name}"))
        return types.CallToolResult(content=[types.TextContent(text=reply.text)], structured_content=reply.data)

    # -- resources --------------------------------------------------------------
    async def _list_resources(self, _ctx: ServerRequestContext[Any], _params: Any) -> types.ListResourcesResult:
        resources = [types.Resource(uri=LIST_URI, name="conversations", mime_type="application/json",
                                    description="every KSI conversation, newest first")]
        try:
            recent = await self.caller.request(CONVERSATION_LIST, {"limit": RECENT})
        except KsiError:  # the daemon is down: the fixed resources are still listed
            recent = {}
        for item in recent.get("conversations", []):
            resources.append(types.Resource(
                uri=conversation_uri(item["conversation_id"]), name=item["conversation_id"],
                title=item.get("title"), mime_type="text/markdown",
                description=f"{item.get('exchanges', 0)} turns, last {item.get('last_activity')}"))
        return types.ListResourcesResult(resources=resources)

    async def _list_templates(self, _ctx: ServerRequestContext[Any],
                              _params: Any) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=TEMPLATE, name="conversation", mime_type="text/markdown",
            description="a KSI conversation's transcript; id is a continuation_id")])

    async def _read_resource(self, _ctx: ServerRequestContext[Any],
                             params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        try:
            mime_type, text = await read(self.caller, uri)
        except LookupError:
            raise MCPError(types.INVALID_PARAMS, f"unknown resource {uri}; try {LIST_URI} or {TEMPLATE}") from None
        except KsiError as error:
            raise MCPError(types.INVALID_PARAMS if error.code.endswith("not_found") else types.INTERNAL_ERROR,
                           f"{error.code}: {error.message}", error.to_wire()) from None
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, mime_type=mime_type,
                                                                             text=text)])

    async def _subscribe(self, ctx: ServerRequestContext[Any], params: types.SubscribeRequestParams) -> types.EmptyResult:
        self.watch.add(ctx.session, str(params.uri))
        return types.EmptyResult()

    async def _unsubscribe(self, ctx: ServerRequestContext[Any],
                           params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        self.watch.remove(ctx.session, str(params.uri))
        return types.EmptyResult()


def _progress_of(ctx: ServerRequestContext[Any]) -> Progress | None:
    """Where a call reports progress: the SDK's `notifications/progress` for the client's token, if it gave one."""
    if ctx.meta is None or ctx.meta.get("progress_token") is None:
        return None

    async def report(progress: float, text: str) -> None:
        await ctx.session.report_progress(progress, message=text or None)

    return report


async def serve_stdio(app: KsiMcp) -> None:
    """Serve `app` on this process's stdin and stdout until the client closes them."""
    from ksi_mcp.stdio import stdio_transport

    try:
        async with stdio_transport() as (read_stream, write_stream):
            await app.server.run(read_stream, write_stream, app.initialization_options())
    finally:
        await app.close()
