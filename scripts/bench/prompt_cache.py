"""How much of a long conversation's input a provider reads from its prompt cache, with KSI's
cache placement, against the same requests with caching off and with one fixed marker.

    .venv/bin/python scripts/bench/prompt_cache.py [--turns 40] [--fork-every 5]

A daemon in this process runs a conversation of `--turns` turns with ten tools per provider shape,
against the cache emulator of the tests (tests/cache_emulator.py: OpenAI's automatic prefix cache,
routed by the prompt_cache_key, and Anthropic's breakpoint rules). The window is small enough that
summaries take over the oldest exchanges several times. The summariser is the emulator too; its
answers fail KSI's checks, so the stored stand-ins are fallbacks, which freeze a stretch the same
way a summary does. Every `--fork-every` turns, right after the parent's turn k+1, the conversation
is forked at k (an edited input, a retry) and the fork takes its first turn.

Each shape runs three times: as KSI runs (summaries, the window's start moving in steps), then with
summaries off, with the stepped window and with a window dropping the oldest exchange each turn
(KSI_HISTORY_STEP=1), as a client trimming its own history would. With summaries on, a new summary
moves the window's start before the budget would, so the step alone shows only with them off.

Per shape and run it reports, over continued turns (the frozen stand-ins unchanged since the
previous request), turns after a new stand-in, and the first turn of each fork:
  read share    tokens read from the cache / cacheable tokens (the prefix the request shares with
                the previous one, 1024 tokens at least; for a fork, with its parent's turn k+1);
  prefix share  the prefix the request shares with the previous one / the request;
  fork read     a fork's first turns: tokens read from the cache / their whole prompts;
  input cost    in units of one uncached input token: cache reads at 0.1 and Anthropic's cache
                writes at 1.25 (OpenAI adds nothing for writes).
The Anthropic costs compare KSI's placement with caching off and with one marker on the last
message (as gateways place it), by replaying the requests KSI sent through a fresh emulator with
the markers moved. The OpenAI cache is automatic: its placement is the key alone, so "off" is
no cache read at all and there is no fixed-marker variant.
Prints a table and writes scripts/bench/results/prompt_cache.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from harness import bench_tools, machine, write_results

from tests.cache_emulator import MINIMUM, CacheEmulator, anthropic_blocks, prompt_words, shared_prefix
from tests.conftest import complete, connected, running_daemon

READ_PRICE = 0.1  # a cached input token, in uncached input tokens (Anthropic; OpenAI's newer models)
WRITE_PRICE = 1.25  # an Anthropic cache write of five minutes
SYSTEM = " ".join(["the"] * (MINIMUM + 200))  # one token a word for both counts
WRITER = "openai/bench-writer"
SHAPES = {"openai": "openai/bench-model", "anthropic": "anthropic/bench-model"}
# where the frozen stand-ins end on the system message: the turn's own fallback or the notes follow
_UNFROZEN = re.compile(r"\n\n\[Exchanges [\d-]+, left out below \(not summarised yet\)|\n\n\[Note:")


def user_prompt(turn: int) -> str:
    return f"Turn {turn}: " + " ".join(f"detail{turn}-{k} of the city plan" for k in range(30))


def system_text(body: dict[str, Any]) -> str:
    """The system message's text, however it was cut into blocks."""
    system = body.get("system")
    if system is None:
        system = next((m["content"] for m in body["messages"] if m["role"] == "system"), "")
    return system if isinstance(system, str) else "".join(block.get("text", "") for block in system)


def frozen(body: dict[str, Any]) -> str:
    text = system_text(body)
    found = _UNFROZEN.search(text)
    return text[:found.start()] if found else text


def words(body: dict[str, Any], shape: str) -> list[str]:
    if shape == "openai":
        return prompt_words(body)
    return [word for text, _tokens, _life in anthropic_blocks(body) for word in text.split()]


