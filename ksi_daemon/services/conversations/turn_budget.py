"""A turn's token budget: the model's window split once into named shares.

Every figure is in the daemon's count (the learned calibration ratio already applied to the
window and the answer's reserve), the count every stored exchange is kept in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ksi_common.errors import ErrorCode, KsiError

MIN_SUMMARY_TOKENS = 48  # a share smaller than this still lets a summary say something


def summaries_share(history: int, share: float) -> int:
    """The tokens summaries may take of a turn's `history` budget."""
    return max(MIN_SUMMARY_TOKENS, int(history * share))


@dataclass(frozen=True, slots=True)
class TurnBudget:
    """One turn's window, split once. `history` is what summaries, pins, files and exchanges share:
    summaries and pins within their own caps first, files within their share of what those leave,
    exchanges in the rest."""

    model: str
    window: int  # the model's own tokens
    output_reserve: int  # the model's own tokens, kept for the answer
    ratio: float  # the model's tokens per token of the daemon's count
    system: int
    input: int
    notes: int  # kept free for the notes on the system message
    history: int
    summaries: int  # at most, for what stands in for the exchanges left out
    pins: int  # at most, for pinned exchanges the history leaves out
    files_share: float  # of what the summary and pins leave

    def files(self, left: int) -> int:
        """The files' share of the `left` tokens the summary and the pins did not take."""
        return int(left * self.files_share)

    def check_fits(self) -> None:
        """Refuse the turn when the system prompt and the new input alone leave no room."""
        if self.history >= 0:
            return
        raise KsiError(
            ErrorCode.CONTEXT_WINDOW_EXCEEDED,
            f"the new input needs about {-self.history} tokens more than {self.model} allows "
            f"after reserving {self.output_reserve} for the answer",
            input_tokens=self.input, context_window=self.window, output_reserve=self.output_reserve,
            calibration_ratio=round(self.ratio, 4),
        )
