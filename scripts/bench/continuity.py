"""Continuity: do the facts of a long conversation reach the model once they no longer fit?

Synthetic conversations (seeded) with facts planted at random turns (names, numbers, dates,
decisions, tool results) among filler, 20 to 200 turns, windows of 1k to 8k tokens. For every
turn after a fact was planted, the fact counts as present when its key strings are in what was
sent besides the new input. Policies compared in one run:

- none: no history (only the new input);
- drop_oldest: a client resending the whole conversation cut to the window, oldest first out;
- ksi_off: KSI with compaction off (whole exchanges within the budget, and the note);
- ksi_good: KSI with a summariser that keeps what it is given;
- ksi_bad: KSI with a summariser that misbehaves in turn: apologises, asks back, answers with
  the last exchange only, drops every name, answers longer than it was given, fails (500);
- oracle: everything.

KSI runs are a real daemon in this process on the local stub, measured from what the provider
received (checked against `conversation:sent` on each conversation's last turn). Reported per
policy: the share of planted facts present, tokens sent per turn, summariser calls and tokens
per turn, each with a 95 % interval over the conversations. With `--model` (any model KSI
serves) the KSI policies answer with that model (in its own window; the summariser stays the
stub of each policy) and also ask one probe question per fact, each in a fork of the finished
conversation, scoring exact-match answers.

Goal: ksi_bad at 1.0 (every planted fact present at every later turn), against drop_oldest
measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness

from ksi_common.client import KsiClient
from ksi_common.settings import Settings
from ksi_daemon.daemon import Daemon
from ksi_daemon.services.completion.compaction import MERGE_REQUEST, SUMMARISER_SYSTEM
from tests.stub_openai import Reply, StubOpenAI

WINDOWS = (1024, 2048, 4096, 8192)
OUTPUT_RESERVE = 200
SUMMARISER = "openai/stub-summariser"
SUMMARY_MARK = SUMMARISER_SYSTEM[:40]
FIRST = ("Alice", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi", "Ingrid", "Jonas")
LAST = ("Bowman", "Castillo", "Duarte", "Eriksen", "Fontaine", "Galloway", "Haddad", "Iversen")
TOOLS = ("Postgres", "Redis", "Kafka", "Terraform", "Grafana", "Nginx")
WORDS = ("please describe the sea the sky clouds waves birds light wind sand shells boats gulls rain fog tides "
         "colour water dusk morning slowly gently over under along across beside quiet bright grey green "
         "long short warm cold soft far near river hill field road stone tree leaf garden path").split()
POLICIES = ("none", "drop_oldest", "ksi_off", "ksi_good", "ksi_bad", "oracle")


@dataclass
class Fact:
    turn: int
    text: str
    keys: tuple[str, ...]  # what must be in what is sent for the fact to count as present
    probe: str  # a question whose answer holds keys[0]


@dataclass
class Conversation:
    cid: str
    turns: int
    window: int
    prompts: list[str]
    facts: list[Fact]


@dataclass
class Outcome:
    present: list[float] = field(default_factory=list)  # per conversation: share of fact-turns present
    tokens: list[float] = field(default_factory=list)  # per conversation: tokens sent per turn
    calls: list[float] = field(default_factory=list)  # summariser calls per turn
    summary_tokens: list[float] = field(default_factory=list)  # summariser prompt+answer tokens per turn
    probes: list[float] = field(default_factory=list)  # share of probe questions answered exactly


def filler(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(25, 70)))


def planted(rng: random.Random, turn: int) -> Fact:
    kind = rng.choice(("name", "number", "date", "decision", "tool"))
    if kind == "name":
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        return Fact(turn, f"My name is {name}, please remember it.", (name,), "What is my name?")
    if kind == "number":
        number = str(rng.randint(10_000, 99_999))
        return Fact(turn, f"My account number is {number}.", (number,), "What is my account number?")
    if kind == "date":
        date = f"2027-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        return Fact(turn, f"My flight leaves on {date}.", (date,), "On which date does my flight leave?")
    if kind == "decision":
        tool = rng.choice(TOOLS)
        return Fact(turn, f"I decided to use {tool} for the billing service.", (tool,),
                    "Which tool did I decide to use for the billing service?")
    code = f"E{rng.randint(1000, 9999)}"
    return Fact(turn, f"The build tool returned: error {code} in src/billing/ledger.py.", (code, "ledger.py"),
                "Which error code did the build tool return?")


def conversations(count: int, seed: int, min_turns: int, max_turns: int) -> list[Conversation]:
    rng = random.Random(seed)
    made = []
    for i in range(count):
        turns = rng.randint(min_turns, max_turns)
        window = rng.choice(WINDOWS)
        at = sorted(rng.sample(range(1, turns), min(10, turns - 1, rng.randint(3, 10))))
        facts = [planted(rng, turn) for turn in at]
        by_turn = {f.turn: f for f in facts}
        prompts = [by_turn[t].text + " " + filler(rng)[:120] if t in by_turn else filler(rng)
                   for t in range(1, turns + 1)]
        made.append(Conversation(f"c{i:03d}", turns, window, prompts, facts))
    return made


def reply_for(messages: list[dict[str, Any]]) -> str:
    """The answering model's reply: short filler, the same for the same input."""
    rng = random.Random(str(messages[-1].get("content"))[:200])
    return "ok, " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30)))


