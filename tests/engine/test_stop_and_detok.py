"""Stop strings, held-back text, incremental detokenization and the chat template.

The stop-checker tests are pure Python. The detokenizer and chat-template tests use the default
model's real tokenizer (the converted SmolLM2 directory; converted once if missing) and are
skipped when the default model package is not installed.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling_params import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.sequence import FinishReason, Sequence
from services.engine.stop_checker import check_stop_token, find_stop_string, num_held_back

# ----- find_stop_string -------------------------------------------------------------------


def stream(deltas: list[str], stops: list[str]) -> tuple[str, tuple[int, str] | None]:
    """Feed deltas like the engine; return the text and the first stop match."""
    text = ""
    for delta in deltas:
        text += delta
        match = find_stop_string(text, len(delta), stops)
        if match is not None:
            return text, match
    return text, None


def test_stop_string_in_one_delta():
    assert find_stop_string("Hello END", 9, ["END"]) == (6, "END")
    assert find_stop_string("Hello", 5, ["END"]) is None
    assert find_stop_string("", 0, ["END"]) is None


def test_stop_string_split_across_deltas():
    text, match = stream(["Hello <|", "en", "d|> more"], ["<|end|>"])
    assert match == (6, "<|end|>")
    assert text[: match[0]] == "Hello "
    # one character at a time
    text, match = stream(list("abc STOP def"), ["STOP"])
    assert match == (4, "STOP")
    assert text == "abc STOP"  # found as soon as its last character arrives


def test_only_matches_ending_in_the_new_text_are_reported():
    # "STOP" lies wholly in the old text (it would have been reported then)
    assert find_stop_string("STOP and more", 4, ["STOP"]) is None
    # ending exactly on the first new character counts
    assert find_stop_string("abSTOP", 1, ["STOP"]) == (2, "STOP")
    assert find_stop_string("abSTOPx", 1, ["STOP"]) is None


def test_earliest_stop_wins():
    assert find_stop_string("xx abc b", 8, ["b", "abc"]) == (3, "abc")
    assert find_stop_string("one two three", 13, ["three", "two"]) == (4, "two")
    # two stops overlapping: the one starting first wins even if it is longer
    assert find_stop_string("<|im_end|>", 10, ["im_end", "<|im"]) == (0, "<|im")
    # a repeated stop: its first occurrence in the new text
    assert find_stop_string("a;b;c", 5, [";"]) == (1, ";")


def test_earliest_stop_across_deltas():
    # the longer stop began in the previous delta and ends in the new one, before the short one
    text, match = stream(["foo <|e", "nd|> bar ###"], ["###", "<|end|>"])
    assert match == (4, "<|end|>")


# ----- num_held_back ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,stops,expected",
    [
        ("Hello <|", ["<|end|>"], 2),
        ("Hello <", ["<|end|>"], 1),
        ("Hello <|end|", ["<|end|>"], 6),
        ("Hello", ["<|end|>"], 0),
        ("Hello <|x", ["<|end|>"], 0),
        ("", ["<|end|>"], 0),
        ("<|end|>", ["<|end|>"], 0),  # a whole stop is matched, not held
        ("ab", ["abc", "b"], 2),  # the longest prefix of any stop
        ("xaba", ["abab"], 3),
        ("xaa", ["aab"], 2),
        ("tail #", ["##", "#!"], 1),
        ("text", [], 0),
        ("end", ["e", "x"], 0),  # one-character stops never hold anything back
    ],
)
def test_num_held_back(text, stops, expected):
    assert num_held_back(text, stops) == expected


def test_streaming_with_hold_back_never_shows_a_stop():
    """Emit text[:len - held] each step: no stop string (or part of one that completes) leaks."""
    stops = ["<|end|>"]
    deltas = ["The answer", " is 4", ".<", "|e", "nd", "|>", " ignored"]
    text, shown = "", ""
    for delta in deltas:
        text += delta
        match = find_stop_string(text, len(delta), stops)
        if match is not None:
            shown = text[: match[0]]
            break
        visible = text[: len(text) - num_held_back(text, stops)]
        assert visible.startswith(shown)
        shown = visible
    assert shown == "The answer is 4."


# ----- check_stop_token -------------------------------------------------------------------


def test_check_stop_token():
    eos = frozenset({2})

    def seq(output: list[int], **kw) -> Sequence:
        s = Sequence(next(itertools.count()), "r", [5, 6], SamplingParams(**kw))
        for t in output:
            s.append_token(t)
        return s

    assert check_stop_token(seq([7]), eos, 100) is None
    assert check_stop_token(seq([2]), eos, 100) == (FinishReason.STOP, None)
    assert check_stop_token(seq([2], ignore_eos=True), eos, 100) is None
    assert check_stop_token(seq([9], stop_token_ids=[9]), eos, 100) == (FinishReason.STOP, 9)
    assert check_stop_token(seq([7, 7], max_tokens=2), eos, 100) == (FinishReason.LENGTH, None)
    assert check_stop_token(seq([7]), eos, 3) == (FinishReason.LENGTH, None)


# ----- the real tokenizer -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from services.engine.model.source import ModelLoadError, resolve_model_dir
    from services.engine.tokenizer import Tokenizer

    try:
        model_dir = resolve_model_dir(None, Path.home() / ".cache" / "pdserve")
    except ModelLoadError as exc:
        pytest.skip(f"default model not available: {exc}")
    return Tokenizer(model_dir)


TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 done.",
    "中文测试：你好，世界！日本語もテストします。",
    "Accents: café, naïve, Ångström, São Paulo, Øresund, Straße.",
    "  leading spaces,\ttabs\nand new lines  \n\n  ",
    "mixed 한국어 text 🚀 with numbers 12345 and symbols €£¥",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(
    "prompt",
    ["", "User said: ", "Prompt ending in emoji 🤖", "中文提示"],
    ids=["none", "ascii", "emoji", "cjk"],
)
def test_incremental_detokenizer_round_trip(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    for d in deltas:
        assert "\ufffd" not in d, f"a half character was emitted: {deltas!r}"
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert len(detok._ids) <= 8  # only a short window is kept, whatever the length


def test_incremental_detokenizer_cost_does_not_grow_with_the_output(tokenizer):
    """Each token decodes the same small window: a long output is linear, not quadratic."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    widths = []
    for t in ids:
        detok.add(t)
        widths.append(len(detok._ids))
    assert max(widths) <= 8


