"""LangChain's ChatOpenAI on the Responses API, used as its documentation tells a user to, against
a real in-process daemon, real litellm and the stub: `use_previous_response_id=True` chains by
the id of the last AI message, which LangChain recognises only when it starts with `resp_`."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI

from ksi_daemon.context import EventContext
from tests.conftest import HttpDaemon
from tests.stub_openai import StubOpenAI


async def request(http: HttpDaemon, event: str, data: dict[str, Any]) -> dict[str, Any]:
    return await http.daemon.router.request(event, data, EventContext.root())


async def test_use_previous_response_id_chains_one_conversation(http_daemon: HttpDaemon, stub: StubOpenAI) -> None:
    llm = ChatOpenAI(model="openai/stub-model", base_url=f"{http_daemon.base_url}/v1", api_key=http_daemon.token,
                     max_retries=0, use_responses_api=True, use_previous_response_id=True)
    history: list[Any] = [HumanMessage("My name is Ada")]
    first = await llm.ainvoke(history)
    assert isinstance(first, AIMessage) and first.text == "stub answer to: My name is Ada"
    assert str(first.response_metadata["id"]).startswith("resp_")
    history += [first, HumanMessage("What is my name?")]
    second = await llm.ainvoke(history)  # only the new message goes, with the first's id
    assert second.text == "stub answer to: What is my name?"
    assert stub.messages() == [{"role": "user", "content": "My name is Ada"},
                               {"role": "assistant", "content": "stub answer to: My name is Ada"},
                               {"role": "user", "content": "What is my name?"}]
    listing = await request(http_daemon, "conversation:list", {})
    assert [c["exchanges"] for c in listing["conversations"]] == [2]  # ONE conversation holding both turns
    shown = await request(http_daemon, "response:show",
                          {"response_id": str(second.response_metadata["id"]).removeprefix("resp_")})
    assert shown["previous_response_id"] == str(first.response_metadata["id"]).removeprefix("resp_")