def moved_markers(body: dict[str, Any], where: str) -> dict[str, Any]:
    """The request with KSI's markers removed, and one on the last message when `where` is "fixed"."""
    moved = copy.deepcopy(body)
    for block in moved.get("system") or []:
        block.pop("cache_control", None)
    for message in moved["messages"]:
        for block in message["content"] if isinstance(message["content"], list) else []:
            block.pop("cache_control", None)
    if where == "fixed":
        last = moved["messages"][-1]
        if isinstance(last["content"], str):
            last["content"] = [{"type": "text", "text": last["content"]}]
        last["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return moved


def input_cost(prompt: int, read: int, written: int) -> float:
    return (prompt - read - written) + READ_PRICE * read + WRITE_PRICE * written


async def converse(shape: str, turns: int, root: Path, variant: tuple[int, str], fork_every: int
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int | None]]:
    """Run the conversation and its forks; the turn requests the emulator received, the usage it
    reported, and for each request the fork point k of the fork that sent it (None: the parent's)."""
    model = SHAPES[shape]
    step, summariser = variant
    forked: list[int | None] = []
    async with CacheEmulator() as emulator:
        where = ({"api_base": emulator.api_base} if shape == "openai" else
                 {"api_base": emulator.api_base.removesuffix("/v1"), "api_key_env": "CACHE_EMULATOR_KEY"})
        models = {model: {**where, "context_window": MINIMUM + 3200, "output_reserve": 100},
                  WRITER: {"api_base": emulator.api_base}}
        async with running_daemon(root, models=models, default_model=model, summariser=summariser,
                                  calibration=False, history_step=step) as daemon:
            async with connected(daemon) as client:
                async def turn_of(conversation_id: str, prompt: str, **create: Any) -> None:
                    await complete(client, prompt=prompt, conversation_id=conversation_id, model=model,
                                   tools=bench_tools(10), timeout=120, **create)
                    while daemon.completion.compactor.health()["running"]:
                        await asyncio.sleep(0.01)  # the stand-in of this turn is stored before the next

                for turn in range(turns):
                    opening = {"create": True, "system": SYSTEM} if turn == 0 else {}
                    await turn_of("bench", user_prompt(turn), **opening)
                    forked.append(None)
                    if turn and turn % fork_every == 0:  # the parent just took turn k+1 = turn + 1
                        fork = await client.request("conversation:fork", {"conversation_id": "bench", "at": turn})
                        await turn_of(fork["conversation_id"], user_prompt(turn) + " (asked again)")
                        forked.append(turn)
        if shape == "openai":
            pairs = [(b, u) for b, u in zip(emulator.requests, emulator.usages, strict=True)
                     if b.get("model") != WRITER.removeprefix("openai/")]
            return [b for b, _u in pairs], [{"prompt": u["prompt_tokens"],
                                            "read": u["prompt_tokens_details"]["cached_tokens"], "written": 0}
                                           for _b, u in pairs], forked
        usages = [{"prompt": u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"],
                   "read": u["cache_read_input_tokens"], "written": u["cache_creation_input_tokens"]}
                  for u in emulator.anthropic_usages]
        return emulator.anthropic_requests, usages, forked


