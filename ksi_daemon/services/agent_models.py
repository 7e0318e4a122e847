"""Payloads of the `agent:*` events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ksi_common.ids import is_safe_id
from ksi_daemon.events import EventData, Text

ID_RULE = "must match [A-Za-z0-9][A-Za-z0-9_.-]{0,127} without '..'"


def _safe(value: str | None) -> str | None:
    if value is not None and not is_safe_id(value):
        raise ValueError(ID_RULE)
    return value


class AgentRef(EventData):
    agent_id: Text = Field(description="the agent's id")

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, value: str) -> str:
        return _safe(value) or value


class AgentSpawn(EventData):
    agent_id: Text | None = Field(default=None, description="the new agent's id; default agent_ + 8 hex digits")
    profile: Text | None = Field(default=None, description="profile supplying model, system prompt and allowed events")
    system: Text | None = Field(default=None, description="system prompt (overrides the profile's)")
    model: Text | None = Field(default=None, description="model (overrides the profile's; default: the daemon's)")
    temperature: float | None = Field(default=None, ge=0, le=2, description="sampling temperature (overrides the profile's)")
    prompt: Text | None = Field(default=None, description="a first message, queued at once")
    stream: bool = Field(default=False, description="stream the first reply as completion:chunk events")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form, kept with the agent")

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, value: str | None) -> str | None:
        return _safe(value)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("prompt must not be empty")
        return value


class AgentSendMessage(AgentRef):
    message: Text = Field(min_length=1, description="the text the agent receives")
    wait: bool | float = Field(default=False, description="true or seconds: reply like completion:wait (ignored for agents)")
    stream: bool = Field(default=False, description="push completion:chunk events while the reply arrives")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form, stored with the message")

    @field_validator("wait")
    @classmethod
    def _wait(cls, value: bool | float) -> bool | float:
        if not isinstance(value, bool) and value < 0:
            raise ValueError("wait must be true, false or a number of seconds >= 0")
        return value

    @field_validator("message")
    @classmethod
    def _message(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("message must not be empty")
        return value


class AgentList(EventData):
    status: Literal["active", "terminated"] | None = Field(default=None, description="only agents in this status")


class AgentInfo(AgentRef):
    pass


class AgentReset(AgentRef):
    pass


class AgentProfiles(EventData):
    pass


class AgentTerminate(EventData):
    agent_id: Text | None = Field(default=None, description="the agent to stop")
    all: bool = Field(default=False, description="stop every active agent")

    @field_validator("agent_id")
    @classmethod
    def _agent_id(cls, value: str | None) -> str | None:
        return _safe(value)

    @model_validator(mode="after")
    def _one_target(self) -> AgentTerminate:
        if (self.agent_id is None) == (not self.all):
            raise ValueError("give either agent_id or all: true")
        return self
