"""What a summary must keep, found without a model, and the checks a candidate passes."""

from __future__ import annotations

from ksi_common.items import message
from ksi_daemon.services.completion.salience import (
    check_candidate,
    exchange_items,
    fallback_text,
    salient_items,
    self_statements,
)
from ksi_daemon.services.conversations.memory import Exchange
from ksi_daemon.services.conversations.salient import Items


def exchange(user: str, reply: str) -> Exchange:
    return Exchange([message("user", user)], [message("assistant", reply)])


def count(text: str) -> int:
    return max(1, len(text) // 4)


def test_salient_items_are_names_numbers_dates_identifiers_paths_urls_and_quotes() -> None:
    text = ('Yesterday Alice Bowman sent 4817 euros on 2027-03-05 for ticket PROJ-1234 to '
            'https://pay.example.org/x?id=9; the log is at /var/log/pay.log and she said "never again".')
    items = salient_items(text)
    for expected in ("Alice Bowman", "4817", "2027-03-05", "PROJ-1234", "https://pay.example.org/x?id=9",
                     "/var/log/pay.log", "never again"):
        assert expected in items, (expected, items)
    assert "Yesterday" not in items  # a sentence's first word is capitalised anyway


def test_the_users_statements_about_themselves_and_decisions_are_kept_questions_are_not() -> None:
    said = self_statements("My name is Alice and I am a dentist. What is the weather? We decided to go by train.")
    assert said == ["My name is Alice and I am a dentist.", "We decided to go by train."]


def test_a_refusal_a_question_a_long_echo_and_a_lossy_summary_fail_their_checks() -> None:
    items = exchange_items([exchange("My name is Alice Bowman; my locker is 4817.",
                                     "Noted, Alice Bowman, locker 4817.")])
    good = check_candidate("The user is Alice Bowman; her locker is 4817.", items, 40, 30, count)
    assert good.ok, good
    assert check_candidate("I apologize, but I need more information.", items, 40, 30, count).reasons[0] == "refusal"
    assert "question" in check_candidate("Which part should I summarise?", items, 40, 30, count).reasons
    assert "dropped_items" in check_candidate("The user has a locker, 4817.", items, 40, 30, count).reasons
    long = check_candidate("The user is Alice Bowman, locker 4817. " * 20, items, 40, 30, count)
    assert {"longer_than_input", "over_budget"} <= set(long.reasons)
    assert check_candidate("", Items(), 40, 30, count).reasons == ["empty"]


def test_the_fallback_keeps_the_users_words_first_and_stays_within_its_limit() -> None:
    exchanges = [(1, exchange("My name is Alice Bowman and I chose plan B-17.", "ok")),
                 *[(n, exchange("tell about the sea " * 30, "the sea is wide"))
                   for n in range(2, 30)]]
    text = fallback_text(exchanges, 60, count)
    assert "My name is Alice Bowman and I chose plan B-17." in text
    assert count(text) <= 60 + len(text.splitlines())


def test_items_past_what_the_summariser_is_shown_are_not_required_of_it() -> None:
    from ksi_daemon.services.completion.salience import EXCHANGE_TEXT_LIMIT

    shown = "Ticket PROJ-1234 is open. "
    reply = shown + "and so on " * (EXCHANGE_TEXT_LIMIT // 10) + "Ticket PROJ-9999 too."
    items = exchange_items([exchange(shown + "x " * EXCHANGE_TEXT_LIMIT + "PROJ-8888",
                                     reply)])
    assert "PROJ-1234" in items.facts
    assert "PROJ-9999" not in items.facts and "PROJ-8888" not in items.facts


def test_an_item_inside_a_longer_one_is_not_taken_again() -> None:
    items = salient_items("see https://example.org/v2/PROJ-77/2027-01-02 and /srv/data/PROJ-78.json then 4817")
    assert items == ["https://example.org/v2/PROJ-77/2027-01-02", "/srv/data/PROJ-78.json", "4817"]
