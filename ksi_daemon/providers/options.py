"""Which provider options a request may set: none that choose where a call goes or what
credentials go with it, unless the model's settings allow that option by name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ksi_common.errors import ErrorCode, KsiError

# litellm options that pick the host, the provider or the credentials of a call; a request that
# set one could send the key configured for a model to a host the settings never named
ROUTING_OPTIONS = frozenset({
    "api_base", "base_url", "api_key", "api_version", "custom_llm_provider", "extra_headers", "headers",
    "organization", "deployment_id", "model_list", "client", "litellm_params", "proxy", "proxies",
    "http_client", "tenant_id", "client_id", "client_secret", "azure_ad_token", "azure_ad_token_provider",
    "azure_username", "azure_password", "region_name", "credentials",
    "ssl_verify", "cert", "verify",
})
_ROUTING_PREFIXES = ("aws_", "vertex_", "azure_", "watsonx_", "databricks_", "bedrock_", "sagemaker_", "litellm_")
_ROUTING_SUFFIXES = ("_base", "_url", "_endpoint", "_key", "_token", "_secret", "_credentials", "_headers",
                     "_password", "_host")


def is_routing_option(name: str) -> bool:
    lowered = name.lower()
    return (lowered in ROUTING_OPTIONS or lowered.startswith(_ROUTING_PREFIXES)
            or lowered.endswith(_ROUTING_SUFFIXES))


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
