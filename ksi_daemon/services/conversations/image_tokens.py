"""What an image costs in a model's prompt, by its provider's published rule.

OpenAI (and the default, as OpenAI-compatible servers follow it): `low` detail is 85 tokens;
otherwise the image is fitted into 2048x2048, its shorter side brought down to 768, and each
512-pixel tile costs 170 on top of the 85. Anthropic: width x height / 750, after the long edge
is brought down to 1568 pixels, at most 1600. An image known only by its URL is counted at the
rule's most, so the budget never under-counts it.
"""

from __future__ import annotations

import math

OPENAI_BASE = 85
OPENAI_TILE = 170
OPENAI_TILE_SIZE = 512
OPENAI_FIT = 2048
OPENAI_SHORT_SIDE = 768
OPENAI_MOST = OPENAI_BASE + OPENAI_TILE * 8  # 768x2048 after fitting: 2 by 4 tiles

ANTHROPIC_PIXELS_PER_TOKEN = 750
ANTHROPIC_LONG_EDGE = 1568
ANTHROPIC_MOST = 1600


def is_anthropic(model: str) -> bool:
    """Claude models under any provider prefix (anthropic/, bedrock/anthropic., vertex_ai/claude-...)."""
    lowered = model.lower()
    return "claude" in lowered or lowered.startswith("anthropic/")


def image_tokens(model: str, width: int | None, height: int | None, detail: str | None = None) -> int:
    """The prompt tokens of one image of `width` x `height` pixels (None: not known) for `model`."""
    if is_anthropic(model):
        if not width or not height:
            return ANTHROPIC_MOST
        return anthropic_tokens(width, height)
    if detail == "low":
        return OPENAI_BASE
    if not width or not height:
        return OPENAI_MOST
    return openai_tokens(width, height)


def openai_tokens(width: int, height: int) -> int:
    # whole pixels after each scaling: a float a hair above 512 must not count one more tile
    scale = min(1.0, OPENAI_FIT / max(width, height))
    width, height = max(1, round(width * scale)), max(1, round(height * scale))
    scale = min(1.0, OPENAI_SHORT_SIDE / min(width, height))
    width, height = max(1, round(width * scale)), max(1, round(height * scale))
    tiles = math.ceil(width / OPENAI_TILE_SIZE) * math.ceil(height / OPENAI_TILE_SIZE)
    return OPENAI_BASE + OPENAI_TILE * tiles


def anthropic_tokens(width: int, height: int) -> int:
    scale = min(1.0, ANTHROPIC_LONG_EDGE / max(width, height))
    width, height = max(1, round(width * scale)), max(1, round(height * scale))
    return min(ANTHROPIC_MOST, math.ceil(width * height / ANTHROPIC_PIXELS_PER_TOKEN))
