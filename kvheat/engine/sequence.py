"""A request as the scheduler sees it, and what one scheduler step hands the engine."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .load_classes import REGULAR

if TYPE_CHECKING:
    from ..cache import Request


class SeqStatus(enum.Enum):
    """Where a sequence is: waiting, running or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Seq:
    """One request as the scheduler sees it: its tokens so far and how many have KV.

    (`Seq`, not `Sequence`: that name is `collections.abc.Sequence` throughout kvheat.)"""

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "max_tokens", "tenant", "session", "lora",
        "arrival", "status", "num_computed", "cache_req", "load_class", "num_cached_tokens",
        "num_preemptions", "admitted_seq", "prompt_done", "finish_reason",
        "full_req", "cached_by_tier",
    )

    def __init__(self, seq_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                 tenant: str | None = None, session: str | None = None,
                 lora: str | None = None, arrival: float | None = None) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.tenant = tenant
        self.session = session
        self.lora = lora
        # NaN until the scheduler stamps it from its clock (when not given)
        self.arrival: float = math.nan if arrival is None else arrival
        self.status = SeqStatus.WAITING
        self.num_computed = 0  # leading tokens whose KV is in the pool
        self.cache_req: Request | None = None  # the manager's view while blocks are held
        self.full_req: Request | None = None  # all its tokens hashed, while their count holds
        self.load_class = REGULAR
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        # The same tokens by the tier that held them ("device", "host", "disk", "redis"):
        # taken together at admission, so the parts always add up to num_cached_tokens.
        self.cached_by_tier: dict[str, int] = {}
        self.num_preemptions = 0
        self.admitted_seq = 0  # admission order; the youngest is preempted first
        self.prompt_done = False
        self.finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """Tokens still to run before the next sample (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    def __repr__(self) -> str:
        return (f"Seq({self.seq_id!r}, {self.status.value}, computed={self.num_computed}/"
                f"{len(self.token_ids)}, class={self.load_class})")


@dataclass(slots=True)
class ScheduledItem:
    """One sequence's work in a step: the tokens to run, its KV so far, its blocks."""

    seq: Seq
    token_ids: list[int]  # the tokens to run this step
    num_computed: int  # KV already in the pool before them
    block_table: list[int]
    sample: bool  # the chunk ends at the sequence's last token: sample the next one


@dataclass(slots=True)
class SchedulerOutput:
    """One step's schedule: the items to run, the sequences preempted, the tokens batched."""

    items: list[ScheduledItem]
    preempted: list[Seq]
    num_batched_tokens: int

    @property
    def empty(self) -> bool:
        """Whether nothing is scheduled."""
        return not self.items
