"""Calibrated token counts: a model whose tokenizer counts 1.6 times ours never sees an overflow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ksi_common.errors import KsiError
from ksi_daemon.daemon import Daemon
from tests.conftest import complete, connected, running_daemon, stub_settings

DENSE = "openai/stub-dense"
WINDOW = 1200
RESERVE = 100


def dense_settings(stub: Any, **overrides: Any) -> dict[str, Any]:
    models = {DENSE: {"api_base": stub.api_base, "context_window": WINDOW, "output_reserve": RESERVE}}
    return stub_settings(stub, models=models, summariser="off", **overrides)


def count_like(daemon: Daemon, factor: float) -> Any:
    """A tokenizer of the stub's own: `factor` times cl100k, with its own per-message overhead."""
    count = daemon.litellm.count_tokens
    return lambda messages: int(factor * sum(count(str(m.get("content", ""))) for m in messages)) + 3 * len(messages)


async def talk(daemon: Daemon, turns: int, conversation_id: str) -> tuple[list[dict[str, Any]], list[str]]:
    results, failures = [], []
    async with connected(daemon) as client:
        for turn in range(turns):
            prompt = f"turn {turn}: " + " ".join(f"word{turn}x{i}" for i in range(40))
            try:
                results.append(await complete(client, model=DENSE, prompt=prompt, conversation_id=conversation_id,
                                              create=True))
            except KsiError as error:
                failures.append(error.code)
    return results, failures


async def test_estimates_converge_and_no_request_overflows_the_window(short_tmp: Path, stub: Any) -> None:
    stub.window = WINDOW
    async with running_daemon(short_tmp, **dense_settings(stub)) as daemon:
        stub.prompt_tokens = count_like(daemon, 1.6)
        results, failures = await talk(daemon, 50, "dense")
        ratio = daemon.completion.calibration.ratio(DENSE)
    assert failures == [] and stub.overflows == 0
    assert max(stub.counted) <= WINDOW
    # after three turns the daemon's estimate of the next prompt is within 5% of the model's count
    for position in range(3, 50):
        estimate = results[position]["history"]["prompt_tokens_estimate"]
        assert abs(estimate - stub.counted[position]) <= 0.05 * stub.counted[position], position
    assert 1.5 < ratio < 1.7
    assert results[-1]["history"]["exchanges_sent"] < results[-1]["history"]["exchanges_total"]  # history was cut


async def test_without_calibration_the_same_conversation_overflows(short_tmp: Path, stub: Any) -> None:
    stub.window = WINDOW
    async with running_daemon(short_tmp, **dense_settings(stub, calibration=False)) as daemon:
        stub.prompt_tokens = count_like(daemon, 1.6)
        results, failures = await talk(daemon, 20, "loose")
    assert stub.overflows > 0 and max(stub.counted) > WINDOW
    assert failures and set(failures) == {"context_window_exceeded"}
    assert len(results) + len(failures) == 20


async def test_a_refusal_tightens_the_ratio_and_the_turn_is_retried_once(short_tmp: Path, stub: Any) -> None:
    stub.window = WINDOW
    async with running_daemon(short_tmp, **dense_settings(stub)) as daemon:
        stub.prompt_tokens = count_like(daemon, 1.6)
        await talk(daemon, 20, "shift")
        learned = daemon.completion.calibration.ratio(DENSE)
        stub.prompt_tokens = count_like(daemon, 2.3)  # the model behind the name changed
        overflows_before = stub.overflows
        results, failures = await talk(daemon, 5, "shift")
        tightened = daemon.completion.calibration.report([DENSE])[DENSE]
    assert failures == [] and len(results) == 5
    assert stub.overflows == overflows_before + 1  # one refusal, then a smaller history fitted
    assert tightened["tightened"] == 1 and tightened["ratio"] > learned


async def test_ratios_survive_a_restart_and_show_in_stats(short_tmp: Path, stub: Any) -> None:
    stub.window = WINDOW
    async with running_daemon(short_tmp, **dense_settings(stub)) as daemon:
        stub.prompt_tokens = count_like(daemon, 1.6)
        await talk(daemon, 4, "kept")
        learned = daemon.completion.calibration.ratio(DENSE)
    assert (short_tmp / "var" / "state" / "calibration.json").exists()
    async with running_daemon(short_tmp, **dense_settings(stub)) as daemon, connected(daemon) as client:
        assert daemon.completion.calibration.ratio(DENSE) == round(learned, 5)
        stats = await client.request("conversation:stats", {"conversation_id": "kept"})
    assert stats["calibration"][DENSE]["samples"] >= 3
    assert abs(stats["calibration"][DENSE]["ratio"] - learned) < 1e-4
