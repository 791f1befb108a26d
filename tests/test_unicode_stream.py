"""CJK, emoji and right-to-left text streamed back byte-exact.

A token is a byte piece, so one character can arrive in two or three tokens. Whatever the split,
the text released step by step must add up to the decoded bytes of all the tokens, with no U+FFFD
where the bytes were valid UTF-8. Three layers: ``TextStream`` on literal byte sequences split at
every position, the engine on the bundled SmolLM2, and the desktop transcript.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import codecs  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from backends.core.text import TextStream  # noqa: E402

REPLACEMENT = "\ufffd"
TEXTS = {
    "cjk": "你好，世界。日本語のテキストと한국어 문장。",
    "emoji": "Family 👩‍👩‍👧‍👦, flag 🇩🇪, thumbs 👍🏽, keycap 1️⃣ and 🤖.",
    "rtl": "שלום עולם! مرحبا بالعالم، ‏كيف حالك؟",
    "mixed": "Price: 5€ — naïve café, 東京 ✈ تل أبيب 🚀 done.",
}


def stream_of(pieces: list[bytes], stop: tuple[str, ...] = ()) -> tuple[TextStream, list[str]]:
    """Push ``pieces`` as one-token steps (token i is piece i); the released texts, flush included."""
    stream = TextStream(lambda t: pieces[t], stop)
    released = []
    for token in range(len(pieces)):
        text, stopped = stream.push([token])
        released.append(text)
        if stopped:
            return stream, released
    released.append(stream.flush())
    return stream, released


# -- TextStream on literal byte sequences -----------------------------------------------------
@pytest.mark.parametrize("name", TEXTS)
def test_every_split_position_streams_back_byte_exact(name):
    data = TEXTS[name].encode("utf-8")
    for cut in range(len(data) + 1):
        stream, released = stream_of([data[:cut], data[cut:]])
        assert "".join(released) == stream.text == TEXTS[name], cut
        assert REPLACEMENT not in "".join(released), cut


@pytest.mark.parametrize("name", TEXTS)
def test_one_byte_per_token_and_every_pair_of_cuts(name):
    data = TEXTS[name].encode("utf-8")
    _, released = stream_of([data[i : i + 1] for i in range(len(data))])
    assert "".join(released) == TEXTS[name]
    assert all(REPLACEMENT not in r for r in released)
    short = data[:40]  # every pair of cut positions: three tokens, any of them possibly empty
    for a in range(len(short) + 1):
        for b in range(a, len(short) + 1):
            _, released = stream_of([short[:a], short[a:b], short[b:]])
            assert "".join(released) == short.decode("utf-8", "replace")


def test_random_multi_token_steps_with_a_non_ascii_stop_string():
    """Several tokens per step (as a speculative step commits), and a stop string that is itself
    split across tokens and characters: the text before it comes out whole, the stop never."""
    rng = random.Random(16)
    text = TEXTS["cjk"] + TEXTS["emoji"] + "終わり" + "never shown"
    data = text.encode("utf-8")
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 30)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        stream = TextStream(lambda t: pieces[t], stop=("終わり", "\nUser:"))
        released, token, stopped = [], 0, False
        while token < len(pieces) and not stopped:
            n = rng.randint(1, 4)
            out, stopped = stream.push(list(range(token, min(token + n, len(pieces)))))
            released.append(out)
            token += n
        assert stopped
        assert "".join(released) == stream.text == TEXTS["cjk"] + TEXTS["emoji"]


def test_invalid_bytes_decode_as_the_whole_would():
    """Bytes that are not UTF-8 (a model can emit them) give exactly the replacement characters that
    decoding all bytes at once gives, wherever the tokens split them; an answer cut off inside a
    character (a length limit) ends in one U+FFFD, as its detokenization does."""
    data = "ab中".encode() + b"\xe4\xb8" + b"cd" + b"\xf0\x9f\x98" + b"\xff" + "é".encode() + b"\xe4\xb8"
    expected = data.decode("utf-8", "replace")
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1):
            _, released = stream_of([data[:cut], data[cut:cut2], data[cut2:]])
            assert "".join(released) == expected, (cut, cut2)


# -- the engine on the bundled model --------------------------------------------------------------
def complete_utf8_but_a_cut_tail(raw: bytes) -> bool:
    """Valid UTF-8, except perhaps one character cut off at the very end."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(raw, final=False)
    except UnicodeDecodeError:
        return False
    return True


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.fixture(scope="module")
def bundled(smollm_q4_path):
    from backends.factory import Session, SessionConfig

    with Session(SessionConfig(model=str(smollm_q4_path), n_ctx=1024)) as session:
        yield session


