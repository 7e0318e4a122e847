"""Per-model overrides: which one a model name gets, asked once or many times."""

from __future__ import annotations

from pathlib import Path

from ksi_common.settings import RESOLVED_KEPT, ModelSettings, Settings


def _settings(tmp_path: Path) -> Settings:
    return Settings(var_dir=tmp_path, models={
        "openai/*": ModelSettings(context_window=1000),
        "openai/gpt-4*": ModelSettings(context_window=2000),
        "openai/gpt-4o": ModelSettings(context_window=3000),
    })


def test_exact_name_first_then_the_longest_glob_then_none(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    for _ in range(2):  # the second round is answered from what the first one found
        assert settings.model_settings("openai/gpt-4o").context_window == 3000
        assert settings.model_settings("openai/gpt-4.1").context_window == 2000
        assert settings.model_settings("openai/o3").context_window == 1000
        assert settings.model_settings("ollama/qwen3").context_window is None


def test_a_copy_with_other_models_does_not_answer_from_the_original(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert settings.model_settings("openai/o3").context_window == 1000
    other = settings.model_copy(update={"models": {"openai/*": ModelSettings(context_window=5)}})
    assert other.model_settings("openai/o3").context_window == 5
    assert settings.model_settings("openai/o3").context_window == 1000


def test_many_names_keep_the_memory_bounded_and_the_answers_right(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    for i in range(RESOLVED_KEPT * 2 + 5):
        assert settings.model_settings(f"openai/m{i}").context_window == 1000
    assert len(settings.resolved_models) <= RESOLVED_KEPT
    assert settings.model_settings("openai/gpt-4o").context_window == 3000


def test_models_assigned_anew_are_answered_from_and_never_shown_as_a_setting(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert settings.model_settings("openai/o3").context_window == 1000
    settings.models = {"openai/o3": ModelSettings(context_window=7)}
    assert settings.model_settings("openai/o3").context_window == 7
    assert "resolved_models" not in settings.model_dump()
    assert "resolved_models" not in settings.public_view()
