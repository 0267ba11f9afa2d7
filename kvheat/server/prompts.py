"""Request prompts to token ids: a text, chat messages or token ids in, checked token ids
out, or a 400. Text too long to fit the context is refused before it is tokenized; token
ids must be in the vocabulary. Runs on the server's tokenizing threads, never on the
event loop."""

from __future__ import annotations

from typing import Any

from .errors import ApiError


class PromptEncoder:
    """Turns prompts and chat messages into token ids, refusing text too long for the context."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_token_bytes = _max_token_bytes(tokenizer)
        # No token of this vocabulary spans more than `max_token_bytes` bytes (x2: text a
        # tokenizer's normalizer drops): a longer text cannot fit the context.
        self.byte_limit = 2 * self.max_token_bytes * max_model_len

    def check_text_size(self, n_bytes: int, param: str) -> None:
        """Raise a 400 when `n_bytes` of text cannot fit the model's context."""
        if n_bytes > self.byte_limit:
            raise ApiError(400, f"the {param} has {n_bytes} bytes; at most "
                           f"{self.max_token_bytes} bytes per token, it cannot fit this "
                           f"model's context length of {self.max_model_len} tokens",
                           param=param, code="context_length_exceeded")

    def encode(self, text: str) -> list[int]:
        """The token ids of a text prompt (a 400 when it cannot be tokenized)."""
        self.check_text_size(len(text.encode("utf-8", "surrogatepass")), "prompt")
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # e.g. lone surrogates the tokenizer cannot take
            raise ApiError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None

    def chat(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of chat `messages`, by the chat template (a 400 when it fails)."""
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in messages]
        self.check_text_size(sum(len(m["content"].encode("utf-8", "surrogatepass"))
                                 for m in msgs), "messages")
        try:
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt)
        except Exception as e:  # template errors and untokenizable text
            raise ApiError(400, f"the messages cannot be rendered: {e}", param="messages") \
                from None

    def completion(self, prompt: Any) -> list[int]:
        """A completion's `prompt`: a string or token ids, or a list of one of either."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:  # the tokenizer would make it <bos> alone: refuse, as []
                raise ApiError(400, "the prompt is empty", param="prompt")
            ids = self.encode(prompt)
        elif prompt and isinstance(prompt[0], int):
            ids = list(prompt)
        else:
            ids = list(prompt[0])
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary of {vocab}",
                           param="prompt")
        return ids


def _max_token_bytes(tok: Any) -> int:
    """The most UTF-8 bytes one token of the vocabulary decodes to (at least 4)."""
    try:
        n = int(tok.vocab_size)
        return max(4, max(len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
                          for i in range(n)))
    except Exception:  # a tokenizer without these: a generous bound
        return 64