@pytest.mark.parametrize("name", TEXTS)
def test_the_prompts_tokens_echoed_one_by_one_round_trip(bundled, name):
    """The prompt's own tokens, streamed back one per step (an answer that echoes the prompt), give
    the prompt text exactly, although some of them hold only part of a character."""
    model = bundled.model
    tokens = model.tokenize(TEXTS[name], add_special=False, parse_special=False)
    pieces = [model.token_piece(t) for t in tokens]
    assert any(not is_utf8(p) for p in pieces), "no character split across tokens: the test proves nothing"
    assert model.detokenize(tokens) == TEXTS[name]
    _, released = stream_of(pieces)
    assert "".join(released) == TEXTS[name]
    assert all(REPLACEMENT not in r for r in released)


# What makes the bundled model answer in the same script (greedy: the same answer every run); asked
# to repeat them, it answers RTL and mixed texts in English words.
ASK = {"cjk": "Repeat this text exactly:\n", "emoji": "Repeat this text exactly:\n",
       "rtl": "Translate to English: ", "mixed": "Translate to English: "}


@pytest.mark.parametrize("method", ["ar", "pld"])
@pytest.mark.parametrize("name", TEXTS)
def test_real_answers_stream_back_byte_exact(bundled, name, method):
    from backends.core.types import Finished, GenerationSettings, Step

    model = bundled.model
    prompt = model.chat_prompt([{"role": "user", "content": ASK[name] + TEXTS[name]}])
    texts, finished = [], None
    for event in bundled.generate(method, prompt, GenerationSettings(max_new_tokens=64)):
        if isinstance(event, Step):
            texts.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None and finished.reason in ("eos", "length")
    raw = b"".join(model.token_piece(t) for t in finished.tokens)
    assert "".join(texts) == finished.text == model.detokenize(list(finished.tokens)) == raw.decode("utf-8", "replace")
    assert complete_utf8_but_a_cut_tail(raw)
    if is_utf8(raw):
        assert REPLACEMENT not in finished.text
    else:  # only a character cut off by the length limit, shown as one U+FFFD at the end
        assert finished.reason == "length" and finished.text.count(REPLACEMENT) == 1
        assert finished.text.endswith(REPLACEMENT)
    assert any(not is_utf8(model.token_piece(t)) for t in finished.tokens), "no split character in the answer"


# -- the desktop transcript -----------------------------------------------------------------------
def test_the_window_streams_cjk_emoji_and_rtl_answers_byte_exact(qtbot, tmp_path, monkeypatch):
    """Through the real window, worker thread and model, prompt lookup drafting (several tokens a
    step) and drafted-token shading on: what streamed into the transcript is the final answer, the
    stored message is that answer, and no U+FFFD is drawn at any moment."""
    from backends.core.types import Step
    from tests.desktop_kit import ANSWER_TIMEOUT, Recorder, close_window, open_window, send

    class TextRecorder(Recorder):
        def __init__(self, window) -> None:
            self.texts: list[str] = []
            super().__init__(window)

        def on_event(self, ev) -> None:
            if isinstance(ev.event, Step):
                self.texts.append(ev.event.text)
            super().on_event(ev)

    monkeypatch.setenv("SPECDECK_DATA_DIR", str(tmp_path / "data"))
    window = open_window(qtbot, tmp_path)
    chat = window.chat
    drawn_replacement: list[str] = []
    chat.redraw_timer.timeout.connect(  # after the panel's own redraw on the same timer
        lambda: REPLACEMENT in chat.transcript_text() and drawn_replacement.append(chat.transcript_text()))
    try:
        assert window.methods.select("pld")
        window.methods.form_of["pld"].editors["adaptive"].setChecked(False)  # draft on every match
        chat.colour.setChecked(True)
        window.sampling.max_tokens.setValue(64)
        drafted = 0
        for name in ("cjk", "emoji", "rtl"):
            rec = TextRecorder(window)
            send(qtbot, window, ASK[name] + TEXTS[name])
            qtbot.waitUntil(rec.done, timeout=ANSWER_TIMEOUT)
            window.worker.answer_event.disconnect(rec.on_event)
            answer = rec.finished.text
            assert "".join(rec.texts) == answer == chat.messages[-1].content
            assert chat.store.messages(chat.conversation)[-1].content == answer  # SQLite round trip
            text = chat.transcript_text()
            assert TEXTS[name] in text  # the question as typed
            assert answer.strip() in text.replace("\u2028", "\n")  # shaded answers are drawn verbatim
            assert REPLACEMENT not in text or REPLACEMENT in answer
            drafted += rec.finished.stats.accepted
        assert drafted > 0  # some steps committed several tokens
        assert drawn_replacement == []
        assert window.error_text() == ""
    finally:
        close_window(window)