def test_incremental_detokenizer_holds_partial_characters(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    # a 4-byte emoji that the byte-level vocabulary splits
    if len(ids) < 2:
        pytest.skip("this tokenizer has the emoji as one token")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "😀"


# Not: unassigned code points and control characters (SmolLM2's vocabulary cannot write some
# of their bytes); surrogates are not text.
WRITABLE = st.characters(exclude_categories=("Cs", "Cn", "Cc"))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.one_of(st.text(WRITABLE, min_size=1, max_size=40), st.sampled_from(TEXTS)))
def test_tokens_bytes_join_to_the_texts_bytes(tokenizer, text):
    """OpenAI's logprob ``bytes``: each token's own bytes, so that joined in order they are the
    text's UTF-8, also where a token holds only part of a character (it decodes alone to
    U+FFFD, whose bytes were given before)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()


def test_a_token_inside_a_character_has_its_own_bytes(tokenizer):
    ids = tokenizer.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1 and tokenizer.decode(ids[:1]) == "\ufffd"  # a part of a character
    assert [tokenizer.token_bytes(t) for t in ids] == [b"\xf0\x9f", b"\xa4", b"\x96"]
    special = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert [tokenizer.token_bytes(t) for t in special] == [b"<|im_end|>"]


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    end_id = tokenizer._tok.token_to_id("<|im_end|>")
    assert end_id is not None
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    out = "".join(detok.add(t) for t in [*ids, end_id])
    assert out == "Hi there"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    out = "".join(detok.add(t) for t in [*ids, end_id])
    assert out == "Hi there<|im_end|>"


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == frozenset({tokenizer._tok.token_to_id("<|im_end|>")})
    assert tokenizer.vocab_size >= 49152


def test_chat_template_renders_smollm2_format(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")  # SmolLM2 adds a default system turn

    with_system = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tokenizer.apply_chat_template(with_system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tokenizer.apply_chat_template(with_system, add_generation_prompt=False)
    assert no_gen.endswith("<|im_start|>user\nBye<|im_end|>\n")


CONVERSATIONS = [
    [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hel"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}],  # said before
    [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}],  # spaces
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go on:"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("continue_final_message", [True, False])
def test_chat_template_options_render_as_transformers(tokenizer, messages, continue_final_message):
    """vLLM's add_generation_prompt: false and continue_final_message render the prompt as
    transformers does (the text ends where the last message's content ends: the model goes on
    with it), with the model's own template."""
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=continue_final_message
    )
    (theirs,), _ = render_jinja_template(
        [messages],
        chat_template=tokenizer.chat_template,
        continue_final_message=continue_final_message,
        add_generation_prompt=False,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    assert ours == theirs
    assert ours.endswith(messages[-1]["content"]) == continue_final_message


def test_chat_template_kwargs_reach_the_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", "{{ greeting }} {{ messages[0].content }}")
    messages = [{"role": "user", "content": "there"}]
    assert tokenizer.apply_chat_template(messages, template_kwargs={"greeting": "Hi"}) == "Hi there"
