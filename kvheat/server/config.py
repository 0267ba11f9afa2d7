"""Server configuration: the model, the cache, tenants and A/B arms.

A config file (TOML or YAML) holds the same keys as `ServerConfig`, with tenants and arms
as lists of tables:

    admin_token = "change-me"
    num_blocks = 512

    [[tenants]]
    name = "acme"                       # letters, digits, '_', '.', '-' (not "none")
    api_keys = ["sk-acme-1"]            # a list, even for one key
    quota_blocks = 128                  # blocks of each arm's pool; fair sharing under contention
    share_group = "corp"                # optional: tenants of one group reuse each other's KV
    temperature = 0.7                   # sampling defaults (docs/server.md, "Tenants")
    logit_bias = { "13" = -100.0 }

    [[arms]]
    name = "lru"
    share = 50                          # percent of users, by hash(user) % 100
    policy = "lru"

Without tenants, the API is open and nothing is salted; with tenants, every request needs
one of their keys and each tenant's blocks are salted by its name (no cross-tenant reuse),
or by its `share_group`'s: tenants of one group see each other's blocks. A router in front
(`kvheat route --config` this file) reads the same tenants, keys and groups, so it keys
prompts as these replicas do.

Every key's value must have exactly the type its field declares (`check_fields`: an
integer is never 64.5 or true, a flag never "false", a list never a bare string), else
the config is refused with one line naming the key.
"""

from __future__ import annotations

