"""The caption pipeline, seeded: candidates, prefix/suffix, dropout, wildcards, shuffle, keep tokens, warmup."""

from __future__ import annotations

import random

import pytest

from library.datasets.captions import (
    CaptionSettings,
    append_tags,
    cacheable_caption,
    expand_wildcards,
    has_wildcards,
    process_caption,
    resolve_token_warmup_steps,
    split_candidates,
)
from library.errors import UserError


def run(text: str, seed: int = 0, **kw):
    settings = CaptionSettings(**{k: v for k, v in kw.items() if k in CaptionSettings.__dataclass_fields__})
    extra = {k: v for k, v in kw.items() if k not in CaptionSettings.__dataclass_fields__}
    return process_caption(split_candidates(text, settings), settings, random.Random(seed), **extra)


def test_first_line_only_by_default() -> None:
    assert split_candidates("a cat\nsecond line\n", CaptionSettings()) == ["a cat"]
    assert split_candidates("", CaptionSettings()) == [""]
    assert run("  a cat  \nmore").text == "a cat"


def test_multiline_keeps_line_breaks_and_separator_makes_candidates() -> None:
    s = CaptionSettings(enable_multiline_caption=True)
    assert split_candidates("A long caption.\nWith a second line.\n", s) == ["A long caption.\nWith a second line."]
    text = "first candidate\nline two\n---\nsecond\r\n  ---  \n\nthird\n---\n"
    assert split_candidates(text, s) == ["first candidate\nline two", "second", "third"]
    # a line merely containing --- is not a separator
    assert split_candidates("a --- b\nc", s) == ["a --- b\nc"]


def test_candidate_chosen_at_random_each_step_and_reproducible() -> None:
    s = CaptionSettings(enable_multiline_caption=True, caption_prefix="P")
    cands = split_candidates("one\n---\ntwo\n---\nthree", s)
    rng = random.Random(123)
    picks = [process_caption(cands, s, rng) for _ in range(60)]
    assert {p.candidate_index for p in picks} == {0, 1, 2}
    assert all(p.text == "P " + cands[p.candidate_index] for p in picks)
    rng2 = random.Random(123)
    assert [process_caption(cands, s, rng2).candidate_index for _ in range(60)] == [p.candidate_index for p in picks]


def test_prefix_suffix_apply_to_every_candidate() -> None:
    s = CaptionSettings(caption_prefix="pre", caption_suffix="suf", enable_wildcard=True)
    cands = split_candidates("line a\n\nline b", s)
    assert cands == ["line a", "line b"]
    texts = {process_caption(cands, s, random.Random(i)).text for i in range(20)}
    assert texts == {"pre line a suf", "pre line b suf"}
    assert cacheable_caption("", CaptionSettings(caption_prefix="pre")) == "pre"


def test_caption_dropout_rate_is_seeded_and_close_to_rate() -> None:
    s = CaptionSettings(caption_dropout_rate=0.3)
    rng = random.Random(5)
    results = [process_caption(["a cat"], s, rng) for _ in range(2000)]
    dropped = sum(r.dropped for r in results)
    assert 500 <= dropped <= 700
    assert all((r.text == "") == r.dropped for r in results)
    assert not any(process_caption(["a"], s, random.Random(1), augment=False).dropped for _ in range(50))


def test_caption_dropout_every_n_epochs() -> None:
    s = CaptionSettings(caption_dropout_every_n_epochs=3)
    dropped = [process_caption(["a"], s, random.Random(0), epoch=e).dropped for e in range(1, 10)]
    assert dropped == [False, False, True, False, False, True, False, False, True]


def test_wildcards_and_escapes() -> None:
    rng = random.Random(0)
    outs = {expand_wildcards("a {red|blue} {{x}} ball", rng) for _ in range(30)}
    assert outs == {"a red {x} ball", "a blue {x} ball"}
    assert has_wildcards("a {b|c}") and not has_wildcards("a {{b|c}}") and not has_wildcards("plain")
    assert run("a {x|x} cat", enable_wildcard=True).text == "a x cat"
    assert run("a {x|y} cat").text == "a {x|y} cat"  # off: left alone


def test_shuffle_keep_tokens() -> None:
    text = "sks, dog, red, blue, green, yellow"
    outs = {run(text, seed=i, shuffle_caption=True, keep_tokens=2).text for i in range(40)}
    assert len(outs) > 5
    for o in outs:
        tags = o.split(", ")
        assert tags[:2] == ["sks", "dog"] and sorted(tags[2:]) == ["blue", "green", "red", "yellow"]
    assert run(text, seed=3, shuffle_caption=True).text == run(text, seed=3, shuffle_caption=True).text


def test_keep_tokens_separator_with_fixed_tail() -> None:
    text = "sks, dog ||| red, blue, green ||| masterpiece, best"
    for i in range(20):
        tags = run(text, seed=i, shuffle_caption=True, keep_tokens_separator="|||").text.split(", ")
        assert tags[:2] == ["sks", "dog"] and tags[-2:] == ["masterpiece", "best"]
        assert sorted(tags[2:5]) == ["blue", "green", "red"]
    # without shuffling the separator is removed, not left in the text
    assert run(text, keep_tokens_separator="|||").text == "sks, dog, red, blue, green, masterpiece, best"


def test_caption_separator_and_secondary_separator() -> None:
    out = run("a; b c; d^e", seed=1, shuffle_caption=True, caption_separator=";", secondary_separator="^")
    assert sorted(out.text.split(", ")) == ["a", "b c", "d;e"]  # the secondary group stays one tag
    assert run("x;;y, z", secondary_separator=";;").text == "x,y, z"


def test_tag_dropout() -> None:
    text = ", ".join(f"t{i}" for i in range(200))
    out = run(text, seed=2, caption_tag_dropout_rate=0.5, keep_tokens=1).text.split(", ")
    assert out[0] == "t0" and 60 < len(out) < 140
    assert run(text, seed=2, caption_tag_dropout_rate=0.5, augment=False).text == text


def test_token_warmup() -> None:
    text = "k, a, b, c, d, e, f, g, h"
    kw = dict(keep_tokens=1, token_warmup_min=2, token_warmup_step=8)
    assert run(text, step=0, **kw).text == "k, a, b"
    assert run(text, step=4, **kw).text == "k, a, b, c, d, e"  # floor(4 * (8 - 2) / 8) + 2 = 5 flexible tags
    assert run(text, step=8, **kw).text == text
    frac = CaptionSettings(token_warmup_step=0.25)
    assert resolve_token_warmup_steps(frac, 400) == 100
    with pytest.raises(UserError, match="fraction"):
        resolve_token_warmup_steps(frac, None)
    fractional = run(text, step=10, max_train_steps=400, keep_tokens=1, token_warmup_min=1, token_warmup_step=0.1)
    assert fractional.text == "k, a, b"
    # 0.1 * 400 = 40 warmup steps: floor(10 * (8 - 1) / 40) + 1 = 2 flexible tags


def test_tags_are_appended_to_every_candidate() -> None:
    assert append_tags(["a", "b"], "x,\ny", ",") == ["a,x,,y", "b,x,,y"]
    assert append_tags([""], "x", ",") == ["x"]
    assert append_tags(["a"], None, ",") == ["a"]


def test_cacheable_caption_is_the_deterministic_text() -> None:
    s = CaptionSettings(caption_prefix="pre", caption_suffix="suf", keep_tokens_separator="|", secondary_separator="^")
    assert cacheable_caption("a | b^c", s) == "pre a, b,c suf"
    assert process_caption(["a | b^c"], s, random.Random(0)).text == cacheable_caption("a | b^c", s)
