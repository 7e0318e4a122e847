"""The litellm adapter: the only module that imports litellm, lazily and offline-safe."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import hashlib
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from types import ModuleType
from typing import Any, TypeVar

import httpx
import structlog

from ksi_common.errors import ErrorCode
from ksi_common.settings import Settings
from ksi_daemon.providers.base import (
    SESSION_ID_KEY,
    SESSION_METADATA_KEY,
    SESSION_NOTE_KEY,
    CommandMissing,
    ModelAbilities,
    Probe,
    ProviderCall,
    ProviderFailure,
    ProviderReply,
    calls_anthropic,
)
from ksi_daemon.providers.body_limit import BodyLimitTransport, ResponseTooLarge
from ksi_daemon.providers.cache_markers import (
    has_markers,
    has_openai_breakpoints,
    placed_breakpoints,
    with_openai_breakpoints,
    with_prefix_breakpoints,
)
from ksi_daemon.providers.cli_provider import CLI_PROGRAMS
from ksi_daemon.providers.client_markers import sendable_markers
from ksi_daemon.providers.echo_answer import answer_without_litellm
from ksi_daemon.providers.model_faults import missing_command, missing_key, unknown_model
from ksi_daemon.providers.native_tools import native_chat_tools, native_history, native_tool_choice
from ksi_daemon.providers.options import KEPT_OPTIONS, SAMPLING_OPTIONS, check_options, is_routing_option
from ksi_daemon.providers.tool_calls import (
    ReasoningDeltas,
    ToolCallDeltas,
    chat_tool_choice,
    chat_tools,
    reply_items,
    without_reasoning,
)
from ksi_daemon.providers.tool_kinds import as_functions, catalog, client_call, streams_as_function
from ksi_daemon.redaction import Redactor, known_secrets

log = structlog.get_logger("ksi.providers.litellm")

_OFFLINE_DEFAULTS = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    # the table of Anthropic beta names litellm passes on: its bundled copy, not one fetched per start
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_MODE": "PRODUCTION",
    "LITELLM_LOG": "ERROR",
}


# models answered by this daemon's own handlers, without litellm's model list (the built-in echo
# and the CLI sessions)
OWN_PREFIXES = ("echo/", *CLI_PROGRAMS)
BUILTIN_NAMES = ("echo/demo", "claude-cli/sonnet", "gemini-cli/default")
KNOWN_KEPT = 1024  # model names found valid, remembered (names come from requests: bounded)
ABILITIES_KEPT = 256  # models whose abilities litellm was asked for, the most recently used
# how providers say a key is missing (litellm passes their words on): OpenAI's SDK, Anthropic, ...
_MISSING_KEY = re.compile(r"missing (credentials|[\w ]{0,20}api[ _-]?key)|no key is set|api_key client option must be set",
                          re.IGNORECASE)


# providers that take their own reasoning back (Anthropic's signed thinking blocks, through litellm):
# every other call is sent its history without it
REASONING_REPLAY = frozenset({"anthropic"})


def provider_of(model: str) -> str:
    return model.split("/", 1)[0] if "/" in model else "openai"


class LiteLLMProvider:
    """Sends calls through litellm; counts tokens and knows context windows."""

    keeps_session = False
    takes_slot = True
    calibrated = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redact = Redactor(known_secrets(settings))  # providers echo keys in their errors
        self._module: ModuleType | None = None
        self._load_lock = threading.Lock()
        self._loading: concurrent.futures.Future[ModuleType] | None = None  # the import in its own thread
        self._windows: dict[str, int] = {}
        self._abilities: OrderedDict[str, ModelAbilities] = OrderedDict()  # least recently used first
        self._supported: OrderedDict[str, frozenset[str] | None] = OrderedDict()  # see _supported_params
        self._unpriced: set[str] = set()
        self._encoder: Any = None
        self._known: set[str] = set()  # model names litellm routes (see check)

    # -- loading ------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self._module is not None

    def load(self) -> ModuleType:
        """Import and configure litellm once (blocking: call it from a thread)."""
        if self._module is not None:
            return self._module
        with self._load_lock:
            if self._module is None:
                started = time.perf_counter()
                self._module = self._import()
                # litellm leaves ~400k long-lived objects; without this every full collection
                # walks them again, a measurable share of the daemon's CPU per completion
                gc.freeze()
                log.info("litellm_loaded", seconds=round(time.perf_counter() - started, 3))
        return self._module

    def _import(self) -> ModuleType:
        for name, value in _OFFLINE_DEFAULTS.items():
            os.environ.setdefault(name, value)
        import litellm

        litellm.suppress_debug_info = True
        litellm.disable_hf_tokenizer_download = True
        litellm.telemetry = False
        litellm.drop_params = True
        # calls through the openai SDK (every OpenAI-compatible server) read their answer
        # through this client, which stops at the size limit; underneath it, litellm's own
        # transport (aiohttp), which costs less CPU per call than httpx's
        from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

        litellm.aclient_session = httpx.AsyncClient(
            transport=BodyLimitTransport(self.settings.max_response_bytes,
                                         AsyncHTTPHandler.create_async_transport()),
            follow_redirects=False)
        litellm.custom_provider_map = [
            *[p for p in litellm.custom_provider_map if p["provider"] not in self._custom_names()],
            *self._custom_providers(),
        ]
        litellm.utils.custom_llm_setup()
        # litellm's bundled copy of cl100k: tiktoken itself would download it
        from litellm.litellm_core_utils.default_encoding import encoding

        self._encoder = encoding
        self._warm_up(litellm)
        return litellm

    @staticmethod
    def _warm_up(litellm: ModuleType) -> None:
        """One echo call here, in the loading thread: litellm's first call imports more of it
        (0.7 s of CPU measured), which would otherwise block the event loop on the first turn."""
        try:
            litellm.completion(model="echo/warm-up", messages=[{"role": "user", "content": "warm up"}])
        except Exception:  # only a warm-up: the first real call pays instead
            log.warning("litellm_warm_up_failed", exc_info=True)

    async def ensure_loaded(self) -> ModuleType:
        """litellm, imported once in a thread of its own. Not the loop's executor: closing the
        loop waits for that one's threads, so a daemon stopped during the import waited for it
        (seconds) although nothing needed litellm any more."""
        if self._module is not None:
            return self._module
        if self._loading is None:
            self._loading = concurrent.futures.Future()
            threading.Thread(target=self._load_into, args=(self._loading,), name="litellm-import",
                             daemon=True).start()
        return await asyncio.wrap_future(self._loading)  # a thread's future: awaitable from any loop

    def _load_into(self, loading: concurrent.futures.Future[ModuleType]) -> None:
        loading.set_running_or_notify_cancel()  # running: a waiter cancelled (a stop) leaves it to the others
        try:
            loading.set_result(self.load())
        except BaseException as exc:  # the waiters get it; a later call tries again
            self._loading = None
            loading.set_exception(exc)

    @property
    def still_loading(self) -> bool:
        """The import runs and nothing has it yet: an exit need not wait for it."""
        return self._loading is not None and not self._loading.done()

    @staticmethod
    def _custom_names() -> set[str]:
        return {"echo", "claude-cli", "gemini-cli"}

    def _custom_providers(self) -> list[dict[str, Any]]:
        from ksi_daemon.providers.cli_session import ClaudeCLI, GeminiCLI
        from ksi_daemon.providers.echo import EchoLLM

        timeout = self.settings.cli_timeout
        return [
            {"provider": "echo", "custom_handler": EchoLLM()},
            {"provider": "claude-cli", "custom_handler": ClaudeCLI(timeout)},
            {"provider": "gemini-cli", "custom_handler": GeminiCLI(timeout)},
        ]

    # -- model names ----------------------------------------------------------
    async def check(self, model: str, _inline: dict[str, Any] | None) -> None:
        """Refuse, before a request is queued, a model no provider answers to and a CLI model
        whose program is missing: `model_not_found` or `provider_unavailable`, never retried."""
        if model.startswith(OWN_PREFIXES) or model in self._known:
            return  # a CLI's own provider checks for its program
        litellm = self._module
        if litellm is None:
            # the ack must not wait seconds for litellm's import: the call itself answers
            # model_not_found for a name no provider routes
            return
        try:
            litellm.get_llm_provider(model)
        except Exception:
            raise unknown_model(model, self.own_model_names(), self.litellm_model_names(litellm)) from None
        self._remember(model)

    def _remember(self, model: str) -> None:
        if len(self._known) >= KNOWN_KEPT:
            self._known.clear()
        self._known.add(model)

    def own_model_names(self) -> list[str]:
        """The names this daemon offers: the default, the configured and the built-in ones."""
        configured = [name for name in self.settings.models if not any(c in name for c in "*?[")]
        return [self.settings.default_model, *configured, *BUILTIN_NAMES]

    @staticmethod
    def litellm_model_names(litellm: ModuleType) -> list[str]:
        return [name for name in litellm.model_cost if name != "sample_spec"]

    def _key_variables(self, litellm: ModuleType, model: str) -> list[str]:
        """The variables that would hold the missing key: the configured one, else litellm's."""
        configured = self.settings.model_settings(model).api_key_env
        if configured:
            return [configured]
        try:
            missing = litellm.validate_environment(model).get("missing_keys") or []
        except Exception:
            return []
        return [str(name) for name in missing if str(name).endswith(("_KEY", "_TOKEN"))]

    def _map(self, litellm: ModuleType, exc: Exception, model: str, url: str | None) -> ProviderFailure:
        """A litellm exception as a ProviderFailure; configuration faults in KSI's words."""
        program = _cause(exc, CommandMissing)
        if program is not None:
            return missing_command(program.binary, model)
        errors = litellm.exceptions
        said = self.redact(str(getattr(exc, "message", None) or exc))[:2000]
        if isinstance(exc, errors.BadRequestError) and "LLM Provider NOT provided" in said:
            return unknown_model(model, self.own_model_names(), self.litellm_model_names(litellm))
        if isinstance(exc, errors.NotFoundError):
            return unknown_model(model, self.own_model_names(), self.litellm_model_names(litellm),
                                 provider_said=said)
        if _MISSING_KEY.search(said) and not isinstance(exc, errors.RateLimitError):
            return missing_key(model, self._key_variables(litellm, model))
        return map_error(litellm, exc, self.redact, url=url)

    # -- model facts --------------------------------------------------------
    async def ready(self, model: str) -> None:
        """Ready to count a turn of `model` exactly; an echo turn does not wait for litellm (its
        counts are estimates until litellm is loaded)."""
        if self._module is None and model.startswith("echo/"):
            return
        await self.ensure_loaded()

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` by cl100k: one tokenizer for all models keeps counts cacheable."""
        if self._encoder is None:
            return max(1, math.ceil(len(text) / 4))
        return len(self._encoder.encode(text, disallowed_special=()))

    def count_tokens_loading(self, text: str) -> int:
        """count_tokens, exact even before litellm is loaded: loads it first (blocking; call it from
        a worker thread, e.g. while counting legacy index lines)."""
        self.load()
        return self.count_tokens(text)

    async def context_window(self, model: str) -> int:
        override = self.settings.model_settings(model).context_window
        if override:
            return override
        if model in self._windows:
            return self._windows[model]
        window = self.settings.default_context_window
        if not model.startswith(OWN_PREFIXES):
            litellm = await self.ensure_loaded()
            try:
                # ollama models make get_model_info call the local server: keep it off the loop
                async with asyncio.timeout(5.0):
                    info = await asyncio.to_thread(litellm.get_model_info, model)
                window = int(info.get("max_input_tokens") or info.get("max_tokens") or window)
            except Exception:
                pass
        self._windows[model] = window
        return window

    async def abilities(self, model: str) -> ModelAbilities:
        """The model's abilities: each as the settings declare it, else as litellm's model list knows it."""
        declared = self.settings.model_settings(model)
        known = self._abilities.get(model)
        if known is None:
            info: dict[str, Any] = {}
            if not model.startswith(OWN_PREFIXES):
                litellm = await self.ensure_loaded()
                try:
                    async with asyncio.timeout(5.0):
                        info = dict(await asyncio.to_thread(litellm.get_model_info, model))
                except Exception:  # a model litellm does not list: nothing is known of it
                    info = {}
            known = ModelAbilities(response_schema=info.get("supports_response_schema"),
                                   function_calling=info.get("supports_function_calling"),
                                   vision=info.get("supports_vision"), web_search=info.get("supports_web_search"),
                                   pdf_input=info.get("supports_pdf_input"))
            self._abilities[model] = known
            while len(self._abilities) > ABILITIES_KEPT:
                self._abilities.popitem(last=False)
        else:
            self._abilities.move_to_end(model)
        return ModelAbilities(
            response_schema=_first_known(declared.supports_response_schema, known.response_schema),
            function_calling=_first_known(declared.supports_function_calling, known.function_calling),
            vision=_first_known(declared.supports_vision, known.vision),
            pdf_input=_first_known(declared.supports_pdf_input, known.pdf_input),
            web_search=_first_known(declared.supports_web_search, known.web_search))

    def output_reserve(self, model: str, max_tokens: int | None) -> int:
        if max_tokens:
            return max_tokens
        override = self.settings.model_settings(model).output_reserve
        return override if override is not None else self.settings.default_output_reserve

    # -- calls --------------------------------------------------------------
    def _call_kwargs(self, call: ProviderCall) -> dict[str, Any]:
        overrides = self.settings.model_settings(call.model)
        # checked when the request was accepted; again here for every model a call reaches
        # (consortium members run under the options of the consortium's request)
        check_options(call.model, call.options, overrides.allow_options)
        kwargs: dict[str, Any] = dict(call.options)
        messages = call.messages if provider_of(call.model) in REASONING_REPLAY else without_reasoning(call.messages)
        kwargs.update(model=call.model, messages=messages, max_retries=0)
        if call.temperature is not None:
            kwargs["temperature"] = call.temperature
        if call.max_tokens is not None:
            kwargs["max_tokens"] = call.max_tokens
        if call.timeout is not None:
            kwargs["timeout"] = call.timeout
        if call.tools and overrides.supports_custom_tools and provider_of(call.model) == "openai":
            # litellm passes OpenAI's custom tool shapes through unchanged (native_tools.py)
            kwargs.update(tools=native_chat_tools(call.tools), messages=native_history(messages, call.tools))
            if call.tool_choice is not None:
                kwargs["tool_choice"] = native_tool_choice(call.tool_choice, catalog(call.tools))
        elif call.tools:
            kwargs["tools"] = chat_tools(as_functions(call.tools))
            if call.tool_choice is not None:
                kwargs["tool_choice"] = chat_tool_choice(call.tool_choice)
        if call.tools and call.parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = call.parallel_tool_calls
        if overrides.api_base:
            kwargs.setdefault("api_base", overrides.api_base)
        if overrides.api_key_env and os.environ.get(overrides.api_key_env):
            kwargs.setdefault("api_key", os.environ[overrides.api_key_env])
        if overrides.api_base and call.model.startswith("openai/") and "api_key" not in kwargs \
                and not os.environ.get("OPENAI_API_KEY"):
            # A local OpenAI-compatible server often wants no key, but the SDK refuses to call without one
            # (an empty one counts as missing): the daemon sends this placeholder so the user need not.
            kwargs["api_key"] = KEYLESS_PLACEHOLDER
        if call.resume_session is not None:  # only a provider that keeps its session is given one
            kwargs["metadata"] = {SESSION_METADATA_KEY: call.resume_session}
        kwargs["messages"] = sendable_markers(kwargs["messages"], calls_anthropic(call.model),
                                              _takes_openai_breakpoints(call.model))
        if overrides.cache_placement == "on" and provider_of(call.model) == "anthropic":
            kwargs["messages"] = with_prefix_breakpoints(kwargs["messages"], call.stable_system, overrides.cache_ttl)
        elif overrides.cache_placement == "on" and _takes_openai_breakpoints(call.model):
            kwargs["messages"] = with_openai_breakpoints(kwargs["messages"], call.stable_system)
        if call.anthropic_beta and calls_anthropic(call.model):
            # merged into headers a model's settings may allow; no other provider has this header
            beta = ",".join(call.anthropic_beta)
            kwargs["extra_headers"] = {**kwargs.get("extra_headers", {}), "anthropic-beta": beta}
        cache_key = _prompt_cache_key(call, overrides.cache_placement)
        if cache_key is not None:
            kwargs.setdefault("prompt_cache_key", cache_key)  # a client's own key is kept as sent
        if overrides.cache_slots and overrides.cache_placement == "on":
            kwargs["extra_body"] = {**_slot_options(call, overrides.cache_slots), **kwargs.get("extra_body", {})}
        return kwargs

    async def complete(self, call: ProviderCall) -> ProviderReply:
        if self._module is None and call.model.startswith("echo/"):
            # the first echo turns after a start do not wait seconds for litellm's import: the
            # same answer, in the same shape, as its custom provider gives once it is loaded
            check_options(call.model, call.options, self.settings.model_settings(call.model).allow_options)
            return answer_without_litellm(call)
        litellm = await self.ensure_loaded()
        kwargs = self._call_kwargs(call)
        for name in self._untaken_kept(litellm, call):
            del kwargs[name]  # kept with the exchange's request lines (see options.KEPT_OPTIONS)
        if forced := self._undropped(litellm, call):
            kwargs["allowed_openai_params"] = forced
        response = None
        try:
            if call.on_chunk is not None:
                reply = await self._stream(litellm, call, kwargs)
            else:
                response = await litellm.acompletion(**kwargs)
        except ProviderFailure:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._map(litellm, exc, call.model, kwargs.get("api_base")) from None
        if response is not None:
            reply = self._reply(litellm, call, response)
        reply.breakpoints = placed_breakpoints(kwargs["messages"], call.stable_system, _placed_by(call))
        return reply

    async def _stream(self, litellm: ModuleType, call: ProviderCall, kwargs: dict[str, Any]) -> ProviderReply:
        kwargs["stream"] = True
        kwargs.setdefault("stream_options", {"include_usage": True})
        stream = await litellm.acompletion(**kwargs)
        parts: list[str] = []
        reasoning = ReasoningDeltas()
        calls = ToolCallDeltas()
        kinds = catalog(call.tools)
        finish_reason = None
        usage: dict[str, int] = {}
        response_id = None
        assert call.on_chunk is not None
        received = 0
        async for chunk in stream:
            response_id = response_id or getattr(chunk, "id", None)
            choices = getattr(chunk, "choices", None) or []
            if choices:
                delta = getattr(choices[0], "delta", None)
                for thought in reasoning.add(delta) if delta is not None else []:
                    call.on_chunk(thought)  # a reasoning model thinks before it answers
                text = getattr(delta, "content", None) if delta is not None else None
                if text:
                    received += len(text.encode())
                    if received > self.settings.max_response_bytes:  # stop reading a flood at the limit
                        close = getattr(stream, "aclose", None)
                        if close is not None:
                            await close()
                        raise self._too_large(received)
                    parts.append(text)
                    call.on_chunk(text)
                if delta is not None and getattr(delta, "tool_calls", None):
                    for piece in calls.add(delta.tool_calls):
                        if streams_as_function(piece["name"], kinds):
                            call.on_chunk(piece)
                finish_reason = getattr(choices[0], "finish_reason", None) or finish_reason
            chunk_usage = getattr(chunk, "usage", None)
            if chunk_usage:
                usage = _usage_dict(chunk_usage)
        content = "".join(parts)
        # litellm's stream wrapper adds a "stop" of its own when the provider sent none; what the
        # provider itself sent is kept on the wrapper
        sent = (getattr(stream, "received_finish_reason", None), getattr(stream, "intermittent_finish_reason", None))
        if not any(sent):
            finish_reason = None
        if finish_reason is None:
            # a stream cut short (a dropped connection, a proxy timeout) ends like a finished one,
            # only without the finish reason: its text is a fragment, never a whole answer
            raise ProviderFailure(ErrorCode.PROVIDER_ERROR, "the provider's stream ended without a finish reason",
                                  retryable=True, reason="truncated", received_bytes=received)
        reasoned = reasoning.item()
        output = [reasoned] if reasoned is not None else []
        if content or not calls:
            output.append({"type": "message", "role": "assistant", "content": content})
        output.extend(client_call(item, kinds) for item in calls.items())
        return ProviderReply(
            content=content, model=call.model, finish_reason="tool_calls" if calls else finish_reason, usage=usage,
            cost=None, provider=provider_of(call.model), provider_response_id=response_id,
            output=output if len(output) > 1 or calls else [],
        )

    def _too_large(self, size: int) -> ProviderFailure:
        limit = self.settings.max_response_bytes
        return ProviderFailure(ErrorCode.PROVIDER_ERROR,
                               f"the provider's answer exceeds the size limit of {limit} bytes",
                               reason="response_too_large", limit=limit, received_bytes=size)

    def _undropped(self, litellm: ModuleType, call: ProviderCall) -> list[str]:
        """The OpenAI options of `call` that litellm does not list for its model and would drop
        (drop_params): named so it passes them as given, and a provider that does not take one says
        so itself rather than the option vanishing. Routing options are never named (they are
        settings)."""
        openai_params = set(getattr(litellm, "OPENAI_CHAT_COMPLETION_PARAMS", ())) | SAMPLING_OPTIONS
        asked = [name for name in call.options
                 if name in openai_params and not is_routing_option(name) and name not in KEPT_OPTIONS]
        if call.tools:
            asked += [name for name in ("tools", "tool_choice", "parallel_tool_calls")
                      if name == "tools" or getattr(call, name) is not None]
        if not asked or call.model.startswith(OWN_PREFIXES):
            return []
        supported = self._supported_params(litellm, call.model)
        if supported is None:
            return []
        return [name for name in asked if name not in supported]

    def _untaken_kept(self, litellm: ModuleType, call: ProviderCall) -> list[str]:
        """The kept options of `call` its model does not take: litellm does not list them for it (a
        provider of this daemon's own takes none). The exchange keeps them; the call goes without."""
        kept = [name for name in call.options if name in KEPT_OPTIONS]
        if not kept:
            return []
        supported = None if call.model.startswith(OWN_PREFIXES) else self._supported_params(litellm, call.model)
        return [name for name in kept if supported is None or name not in supported]

    def _supported_params(self, litellm: ModuleType, model: str) -> frozenset[str] | None:
        """The OpenAI options litellm maps for `model` (None: it maps none, so drops none), asked
        once per model; the most recently used ABILITIES_KEPT models are remembered."""
        if model in self._supported:
            self._supported.move_to_end(model)
            return self._supported[model]
        try:
            _, provider, _, _ = litellm.get_llm_provider(model=model)
            listed = litellm.get_supported_openai_params(model=model, custom_llm_provider=provider)
        except Exception:  # a provider litellm cannot name: it maps no option, so it drops none either
            listed = None
        supported = frozenset(listed) if listed is not None else None
        self._supported[model] = supported
        while len(self._supported) > ABILITIES_KEPT:
            self._supported.popitem(last=False)
        return supported

    def _reply(self, litellm: ModuleType, call: ProviderCall, response: Any) -> ProviderReply:
        choices = getattr(response, "choices", None)
        if not choices or getattr(choices[0], "message", None) is None:
            raise ProviderFailure(ErrorCode.PROVIDER_ERROR, "the provider answered without a choice",
                                  retryable=True, reason="no_choices")
        choice = choices[0]
        content = choice.message.content or ""
        kinds = catalog(call.tools)
        output = [client_call(item, kinds) if item["type"] == "function_call" else item
                  for item in reply_items(choice.message)]
        called = any(item["type"] == "function_call" for item in output)
        size = len(content.encode()) + sum(len(str(item.get("arguments", "")).encode()) for item in output)
        if size > self.settings.max_response_bytes:
            raise self._too_large(size)
        hidden = getattr(response, "_hidden_params", {}) or {}
        usage = _usage_dict(getattr(response, "usage", None))
        cost = hidden.get("response_cost")
        if cost is None and call.model not in self._unpriced:
            try:
                cost = litellm.completion_cost(completion_response=response)
            except Exception:  # litellm has no price for it: do not ask again on every reply
                self._unpriced.add(call.model)
                cost = None
        return ProviderReply(
            content=content,
            model=call.model,
            finish_reason="tool_calls" if called else choice.finish_reason,
            usage=usage,
            cost=float(cost) if cost else None,
            cost_uncached=_uncached_cost(litellm, call.model, usage) if cost else None,
            provider=provider_of(call.model),
            provider_response_id=getattr(response, "id", None),
            # set by a CLI's handler only: the session that now holds this exchange
            session_id=hidden.get(SESSION_ID_KEY),
            session_note=hidden.get(SESSION_NOTE_KEY),
            output=output if len(output) > 1 or called else [],
        )


def _first_known(declared: bool | None, listed: Any) -> bool | None:
    if declared is not None:
        return declared
    return listed if isinstance(listed, bool) else None


def _cache_owner(call: ProviderCall) -> str | None:
    """The conversation a call's cache is named by: the root of its fork chain (every fork of it
    shares a prefix with its turns), else the conversation asking."""
    return call.cache_root or call.request.get("conversation_id")


def _prompt_cache_key(call: ProviderCall, placement: str) -> str | None:
    """The key OpenAI routes a conversation's requests to one cache by: the KSI id of its fork
    chain's root, prefixed so it never meets a key the client's other programs use. Only OpenAI's
    own models take one."""
    owner = _cache_owner(call)
    if placement == "off" or provider_of(call.model) != "openai" or not owner:
        return None
    return f"ksi:{owner}"


def _placed_by(call: ProviderCall) -> str:
    """Who placed a call's breakpoints: the client, when markers of its own go out (KSI then
    places none), else KSI."""
    own = sendable_markers(call.messages, calls_anthropic(call.model), _takes_openai_breakpoints(call.model))
    return "client" if has_markers(own) or has_openai_breakpoints(own) else "ksi"


def _takes_openai_breakpoints(model: str) -> bool:
    """Whether an OpenAI model takes explicit prompt_cache_breakpoint blocks (gpt-5.6 on, or as
    litellm's model list says); litellm carries the blocks to it as they are."""
    if provider_of(model) != "openai":
        return False
    from litellm.integrations.anthropic_cache_control_hook import supports_openai_prompt_cache_breakpoint
    return bool(supports_openai_prompt_cache_breakpoint(model.removeprefix("openai/")))


def _uncached_cost(litellm: ModuleType, model: str, usage: dict[str, int]) -> float | None:
    """What the reply would have cost had the provider read and written no cache: its prompt and
    answer tokens at the model's plain prices (litellm's prompt_tokens include the cached ones).
    None when the provider reported no cache use (the cost is then the same) or has no price."""
    if not (usage.get("cache_read_input_tokens") or usage.get("cache_creation_input_tokens")):
        return None
    try:
        prompt, completion = litellm.cost_per_token(model=model, prompt_tokens=usage.get("prompt_tokens", 0),
                                                    completion_tokens=usage.get("completion_tokens", 0))
    except Exception:  # no price for the model: nothing to compare with
        return None
    return float(prompt) + float(completion)


def _slot_options(call: ProviderCall, slots: int) -> dict[str, Any]:
    """A llama.cpp-style server's prompt-cache options: keep the prompt cached, in the conversation's
    own slot, so its next turn finds its prefix there (the server evaluates only what follows).
    The slot comes from a digest of the fork chain's root: the same on every turn and every daemon,
    and a fork's the slot holding its parent's prefix. The client's own values are kept (the caller
    lays its extra_body over these)."""
    options: dict[str, Any] = {"cache_prompt": True}
    owner = _cache_owner(call)
    if owner:
        digest = hashlib.sha256(str(owner).encode()).digest()
        options["id_slot"] = int.from_bytes(digest[:8], "big") % slots
    return options


def _usage_dict(usage: Any) -> dict[str, int]:
    if not usage:
        return {}
    counts = {
        key: int(getattr(usage, key, 0) or 0)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    counts.update(_cache_counts(usage))
    return counts


def _cache_counts(usage: Any) -> dict[str, int]:
    """The prompt-cache reads and writes a provider reported, under Anthropic's names for every
    provider: litellm fills prompt_tokens_details from OpenAI's cached_tokens and Anthropic's
    cache_read_input_tokens alike, and keeps Anthropic's cache_creation_input_tokens as sent."""
    details = getattr(usage, "prompt_tokens_details", None)
    read = int(getattr(details, "cached_tokens", 0) or 0) or int(getattr(usage, "cache_read_input_tokens", 0) or 0)
    created = (int(getattr(usage, "cache_creation_input_tokens", 0) or 0)
               or int(getattr(details, "cache_write_tokens", 0) or 0))
    counts: dict[str, int] = {}
    if read:
        counts["cache_read_input_tokens"] = read
    if created:
        counts["cache_creation_input_tokens"] = created
    return counts


def _retry_after(exc: Exception) -> float | None:
    headers = None
    response = getattr(exc, "response", None)
    if response is not None:
        headers = getattr(response, "headers", None)
    headers = headers or getattr(exc, "litellm_response_headers", None)
    if not headers:
        return None
    value = headers.get("retry-after") or headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


KEYLESS_PLACEHOLDER = "no-key"
CauseT = TypeVar("CauseT", bound=BaseException)


def _cause(exc: BaseException, kind: type[CauseT]) -> CauseT | None:
    """The exception of `kind` behind `exc`: litellm wraps what its custom providers raise, and
    the SDK and litellm wrap the size-limit refusal in their own errors."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def reach_probe(url: str) -> Probe | None:
    """Whether anything accepts a connection at `url`'s host and port: a local server that was
    not up yet closes its circuit the moment it is (see CircuitBreaker.check)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None

    async def answers() -> bool:
        try:
            async with asyncio.timeout(0.5):
                _reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:  # the peer reset it: it answered all the same
            pass
        return True

    return answers


def _connection_failed(exc: BaseException) -> bool:
    """True when the provider could not be reached: litellm wraps that in other errors (a 500)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ConnectionError) or type(current).__name__ in ("APIConnectionError", "ConnectError"):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def map_error(litellm: ModuleType, exc: Exception, redact: Callable[[str], str] = str,
              url: str | None = None) -> ProviderFailure:
    """A litellm exception as a ProviderFailure with the design's error code, secrets hidden."""
    errors = litellm.exceptions
    message = redact(str(getattr(exc, "message", None) or exc))[:2000]
    status = getattr(exc, "status_code", None)
    if (too_large := _cause(exc, ResponseTooLarge)) is not None:
        return ProviderFailure(ErrorCode.PROVIDER_ERROR,
                               f"the provider's answer exceeds the size limit of {too_large.limit} bytes",
                               reason="response_too_large", limit=too_large.limit)
    if isinstance(exc, errors.ContextWindowExceededError):
        return ProviderFailure(ErrorCode.CONTEXT_WINDOW_EXCEEDED, message, status=status)
    if isinstance(exc, errors.RateLimitError):
        return ProviderFailure(ErrorCode.RATE_LIMITED, message, retryable=True,
                               retry_after=_retry_after(exc), status=429)
    if isinstance(exc, errors.Timeout):
        return ProviderFailure(ErrorCode.TIMEOUT, message, retryable=True, status=status)
    if isinstance(exc, errors.APIConnectionError) or _connection_failed(exc):
        where = url or "the provider's default URL"  # a connection error says where it tried
        return ProviderFailure(ErrorCode.PROVIDER_ERROR, f"cannot connect to {where}: {message}", retryable=True,
                               probe=reach_probe(url) if url else None, status=status, reason="connection", url=url)
    retryable = isinstance(status, int) and (status >= 500 or status in (408, 409, 429))
    return ProviderFailure(ErrorCode.PROVIDER_ERROR, message, retryable=retryable,
                           retry_after=_retry_after(exc) if retryable else None, status=status)
