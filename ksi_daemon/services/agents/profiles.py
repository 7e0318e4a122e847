"""Agent profiles: YAML files, or Markdown whose body is the system prompt under YAML front matter."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ksi_common.errors import ErrorCode, KsiError
from ksi_common.ids import is_safe_id

SUFFIXES = (".yaml", ".yml", ".md")
# the request itself sets these; a profile setting them would be refused at every message
RESERVED_OPTIONS = frozenset({"model", "messages", "stream", "metadata", "api_key", "api_base"})


def shipped_profiles_dir() -> Path:
    """The profiles that ship inside the package (`ksi_daemon/profiles/`)."""
    return Path(str(resources.files("ksi_daemon").joinpath("profiles")))


def is_event_pattern(pattern: str) -> bool:
    """`*`, `ns:*` or an exact `ns:name`: the shapes the router's matcher understands."""
    if pattern == "*":
        return True
    namespace, colon, name = pattern.partition(":")
    return bool(namespace and colon and name) and ("*" not in name or name == "*") and "*" not in namespace


class Profile(BaseModel):
    """What a profile file may say; unknown keys are refused so a typo is reported, not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str = ""
    model: str | None = None
    system: str | None = Field(default=None, validation_alias=AliasChoices("system", "system_prompt"))
    temperature: float | None = Field(default=None, ge=0, le=2)
    allowed_events: list[str] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not is_safe_id(value):
            raise ValueError("must match [A-Za-z0-9][A-Za-z0-9_.-]{0,127} without '..'")
        return value

    @field_validator("system")
    @classmethod
    def _system(cls, value: str | None) -> str | None:
        return value.strip() or None if value is not None else None

    @field_validator("options")
    @classmethod
    def _options(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = RESERVED_OPTIONS & set(value)
        if reserved:
            raise ValueError(f"options may not set {sorted(reserved)}")
        return value

    @field_validator("allowed_events")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not is_event_pattern(pattern):
                raise ValueError(f"{pattern!r} must be `*`, `ns:*` or an exact event name")
        return value

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "description": self.description,
                "allowed_events": self.allowed_events}


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """Markdown `---` YAML front matter and the body after it."""
    if not text.startswith("---"):
        return {}, text
    first_newline = text.find("\n")
    if first_newline < 0 or text[:first_newline].strip() != "---":
        return {}, text
    rest = text[first_newline + 1:]
    lines = rest.splitlines(keepends=True)
    offset = 0
    for line in lines:
        if line.strip() == "---":
            header = yaml.safe_load(rest[:offset]) or {}
            if not isinstance(header, dict):
                raise ValueError("front matter must be a YAML mapping")
            return header, rest[offset + len(line):]
        offset += len(line)
    raise ValueError("front matter is not closed by a `---` line")


def parse_profile(path: Path) -> Profile:
    """One profile file; raises ValueError (or pydantic's) with the reason it is unusable."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        fields, body = split_front_matter(text)
        if body.strip():
            if fields.get("system") or fields.get("system_prompt"):
                raise ValueError("give the system prompt either as the body or in the front matter, not both")
            fields["system"] = body.strip()
    else:
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ValueError("a YAML profile must be a mapping")
        fields = loaded
    fields.setdefault("name", path.stem)
    return Profile.model_validate(fields)


@dataclass(slots=True)
class ProfileSet:
    profiles: dict[str, Profile] = field(default_factory=dict)
    invalid: list[dict[str, str]] = field(default_factory=list)  # files that could not be used, and why


class ProfileLibrary:
    """The shipped profiles plus those of the profiles directory (which win on a shared name),
    read on each use, so edited or added files count without a restart."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory or shipped_profiles_dir()
        self.directories = [shipped_profiles_dir()]
        if directory is not None and directory.resolve() != self.directories[0].resolve():
            self.directories.append(directory)

    def load(self) -> ProfileSet:
        """Every profile of every directory (blocking: run it in a worker thread)."""
        found = ProfileSet()
        for directory in self.directories:
            own = self._load_one(directory)
            found.profiles.update(own.profiles)
            found.invalid.extend(own.invalid)
        return found

    @staticmethod
    def _load_one(directory: Path) -> ProfileSet:
        found = ProfileSet()
        if not directory.is_dir():
            return found
        for path in sorted(p for p in directory.iterdir() if p.suffix in SUFFIXES and p.is_file()):
            try:
                profile = parse_profile(path)
            except ValidationError as exc:
                reason = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}"
                                   for e in exc.errors(include_url=False))
                found.invalid.append({"file": path.name, "reason": reason})
                continue
            except (OSError, ValueError, yaml.YAMLError) as exc:
                found.invalid.append({"file": path.name, "reason": str(exc)[:300]})
                continue
            if profile.name in found.profiles:
                found.invalid.append({"file": path.name, "reason": f"duplicate profile name {profile.name!r}"})
                continue
            found.profiles[profile.name] = profile
        return found

    def get(self, name: str) -> Profile:
        """The profile called `name`, or `profile_not_found` listing the ones there are."""
        found = self.load()
        profile = found.profiles.get(name)
        if profile is None:
            unusable = [item for item in found.invalid if Path(item["file"]).stem == name]
            raise KsiError(ErrorCode.PROFILE_NOT_FOUND,
                           f"no profile {name!r} in {', '.join(map(str, self.directories))}",
                           profile=name, available=sorted(found.profiles), invalid=unusable)
        return profile
