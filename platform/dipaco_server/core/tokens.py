"""Bearer secrets: generated with `secrets`, stored only as sha256, compared in constant time.

A plaintext token is shown once, when it is made; the database holds its sha256,
so a leaked database reveals no usable token. Lookups go by the hash (an index
hit that leaks nothing about the secret); `token_matches` is for comparing one
secret against one stored hash.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

# 32 random bytes (256 bits): the size Django and healthchecks use for API keys.
TOKEN_BYTES = 32
# A prefix names the kind of secret in logs and leak scanners without revealing it.
WORKER_PREFIX = "dpw_"
ENROLLMENT_PREFIX = "dpe_"
LEASE_PREFIX = "dpl_"
MAX_TOKEN_LENGTH = 256


def generate_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(TOKEN_BYTES)


def hash_token(token: str) -> str:
    """sha256 hex of the token; a token needs no salt, it is random and long."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def token_matches(token: str, stored_hash: str) -> bool:
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_LENGTH:
        return False
    return hmac.compare_digest(hash_token(token), stored_hash)
