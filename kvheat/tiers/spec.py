"""One definition of the lower KV tiers' settings (`TierSpec`) and the one place that
builds them under a device pool (`build_tiers`). The engine embeds a spec
(`EngineConfig.tiers`); the server fills one from its config file's and `serve` options'
tier keys, per arm."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .store import DeviceBlocks, KVStore

if TYPE_CHECKING:
    from ..cache.manager import KVCacheManager
    from .cost import PrefillSpeed
    from .hierarchy import TieredCache

MODES = ("exclusive", "write_through")


@dataclass(slots=True)
class TierSpec:
    # Which tiers, in this order under the device: host memory, local disk (survives a
    # restart), Redis (shared by replicas).
    host_blocks: int = 0  # >0: a host-memory tier of this many blocks
    disk_dir: str | None = None
    disk_bytes: int = 0
    redis_url: str | None = None
    redis_bytes: int = 0
    redis_cluster: bool = False  # the URL is a Redis Cluster node
    # Replicas on one Redis tier tell each other (pub/sub) which blocks they put there, so
    # any replica loads what another demoted (kvheat.tiers.shared; the server wires it).
    redis_shared: bool = True
    # Keys the MAC of every KV value read back from disk or Redis, and their key names
    # (codec.tier_key); None: the KVHEAT_TIER_SECRET environment variable, else a disk
    # folder's own key file and a per-process Redis key. Servers sharing a Redis (or a disk
    # folder) need the same one.
    secret: str | None = None
    # Separates engines that must not share lower-tier KV of one model (the server's arms).
    namespace: str = ""
    # How blocks move between them.
    mode: str = "exclusive"  # a block in one tier at a time; or "write_through"
    policy: str | None = None  # the lower tiers' eviction policy; None: the device's
    # Background demotion and prefetch loaders, and timing each tier once at start (with a
    # prefill speed); None: when a tier is slow (disk, Redis). Host only: synchronous
    # copies, always loaded (a memory copy beats recomputing, bench/tiers.py).
    async_io: bool | None = None
    calibrate: bool | None = None
    queue_size: int = 256  # pending demotions (each holds one block's bytes)
    load_workers: int = 2
    # A tier judged slower than recomputing gets no reads, so its estimate would never
    # change: after this long without a read, one block is loaded anyway to measure again.
    remeasure_s: float = 10.0

    def __post_init__(self) -> None:
        check_fields(self)
        if self.host_blocks < 0:
            raise ValueError("host_tier_blocks must be >= 0")
        if bool(self.disk_dir) != (self.disk_bytes > 0):
            raise ValueError("a disk tier needs both a folder (disk_tier_dir) and a size "
                             "(disk_tier_bytes > 0)")
        if bool(self.redis_url) != (self.redis_bytes > 0):
            raise ValueError("a Redis tier needs both a URL (redis_tier_url) and a size "
                             "(redis_tier_bytes > 0)")
        if self.mode not in MODES:
            raise ValueError(f"tier_mode must be exclusive or write_through, not {self.mode!r}")
        if self.secret is not None and len(self.secret.encode()) < 16:
            raise ValueError("tier_secret must have at least 16 bytes")
        if self.queue_size <= 0 or self.load_workers <= 0:
            raise ValueError("queue_size and load_workers must be positive")
        if self.disk_bytes < 0 or self.redis_bytes < 0:
            raise ValueError("tier sizes must be >= 0")
        if self.remeasure_s <= 0:
            raise ValueError("remeasure_s must be positive")

    @property
    def enabled(self) -> bool:
        """Is any lower tier configured?"""
        return self.host_blocks > 0 or bool(self.disk_dir) or bool(self.redis_url)

    def stores(self, device: DeviceBlocks, model_id: str) -> list[KVStore]:
        """The configured stores, top first, for blocks of `device` and KV of `model_id`
        (names the KV on disk and in Redis, so KV of other weights is never served)."""
        from .disk import DiskStore
        from .host import HostStore

        out: list[KVStore] = []
        if self.host_blocks > 0:
            out.append(HostStore(self.host_blocks * device.bytes_per_block,
                                 device.bytes_per_block))
        if self.namespace:
            model_id += "/" + self.namespace
        dtype = str(device.dtype).removeprefix("torch.")
        layout = f"{device.layout}-b{device.block_size}-{dtype}"
        if self.disk_dir:
            out.append(DiskStore(self.disk_dir, self.disk_bytes, model=model_id,
                                 layout=layout, secret=self.secret))
        if self.redis_url:
            from .redis_store import RedisStore, connect

            out.append(RedisStore(connect(self.redis_url, cluster=self.redis_cluster),
                                  self.redis_bytes, model=model_id, layout=layout,
                                  secret=self.secret))
        return out


def build_tiers(spec: TierSpec, mgr: KVCacheManager, device: DeviceBlocks, model_id: str,
                prefill_tokens_per_s: PrefillSpeed = None) -> TieredCache | None:
    """The tiers `spec` names under `mgr` and its `device` pool (None when it names none).
    With a slow tier, loads are made only where they beat the engine's measured
    `prefill_tokens_per_s`; host-only tiers always load."""
    from .hierarchy import TieredCache

    if not spec.enabled:
        return None
    stores = spec.stores(device, model_id)
    slow = any(not st.inline for st in stores)
    return TieredCache(mgr, device, stores, spec,
                       prefill_tokens_per_s=prefill_tokens_per_s if slow else None)


# ---- the one type check of every config dataclass ---------------------------------------
# (TierSpec here; the engine's, the server's and the router's configs call it too: this is
# the lowest package they all may import.) Driven by the fields' type hints, so a new field
# is checked as soon as it is declared. JSON, YAML and TOML give any type for any key: a
# string where a list belongs iterates as characters, "false" is a true string, 64.5
# blocks or an integer token fail far from the config, so each value must be exactly
# its declared type.


def check_fields(obj: Any, what: str = "", error: type[Exception] = ValueError,
                 skip: tuple[str, ...] = ()) -> None:
    """Raise `error` naming the first field of dataclass `obj` whose value is not of its
    declared type (see `type_ok`), prefixed by `what` (e.g. "tenant 'acme'")."""
    hints = _hints(type(obj))
    for f in fields(obj):
        if f.name not in skip:
            check_value(getattr(obj, f.name), hints[f.name], f.name, what, error)


def check_value(value: Any, tp: Any, name: str, what: str = "",
                error: type[Exception] = ValueError) -> None:
    """Raise `error` ("[what: ]name must be <tp>, not <value's type>") unless `value` is
    of type `tp`. The message names the value's type, never the value (it may be a
    secret)."""
    if not type_ok(value, tp):
        raise error(f"{what + ': ' if what else ''}{name} must be {describe_type(tp)}, "
                    f"not {_what_is(value, tp)}")


def type_ok(value: Any, tp: Any) -> bool:
    """Is `value` of type hint `tp`? int: an int, never a bool; float: a finite int or
    float, never a bool; bool: True or False only; str; None; X | Y; list[X];
    tuple[X, ...]; dict[K, V]; Any; any other class: an instance of it."""
    if tp is Any or tp is object:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return any(type_ok(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if origin is list:
        return isinstance(value, list) and all(type_ok(x, args[0]) for x in value)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(type_ok(x, args[0]) for x in value)
        return len(args) == len(value) and all(type_ok(x, a) for x, a in zip(value, args))
    if origin is dict:
        return isinstance(value, dict) and all(type_ok(k, args[0]) and type_ok(v, args[1])
                                               for k, v in value.items())
    if origin is not None:  # e.g. Callable[...]: the origin class only
        return isinstance(value, origin)
    return isinstance(value, tp)


def describe_type(tp: Any) -> str:
    """`tp` in words, for error messages: "an integer", "a list of strings", ..."""
    if tp is None or tp is type(None):
        return "null (unset)"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        parts = [describe_type(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return text + " (or unset)" if type(None) in args else text
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is list or origin is tuple:
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return f"a table of {_plural(args[0])} to {_plural(args[1])}"
    return _NAMES.get(tp, (f"a {getattr(tp, '__name__', tp)}",))[0]


_NAMES: dict[Any, tuple[str, str]] = {
    int: ("an integer", "integers"), float: ("a finite number", "finite numbers"),
    bool: ("true or false", "booleans"), str: ("a string", "strings"),
}


def _plural(tp: Any) -> str:
    if tp in _NAMES:
        return _NAMES[tp][1]
    if isinstance(tp, type) and hasattr(tp, "__dataclass_fields__"):
        return f"{tp.__name__} tables"
    return describe_type(tp)


def _what_is(value: Any, tp: Any = None) -> str:
    """`value`'s type in words; for a container of the type `tp` wants, the first wrong
    item's too (its type, never the value)."""
    if isinstance(value, (list, tuple, dict)) and tp is not None:
        wanted = [a for a in (typing.get_args(tp) if typing.get_origin(tp) in
                              (typing.Union, types.UnionType) else (tp,))
                  if typing.get_origin(a) in (list, tuple, dict)]
        for a in wanted:
            if not isinstance(value, typing.get_origin(a)):
                continue
            args = typing.get_args(a)
            text = "a table" if isinstance(value, dict) else "a list"
            if isinstance(value, dict):
                for k, v in value.items():
                    if not type_ok(k, args[0]):
                        return f"{text} with {_what_is(k, args[0])} as a key"
                    if not type_ok(v, args[1]):
                        return f"{text} with {_what_is(v, args[1])} as a value"
            else:
                for x in value:
                    if not type_ok(x, args[0]):
                        return f"{text} holding {_what_is(x, args[0])}"
    if value is None:
        return "null (unset)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value!r}"  # nan or inf: no secret, and the point of the message
    names = {int: "an integer", float: "a decimal number", str: "a string",
             list: "a list", tuple: "a list", dict: "a table"}
    for t, text in names.items():
        if isinstance(value, t):
            return text
    return f"a {type(value).__name__}"


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s evaluated field annotations (they are strings under `from __future__
    import annotations`), once per class."""
    h = _HINTS.get(cls)
    if h is None:
        h = _HINTS[cls] = typing.get_type_hints(cls)
    return h
