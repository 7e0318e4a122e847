"""The narrow contract between the completion service and whatever answers a model call."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.items import Item, message

# models litellm calls through Anthropic's own API: the only ones that take Anthropic's own fields
# (thinking as it is, anthropic-beta, cache_control on blocks)
ANTHROPIC_ROUTES = ("anthropic/", "claude-")


def calls_anthropic(model: str) -> bool:
    return model.startswith(ANTHROPIC_ROUTES)


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    """A piece of a reply's reasoning as it streams: text of the thinking block being written, the
    signature that ends it, or a redacted block whole (its data)."""

    text: str = ""
    signature: str = ""
    redacted: str = ""

    def payload(self) -> dict[str, str]:
        """Its non-empty fields: what a `completion:chunk` carries as `reasoning`."""
        fields = {"text": self.text, "signature": self.signature, "redacted": self.redacted}
        return {name: value for name, value in fields.items() if value}


# a streamed piece: text, a tool call's delta ({"index", "call_id", "name", "arguments"}), or reasoning
ChunkSink = Callable[[str | dict[str, Any] | ReasoningPiece], None]


@dataclass(slots=True)
class ProviderCall:
    """One model call: the full message list to send and the caller's options."""

    model: str
    messages: list[dict[str, Any]]
    temperature: float | None = None
    max_tokens: int | None = None
    timeout: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # function tools in the Responses form ({"type": "function", "name", "description", "parameters",
    # "strict"}); the provider turns them (and tool_choice) into its own shapes
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    on_chunk: ChunkSink | None = None
    # CLI-session providers: resume this session (None starts a fresh one seeded with `messages`).
    resume_session: str | None = None
    # the client's `anthropic-beta` features: a header of Anthropic's API, sent to its models only
    anthropic_beta: list[str] = field(default_factory=list)
    # who is asking: request_id, response_id, conversation_id, agent_id, and an inline consortium
    # definition when there is one; answerers that log calls of their own (consortium) use it
    request: dict[str, Any] = field(default_factory=dict)
    # what the system message opens with, in order, that changes least (the system prompt, then the
    # stored summaries up to the newest): a provider taking cache breakpoints closes each of them
    stable_system: list[str] = field(default_factory=list)
    # the conversation whose cached prefix the call extends: the root of its fork chain, so a fork
    # meets the cache (OpenAI's key, a local server's slot) its parent's turns filled
    cache_root: str | None = None


@dataclass(slots=True)
class ProviderReply:
    content: str
    model: str
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    cost: float | None = None
    cost_uncached: float | None = None  # the same usage priced with no cache read or written
    provider: str | None = None
    provider_response_id: str | None = None
    session_id: str | None = None  # CLI-session providers: the session that now holds this exchange
    session_note: str | None = None  # e.g. "resume failed; started a fresh session"
    # answerer-specific fields added to the result and the response file (consortium: run_id, ...)
    extra: dict[str, Any] = field(default_factory=dict)
    # the reply as items (function calls, a reasoning summary, the text); empty: the text alone
    output: list[Item] = field(default_factory=list)
    # the prompt-cache breakpoints the call went out with ({at, ttl, by, closes?}, `at` an index of
    # the call's messages); empty: none (placement off, or a provider that takes none)
    breakpoints: list[dict[str, Any]] = field(default_factory=list)

    def items(self) -> list[Item]:
        """The reply's output items: those the provider gave, else its text as one assistant message."""
        return self.output or [message("assistant", self.content)]


Probe = Callable[[], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class ModelAbilities:
    """What a model is known to do: True or False when its provider, the settings or litellm say,
    None when nobody does (the option is then passed on and the provider's own refusal comes back)."""

    response_schema: bool | None = None
    function_calling: bool | None = None
    vision: bool | None = None
    pdf_input: bool | None = None  # takes a PDF as a file part (litellm's supports_pdf_input)
    web_search: bool | None = None  # searches the web itself (litellm's web_search_options)
    options: bool = True  # takes request options at all (a CLI keeps its own sampling)
    # what the provider is, when that (not the model) is why it cannot ("runs the claude CLI", "is a
    # consortium"): said in each refusal; None: the model cannot, and the settings may declare it can
    because: str | None = None


class ProviderFailure(KsiError):
    """A failed model call; `retryable` and `retry_after` steer the daemon's retry policy, and
    `probe` (for a provider that could not be reached) asks cheaply whether it answers again."""

    def __init__(self, code: ErrorCode | str, message: str, *, retryable: bool = False,
                 retry_after: float | None = None, probe: Probe | None = None, **details: Any) -> None:
        if retry_after is not None:
            details.setdefault("retry_after", retry_after)  # the client's hint as well
        super().__init__(code, message, **details)
        self.retryable = retryable
        self.retry_after = retry_after
        self.probe = probe


class CommandMissing(Exception):
    """A CLI provider's program is not on the daemon's PATH (raised inside litellm, found by the adapter)."""

    def __init__(self, binary: str) -> None:
        super().__init__(f"{binary!r} was not found on PATH")
        self.binary = binary


class Provider(Protocol):
    """What answers a model's calls: one async method to call it, and what the daemon must know of
    it, read from it rather than guessed from a model's name."""

    # it holds the conversation itself (a CLI session): a turn continuing its session is sent to it
    # with that session to resume (ProviderCall.resume_session), and the reply names the session
    keeps_session: bool
    # a call takes a concurrency slot; False for one whose own calls take theirs (a consortium run)
    takes_slot: bool
    # its usage counts the prompt the daemon built, so the daemon learns its token ratio from it
    calibrated: bool

    async def abilities(self, model: str) -> ModelAbilities:
        """What `model` can take from a request: tools, images, a JSON schema, options."""

    async def complete(self, call: ProviderCall) -> ProviderReply:
        """Send the call; return the reply or raise ProviderFailure."""


# CLI-session providers receive the session to resume through litellm's `metadata`, and name the
# session that holds the exchange (and why a fresh one was started) in the reply's hidden params.
SESSION_METADATA_KEY = "ksi_resume_session"
SESSION_ID_KEY = "ksi_session_id"
SESSION_NOTE_KEY = "ksi_session_note"


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message, joining the text parts of multi-part content."""
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")
