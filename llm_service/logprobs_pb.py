"""Engines' per-token logprobs as llm.v1 TokenLogprob messages, each token named as OpenAI does:
its exact bytes, and its text (U+FFFD where the bytes are part of a multi-byte character)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from llm_service.engines.base import SampledToken
from shared.pb.llm.v1 import llm_pb2

# Qwen2's tokenizer is byte-level BPE: every byte is spelled as one printable character.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenNamer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._names: dict[int, tuple[str, bytes]] = {}

    def name(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token. Decoding a lone token would hide a partial character's
        bytes behind U+FFFD, so the bytes come from the BPE spelling instead."""
        if token_id not in self._names:
            spelled = self._tokenizer.convert_ids_to_tokens(token_id)
            assert isinstance(spelled, str)  # one id in, one token out (a list in gives a list)
            if all(char in _BYTE_OF_CHAR for char in spelled):
                raw = bytes(_BYTE_OF_CHAR[char] for char in spelled)
            else:  # an added token (e.g. <|im_end|>) is stored as its plain text
                raw = spelled.encode()
            self._names[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return self._names[token_id]

    def to_pb(self, logprobs: list[SampledToken]) -> list[llm_pb2.TokenLogprob]:
        return [self._entry(entry) for entry in logprobs]

    def _entry(self, entry: SampledToken) -> llm_pb2.TokenLogprob:
        text, raw = self.name(entry.token_id)
        top = [self._top(token_id, logprob) for token_id, logprob in entry.top]
        return llm_pb2.TokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top)

    def _top(self, token_id: int, logprob: float) -> llm_pb2.TopLogprob:
        text, raw = self.name(token_id)
        return llm_pb2.TopLogprob(token=text, logprob=logprob, bytes=raw, token_id=token_id)
