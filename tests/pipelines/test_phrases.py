"""Pieces of the omni_chat path that need no process: phrases cut from a token stream, WAV
parts joined, chat messages built from a history and encoder items, CLI files."""

from __future__ import annotations

import io
import wave

import pytest

from omniflow.api.common.v1 import common_pb2
from omniflow.api.coordinator.v1 import coordinator_pb2 as cpb
from omniflow.cli.workflow import parse_inputs, save_files
from omniflow.dsl import VType, Workflow
from omniflow.errors import InvalidArgument
from omniflow_services.coordinator.conversation import conversation, encode_items
from omniflow_services.coordinator.streams import (
    FIRST_PHRASE_CHARS,
    MIN_CLAUSE_CHARS,
    Phrases,
    join,
    join_wavs,
)


def _feed(tokens: list[str], max_chars: int = 120) -> list[str]:
    """What a consumer gets when every token arrives while it is idle."""
    cut = Phrases(max_chars)
    out = [p for p in (cut.feed(t) for t in tokens) if p]
    rest = cut.rest()
    return [*out, rest] if rest else out


def test_phrases_end_at_sentence_marks_once_whitespace_follows() -> None:
    tokens = ["Hello", " there", ".", " How", " are", " you", "?", " Fine", "."]
    assert _feed(tokens) == ["Hello there. ", "How are you? ", "Fine."]
    assert "".join(_feed(tokens)) == "".join(tokens)  # nothing lost, nothing reordered


def _words(text: str) -> list[str]:
    """``text`` as an llm streams it: a token per word, the space in front."""
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def test_after_the_first_phrase_clause_marks_count_only_after_enough_text() -> None:
    short = ["Yes", ",", " it", " is", " a", " cat", ",", " a", " big", " one", "."]
    assert _feed(short) == ["Yes, ", "it is a cat, a big one."]  # "it is a cat," too short
    got = _feed(_words("Well, cats are loyal and loving animals, and they like to sleep"))
    assert got[1] == "cats are loyal and loving animals, "
    assert len(got[1]) - 2 >= MIN_CLAUSE_CHARS


def test_the_first_phrase_ends_at_a_word_boundary_after_a_few_words() -> None:
    tokens = _words("The capital of France is Paris. It is a lovely city to visit in spring.")
    cut = Phrases(120)
    got = [cut.feed(t) for t in tokens]
    # Nothing until a whole word lies past FIRST_PHRASE_CHARS: "The capital" (11) is short,
    # and "The capital of" is only known whole once " France" arrives.
    assert got[:3] == ["", "", ""]
    assert got[3] == "The capital of " and len("The capital of") >= FIRST_PHRASE_CHARS
    # Later phrases are sentences, not a few words each.
    assert [p for p in got[4:] if p] == ["France is Paris. "]
    assert cut.rest() == "It is a lovely city to visit in spring."
    # Leading whitespace does not count toward the first phrase; nothing is lost.
    spaced = _feed(["\n", " Sure", " thing", " my", " friend", " here", " it", " is"])
    assert (
        spaced[0] == "\n Sure thing my " and "".join(spaced) == "\n Sure thing my friend here it is"
    )
    # A first phrase past max_chars is cut by the max_chars rule instead.
    assert _feed(_words("abcdefghijklm nopq rs"), max_chars=10) == ["abcdefghij", "klm nopq ", "rs"]
    assert _feed(["Hi", "!", " Yes", "."]) == ["Hi! ", "Yes."]  # a short sentence is a phrase


def test_phrases_keep_every_character_in_order_however_the_stream_is_split() -> None:
    text = (
        "Sure! Cats are wonderful pets; they purr, play and sleep. Many people love them, "
        "because they are calm, clean and independent animals\nThe end..."
    )
    for size in (1, 2, 3, 5, 7, 40):
        for max_chars in (10, 30, 120):
            cut = Phrases(max_chars)
            got = [cut.feed(text[i : i + size]) for i in range(0, len(text), size)]
            phrases = [p for p in got if p] + [cut.rest()]
            assert "".join(phrases) == text, (size, max_chars)
            if size == 1:  # (larger chunks may hand several phrases over at once)
                assert all(len(p) <= max_chars for p in phrases), (max_chars, phrases)
                assert phrases[0] == "Sure! "


def test_phrases_without_marks_are_cut_at_a_space_within_the_limit() -> None:
    got = _feed([w + " " for w in "one two three four five six seven".split()], max_chars=10)
    assert (
        all(len(p) <= 10 for p in got[:-1]) and "".join(got) == "one two three four five six seven "
    )
    assert got[0] == "one two "
    assert _feed(["x" * 25], max_chars=10) == ["x" * 20, "x" * 5]  # two cuts, given at once


def test_coalesced_chunks_give_every_complete_phrase_at_once() -> None:
    cut = Phrases(120)
    assert cut.feed("One. Two. Thr") == "One. Two. "
    assert cut.feed("ee") == "" and cut.rest() == "Three"


