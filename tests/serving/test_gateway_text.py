"""The gateway renders a choice's text a window at a time: at every token it must equal what
decoding every id so far gives, for the byte tokenizer and for real HF tokenizers (byte-level
BPE and SentencePiece-style, trained here on a few lines: nothing is downloaded)."""

from __future__ import annotations

import random

import pytest

from pdx.serving.backends.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pdx.serving.gateway.flow import Outcome, TextTracker

CORPUS = [
    "The prefill site computes the prompt; the decode site streams tokens.",
    "Über die Leitung: 10 ms RTT, 1 Gbit/s — naïve café déjà vu. Ça va?",
    "KV 캐시는 디코드 쪽으로 이동합니다. 東京から大阪へ。 emoji: 🚀🔥 done",
    "  leading spaces, tabs\tand\nnew lines ... don't, can't, it's.",
]


def _hf(kind: str) -> HFTokenizer:
    from tokenizers import SentencePieceBPETokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    if kind == "byte_bpe":
        raw = RawTokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        raw.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
            vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    else:  # SentencePiece-style: "▁" for spaces, the first one dropped on decode
        sp = SentencePieceBPETokenizer()
        sp.train_from_iterator(CORPUS * 3, vocab_size=300, min_frequency=1)
        raw = sp._tokenizer
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))


def _ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Generated-looking ids: pieces of the corpus, cut anywhere, and random ids."""
    out: list[int] = []
    while len(out) < n:
        if rng.random() < 0.7:
            ids = tok.encode(rng.choice(CORPUS))
            a = rng.randrange(len(ids))
            out += ids[a : a + rng.randrange(1, 12)]
        else:
            vocab = 260 if isinstance(tok, ByteTokenizer) else 300
            out.append(rng.randrange(vocab))
    return out[:n]


@pytest.mark.parametrize("kind", ["byte", "byte_bpe", "sentencepiece"])
def test_the_text_at_every_token_is_the_whole_decode(kind: str) -> None:
    tok = ByteTokenizer() if kind == "byte" else _hf(kind)
    rng = random.Random(7)
    for _ in range(40):
        ids = _ids(tok, rng, rng.randrange(1, 120))
        text, out = TextTracker(tok, [], 0), Outcome()
        for i, token in enumerate(ids):
            out.tokens.append(token)
            text.update(out)
            assert out.text == tok.decode(ids[: i + 1]), (kind, ids[: i + 1])


def test_a_stop_string_still_cuts_the_text() -> None:
    tok = ByteTokenizer()
    text, out = TextTracker(tok, ["ST"], 0), Outcome()
    stopped = False
    for token in tok.encode("abc déjà STOP more"):
        out.tokens.append(token)
        if text.update(out):
            stopped = True
            break
    assert stopped and out.text == "abc déjà "


def test_a_long_output_decodes_a_few_ids_per_token_not_all_of_them() -> None:
    """Rendering token 4,000 decodes about as many ids as token 10 did (before: all 4,000,
    quadratic in the output)."""

    class Counting(ByteTokenizer):
        def __init__(self) -> None:
            super().__init__()
            self.decoded: list[int] = []

        def decode(self, ids: list[int]) -> str:
            self.decoded[-1] += len(ids)
            return super().decode(ids)

    tok = Counting()
    ids = tok.encode("a long output, one byte a token; déjà vu 🚀. " * 100)[:4000]
    text, out = TextTracker(tok, [], 0), Outcome()
    for token in ids:
        out.tokens.append(token)
        tok.decoded.append(0)
        text.update(out)
    assert out.text == ByteTokenizer().decode(ids)
    assert max(tok.decoded) <= 16, max(tok.decoded)  # a window of a few ids, twice