import json
import os
import re
import sys
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..checks import check_fields, check_value
from ..checks import parse_size as checks_parse_size
from ..tiers.spec import TierSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad server configuration (file or options)."""


# Tenant names are hash salts, path segments of the admin API (/admin/tenants/NAME/...)
# and, with a metrics token, metric label values: a safe charset, and never a word that
# means "no tenant" there (the admin API reads "none" so, and requests without a tenant
# are labelled "none"; "unknown" labels a name the metrics do not know).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
NO_TENANT_LABEL = "none"
UNKNOWN_TENANT_LABEL = "unknown"
RESERVED_TENANT_NAMES = frozenset({NO_TENANT_LABEL, "null", UNKNOWN_TENANT_LABEL})
# Metric labels of tenants without a metrics token: `metrics_label`, else tenant-<i>.
GENERATED_LABEL_RE = re.compile(r"tenant-[0-9]+")
# API keys and bearer tokens travel in an HTTP header, compared after stripping: visible
# ASCII only, else the key could never be sent or never match.
TOKEN_RE = re.compile(r"[\x21-\x7e]+")
MIN_SECRET_BYTES = 16
EVENTS_SECRET_ENV = "KVHEAT_EVENTS_SECRET"
SELF_HEAL_MODES = ("off", "on", "dry-run")


def check_name(value: str, what: str, reserved: bool = True) -> None:
    """A tenant name or metric label: NAME_RE, and not a reserved word (any case)."""
    if not NAME_RE.fullmatch(value):
        raise ConfigError(f"{what} {value!r}: use 1-64 letters, digits, '_', '.', '-' "
                          f"(starting with a letter or digit)")
    if reserved and value.lower() in RESERVED_TENANT_NAMES:
        raise ConfigError(f"{what} {value!r} is reserved (it means no tenant in the admin "
                          f"API and the metrics); choose another")


def check_secret(value: str | None, name: str, error: type[Exception] = ValueError) -> None:
    """A shared secret: None (unset) or a string of at least MIN_SECRET_BYTES bytes."""
    check_value(value, str | None, name, error=error)
    if value is not None and len(value.encode()) < MIN_SECRET_BYTES:
        raise error(f"{name} must have at least {MIN_SECRET_BYTES} bytes")


def secret_from_env(name: str = EVENTS_SECRET_ENV,
                    error: type[Exception] = ValueError) -> str | None:
    """The secret in environment variable `name` (unset or empty: None), checked."""
    value = os.environ.get(name) or None
    check_secret(value, f"${name}", error)
    return value


@dataclass(slots=True)
class TenantConfig:
    """One tenant: its API keys, block quota, sampling defaults, metrics label, priority."""

    name: str
    api_keys: list[str]
    quota_blocks: int | None = None  # per arm; None: no quota
    # Sampling defaults, used where a request leaves them out.
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Its label in /metrics when no metrics_token is set (else the name is): None:
    # tenant-<i>, its position in the config. /metrics needs no key then, and must not
    # tell who the tenants are.
    metrics_label: str | None = None
    # Tenants with the same share group are salted alike (kvheat.cache.hashing.tenant_salt):
    # each reuses the others' cached prefixes. None: salted by its own name.
    share_group: str | None = None
    # Under overload, self-healing (self_heal) refuses the lowest priority first.
    priority: int = 0

    def __post_init__(self) -> None:
        check_value(self.name, str, "name", "a tenant", ConfigError)
        if not self.name:
            raise ConfigError("a tenant needs a non-empty name")
        check_name(self.name, "tenant name")
        what = f"tenant {self.name!r}"
        if isinstance(self.logit_bias, dict):
            # Keys in decimal only: int() would also read "5_0" as 50. Config files give
            # them as strings (TOML, JSON) or integers (YAML).
            if any(isinstance(k, bool) or not re.fullmatch(r"[0-9]{1,10}", str(k))
                   for k in self.logit_bias):
                raise ConfigError(f"{what}: logit_bias maps token ids to numbers")
            self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
        check_fields(self, what, ConfigError)
        self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()}
        if not self.api_keys:
            raise ConfigError(f"{what} needs at least one api key")
        if not all(TOKEN_RE.fullmatch(k) for k in self.api_keys):
            raise ConfigError(f"{what}: api keys must be non-empty, of visible ASCII "
                              f"characters, without spaces")
        if self.quota_blocks is not None and not 1 <= self.quota_blocks <= 2**31 - 1:
            raise ConfigError(f"{what}: quota_blocks must be an integer in [1, 2**31 - 1]")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise ConfigError(f"tenant {self.name!r}: temperature must be in [0, 2]")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"tenant {self.name!r}: top_p must be in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"tenant {self.name!r}: max_tokens must be at least 1")
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ConfigError(f"tenant {self.name!r}: logit_bias values must be in [-100, 100]")
        if self.share_group is not None:
            check_name(self.share_group, f"{what}: share_group", reserved=False)
        if self.metrics_label is not None:
            check_name(self.metrics_label, f"{what}: metrics_label")
            if GENERATED_LABEL_RE.fullmatch(self.metrics_label):
                raise ConfigError(f"{what}: metrics_label {self.metrics_label!r} looks like "
                                  f"the label of a tenant without one (tenant-<i>)")


@dataclass(slots=True)
class ArmConfig:
    """One A/B arm: its share of users, eviction policy, pool and prefix caching."""

    name: str
    share: int  # percent of users (the arms' shares add up to 100)
    policy: str = "kvheat"
    num_blocks: int | None = None  # None: the server's num_blocks
    host_tier_blocks: int | None = None  # None: the server's host_tier_blocks
    prefix_caching: str = "block"  # "block", "exact" or "off"
    priority: int = 0  # ranks after the tenant's priority when self-healing sheds load

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*",
                                                               self.name):
            raise ConfigError(f"an arm needs a name of letters, digits, '_', '.', '-' "
                              f"(it names metrics and a disk tier folder), not {self.name!r}")
        check_fields(self, f"arm {self.name!r}", ConfigError)
        if not 0 <= self.share <= 100:
            raise ConfigError(f"arm {self.name!r}: share must be an integer percent in [0, 100]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"arm {self.name!r}: num_blocks must be positive")
        if self.host_tier_blocks is not None and self.host_tier_blocks < 0:
            raise ConfigError(f"arm {self.name!r}: host_tier_blocks must be >= 0")
        if self.prefix_caching not in ("block", "exact", "off"):
            raise ConfigError(f"arm {self.name!r}: prefix_caching must be block, exact or off")


@dataclass(slots=True)
class ServerConfig:
    """The server's configuration: model, pool, tiers, arms, tenants, limits, listeners."""

    model: str | None = None  # a local Hugging Face directory; None: the built-in tiny model
    family: str = "llama"  # the built-in model's family (llama, qwen3, deepseek)
    served_model_name: str | None = None
    seed: int = 0
    num_blocks: int = 512
    block_size: int = 16
    # Lower KV tiers under each arm's device pool (kvheat.tiers.TierSpec). In a config
    # file and as `serve` options they are flat keys (TIER_KEYS); sizes in bytes or as
    # "64GiB", "500MB". Each arm gets its own disk folder and Redis namespace (`arm_tiers`).
    tiers: TierSpec = field(default_factory=TierSpec)
    policy: str = "kvheat"  # the single arm's policy when no arms are configured
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    default_max_tokens: int = 64  # when a request gives none
    max_tokens_limit: int | None = None  # a cap on max_tokens (None: the context length)
    max_queued_requests: int = 1024  # more in flight: 503, the client retries
    # HTTP requests open at once, of any kind but /health and /metrics, counted from
    # before the body is read (kvheat/server/concurrency.py): more get 503 with their body
    # unread, so at most this many bodies (each up to max_body_bytes) are held. None:
    # max_queued_requests + 1024 (room for requests being read, the admin API and such).
    max_concurrent_requests: int | None = None
    max_body_bytes: int | str = "8MiB"  # larger request bodies: 413, never read whole
    # The body bytes those open requests may bring, together (each its Content-Length, or
    # max_body_bytes when it gives none): past it 503, body unread. At least max_body_bytes.
    max_in_flight_bytes: int | str = "1GiB"
    # On shutdown (SIGTERM): requests in flight get this long to finish, then end with an
    # error (streams: a final error event). Keep k8s terminationGracePeriodSeconds above it.
    drain_timeout_s: float = 25.0
    threads: int | None = None  # torch intra-op threads for the engine
    # CPUs the engine thread runs on (as vLLM's VLLM_CPU_OMP_THREADS_BIND); None: any.
    # The HTTP side stays unpinned.
    engine_cores: list[int] | None = None
    admin_token: str | None = None  # None: the admin API is off
    otlp_endpoint: str | None = None  # OTLP/HTTP traces endpoint; None: tracing off
    # KV events (vLLM 0.32's schema, kvheat.kvevents) on a ZMQ PUB socket bound here, e.g.
    # "tcp://*:5557", and a replay socket (ROUTER) for subscribers that missed batches;
    # None: no events. Token ids go out only with kv_events_token_ids (operator mode).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_token_ids: bool = False
    kv_events_queue: int = 100_000  # events waiting to be sent; more are dropped, counted
    # Bytes of sent batches kept for subscribers' replays (as well as 10,000 batches): the
    # oldest go first; a subscriber that missed them resyncs from a snapshot.
    kv_events_buffer_bytes: int | str = "256MiB"
    # Keys the KV events' block hashes and authenticates the event sockets (at least 16
    # bytes); None: $KVHEAT_EVENTS_SECRET where the publisher reads it. Routers need the same.
    kv_events_secret: str | None = None
    # With it, /metrics needs `Authorization: Bearer <metrics_token>` and labels tenants by
    # name; without it /metrics is open and tenants are labelled by `metrics_label` or
    # tenant-<i> (never by name).
    metrics_token: str | None = None
    # Kernel network signals per peer in /metrics (kvheat/server/netsignals.py): TCP
    # retransmits, RTT, TIME_WAIT/CLOSE_WAIT sockets, listen-queue overflows.
    net_signals: bool = True
    # With net_signals: per-peer retransmits from eBPF too (bpftrace on tcp_retransmit_skb,
    # where it can run; kvheat_net_ebpf_state says why not), beside sock_diag and /proc.
    net_signals_ebpf: bool = True
    # Guarded self-healing (kvheat/server/selfheal.py, docs/operations.md "Self-healing"):
    # "off"; "on": every self_heal_interval_s, score this server's own metrics as `kvheat
    # doctor` does and act (bypass a failing or slow tier, shed the lowest priority,
    # recalibrate load-or-recompute, raise the autoscaler's signal); "dry-run": only
    # report what it would do.
    self_heal: str = "off"
    self_heal_interval_s: float = 2.0
    # Hysteresis: an action in force lasts at least this long, and ends only once its
    # cause has been gone this long (a bypassed tier: its probes pass self_heal_probe_ok
    # times in a row).
    self_heal_hold_s: float = 10.0
    self_heal_min_gap_s: float = 10.0  # the same action on the same tier: at most this often
    self_heal_probe_ok: int = 3
    tenants: list[TenantConfig] = field(default_factory=list)
    arms: list[ArmConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, TierSpec):
            raise ConfigError("tiers must be a TierSpec (config files use the flat tier keys)")
        if isinstance(self.engine_cores, str):
            self.engine_cores = parse_cores(self.engine_cores)
        for name, cls in (("tenants", TenantConfig), ("arms", ArmConfig)):
            items = getattr(self, name)
            check_value(items, list, name, error=ConfigError)
            what = name[:-1]
            setattr(self, name, [x if isinstance(x, cls) else _build(cls, x, what)
                                 for x in items])
        check_fields(self, error=ConfigError)
        if self.num_blocks < 1 or self.block_size < 1:
            raise ConfigError("num_blocks and block_size must be positive")
        if not 0 <= self.seed <= 2**63 - 1:
            raise ConfigError("seed must be in [0, 2**63 - 1]")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be at least 1")
        for name in ("admin_token", "metrics_token"):
            v = getattr(self, name)
            if v and not TOKEN_RE.fullmatch(v):
                raise ConfigError(f"{name} must be visible ASCII characters without spaces")
        if self.metrics_token == "":
            raise ConfigError("metrics_token must not be empty (leave it out for an open "
                              "/metrics without tenant names)")
        check_secret(self.kv_events_secret, "kv_events_secret", ConfigError)
        if self.engine_cores is not None:
            known = os.sched_getaffinity(0)
            bad = [c for c in self.engine_cores if c not in known]
            if not self.engine_cores or bad:
                raise ConfigError(f"engine_cores {self.engine_cores}: this process may run on "
                                  f"CPUs {sorted(known)} only")
        self.max_body_bytes = parse_size(self.max_body_bytes, "max_body_bytes")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1KiB")
        self.max_in_flight_bytes = parse_size(self.max_in_flight_bytes, "max_in_flight_bytes")
        if self.max_in_flight_bytes < self.max_body_bytes:
            raise ConfigError(f"max_in_flight_bytes ({self.max_in_flight_bytes}) must be at "
                              f"least max_body_bytes ({self.max_body_bytes})")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens must be at least 1")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ConfigError("max_tokens_limit must be at least 1")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ConfigError("drain_timeout_s must be in [0, 3600]")
        if self.max_queued_requests < 1:
            raise ConfigError("max_queued_requests must be at least 1")
        if self.max_concurrent_requests is None:
            self.max_concurrent_requests = self.max_queued_requests + 1024
        if self.max_concurrent_requests < self.max_queued_requests:
            raise ConfigError(f"max_concurrent_requests ({self.max_concurrent_requests}) must "
                              f"be at least max_queued_requests ({self.max_queued_requests}),"
                              " or the queue bound never applies")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            v = getattr(self, name)
            if v is not None and not re.fullmatch(r"(tcp://[^\s/]+:[0-9]+|ipc://\S+|inproc://\S+)",
                                                  v):
                raise ConfigError(f"{name} must be a ZMQ address such as tcp://*:5557, "
                                  f"not {v!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_queue < 1:
            raise ConfigError("kv_events_queue must be at least 1")
        self.kv_events_buffer_bytes = parse_size(self.kv_events_buffer_bytes,
                                                 "kv_events_buffer_bytes")
        if self.kv_events_buffer_bytes < 1:
            raise ConfigError("kv_events_buffer_bytes must be at least 1 byte")
        if self.self_heal not in SELF_HEAL_MODES:
            raise ConfigError(f"self_heal must be one of {', '.join(SELF_HEAL_MODES)}, not "
                              f"{self.self_heal!r}")
        for name in ("self_heal_interval_s", "self_heal_hold_s", "self_heal_min_gap_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ConfigError(f"{name} must be in (0, 3600]")
        if self.self_heal_probe_ok < 1:
            raise ConfigError("self_heal_probe_ok must be at least 1")
        seen_keys: set[str] = set()
        names: set[str] = set()
        for t in self.tenants:
            if t.name in names:
                raise ConfigError(f"tenant {t.name!r} is defined twice")
            names.add(t.name)
            for k in set(t.api_keys):
                if k in seen_keys:
                    raise ConfigError("an api key is given to two tenants")
                if k in (self.admin_token, self.metrics_token):
                    raise ConfigError(f"tenant {t.name!r}: an api key is the admin or "
                                      f"metrics token")
                seen_keys.add(k)
        labels = list(self.tenant_labels().values())
        if len(set(labels)) != len(labels):
            raise ConfigError("two tenants have the same metrics_label")
        if self.arms:
            arm_names = [a.name for a in self.arms]
            if len(set(arm_names)) != len(arm_names):
                raise ConfigError("arm names must be unique")
            total = sum(a.share for a in self.arms)
            if total != 100:
                raise ConfigError(f"the arms' shares add up to {total}, not 100")

    def arm_tiers(self, arm: ArmConfig) -> TierSpec:
        """An arm's tiers: its own host tier size, disk folder and Redis namespace.

        Arms never share lower-tier KV: it would blur the A/B comparison."""
        t = self.tiers
        return replace(t, host_blocks=t.host_blocks if arm.host_tier_blocks is None
                       else arm.host_tier_blocks,
                       disk_dir=str(Path(t.disk_dir) / arm.name) if t.disk_dir else None,
                       namespace=arm.name)

    def tenant_labels(self) -> dict[str, str]:
        """Tenant name -> its label value in /metrics.

        The name when a metrics token guards /metrics, else its `metrics_label`, else
        tenant-<i> (its position here). Requests without a tenant are labelled
        NO_TENANT_LABEL ("none")."""
        if self.metrics_token:
            return {t.name: t.name for t in self.tenants}
        return {t.name: t.metrics_label or f"tenant-{i}" for i, t in enumerate(self.tenants)}

    @property
    def share_groups(self) -> dict[str, str]:
        """Tenant name -> its share group, for the tenants in one.

        As `CacheConfig` and a router take them."""
        return {t.name: t.share_group for t in self.tenants if t.share_group is not None}

    @property
    def arm_list(self) -> list[ArmConfig]:
        """The configured arms, or one arm with the server's policy."""
        return self.arms or [ArmConfig("default", 100, self.policy)]

    @property
    def model_name(self) -> str:
        """The name the server answers to: the configured one, else the model folder's."""
        if self.served_model_name:
            return self.served_model_name
        if self.model:
            return Path(self.model).name or str(self.model)
        return f"kvheat-tiny-{self.family}"


def _build(cls: type, data: Any, what: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"each {what} must be a table/mapping, not {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) if re.fullmatch(r"[\w.-]+", str(k)) else repr(k)
                     for k in set(data) - known)  # one line, whatever the file holds
    if unknown:
        raise ConfigError(f"unknown {what} key(s): {', '.join(unknown)}")
    required = [f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        name = data.get("name")
        who = f"{what} {name!r}" if isinstance(name, str) else f"a {what}"
        raise ConfigError(f"{who} needs the key(s): {', '.join(missing)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ConfigError(f"bad {what}: {e}") from None


def parse_size(value: int | str, name: str) -> int:
    """Bytes from an int or a string such as "64GiB" (`checks.parse_size`), as a ConfigError."""
    return checks_parse_size(value, name, ConfigError)


def parse_cores(text: str) -> list[int]:
    """The CPU numbers of a list such as "0", "0,2", "0-3" or "0-1,4"."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"engine_cores {text!r}: give CPUs as 0,1 or 0-3") from None
    return out


def load_config(path: str | Path | None = None, *, this_host: bool = True,
                **overrides: Any) -> ServerConfig:
    """A `ServerConfig` from a TOML, YAML or JSON file, then `overrides`.

    `overrides` are options given on the command line; None values are skipped.
    `this_host=False`: the config is read elsewhere (a router reading its replicas'
    tenants), so what only the serving host can check (engine_cores against this process's
    CPUs) is checked for its type only."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config {p}: {e}") from None
        try:
            if p.suffix == ".toml":
                data = tomllib.loads(text)
            elif p.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text) or {}
            elif p.suffix == ".json":
                data = json.loads(text)
            else:
                raise ConfigError(f"config {p}: use a .toml, .yaml, .yml or .json file")
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config {p}: {e}") from None
        except ImportError:
            raise ConfigError("YAML configs need pyyaml (pip install pyyaml)") from None
        except Exception as e:  # yaml.YAMLError and friends
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config {p}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {p} must hold a mapping at the top")
    data.update({k: v for k, v in overrides.items() if v is not None})
    if "tiers" in data:
        raise ConfigError("give the tier keys flat (host_tier_blocks, disk_tier_dir, ...)")
    if not this_host and data.get("engine_cores") is not None:
        cores = data.pop("engine_cores")
        if isinstance(cores, str):
            parse_cores(cores)
        else:
            check_value(cores, list[int], "engine_cores", error=ConfigError)
    data["tiers"] = tier_spec({k: data.pop(k) for k in list(data) if k in TIER_KEYS})
    return _build(ServerConfig, data, "server config")


# The tier keys of a config file and the `serve` options -> their TierSpec fields.
TIER_KEYS = {"host_tier_blocks": "host_blocks", "disk_tier_dir": "disk_dir",
             "disk_tier_bytes": "disk_bytes", "redis_tier_url": "redis_url",
             "redis_tier_bytes": "redis_bytes", "redis_cluster": "redis_cluster",
             "redis_tier_shared": "redis_shared", "tier_mode": "mode", "tier_secret": "secret"}


def tier_spec(keys: dict[str, Any]) -> TierSpec:
    """A `TierSpec` from flat tier keys (TIER_KEYS), sizes read with `parse_size`.

    Each key is type-checked (and named in errors) as the config spells it."""
    hints = typing.get_type_hints(TierSpec)
    for k, v in keys.items():
        if not k.endswith("_bytes"):
            check_value(v, hints[TIER_KEYS[k]], k, error=ConfigError)
    spec: dict[str, Any] = {TIER_KEYS[k]: parse_size(v, k) if k.endswith("_bytes") else v
                            for k, v in keys.items()}
    try:
        return TierSpec(**spec)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