def _wav(frames: bytes, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def test_wav_parts_join_into_one_wav() -> None:
    a, b = b"\x01\x00\x02\x00", b"\x03\x00"
    joined = join([_wav(a), _wav(b)])
    with wave.open(io.BytesIO(joined), "rb") as w:
        assert w.getframerate() == 16000 and w.readframes(w.getnframes()) == a + b
    assert join([b"ab", b"cd"]) == b"abcd"  # other bytes: concatenated
    assert join([_wav(a), _wav(b, 22050)]) == _wav(a) + _wav(b, 22050)  # formats differ
    with pytest.raises(ValueError, match="differ in format"):
        join_wavs([_wav(a), _wav(b, 22050)])


def _ref() -> dict:
    return {"item_id": b"\x07" * 16, "embeddings": common_pb2.TensorRef(shape=[4, 8])}


def test_conversation_puts_history_then_the_question_and_media_first() -> None:
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    msgs = conversation(
        "And now?", {"messages": history, "media": [_ref()]}, {"system": "Be brief."}
    )
    assert [m.role for m in msgs.messages] == ["system", "user", "assistant", "user"]
    first = msgs.messages[1].content
    assert first[0].encoded.item_id == b"\x07" * 16 and first[1].text == "Hi"
    assert [p.text for p in msgs.messages[3].content] == ["And now?"]
    last = conversation("Q", {"media": [_ref()], "messages": history}, {"media_turn": "last"})
    assert last.messages[2].content[0].WhichOneof("part") == "encoded"
    one = conversation("Q", {"media": _ref()}, {})  # one item alone, not in a list
    assert [p.WhichOneof("part") for p in one.messages[0].content] == ["encoded", "text"]
    assert msgs.add_generation_prompt


@pytest.mark.parametrize(
    ("inputs", "params", "message"),
    [
        ({"messages": "hi"}, {}, "input 'messages' is str; accepted: a list of"),
        ({"messages": [{"role": "bot", "content": "x"}]}, {}, r"messages\[0\].role is 'bot'"),
        ({"messages": [{"role": "user", "content": 3}]}, {}, r"messages\[0\].content is int"),
        ({"media": [b"raw"]}, {}, r"media\[0\] is not an encoded item"),
        ({"messages": ["hi"]}, {}, r"messages\[0\].role is None"),
        ({"messages": [{}] * 257}, {}, "input 'messages' has 257 entries; at most 256"),
        ({"media": [_ref()] * 17}, {}, "input 'media' has 17 items; at most 16"),
        ({}, {"media_turn": "middle"}, "param 'media_turn' is 'middle'; accepted: first, last"),
    ],
)
def test_conversation_names_what_is_wrong(inputs: dict, params: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        conversation("q", inputs, params)


def test_encode_items_from_file_bytes() -> None:
    items = encode_items({"image": b"\x89PNG...", "audio": b"RIFF...", "media": None})
    kinds = [i.kind for i in items]
    assert kinds == [common_pb2.MediaItem.KIND_IMAGE, common_pb2.MediaItem.KIND_AUDIO]
    with pytest.raises(InvalidArgument, match="encode needs media: set input 'media', 'image'"):
        encode_items({"image": None})
    with pytest.raises(InvalidArgument, match="media\\[0\\] is bytes with no kind"):
        encode_items({"media": [b"x"]})


def test_stream_option_compiles_into_the_edge() -> None:
    wf = Workflow("w")
    llm = wf.call("a", "llm", "generate", prompt=wf.input("q", VType.TEXT))
    talk = wf.call("t", "talker", "synthesize", text=llm["text"].stream(phrase_chars=80))
    wf.output("wav", talk["wav"])
    src = wf.compile().nodes[1].inputs["text"]
    assert src.streaming and src.phrase_chars == 80
    with pytest.raises(InvalidArgument, match="phrase_chars is -1; accepted: 0 to 100000"):
        llm["text"].stream(phrase_chars=-1)


def test_cli_reads_a_file_path_for_a_bytes_input_and_saves_file_outputs(tmp_path) -> None:
    graph = cpb.WorkflowGraph(
        name="g",
        inputs=[cpb.Port(name="audio", type=int(VType.ANY)), cpb.Port(name="text", type=1)],
    )
    clip = tmp_path / "q.wav"
    clip.write_bytes(_wav(b"\x00\x00"))
    got = parse_inputs([f"audio={clip}", f"text={clip}"], graph)
    assert got == {"audio": clip.read_bytes(), "text": str(clip)}  # text stays text
    shown = save_files({"audio": got["audio"], "text": "hi"}, "g", tmp_path / "out")
    assert shown == {"audio": str(tmp_path / "out" / "g.audio.wav"), "text": "hi"}
    assert (tmp_path / "out" / "g.audio.wav").read_bytes() == got["audio"]
