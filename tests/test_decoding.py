"""RowDecoder: one row's tokens become text deltas; max_tokens, end of sequence and
stop strings end the row; a stop string is never shown."""

import pytest
from hypothesis import assume, given, settings, strategies as st

from mlxnb.core.messages import Admit, Ending
from mlxnb.core.rows import SamplingParams
from mlxnb.core.states import Finish
from mlxnb.core.worker.decoding import RowDecoder
from mlxnb.models.tiny import byte_tokenizer

TOK = byte_tokenizer()
EOS = TOK.eos_token_id
EOS_SET = {EOS}


def decoder(max_tokens=10_000, stop=(), rid=7):
    params = SamplingParams(max_tokens=max_tokens, stop=tuple(stop)).check()
    return RowDecoder(Admit(rid, [1, 2, 3], params), TOK.detokenizer, [])


def feed(dec, toks, lps=None):
    """Accept tokens until the row ends: (emitted, ending, tokens accepted)."""
    emitted, ending, n = [], None, 0
    for i, t in enumerate(toks):
        ending = dec.accept(t, None if lps is None else lps[i], emitted, EOS_SET)
        n += 1
        if ending is not None:
            break
    return emitted, ending, n


def text_of(emitted):
    return "".join(e.text for e in emitted)


def ids(text):
    return list(text.encode("utf-8"))  # byte tokenizer: byte b is token b


# Multi-byte characters (2, 3 and 4 bytes) split across byte tokens; no leading space
# (the streaming detokenizer drops a leading space, as SentencePiece does).
text_st = st.text(alphabet=st.sampled_from(list("ab \n.é€😀ß")), max_size=40).filter(
    lambda s: not s.startswith(" "))


# -- text -----------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(text_st)
def test_emitted_text_is_the_decode_of_the_tokens_ending_at_length(text):
    toks = ids(text)
    assume(toks)
    dec = decoder(max_tokens=len(toks))
    emitted, ending, n = feed(dec, toks)
    assert n == len(toks)
    assert ending == Ending(Finish.LENGTH)
    assert text_of(emitted) == TOK.decode(toks) == text
    # one record per token, in order, for this row
    assert [e.token for e in emitted] == toks
    assert {e.row_id for e in emitted} == {7}


@settings(max_examples=200, deadline=None)
@given(text_st)
def test_emitted_text_is_the_decode_of_the_tokens_ending_at_eos(text):
    toks = ids(text)
    dec = decoder()
    emitted, ending, n = feed(dec, toks + [EOS])
    assert n == len(toks) + 1
    assert ending == Ending(Finish.STOP)
    assert text_of(emitted) == text
    assert EOS not in [e.token for e in emitted]
    assert "<eos>" not in text_of(emitted)


def test_partial_character_is_shown_once_complete():
    euro = ids("€")  # 3 bytes
    dec = decoder()
    emitted = []
    assert dec.accept(euro[0], None, emitted, EOS_SET) is None
    assert dec.accept(euro[1], None, emitted, EOS_SET) is None
    assert text_of(emitted) == ""
    dec.accept(euro[2], None, emitted, EOS_SET)
    assert [e.text for e in emitted] == ["", "", "€"]


def test_tokens_of_the_tiny_model_tokenizer(tiny):
    tok = tiny[1]
    text = "Hi é€ x\n"
    toks = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(toks))
    dec = RowDecoder(Admit(1, [0], params), tok.detokenizer, [])
    emitted, ending, _ = feed(dec, toks)
    assert ending.reason == Finish.LENGTH
    assert text_of(emitted) == tok.decode(toks) == text


# -- max_tokens and end of sequence ---------------------------------------------------

@pytest.mark.parametrize("stop", [(), ("zzz",)], ids=["no-stop", "stop"])
@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_length_ends_exactly_at_max_tokens(max_tokens, stop):
    dec = decoder(max_tokens=max_tokens, stop=stop)
    emitted = []
    toks = ids("abcdefgh")
    for i, t in enumerate(toks[:max_tokens]):
        ending = dec.accept(t, None, emitted, EOS_SET)
        if i < max_tokens - 1:
            assert ending is None
    assert ending == Ending(Finish.LENGTH)
    # the held-back tail is shown as the row ends
    assert text_of(emitted) == "abcdefgh"[:max_tokens]


