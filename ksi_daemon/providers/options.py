"""Which provider options a request may set: none that choose where a call goes or what
credentials go with it, unless the model's settings allow that option by name; the sampling and
format options every door maps its fields onto; and the options refused because KSI could not
keep what they ask for (tool calls, several answers, logprobs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from ksi_common.errors import ErrorCode, KsiError

# litellm options that pick the host, the provider or the credentials of a call; a request that
# set one could send the key configured for a model to a host the settings never named. Named one by
# one (and by the prefixes of litellm's provider-specific settings), never by a suffix: a name such
# as `prompt_cache_key` or `max_tokens` says nothing about credentials
ROUTING_OPTIONS = frozenset({
    "api_base", "base_url", "api_key", "api_version", "api_type", "custom_llm_provider", "extra_headers",
    "headers", "organization", "deployment_id", "model_list", "client", "litellm_params", "proxy", "proxies",
    "http_client", "shared_session", "tenant_id", "client_id", "client_secret", "azure_ad_token",
    "azure_ad_token_provider", "azure_username", "azure_password", "region_name", "credentials",
    "token", "access_token", "api_token", "refresh_token", "password", "secret", "endpoint", "url",
    "project_id", "space_id", "ssl_verify", "cert", "verify",
})
_ROUTING_PREFIXES = ("aws_", "vertex_", "azure_", "watsonx_", "databricks_", "bedrock_", "sagemaker_", "litellm_")

# options that choose no host and carry no secret, sent by Responses clients (Codex sends
# prompt_cache_key and client_metadata with every request): passed to a provider that takes them
# (litellm lists them for its model), left out of any other call, and always kept with the exchange's
# request lines, so what the client asked is never lost
KEPT_OPTIONS = frozenset({"prompt_cache_key", "safety_identifier", "client_metadata", "service_tier",
                          "max_tool_calls", "truncation", "verbosity"})


def is_routing_option(name: str) -> bool:
    lowered = name.lower()
    return lowered in ROUTING_OPTIONS or lowered.startswith(_ROUTING_PREFIXES)


def kept_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of `options` that are kept with the exchange whether or not a provider takes them."""
    return {name: value for name, value in options.items() if name in KEPT_OPTIONS}


def check_options(model: str, options: Mapping[str, Any], allowed: Iterable[str]) -> None:
    """Refuse (validation_error) every routing option of `options` the model's settings do not allow."""
    permitted = set(allowed)
    refused = sorted(name for name in options if is_routing_option(name) and name not in permitted)
    if refused:
        raise KsiError(
            ErrorCode.VALIDATION_ERROR,
            f"options {refused} choose where a call to {model} goes or what credentials it carries; "
            "only the model's settings may allow them (allow_options)",
            fields={f"options.{name}": "not allowed for this model" for name in refused},
            model=model,
        )


def circuit_key(model: str, api_base: str | None, options: Mapping[str, Any]) -> str:
    """What a circuit breaker counts failures of: one model at one endpoint. A failing local
    server must not silence every model of its provider prefix, nor one model elsewhere."""
    base = options.get("api_base") or options.get("base_url") or api_base
    return f"{model} @ {base}" if base else model


# -- sampling and format options ------------------------------------------------------------
# The one list of what a request may ask of the answer's sampling and form: every door maps its
# own fields onto these keys (completion:async takes them in `options`), and they reach litellm
# as given. Everything else a request could ask is either in REFUSED_OPTIONS or, on the socket,
# a provider option passed on by name.

JSON_SCHEMA_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[str, StringConstraints(pattern=JSON_SCHEMA_NAME)]
    description: str | None = None
    # `schema` is a method of BaseModel: the field takes another Python name
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class SamplingOptions(BaseModel):
    """The shape of each sampling/format option; keys not named here are not checked by it."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    seed: int | None = None
    stop: str | Annotated[list[str], Field(min_length=1, max_length=4)] | None = None
    top_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    max_tokens: int | None = Field(default=None, gt=0)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]] \
        | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None


SAMPLING_OPTIONS = frozenset(SamplingOptions.model_fields)

TOOLS_NOT_STORED = "tool calls are not stored by this version of KSI (an exchange holds text only)"
ONE_ANSWER = "KSI stores one answer per exchange"
NO_LOGPROBS = "answers are not returned with logprobs"
OWN_STREAMING = "KSI owns streaming: use the request's own stream field"
NO_BACKGROUND = "a background run is asked with completion:async's own background field, not as a provider option"


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _no_tool_choice(value: Any) -> bool:
    # "auto" with no tools (tools are never passed) cannot make a call: SDKs send it by default
    return value in (None, "none", "auto")


# option -> (is the value one that asks for nothing, why a value that does ask is refused)
REFUSED_OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_unset, TOOLS_NOT_STORED),
    "functions": (_unset, TOOLS_NOT_STORED),
    "tool_choice": (_no_tool_choice, TOOLS_NOT_STORED),
    "function_call": (_no_tool_choice, TOOLS_NOT_STORED),
    # parallel_tool_calls only says how tools are called: without tools (never passed) it asks nothing
    "parallel_tool_calls": (lambda value: True, TOOLS_NOT_STORED),
    "n": (lambda value: value in (None, 1), ONE_ANSWER),
    "logprobs": (_unset, NO_LOGPROBS),
    "top_logprobs": (lambda value: value in (None, 0), NO_LOGPROBS),
    "background": (_unset, NO_BACKGROUND),
    "stream": (lambda value: False, OWN_STREAMING),
    "stream_options": (lambda value: False, OWN_STREAMING),
}


def check_request_options(options: Mapping[str, Any], where: str = "options.") -> dict[str, Any]:
    """`options` as they go to the provider: refused ones fail with `unsupported_parameter`, the
    sampling/format ones are checked in shape (`validation_error`), values that ask for nothing
    (an SDK's `tools: []`, `n: 1`) are left out. `where` prefixes the field names in errors."""
    refused = {f"{where}{name}": why for name, (asks_nothing, why) in REFUSED_OPTIONS.items()
               if name in options and not asks_nothing(options[name])}
    if refused:
        raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       "; ".join(f"{name} is not supported: {why}" for name, why in refused.items()),
                       fields=refused)
    try:
        SamplingOptions.model_validate(dict(options))
    except ValidationError as exc:
        fields = {where + ".".join(str(p) for p in _without_tag(error["loc"])): error["msg"]
                  for error in exc.errors(include_url=False)}
        raise KsiError(ErrorCode.VALIDATION_ERROR,
                       "invalid options: " + "; ".join(f"{k}: {v}" for k, v in fields.items()),
                       fields=fields) from None
    return {name: value for name, value in options.items()
            if name not in REFUSED_OPTIONS and not (name in SAMPLING_OPTIONS and value is None)}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "constrained-str", "function-after"})


def _without_tag(location: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A field's path without the union members pydantic names in it (`stop.list[str]`)."""
    if len(location) > 2 and location[0] == "response_format":
        location = location[:1] + location[2:]  # the format's type, its union tag
    return tuple(p for p in location if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))


def asks_for_schema(options: Mapping[str, Any]) -> bool:
    """True when `options` ask the answer to follow a JSON schema."""
    fmt = options.get("response_format")
    return isinstance(fmt, Mapping) and fmt.get("type") == "json_schema"
