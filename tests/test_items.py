"""Exchange items read from response-record lines, old and new."""

from ksi_common.items import (
    call_ids_answered,
    function_calls,
    input_items,
    input_line_fields,
    item_line,
    item_public,
    item_text,
    output_fields,
    output_items,
    output_text,
    part_text,
    ref_public,
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


def test_an_item_stored_as_a_line_reads_back_as_the_same_item() -> None:
    picture = {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "look"},
        {"type": "input_image", "image": {"sha256": "ab" * 32, "media_type": "image/png", "bytes": 3}}]}
    for item, user_type in ((picture, "user"), ({"type": "message", "role": "user", "content": "hi"}, "feedback"),
                            ({"type": "message", "role": "system", "content": "be brief"}, "user"),
                            ({"type": "function_call_output", "call_id": "c1", "output": "12C"}, "user")):
        line = input_line_fields(item, user_type)
        assert input_items([line]) == [item]
    assert input_line_fields(picture)["content"] == "look"  # every reader made before parts sees the text
    assert input_line_fields({"type": "message", "role": "user", "content": "hi"}, "feedback")["type"] == "feedback"


def test_what_a_person_is_shown_of_an_item_names_references_never_bytes_or_paths() -> None:
    ref = {"sha256": "ab12" * 16, "media_type": "image/png", "bytes": 3072, "path": "/home/me/cat.png",
           "url": "data:image/png;base64,AAAA"}
    assert ref_public(ref) == {"sha256": "ab12" * 16, "media_type": "image/png", "bytes": 3072}
    shown = item_public({"type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": "and this?"}, {"type": "input_image", "image": ref}]})
    assert shown["content"][1] == {"type": "input_image", "image": ref_public(ref)}
    assert item_line(shown) == "and this? [image sha256:ab12ab12ab12\u2026 image/png 3 KB]"
    web = {"type": "input_image", "image": {"url": "https://example.org/cat.png", "bytes": 2_500_000}}
    assert item_line({"type": "message", "role": "user", "content": [web]}) == \
        "[image https://example.org/cat.png 2.4 MB]"
    assert item_line({"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}) \
        == '\u2192 call weather({"city": "Oslo"}) [c1]'
    assert item_line({"type": "function_call_output", "call_id": "c1", "output": "12C"}) == "\u2190 c1: 12C"
    assert item_line({"type": "reasoning", "summary": "thought"}) == "(reasoning) thought"


def test_a_record_that_kept_a_client_path_as_the_image_name_is_shown_with_the_file_name_only() -> None:
    ref = {"sha256": "cd34" * 16, "media_type": "image/png", "bytes": 10, "width": 4, "height": 3,
           "name": "/home/me/private/cat.png"}
    assert ref_public(ref) == {**ref, "name": "cat.png"}  # with the size in pixels an import counts by
    part = {"type": "input_image", "image": ref}
    assert "/home/me" not in item_line({"type": "message", "role": "user", "content": [part]})
    assert part_text([part]) == "[image cat.png]"  # the note a model without vision is sent


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
