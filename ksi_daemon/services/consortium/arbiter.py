"""The arbiter's side of a consortium: what it is asked, and reading its verdict."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ARBITER_INSTRUCTIONS = """\
You are the arbiter of a consortium of language models. Several members answered the \
latest user input of the conversation below; you judge their answers.
{task}
Reply with ONLY a JSON object, no prose around it:
{{"synthesis": "<the answer to give the user>", "confidence": <0.0 to 1.0>, \
"dissent": "<where members disagree and why>", "refinement_areas": ["<what a further round \
should improve>"], "needs_iteration": <true or false>, "ranking": [<answer numbers, best first>]}}"""

SYNTHESIS_TASK = ("Write the best possible answer to the user's latest input as `synthesis`, "
                  "combining what the members got right and fixing what they got wrong.")
RANK_TASK = ("Rank the member answers by number in `ranking`, best first; the best one is given "
             "to the user verbatim, so `synthesis` may stay empty.")

REFINE_REQUEST = ("The consortium's draft answer is above. Answer the earlier request again, in full, "
                  "improving on the draft.")


@dataclass(slots=True)
class MemberAnswer:
    """One member instance's successful answer in one iteration."""

    number: int  # 1-based, as the arbiter sees it
    model: str
    instance: int
    content: str


@dataclass(slots=True)
class Judged:
    """What one iteration concluded: the arbiter's reading, as far as it could be read."""

    iteration: int
    synthesis: str
    confidence: float
    ranking: list[int] = field(default_factory=list)
    refinement_areas: list[str] = field(default_factory=list)
    dissent: str = ""
    needs_iteration: bool | None = None


class Verdict(BaseModel):
    """The arbiter's JSON answer; lenient about shapes a model is likely to produce."""

    model_config = ConfigDict(extra="ignore")

    synthesis: str = ""
    confidence: float = Field(default=0.0)
    dissent: str = ""
    refinement_areas: list[str] = Field(default_factory=list)
    needs_iteration: bool | None = None
    ranking: list[int] = Field(default_factory=list)

    @field_validator("confidence", mode="before")
    @classmethod
    def _confidence(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip().rstrip("%")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError("confidence must be a number") from None
        if number > 1:  # a percentage
            number /= 100
        return min(1.0, max(0.0, number))

    @field_validator("dissent", "synthesis", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        if value is None:
            return ""
        if isinstance(value, list):
            return "\n".join(str(v) for v in value)
        return value if isinstance(value, str) else json.dumps(value)

    @field_validator("refinement_areas", mode="before")
    @classmethod
    def _areas(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value] if value.strip() else []
        return [str(v) for v in value] if isinstance(value, list) else value

    @field_validator("ranking", mode="before")
    @classmethod
    def _ranking(cls, value: Any) -> Any:
        # numbers, "2", "answer 2" or "[2]"; entries without a number are dropped
        if value is None:
            return []
        if not isinstance(value, list):
            value = [value]
        ranks = []
        for item in value:
            if isinstance(item, bool):
                continue
            if isinstance(item, int):
                ranks.append(item)
                continue
            found = re.search(r"\d+", str(item))
            if found:
                ranks.append(int(found.group()))
        return ranks


@dataclass(slots=True)
class Reading:
    verdict: Verdict
    parse: Literal["json", "fallback"]
    problem: str | None = None  # why the fallback was used


_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)


def _objects(text: str) -> list[dict[str, Any]]:
    """JSON objects found in `text`: the whole text, fenced blocks, then any inline `{...}`."""
    found: list[dict[str, Any]] = []
    candidates = [text.strip(), *(m.group(1).strip() for m in _FENCE.finditer(text))]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    if found:
        return found
    decoder = json.JSONDecoder()
    position = text.find("{")
    while position >= 0:
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            position = text.find("{", position + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        position = text.find("{", end)
    return found


def read_verdict(text: str) -> Reading:
    """The arbiter's verdict from JSON (fenced or inline too); else its prose with confidence 0."""
    problem = "no JSON object in the answer"
    for candidate in _objects(text):
        if not ({"synthesis", "confidence", "ranking"} & set(candidate)):
            problem = "the JSON object has none of synthesis, confidence, ranking"
            continue
        try:
            return Reading(Verdict.model_validate(candidate), "json")
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return Reading(Verdict(synthesis=text.strip(), confidence=0.0), "fallback", problem)


def arbiter_messages(
    history: list[dict[str, Any]],
    system: str | None,
    new_input: list[dict[str, Any]],
    answers: list[MemberAnswer],
    earlier: list[Judged],
    judging: str,
) -> list[dict[str, Any]]:
    """System instructions, the conversation's history as turns, then one judging request."""
    instructions = ARBITER_INSTRUCTIONS.format(task=RANK_TASK if judging == "rank" else SYNTHESIS_TASK)
    if system:
        instructions += f"\n\nThe conversation's own system prompt, which the answer must respect:\n{system}"
    return [{"role": "system", "content": instructions}, *history,
            {"role": "user", "content": judging_request(new_input, answers, earlier)}]


def judging_request(new_input: list[dict[str, Any]], answers: list[MemberAnswer], earlier: list[Judged]) -> str:
    """The arbiter's user message: the new input, the member answers and earlier rounds."""
    parts = ["The user's latest input:"]
    parts.extend(str(m.get("content", "")) for m in new_input)
    parts.append(f"\nMember answers ({len(answers)}):")
    for answer in answers:
        parts.append(f"\n[answer {answer.number}] from {answer.model} (instance {answer.instance}):\n"
                     f"{answer.content}")
    for judged in earlier:
        parts.append(f"\nEarlier round {judged.iteration}: your synthesis had confidence {judged.confidence:.2f}:\n"
                     f"{judged.synthesis}")
        if judged.refinement_areas:
            parts.append("Areas you asked to refine: " + "; ".join(judged.refinement_areas))
    parts.append("\nReply with the JSON object only.")
    return "\n".join(parts)


def refinement_turns(judged: Judged) -> list[dict[str, Any]]:
    """What members see after the conversation in a later round: the draft and a request to improve it."""
    request = REFINE_REQUEST
    if judged.refinement_areas:
        request += " Areas to improve: " + "; ".join(judged.refinement_areas) + "."
    if judged.dissent:
        request += f" Points of disagreement: {judged.dissent}"
    return [{"role": "assistant", "content": judged.synthesis}, {"role": "user", "content": request}]