def is_summariser(messages: list[dict[str, Any]]) -> bool:
    return str(messages[0].get("content", "")).startswith(SUMMARY_MARK)


def good_summary(request: str) -> str:
    """Keeps every user line that says something, as a careful summariser would."""
    if MERGE_REQUEST in request:
        return "\n".join(dict.fromkeys(line for line in request.splitlines() if line.startswith("- ")))
    said = [m for m in re.findall(r"\] User: (.*)", request) if m[:1].isupper()]  # filler is lower case
    return "## User and goals\n" + ("\n".join(f"- {' '.join(line.split()[:14])}" for line in said) or "none")


BAD = (
    lambda request: "I apologize, but I need more information to write a summary.",
    lambda request: "Which parts of the conversation would you like me to summarise?",
    lambda request: "\n".join([line for line in request.splitlines() if re.match(r"\[\d+\] ", line)][-2:]) or "none",
    lambda request: re.sub(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b", "someone", good_summary(request)),
    lambda request: request * 3,
)


class Forgetful(list):  # type: ignore[type-arg]
    """The stub's log of requests, kept empty: the answerer logs what the run needs."""

    def append(self, _item: Any) -> None:
        pass


def answerer(kind: str, log: list[list[dict[str, Any]]]) -> Callable[[list[dict[str, Any]]], str]:
    turn = [0]

    def answer(messages: list[dict[str, Any]]) -> str:
        log.append(messages)
        if not is_summariser(messages):
            return reply_for(messages)
        request = str(messages[-1]["content"])
        if kind == "good":
            return good_summary(request)
        turn[0] += 1
        return BAD[turn[0] % len(BAD)](request)
    return answer


def sent_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content")) for m in messages[:-1])


def share_present(conversation: Conversation, sent: dict[int, str]) -> float:
    hits = total = 0
    for fact in conversation.facts:
        for turn in range(fact.turn + 1, conversation.turns + 1):
            total += 1
            hits += all(key in sent.get(turn, "") for key in fact.keys)
    return hits / total if total else 1.0


def model_free(conversation: Conversation, policy: str, count: Callable[[str], int]) -> tuple[float, float]:
    """none, drop_oldest and oracle, computed from the conversation itself."""
    sent: dict[int, str] = {}
    tokens = 0
    replies = [reply_for([{"content": p}]) for p in conversation.prompts]
    costs = [count(p) + count(r) + 8 for p, r in zip(conversation.prompts, replies, strict=True)]
    for turn in range(1, conversation.turns + 1):
        shown: list[int] = []
        if policy == "oracle":
            shown = list(range(turn - 1))
        elif policy == "drop_oldest":
            room = conversation.window - OUTPUT_RESERVE - count(conversation.prompts[turn - 1]) - 4
            for k in range(turn - 2, -1, -1):
                if costs[k] > room:
                    break
                room -= costs[k]
                shown.insert(0, k)
        sent[turn] = "\n".join(f"{conversation.prompts[k]}\n{replies[k]}" for k in shown)
        tokens += sum(costs[k] for k in shown) + count(conversation.prompts[turn - 1])
    return share_present(conversation, sent), tokens / conversation.turns


async def run_ksi(policy: str, items: list[Conversation], model: str | None, outcome: Outcome) -> Callable[[str], int]:
    kind = {"ksi_off": "off", "ksi_good": "good", "ksi_bad": "bad"}[policy]
    log: list[list[dict[str, Any]]] = []
    async with StubOpenAI(answer=answerer(kind, log)) as stub:
        stub.requests = Forgetful()
        if kind == "bad":  # one summariser call in six fails outright
            stub.model_script["stub-summariser"] = deque(
                Reply(status=500) if i % 6 == 5 else Reply() for i in range(20_000))
        models: dict[str, Any] = dict(Settings(_env_file=None).models)  # a --model's own settings, if any
        models.update({f"openai/stub-w{w}": {"api_base": stub.api_base, "context_window": w,
                                             "output_reserve": OUTPUT_RESERVE} for w in WINDOWS})
        models[SUMMARISER] = {"api_base": stub.api_base}
        root = Path(tempfile.mkdtemp(prefix="ksi-continuity-", dir="/tmp"))
        settings = Settings(_env_file=None, var_dir=root / "var", socket_path=root / "d.sock", litellm_preload=False,
                            models=models, calibration=False, fsync="never", summary_retry_delay=0.05,
                            summary_retry_max_delay=0.5,
                            summariser="off" if kind == "off" else SUMMARISER)  # the stubs, with --model too
        daemon = Daemon(settings)
        await daemon.start()
        try:
            async with KsiClient(settings.socket) as client:
                for conversation in items:
                    await one_conversation(daemon, client, log, conversation, model, outcome)
            return daemon.litellm.count_tokens
        finally:
            await daemon.shutdown()
            shutil.rmtree(root, ignore_errors=True)


async def settle(daemon: Daemon) -> None:
    while daemon.completion.compactor.health()["running"]:
        await asyncio.sleep(0.005)


async def one_conversation(daemon: Daemon, client: KsiClient, log: list[list[dict[str, Any]]],
                           conversation: Conversation, model: str | None, outcome: Outcome) -> None:
    count = daemon.litellm.count_tokens
    chosen = model or f"openai/stub-w{conversation.window}"
    sent: dict[int, str] = {}
    tokens = calls = summary_tokens = 0
    last: list[dict[str, Any]] = []
    for turn, text in enumerate(conversation.prompts, start=1):
        log.clear()
        ack = await client.request("completion:async", {"model": chosen, "prompt": text,
                                                        "conversation_id": conversation.cid, "create": True})
        result = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 120})
        await settle(daemon)
        tokens += result["history"]["prompt_tokens_estimate"]
        if model is not None:  # the turn went to the model, not the stub: what the daemon says it sent
            shown = await client.request("conversation:sent", {"conversation_id": conversation.cid,
                                                               "n": result["exchange"]})
            sent[turn] = "\n".join(str(m["content"]) for m in shown["messages"] if m["part"] != "input")
        for messages in log:
            if is_summariser(messages):
                calls += 1
                summary_tokens += sum(count(str(m["content"])) for m in messages)
            else:
                sent[turn] = sent_text(messages)
                last = messages
    shown = await client.request("conversation:sent", {"conversation_id": conversation.cid, "n": conversation.turns})
    if model is None:  # what the provider received is what the daemon says it sent
        assert [m["content"] for m in shown["messages"]] == [m["content"] for m in last]
    outcome.present.append(share_present(conversation, sent))
    outcome.tokens.append(tokens / conversation.turns)
    outcome.calls.append(calls / conversation.turns)
    outcome.summary_tokens.append(summary_tokens / conversation.turns)
    if model is not None:
        right = 0
        for fact in conversation.facts:
            fork = await client.request("conversation:fork", {"conversation_id": conversation.cid})
            ack = await client.request("completion:async", {"model": chosen, "prompt": fact.probe,
                                                            "conversation_id": fork["conversation_id"]})
            answer = await client.request("completion:wait", {"request_id": ack["request_id"], "timeout": 300})
            right += fact.keys[0].lower() in str(answer["content"]).lower()
        outcome.probes.append(right / len(conversation.facts) if conversation.facts else 1.0)


