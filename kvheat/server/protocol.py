"""Request bodies of the OpenAI-compatible API (pydantic; they make the OpenAPI schema).

Only what kvheat does is accepted: `n`, `best_of` > 1, `echo`, `logprobs`, `suffix`,
tools and non-zero penalties are refused with a clear 400 rather than ignored. Unknown
extra fields are ignored, as OpenAI's own server does for fields it does not know.
Types are strict: `"stream": "yes"` is not true and `[true, false]` is not a list of token
ids (pydantic's lax mode took both); an int is still a valid float.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
MAX_QUOTA_BLOCKS = 2**31 - 1  # far above any pool; 10**23 is a typo, not a quota
LOGIT_BIAS_KEY = r"^[0-9]{1,10}$"  # a token id in decimal: int() also takes "5_0", " 5", "+5"
StopSpec = str | Annotated[list[str], Field(max_length=4)] | None
# A request marked with this header is a router's prewarm (kvheat route sends the hot head
# of a prompt to replicas that lack it): served as any other, counted apart from clients'.
# Its value is the events secret's MAC of the prompt (`EventSecret.prewarm_mark`): a
# client cannot mark its own requests.
PREWARM_HEADER = "x-kvheat-prewarm"


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat requests share: model, sampling, stream, stops."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's, as vLLM's
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopSpec = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = Field(None, max_length=256)
    logit_bias: dict[Annotated[str, Field(pattern=LOGIT_BIAS_KEY)],
                     Annotated[float, Field(ge=-100, le=100)]] | None = None
    presence_penalty: float | None = Field(None, ge=0, le=0)
    frequency_penalty: float | None = Field(None, ge=0, le=0)
    ignore_eos: bool = False  # as vLLM's: generate exactly max_tokens (for benchmarks)

    def stop_list(self) -> list[str]:
        """The stop strings, as a list without empty ones."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: a prompt as text or token ids."""

    # A string, or token ids; a one-element list of either is accepted too.
    prompt: (str | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=1)])
    echo: bool = Field(False, description="not supported: must be false")
    logprobs: int | None = Field(None, ge=0, le=0)
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: str | None = Field(None, max_length=0)


class TextPart(BaseModel):
    """A text part of a chat message's content."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: its role and its content."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: the messages."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="not supported: must be false")
    tools: Annotated[list[Any], Field(max_length=0)] | None = None


class PinRequest(BaseModel):
    """A prefix to keep cached: text, chat messages or token ids (one of them)."""

    model_config = ConfigDict(strict=True)

    tenant: str | None = Field(None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    add_generation_prompt: bool = False


class ClusterRequest(BaseModel):
    """`PUT /admin/cluster`, from `kvheat route`: the cluster's entropy.

    The entropy of all the traffic it spreads over this replica and its peers, for the
    eviction regime (`KVHeat.set_cluster_entropy`)."""

    model_config = ConfigDict(strict=True)

    # 64 bits: more keys than any window holds; allow_inf_nan: a NaN is a client mistake
    entropy_bits: float = Field(..., ge=0.0, le=64.0, allow_inf_nan=False)


class QuotaRequest(BaseModel):
    """`PUT /admin/tenants/{tenant}/quota`: blocks per arm, or null to remove the quota."""

    model_config = ConfigDict(strict=True)

    blocks: int | None = Field(..., ge=1, le=MAX_QUOTA_BLOCKS,
                               description="blocks per arm; null removes the quota")