def test_eos_is_not_counted_or_shown():
    dec = decoder(max_tokens=3)
    emitted, ending, _ = feed(dec, ids("ab") + [EOS])
    assert ending == Ending(Finish.STOP)
    assert text_of(emitted) == "ab"
    assert dec.ntok == 2
    assert [e.token for e in emitted] == [ord("a"), ord("b"), None]


def test_eos_first():
    dec = decoder(max_tokens=1)
    emitted, ending, _ = feed(dec, [EOS])
    assert ending == Ending(Finish.STOP)
    assert text_of(emitted) == ""
    assert dec.ntok == 0


def test_eos_before_a_character_is_complete_shows_what_there_is():
    dec = decoder()
    emitted, ending, _ = feed(dec, ids("a€")[:2] + [EOS])
    assert ending.reason == Finish.STOP
    assert text_of(emitted) == TOK.decode(ids("a€")[:2])
    assert text_of(emitted).startswith("a")


# -- stop strings ---------------------------------------------------------------------

def reference_cut(text, stops):
    """The text shown for `text` streamed one character at a time: everything before
    the first stop string to complete (the earliest-starting one, if several complete
    at the same character), or all of it."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    return text, False


stop_text_st = st.text(alphabet=st.sampled_from(list("abé€")), max_size=30)
stops_st = st.lists(st.text(alphabet=st.sampled_from(list("abé€")), min_size=1,
                            max_size=4), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(stop_text_st, stops_st)
def test_stop_strings_cut_the_text_and_are_never_shown(text, stops):
    toks = ids(text)
    assume(toks)
    expected, hit = reference_cut(text, stops)
    dec = decoder(max_tokens=len(toks), stop=stops)
    emitted, ending, _ = feed(dec, toks)
    shown = text_of(emitted)
    assert shown == expected
    assert ending == Ending(Finish.STOP if hit else Finish.LENGTH)
    for s in stops:
        assert s not in shown


@settings(max_examples=300, deadline=None)
@given(stop_text_st, stops_st)
def test_text_held_back_for_a_stop_is_released_at_eos(text, stops):
    toks = ids(text)
    expected, hit = reference_cut(text, stops)
    assume(not hit)
    dec = decoder(stop=stops)
    emitted, ending, _ = feed(dec, toks + [EOS])
    assert ending == Ending(Finish.STOP)
    assert text_of(emitted) == text
    assert emitted[-1].token is None


@settings(max_examples=200, deadline=None)
@given(stop_text_st, stops_st)
def test_shown_text_is_always_a_prefix_of_the_final_text(text, stops):
    """A delta, once shown, is never taken back: the stop string's head is held."""
    toks = ids(text)
    expected, _ = reference_cut(text, stops)
    dec = decoder(stop=stops)
    emitted = []
    for t in toks:
        ending = dec.accept(t, None, emitted, EOS_SET)
        assert expected.startswith(text_of(emitted))
        if ending is not None:
            break


def test_stop_spanning_several_tokens():
    dec = decoder(stop=("END",))
    emitted, ending, n = feed(dec, ids("helloENDworld"))
    assert ending == Ending(Finish.STOP)
    assert n == len("helloEND")
    assert text_of(emitted) == "hello"
    # while "EN" could still become "END" it was not shown
    dec = decoder(stop=("END",))
    emitted = []
    for t in ids("helloEN"):
        dec.accept(t, None, emitted, EOS_SET)
    assert not text_of(emitted).endswith(("E", "EN"))
    dec.flush(emitted)
    assert text_of(emitted) == "helloEN"


def test_stop_made_of_multibyte_characters():
    dec = decoder(stop=("€€",))
    emitted, ending, _ = feed(dec, ids("a€b€€c"))
    assert ending.reason == Finish.STOP
    assert text_of(emitted) == "a€b"