def interval(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values) if values else math.nan
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {"mean": round(mean, 4), "low": round(mean - half, 4), "high": round(mean + half, 4)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", "-n", type=int, default=50)
    parser.add_argument("--min-turns", type=int, default=20)
    parser.add_argument("--max-turns", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--model", help="a model KSI serves: the KSI policies answer with it and are probed")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    items = conversations(args.conversations, args.seed, args.min_turns, args.max_turns)
    wanted = [p for p in args.policies.split(",") if p]
    outcomes = {policy: Outcome() for policy in wanted}
    count: Callable[[str], int] = lambda text: max(1, math.ceil(len(text) / 4))  # noqa: E731 (until a daemon has run)
    for policy in wanted:
        if policy.startswith("ksi_"):
            print(f"running {policy} over {len(items)} conversations ...", file=sys.stderr)
            count = await run_ksi(policy, items, args.model, outcomes[policy])
    for policy in wanted:
        if not policy.startswith("ksi_"):
            for conversation in items:
                present, tokens = model_free(conversation, policy, count)
                outcomes[policy].present.append(present)
                outcomes[policy].tokens.append(tokens)
                outcomes[policy].calls.append(0.0)
                outcomes[policy].summary_tokens.append(0.0)
    report: dict[str, Any] = {"machine": harness.machine(), "conversations": len(items), "seed": args.seed,
                              "turns": [args.min_turns, args.max_turns], "windows": list(WINDOWS),
                              "facts": sum(len(c.facts) for c in items), "model": args.model, "policies": {}}
    print(f"\n{len(items)} conversations, {args.min_turns}-{args.max_turns} turns, windows {WINDOWS}, "
          f"{report['facts']} planted facts (95 % intervals over conversations)\n")
    print(f"{'policy':<12} {'facts present':>24} {'tokens sent/turn':>26} {'summariser calls/turn':>24} "
          f"{'summariser tokens/turn':>26}" + (f" {'probes right':>22}" if args.model else ""))
    for policy in wanted:
        o = outcomes[policy]
        row = {"present": interval(o.present), "tokens_per_turn": interval(o.tokens),
               "summariser_calls_per_turn": interval(o.calls), "summariser_tokens_per_turn": interval(o.summary_tokens)}
        if o.probes:
            row["probes"] = interval(o.probes)
        report["policies"][policy] = row

        def cell(value: dict[str, float], digits: int = 3) -> str:
            return f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"
        print(f"{policy:<12} {cell(row['present']):>24} {cell(row['tokens_per_turn'], 0):>26} "
              f"{cell(row['summariser_calls_per_turn']):>24} {cell(row['summariser_tokens_per_turn'], 0):>26}"
              + (f" {cell(row['probes']):>22}" if 'probes' in row else ""))
    if "ksi_bad" in outcomes and "drop_oldest" in outcomes:
        bad, base = report["policies"]["ksi_bad"]["present"]["mean"], report["policies"]["drop_oldest"]["present"]["mean"]
        report["goal"] = {"ksi_bad_present": bad, "drop_oldest_present": base,
                          "ratio": round(bad / base, 3) if base else None, "met": bad >= 1.0}
        print(f"\ngoal: ksi_bad keeps every planted fact: {bad:.4f} (drop_oldest {base:.4f}, "
              f"{report['goal']['ratio']}x) -> {'met' if bad >= 1.0 else 'NOT met'}")
    harness.write_results("continuity", report)


if __name__ == "__main__":
    asyncio.run(main())
