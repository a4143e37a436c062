"""Who is calling: API keys mapped to tenants, each with a quota, a priority class and allowed models.

`--api-keys FILE` (YAML or JSON; the operator mounts it from a Secret) lists tenants:

    tenants:
      - name: search                 # label on per-tenant metrics; [a-z0-9-], at most 63
        keys: ["sk-search-0a1b2c3d4e5f6a7b"]   # or "sha256:<hex of the key>" to keep no key in the file
        priority: interactive        # interactive (default) | batch
        tokens_per_minute: 600000    # omit for no quota
        models: ["bge-large"]        # omit (or "*") for every served model

A key is looked up by its SHA-256, so the comparison leaks nothing useful through timing and a file
may hold digests instead of keys. `--api-key KEY` is the one-tenant case (tenant `default`, no
quota, interactive, every model); with neither flag, every caller is tenant `default` unauthenticated.

A batch tenant's requests are all bulk work (served after interactive work, bounded by
--max-queue-seconds-bulk); an interactive tenant's are urgent or bulk by size, as without tenants.
Within a class the batch planner serves the tenant it has served least recently (core/batching.py),
so one tenant's backfill cannot hold back another tenant's requests of the same class.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from embedfleet.runtime.core.jobs import QueueFull
from embedfleet.runtime.core.quota import Bucket, Take, give_back, take

Priority = Literal["interactive", "batch"]
DEFAULT_TENANT = "default"
MIN_KEY_LENGTH = 16
SHA256_PREFIX = "sha256:"


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the entry."""


class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
                      description="tenant name: metric label and job owner")
    keys: list[str] = Field(min_length=1, description="API keys, or sha256:<hex> digests of them")
    priority: Priority = "interactive"
    tokens_per_minute: int | None = Field(None, ge=1, description="quota per replica; omit for none")
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1, description="served model names or *")

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key.startswith(SHA256_PREFIX):
                digest = key[len(SHA256_PREFIX):]
                if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                    raise ValueError("a sha256: key must be 64 lower-case hex digits")
            elif len(key) < MIN_KEY_LENGTH or not key.isprintable() or " " in key:
                raise ValueError(f"keys must be at least {MIN_KEY_LENGTH} printable characters without spaces")
        return keys


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[TenantSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        names = [t.name for t in self.tenants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tenant names must be unique: {', '.join(twice)}")
        owners: dict[str, str] = {}
        for t in self.tenants:
            for key in t.keys:
                digest = key_digest(key)
                if digest in owners:
                    raise ValueError(f"one key is listed for both {owners[digest]!r} and {t.name!r}")
                owners[digest] = t.name
        return self


def key_digest(key: str) -> str:
    """The hex SHA-256 a key is looked up by (a `sha256:` entry already is one)."""
    if key.startswith(SHA256_PREFIX):
        return key[len(SHA256_PREFIX):]
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Tenant:
    name: str
    priority: Priority = "interactive"
    tokens_per_minute: int | None = None
    models: frozenset[str] = frozenset({"*"})
    bucket: Bucket | None = field(default=None, repr=False)

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    @property
    def interactive(self) -> bool:
        return self.priority == "interactive"

    def take(self, tokens: int, now: float | None = None) -> Take | None:
        """Charge `tokens` against the quota: None when the tenant has none, else the outcome."""
        if self.tokens_per_minute is None:
            return None
        now = time.monotonic() if now is None else now
        if self.bucket is None:
            self.bucket = Bucket.full(self.tokens_per_minute, now)
        outcome = take(self.bucket, tokens, now)
        self.bucket = outcome.bucket
        return outcome

    def give_back(self, tokens: int, now: float | None = None) -> None:
        if self.bucket is not None:
            self.bucket = give_back(self.bucket, tokens, time.monotonic() if now is None else now)

    def charge(self, tokens: int) -> bool:
        """Take `tokens` from the quota or raise QuotaExceeded / RequestOverQuota; True when anything was
        taken (so the caller gives it back if the work is then refused)."""
        outcome = self.take(tokens)
        if outcome is None:
            return False
        if outcome.never:
            raise RequestOverQuota(self.name, tokens, self.tokens_per_minute or 0)
        if not outcome.ok:
            raise QuotaExceeded(self.name, tokens, self.tokens_per_minute or 0, outcome.retry_after)
        return True


class Tenants:
    """Every tenant, and the lookup from an `Authorization` header to one."""

    def __init__(self, tenants: list[Tenant], by_digest: dict[str, Tenant], open_access: bool) -> None:
        self.all = {t.name: t for t in tenants}
        self._by_digest = by_digest
        self.open_access = open_access  # no key configured: everyone is the default tenant

    @classmethod
    def open(cls) -> Tenants:
        default = Tenant(DEFAULT_TENANT)
        return cls([default], {}, open_access=True)

    @classmethod
    def single_key(cls, key: str) -> Tenants:
        default = Tenant(DEFAULT_TENANT)
        return cls([default], {key_digest(key): default}, open_access=False)

    @classmethod
    def from_file(cls, path: Path) -> Tenants:
        import yaml  # here, not at the top: a server without a keys file never pays for its import

        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise KeysFileError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:  # the problem and where, never the snippet (it may hold a key)
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise KeysFileError(f"the API keys file {path} is not YAML or JSON{where}: "
                                f"{getattr(exc, 'problem', None) or type(exc).__name__}") from None
        try:
            parsed = KeysFile.model_validate(raw)
        except ValidationError as exc:
            where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise KeysFileError(f"the API keys file {path} is invalid: {where}") from None
        tenants, by_digest = [], {}
        for spec in parsed.tenants:
            tenant = Tenant(spec.name, spec.priority, spec.tokens_per_minute, frozenset(spec.models))
            tenants.append(tenant)
            for key in spec.keys:
                by_digest[key_digest(key)] = tenant
        return cls(tenants, by_digest, open_access=False)

    def identify(self, authorization: bytes | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header, or None (refuse with 401)."""
        if self.open_access:
            return self.all[DEFAULT_TENANT]
        if not authorization or not authorization.startswith(b"Bearer "):
            return None
        key = authorization[len(b"Bearer "):].strip()
        return self._by_digest.get(hashlib.sha256(key).hexdigest())

    def job_owner(self, name: str) -> Tenant:
        """The tenant an async job runs as. A job outlives configuration: if its tenant has since left
        the keys file, it still runs (accepted work is never dropped) as batch work without a quota."""
        return self.all.get(name or DEFAULT_TENANT) or Tenant(name, priority="batch")


class QuotaExceeded(QueueFull):
    """The tenant's tokens-per-minute quota is spent for now (429 with Retry-After; async jobs wait)."""

    def __init__(self, tenant: str, tokens: int, quota: int, retry_after: int) -> None:
        super().__init__(f"tenant {tenant!r} is over its quota of {quota} tokens per minute (this request: "
                         f"{tokens} tokens); retry in {retry_after}s", retry_after=retry_after, reason="quota")


class RequestOverQuota(ValueError):
    """One request needs more tokens than the tenant's whole per-minute quota: no wait helps (413)."""

    def __init__(self, tenant: str, tokens: int, quota: int) -> None:
        super().__init__(f"this request needs {tokens} tokens, more than tenant {tenant!r}'s whole quota of "
                         f"{quota} tokens per minute; split it")
