"""One rule for every door and every provider: what a request asks of a model that the model's
abilities say it cannot take is refused (`unsupported_parameter`, naming each field), never dropped.
A web search is the exception that must be known: a provider that does not search ignores the ask."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ksi_common.errors import ErrorCode, KsiError
from ksi_daemon.providers.base import ModelAbilities
from ksi_daemon.providers.options import KEPT_OPTIONS, asks_for_schema


def refuse_unable(model: str, abilities: ModelAbilities, options: Mapping[str, Any], tools: bool,
                  image_fields: Sequence[str], pdf_fields: Sequence[str] = ()) -> None:
    """Raise for the first of `options`, tools, images and PDFs that `model` is known not to take;
    what nobody knows it cannot take is passed on (the provider's own refusal then comes back)."""
    sent = [name for name in options if name not in KEPT_OPTIONS]  # kept ones are kept whoever answers
    if sent and not abilities.options:
        _refuse(model, abilities, f"takes no request options ({', '.join(sorted(sent))})",
                {f"options.{name}": "not passed on to this model" for name in sent})
    if asks_for_schema(options) and abilities.response_schema is False:
        _refuse(model, abilities, "cannot follow a JSON schema (response_format json_schema); use json_object",
                {"options.response_format": "this model cannot follow a JSON schema"}, "supports_response_schema")
    if "web_search_options" in options and abilities.web_search is not True:
        # a search the model does not run itself would be dropped by the provider without a word
        _refuse(model, abilities, "is not known to search the web itself (web_search_options; a web_search tool "
                                  "is left out for a model whose drop_hosted_tools names it)",
                {"options.web_search_options": "this model is not known to search the web"}, "supports_web_search")
    if tools and abilities.function_calling is False:
        _refuse(model, abilities, "cannot call tools", {"tools": "this model cannot call tools"},
                "supports_function_calling")
    if image_fields and abilities.vision is False:
        _refuse(model, abilities, "does not take images; use a vision model",
                {name: "this model does not take images" for name in image_fields}, "supports_vision")
    if pdf_fields and abilities.pdf_input is False:
        _refuse(model, abilities, "does not read PDF documents; send their text, or use a model that reads PDFs",
                {name: "this model does not read PDFs" for name in pdf_fields}, "supports_pdf_input")


def _refuse(model: str, abilities: ModelAbilities, what: str, fields: dict[str, str],
            declaration: str | None = None) -> NoReturn:
    if abilities.because:  # the provider's nature: no setting changes it
        raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{model} {abilities.because}: it {what}",
                       fields=fields, model=model)
    hint = f", or declare {declaration} for it in KSI_MODELS if it can" if declaration else ""
    raise KsiError(ErrorCode.UNSUPPORTED_PARAMETER, f"{model} {what}{hint}", fields=fields, model=model)