def replayed(bodies: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The Anthropic usage of the same requests with the markers moved, through a fresh emulator."""
    emulator = CacheEmulator()
    usages = []
    for body in bodies:
        blocks = anthropic_blocks(moved_markers(body, where))
        read, written = emulator.anthropic_cache(blocks)
        usages.append({"prompt": sum(tokens for _t, tokens, _l in blocks), "read": read, "written": written})
    return usages


def measure(shape: str, bodies: list[dict[str, Any]], usages: list[dict[str, Any]],
            forked: list[int | None]) -> dict[str, Any]:
    kinds, read_share, prefix_share = [], {"continued": [0, 0], "after_stand_in": [0, 0], "fork": [0, 0]}, []
    fork_prompts = [0, 0]  # a fork's reads, and its whole prompt: how much of it was its parent's
    for n in range(1, len(bodies)):
        # what this request extends: the parent's request before it (a fork's is its parent's turn
        # k+1, sent just before it; the parent's next turn skips the fork's)
        previous = n - 2 if forked[n] is None and forked[n - 1] is not None else n - 1
        kind = "fork" if forked[n] is not None else \
            "continued" if frozen(bodies[n]) == frozen(bodies[previous]) else "after_stand_in"
        kinds.append(kind)
        current = words(bodies[n], shape)
        shared = shared_prefix(words(bodies[previous], shape), current)
        if shared >= MINIMUM:
            read_share[kind][0] += min(usages[n]["read"], shared)
            read_share[kind][1] += shared
        if kind == "continued":
            prefix_share.append(shared / len(current))
        if kind == "fork":
            fork_prompts[0] += usages[n]["read"]
            fork_prompts[1] += usages[n]["prompt"]
    costs = {"ksi": sum(input_cost(u["prompt"], u["read"], u["written"]) for u in usages),
             "off": float(sum(u["prompt"] for u in usages))}
    if shape == "anthropic":
        fixed = replayed(bodies, "fixed")
        costs["fixed"] = sum(input_cost(u["prompt"], u["read"], u["written"]) for u in fixed)
    return {
        "requests": len(bodies), "stand_ins": kinds.count("after_stand_in"), "forks": kinds.count("fork"),
        "read_share_continued": _share(*read_share["continued"]),
        "read_share_after_stand_in": _share(*read_share["after_stand_in"]),
        "read_share_fork": _share(*read_share["fork"]),
        "fork_read_of_prompt": _share(*fork_prompts),
        "prefix_share_continued_mean": round(sum(prefix_share) / len(prefix_share), 4) if prefix_share else None,
        "prefix_share_continued_min": round(min(prefix_share), 4) if prefix_share else None,
        "input_cost": {k: round(v, 1) for k, v in costs.items()},
        "ksi_vs_off": round(costs["ksi"] / costs["off"], 4),
    }


def _share(read: int, cacheable: int) -> float | None:
    return round(read / cacheable, 4) if cacheable else None


# each run: KSI_HISTORY_STEP, and the summariser
VARIANTS = {"ksi": (4, WRITER), "steps": (4, "off"), "drop-oldest": (1, "off")}


def print_table(report: dict[str, Any]) -> None:
    print(f"{'shape':<10} {'run':<12} {'stand-ins':>9} {'forks':>5} {'read cont.':>10} {'read after':>10} "
          f"{'read fork':>9} {'fork/all':>8} {'prefix mean':>11} {'prefix min':>10} {'cost ksi':>10} {'cost off':>10} "
          f"{'cost fixed':>10} {'ksi/off':>8}")
    for name, row in report["shapes"].items():
        shape, window = name.split(" ")
        cost = row["input_cost"]
        print(f"{shape:<10} {window:<12} {row['stand_ins']:>9} {row['forks']:>5} "
              f"{str(row['read_share_continued']):>10} {str(row['read_share_after_stand_in']):>10} "
              f"{str(row['read_share_fork']):>9} {str(row['fork_read_of_prompt']):>8} "
              f"{str(row['prefix_share_continued_mean']):>11} {str(row['prefix_share_continued_min']):>10} "
              f"{cost['ksi']:>10} {cost['off']:>10} {str(cost.get('fixed', '-')):>10} {row['ksi_vs_off']:>8}")


async def run(turns: int, fork_every: int) -> dict[str, Any]:
    os.environ["CACHE_EMULATOR_KEY"] = "sk-ant-bench"
    os.environ.setdefault("OPENAI_API_KEY", "sk-bench-dummy")
    shapes = {}
    for shape in SHAPES:
        for name, variant in VARIANTS.items():
            with tempfile.TemporaryDirectory(prefix="ksi-cache-") as root:
                bodies, usages, forked = await converse(shape, turns, Path(root), variant, fork_every)
            shapes[f"{shape} {name}"] = measure(shape, bodies, usages, forked)
    return {"machine": machine(turns=turns, fork_every=fork_every), "shapes": shapes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--fork-every", type=int, default=5,
                        help="fork at k after the parent's turn k+1, every N turns")
    args = parser.parse_args()
    report = asyncio.run(run(args.turns, args.fork_every))
    print_table(report)
    write_results("prompt_cache", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
