"""Exchange items read from response-record lines, old and new."""

from ksi_common.items import (
    call_ids_answered,
    function_calls,
    input_items,
    item_text,
    output_fields,
    output_items,
    output_text,
)
from ksi_daemon.providers.tool_calls import input_messages, output_message, with_calls_answered


def test_a_record_written_before_items_reads_as_one_user_and_one_assistant_message() -> None:
    inputs = [{"v": 1, "type": "system", "content": "be brief"}, {"v": 1, "type": "user", "content": "hi"}]
    outcome = {"v": 1, "type": "assistant", "content": "hello"}
    assert input_items(inputs) == [{"type": "message", "role": "system", "content": "be brief"},
                                   {"type": "message", "role": "user", "content": "hi"}]
    assert output_items(outcome) == [{"type": "message", "role": "assistant", "content": "hello"}]


def test_tool_calls_survive_the_outcome_line_and_its_text_stays_readable() -> None:
    output = [{"type": "message", "role": "assistant", "content": "checking"},
              {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}]
    line = {"type": "assistant", **output_fields(output)}
    assert line["content"] == "checking"
    assert output_items(line) == output
    assert [c["call_id"] for c in function_calls(output_items(line))] == ["c1"]
    plain = [{"type": "message", "role": "assistant", "content": "done"}]
    assert output_fields(plain) == {"content": "done"}  # a plain reply keeps the old line shape


def test_function_call_outputs_and_image_parts_are_input_items() -> None:
    lines = [{"type": "function_call_output", "call_id": "c1", "output": "12C"},
             {"type": "user", "content": "and this?",
              "parts": [{"type": "input_text", "text": "and this?"},
                        {"type": "input_image", "image": {"sha256": "ab" * 32, "media_type": "image/png", "bytes": 3}}]}]
    items = input_items(lines)
    assert call_ids_answered(items) == ["c1"]
    assert item_text(items[1]) == "and this? [image sha256:abababababab]"
    assert output_items({"type": "error", "code": "timeout"}) == []
    assert output_text([{"type": "function_call", "call_id": "c", "name": "n", "arguments": "{}"}]) == ""


def test_a_call_without_its_output_and_an_output_without_its_call_are_shown_as_text() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}
    made = output_message([call])
    answer = input_messages([{"type": "function_call_output", "call_id": "c1", "output": "12C"}])
    paired = [{"role": "user", "content": "hi"}, made, *answer]
    assert with_calls_answered(paired) == paired  # kept as they are when whole
    # a pinned exchange shown without the one that answers it, and an answer without its call
    broken = with_calls_answered([{"role": "user", "content": "hi"}, made, {"role": "user", "content": "next"},
                                  *answer])
    assert [m["role"] for m in broken] == ["user", "assistant", "user", "user"]
    assert "tool_calls" not in broken[1] and "weather" in broken[1]["content"] and "c1" in broken[1]["content"]
    assert broken[3]["content"] == "[output of c1: 12C]"
