"""Consortium definitions and reading the arbiter's verdict, without a daemon."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from ksi_common.errors import KsiError
from ksi_daemon.services.consortium.arbiter import Judged, read_verdict, refinement_turns
from ksi_daemon.services.consortium.models import ConsortiumDefinition, Member, parse_definition
from ksi_daemon.services.consortium.run import split_messages, with_member_system


@pytest.mark.parametrize(("text", "model", "count"), [
    ("openai/gpt-4o:2", "openai/gpt-4o", 2),
    ("ollama/qwen3:4b", "ollama/qwen3:4b", 1),
    ("ollama/qwen3:4b:3", "ollama/qwen3:4b", 3),
    ("openai/gpt-4.1-2025-04-14", "openai/gpt-4.1-2025-04-14", 1),
    (" gemini/gemini-2.0-flash ", "gemini/gemini-2.0-flash", 1),
])
def test_member_text_names_model_and_count(text: str, model: str, count: int) -> None:
    member = Member.model_validate(text)
    assert (member.model, member.count) == (model, count)


@pytest.mark.parametrize("text", ["gpt:0", "", ":3", "gpt:", "openai/x:-1", "a b", "consortium/x", "/x"])
def test_bad_member_text_is_refused(text: str) -> None:
    with pytest.raises(ValidationError):
        Member.model_validate(text)


def test_a_model_ending_in_colon_digits_is_written_as_an_object() -> None:
    member = Member.model_validate({"model": "bedrock/anthropic.claude-v1:0", "count": 1})
    assert member.model == "bedrock/anthropic.claude-v1:0"


def test_definition_defaults_and_instances() -> None:
    definition = ConsortiumDefinition.model_validate(
        {"members": ["openai/a:2", "ollama/qwen3:4b"], "arbiter": "openai/j"})
    assert definition.confidence_threshold == 0.8
    assert (definition.min_iterations, definition.max_iterations, definition.judging) == (1, 3, "synthesis")
    assert definition.instances() == [("openai/a", 1), ("openai/a", 2), ("ollama/qwen3:4b", 1)]
    assert ConsortiumDefinition.model_validate(
        {"members": ["openai/a"], "arbiter": "openai/j", "confidence_threshold": 80}).confidence_threshold == 0.8
    assert ConsortiumDefinition.model_validate(
        {"members": ["openai/a"], "arbiter": "openai/j", "confidence_threshold": 1}).confidence_threshold == 1.0


def test_inline_errors_name_fields_under_consortium() -> None:
    with pytest.raises(KsiError) as caught:
        parse_definition({"members": ["openai/a"], "arbiter": "openai/j", "min_iterations": 4, "max_iterations": 2})
    assert caught.value.code == "validation_error"
    assert list(caught.value.details["fields"]) == ["consortium.max_iterations"]


@pytest.mark.parametrize(("text", "synthesis", "confidence", "parse"), [
    ('{"synthesis": "s", "confidence": 0.7}', "s", 0.7, "json"),
    ('Sure!\n```json\n{"synthesis": "f", "confidence": "90%"}\n```\nDone.', "f", 0.9, "json"),
    ('My verdict: {"synthesis": "inline {braces}", "confidence": 75, "ranking": ["answer 2"]} ok', "inline {braces}",
     0.75, "json"),
    ("Plain prose, no JSON.", "Plain prose, no JSON.", 0.0, "fallback"),
    ('{"unrelated": true}', '{"unrelated": true}', 0.0, "fallback"),
    ('{"synthesis": "s", "confidence": "very"}', '{"synthesis": "s", "confidence": "very"}', 0.0, "fallback"),
])
def test_read_verdict(text: str, synthesis: str, confidence: float, parse: str) -> None:
    reading = read_verdict(text)
    assert (reading.verdict.synthesis, reading.verdict.confidence, reading.parse) == (synthesis, confidence, parse)
    assert (reading.problem is None) == (parse == "json")


def test_verdict_ranking_and_lists_are_lenient() -> None:
    reading = read_verdict('{"synthesis": "s", "confidence": 0.5, "ranking": [2, "1", "answer 3", "x"], '
                           '"refinement_areas": "be concise", "dissent": ["a", "b"], "needs_iteration": true}')
    verdict = reading.verdict
    assert verdict.ranking == [2, 1, 3]
    assert verdict.refinement_areas == ["be concise"]
    assert verdict.dissent == "a\nb"
    assert verdict.needs_iteration is True


def test_split_messages_finds_history_and_new_input() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}, {"role": "user", "content": "u3"}]
    system, history, new_input = split_messages(messages)
    assert system == "S"
    assert [m["content"] for m in history] == ["u1", "a1"]
    assert [m["content"] for m in new_input] == ["u2", "u3"]
    assert split_messages([{"role": "user", "content": "only"}]) == (None, [], [{"role": "user", "content": "only"}])


def test_member_system_is_merged_after_the_conversations() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert with_member_system(messages, "M")[0] == {"role": "system", "content": "S\n\nM"}
    assert with_member_system(messages[1:], "M")[0] == {"role": "system", "content": "M"}
    assert with_member_system(messages, None) == messages


def test_refinement_turns_carry_the_draft_and_the_areas() -> None:
    turns = refinement_turns(Judged(1, "draft", 0.4, refinement_areas=["cite sources"], dissent="dates differ"))
    assert turns[0] == {"role": "assistant", "content": "draft"}
    assert turns[1]["role"] == "user"
    assert "cite sources" in turns[1]["content"] and "dates differ" in turns[1]["content"]