def test_earliest_stop_wins_among_several():
    dec = decoder(stop=("cd", "bcd"))
    emitted, ending, _ = feed(dec, ids("abcde"))
    assert ending.reason == Finish.STOP
    assert text_of(emitted) == "a"


def test_stop_on_the_last_allowed_token_is_a_stop():
    dec = decoder(max_tokens=4, stop=("cd",))
    emitted, ending, _ = feed(dec, ids("abcd"))
    assert ending == Ending(Finish.STOP)
    assert text_of(emitted) == "ab"


def test_flush_on_cancel_shows_the_held_tail():
    dec = decoder(stop=("xyz",))
    emitted = []
    for t in ids("abcx"):
        dec.accept(t, None, emitted, EOS_SET)
    assert len(text_of(emitted)) < 4
    dec.flush(emitted)
    assert text_of(emitted) == "abcx"
    assert emitted[-1].token is None and emitted[-1].row_id == 7


# -- callable stops -------------------------------------------------------------------

def test_callable_stop_ends_the_row_with_its_text():
    dec = decoder(stop=(lambda text: text.endswith("!"),))
    emitted, ending, n = feed(dec, ids("hi! more"))
    assert ending == Ending(Finish.STOP)
    assert n == 3
    assert text_of(emitted) == "hi!"


def test_callable_stop_that_raises_ends_the_row_with_an_error():
    calls = []

    def boom(text):
        calls.append(text)
        if len(text) >= 3:
            raise KeyError("nope")
        return False

    dec = decoder(max_tokens=100, stop=(boom,))
    lps = [{"logprob": -0.5} for _ in range(6)]
    emitted, ending, n = feed(dec, ids("abcdef"), lps)
    assert n == 3
    assert ending.reason == Finish.ERROR
    assert "KeyError" in ending.error and "nope" in ending.error
    assert "\n" not in ending.error
    # the failing token is still reported, with its logprob record
    assert emitted[-1].token == ord("c")
    assert emitted[-1].logprob == {"logprob": -0.5, "token": ord("c")}
    assert calls == ["a", "ab", "abc"]


# -- logprobs -------------------------------------------------------------------------

@pytest.mark.parametrize("stop", [(), ("zz",), ("c",)], ids=["plain", "held", "hit"])
def test_logprob_record_gets_its_token(stop):
    dec = decoder(max_tokens=3, stop=stop)
    toks = ids("abc")
    lps = [{"logprob": -float(i), "top": {}} for i in range(3)]
    emitted, ending, _ = feed(dec, toks, lps)
    assert ending is not None
    for e, t, lp in zip(emitted, toks, lps):
        assert e.token == t
        assert e.logprob is lp
        assert lp["token"] == t
    # rows without logprobs carry none
    dec = decoder(max_tokens=3, stop=stop)
    emitted, _, _ = feed(dec, toks)
    assert all(e.logprob is None for e in emitted)


@pytest.mark.parametrize("end", ["eos", "cancel"])
def test_a_stop_completed_by_text_the_detokenizer_held_is_not_shown(end):
    # the byte detokenizer holds a lone space until the next token: the row ends
    # (eos, or a cancel's flush) before "b " is ever searched
    dec = decoder(stop=("b ",))
    emitted, ending, _ = feed(dec, ids("ab ") + ([EOS] if end == "eos" else []))
    if end == "cancel":
        assert ending is None
        dec.flush(emitted)
    assert text_of(emitted) == "a"


def test_a_stop_string_before_a_callable_stop_on_the_same_token_is_cut():
    for stops in (("END", lambda t: t.endswith("D")), (lambda t: t.endswith("D"), "END")):
        emitted, ending, _ = feed(decoder(stop=stops), ids("xEND"))
        assert ending == Ending(Finish.STOP) and text_of(emitted) == "x"


def test_a_failing_callable_stop_reports_one_line():
    def boom(text):
        raise ValueError("line one\nline two")

    _, ending, _ = feed(decoder(stop=(boom,)), ids("a"))
    assert ending.reason == Finish.ERROR and "\n" not in ending.error
    assert "line one line two" in ending.error
