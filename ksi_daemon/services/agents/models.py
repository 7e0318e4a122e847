"""Payloads of the `agent:*` events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ksi_common.limits import MAX_TIMEOUT
from ksi_daemon.events import EventData, ModelName, NonBlank, SafeId, Text


class AgentRef(EventData):
    agent_id: SafeId = Field(description="the agent's id")


class AgentSpawn(EventData):
    agent_id: SafeId | None = Field(default=None, description="the new agent's id; default agent_ + 8 hex digits")
    profile: Text | None = Field(default=None, description="profile supplying model, system prompt and allowed events")
    system: Text | None = Field(default=None, description="system prompt (overrides the profile's)")
    model: ModelName | None = Field(default=None, description="model (overrides the profile's; default: the daemon's)")
    temperature: float | None = Field(default=None, ge=0, le=2, description="sampling temperature (overrides the profile's)")
    prompt: NonBlank | None = Field(default=None, description="a first message, queued at once")
    stream: bool = Field(default=False, description="stream the first reply as completion:chunk events")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form, kept with the agent")
    component: Text | None = Field(default=None, description="older clients' name for profile")

    @model_validator(mode="after")
    def _component_names_the_profile(self) -> AgentSpawn:
        # The original KSI client spawns with `component`; it means a profile when one has that name.
        if self.component is not None:
            if self.profile is not None and self.profile != self.component:
                raise ValueError("give profile or component, not two different names")
            self.profile = self.component
        return self


class AgentSendMessage(AgentRef):
    message: NonBlank = Field(description="the text the agent receives (older clients: {role, content})")
    wait: bool | float = Field(default=False, description="true or seconds: reply like completion:wait (ignored for agents)")
    stream: bool = Field(default=False, description="push completion:chunk events while the reply arrives")
    metadata: dict[str, Any] = Field(default_factory=dict, description="free-form, stored with the message")

    @field_validator("message", mode="before")
    @classmethod
    def _message_object(cls, value: Any) -> Any:
        # The original KSI client sends {"role": "user", "content": "..."}: its content is the text.
        if isinstance(value, dict) and set(value) <= {"role", "content"} and "content" in value:
            if value.get("role", "user") != "user":
                raise ValueError("a message object must have role user")
            return value["content"]
        return value

    @field_validator("wait")
    @classmethod
    def _wait(cls, value: bool | float) -> bool | float:
        if not isinstance(value, bool) and not 0 <= value <= MAX_TIMEOUT:
            raise ValueError(f"wait must be true, false or a number of seconds from 0 to {MAX_TIMEOUT:g}")
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
    agent_id: SafeId | None = Field(default=None, description="the agent to stop")
    all: bool = Field(default=False, description="stop every active agent")

    @model_validator(mode="after")
    def _one_target(self) -> AgentTerminate:
        if (self.agent_id is None) == (not self.all):
            raise ValueError("give either agent_id or all: true")
        return self
