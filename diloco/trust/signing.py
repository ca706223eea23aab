"""Delta signing: HMAC-SHA256 over (run, learner, seq, the delta's bytes) with the learner's own key, stored
beside the delta as deltas/<learner>/<seq>.sig; the merger's keyring verifies it.

Contract: keys come from the environment (DILOCO_SIGNING_KEY for a learner, DILOCO_KEYRING for the merger and
audit) or from a Prefect Secret block named by DILOCO_SIGNING_KEY_BLOCK / DILOCO_KEYRING_BLOCK (loaded by the
caller's `load_block`, so this module imports no Prefect) — never from the bucket; a key is at least 16 bytes;
`verify` returns a reason (a rejection) or "" (good); comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable, Mapping

ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
KEY_ENV, KEY_BLOCK_ENV = "DILOCO_SIGNING_KEY", "DILOCO_SIGNING_KEY_BLOCK"
KEYRING_ENV, KEYRING_BLOCK_ENV = "DILOCO_KEYRING", "DILOCO_KEYRING_BLOCK"
MAX_SIG_BYTES = 4096


class SigningError(ValueError):
    """A key or keyring is missing or malformed; the message says which variable and what is wrong."""


def _check_key(key: str, what: str) -> bytes:
    raw = key.encode()
    if len(raw) < MIN_KEY_BYTES:
        raise SigningError(f"{what} is {len(raw)} bytes: a signing key needs at least {MIN_KEY_BYTES} "
                           "(make one with `diloco keygen`)")
    return raw


def new_key() -> str:
    """A fresh random key: 32 bytes, hex."""
    return secrets.token_hex(32)


def _message(run_id: str, learner: str, seq: int, data: bytes) -> bytes:
    return f"diloco-delta-v1\n{run_id}\n{learner}\n{seq}\n".encode() + hashlib.sha256(data).digest()


def sign(key: bytes, run_id: str, learner: str, seq: int, data: bytes) -> bytes:
    """The signature object's bytes for one delta (small JSON)."""
    mac = hmac.new(key, _message(run_id, learner, seq, data), hashlib.sha256).hexdigest()
    return json.dumps({"alg": ALGORITHM, "learner": learner, "seq": seq, "mac": mac}, sort_keys=True).encode()


def verify(keys: list[bytes], run_id: str, learner: str, seq: int, data: bytes,
           signature: bytes | None) -> str:
    """"" when `signature` is a valid signature of `data` under one of the learner's keys, else the reason."""
    if signature is None:
        return "unsigned: no signature object beside the delta"
    if not keys:
        return f"signature: no key for learner {learner} in the merger's keyring"
    if len(signature) > MAX_SIG_BYTES:
        return f"signature: object of {len(signature)} bytes is not a signature"
    try:
        obj = json.loads(signature)
    except ValueError:
        return "signature: not valid JSON"
    if not isinstance(obj, dict) or obj.get("alg") != ALGORITHM or not isinstance(obj.get("mac"), str):
        return f"signature: not an {ALGORITHM} signature"
    message = _message(run_id, learner, seq, data)
    for key in keys:
        if hmac.compare_digest(hmac.new(key, message, hashlib.sha256).hexdigest(), obj["mac"]):
            return ""
    return "signature: does not match the delta under the learner's key"


BlockLoader = Callable[[str], str]


def _from_env_or_block(env: Mapping[str, str], var: str, block_var: str, load_block: BlockLoader | None,
                       what: str) -> str | None:
    if env.get(var):
        return env[var]
    if env.get(block_var):
        if load_block is None:
            raise SigningError(f"{block_var} is set but Prefect Secret blocks cannot be read here")
        return load_block(env[block_var])
    return None


def learner_key(env: Mapping[str, str] | None = None, load_block: BlockLoader | None = None) -> bytes:
    """This learner's key: DILOCO_SIGNING_KEY, or the Secret block named by DILOCO_SIGNING_KEY_BLOCK."""
    env = os.environ if env is None else env
    key = _from_env_or_block(env, KEY_ENV, KEY_BLOCK_ENV, load_block, "key")
    if key is None:
        raise SigningError(f"learner.sign is on but this learner has no key: set {KEY_ENV} "
                           f"or {KEY_BLOCK_ENV} (a Prefect Secret block)")
    return _check_key(key, KEY_ENV)


def parse_keyring(text: str, what: str = KEYRING_ENV) -> dict[str, list[bytes]]:
    """A keyring: a JSON object learner -> key (or a list of keys, to rotate without a gap)."""
    try:
        obj = json.loads(text)
    except ValueError as err:
        raise SigningError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise SigningError(f"{what} must be a JSON object learner -> key")
    ring: dict[str, list[bytes]] = {}
    for learner, value in obj.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) for v in values):
            raise SigningError(f"{what}[{learner!r}] must be a key or a list of keys (strings)")
        ring[str(learner)] = [_check_key(v, f"{what}[{learner!r}]") for v in values]
    return ring


def load_keyring(env: Mapping[str, str] | None = None, load_block: BlockLoader | None = None,
                 required: bool = True) -> dict[str, list[bytes]] | None:
    """The merger's keyring: DILOCO_KEYRING, or the Secret block named by DILOCO_KEYRING_BLOCK; None when
    neither is set and not `required`."""
    env = os.environ if env is None else env
    text = _from_env_or_block(env, KEYRING_ENV, KEYRING_BLOCK_ENV, load_block, "keyring")
    if text is None:
        if required:
            raise SigningError(f"learner.sign is on but the merger has no keyring: set {KEYRING_ENV} "
                               f"(JSON learner -> key) or {KEYRING_BLOCK_ENV} (a Prefect Secret block)")
        return None
    return parse_keyring(text)
