from __future__ import annotations

from services.gateway.stop_strings import StopStringMatcher


def feed(matcher: StopStringMatcher, pieces: list[str]) -> str:
    return "".join(matcher.push(p) for p in pieces) + matcher.flush()


def test_text_before_the_stop_string_is_kept_and_the_rest_dropped() -> None:
    matcher = StopStringMatcher(["END"])
    assert feed(matcher, ["hello E", "N", "D and more"]) == "hello "
    assert matcher.is_stopped


def test_partial_stop_prefix_is_held_back_then_released() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.push("abcE") == "abc"
    assert matcher.push("x") == "Ex"
    assert not matcher.is_stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["zz", "b"])
    assert feed(matcher, ["azzb"]) == "a"


def test_no_stop_strings_passes_text_through() -> None:
    assert feed(StopStringMatcher([]), ["a", "b"]) == "ab"


def test_held_text_is_released_at_the_end() -> None:
    assert feed(StopStringMatcher(["xyz"]), ["abx"]) == "abx"


def test_an_included_stop_string_ends_the_output() -> None:
    matcher = StopStringMatcher(["END"], include_stop=True)
    assert feed(matcher, ["hello E", "N", "D and more"]) == "hello END"
    assert matcher.is_stopped


def test_of_stop_strings_matching_at_one_place_the_first_listed_is_included() -> None:
    assert feed(StopStringMatcher(["a", "ab"], include_stop=True), ["xab"]) == "xa"
    assert feed(StopStringMatcher(["ab", "a"], include_stop=True), ["xab"]) == "xab"
