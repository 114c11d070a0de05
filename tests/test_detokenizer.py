"""Incremental detokenization: multi-byte characters are never split, stop strings are
never half-emitted, and the deltas add up to the full decode."""

from __future__ import annotations

from agent_infer.engine.detokenizer import IncrementalDetokenizer


def run(tok, ids, stop=None, include=False):
    d = IncrementalDetokenizer(tok, [], stop=stop, include_stop_str_in_output=include)
    deltas = []
    for t in ids:
        hit = d.add_token(t)
        finished = hit is not None or t == ids[-1]
        deltas.append(d.take_delta(finished))
        if hit:
            break
    return d, deltas


def test_multibyte_characters_are_never_split(smol_engine):
    tok = smol_engine.tokenizer
    text = "Café ☕ naïve 日本語 🙂 done"
    ids = tok.encode(text)
    d, deltas = run(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in x for x in deltas)
    # Byte-level BPE splits some of these characters over several tokens.
    assert len(ids) > len(text.split())


def test_stop_string_is_held_back_then_cut(smol_engine):
    tok = smol_engine.tokenizer
    ids = tok.encode("one two three STOP four five")
    d, deltas = run(tok, ids, stop=["STOP"])
    assert d.stopped_by == "STOP"
    assert "".join(deltas) == "one two three "
    # Nothing past the cut was ever handed out, not even the "S" of "STOP".
    for i in range(len(deltas)):
        assert "one two three ".startswith("".join(deltas[: i + 1]))
    d2, deltas2 = run(tok, ids, stop=["STOP"], include=True)
    assert "".join(deltas2) == "one two three STOP"
