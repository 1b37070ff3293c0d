"""Verification of EKS bearer tokens, as the EKS control plane's authenticator checks their form.

An EKS token is ``k8s-aws-v1.`` followed by the unpadded base64url encoding
of a presigned STS ``GetCallerIdentity`` URL whose signature covers the
``x-k8s-aws-id`` header (the cluster name). The stand-in cannot call STS to
check the signature itself, so it checks everything else a real cluster
would refuse: the prefix, the encoding, the action, SigV4 query parameters,
that ``x-k8s-aws-id`` is among the signed headers, and the expiry.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

TOKEN_PREFIX = "k8s-aws-v1."
# The authenticator refuses presigned URLs that claim to live longer than this.
MAX_EXPIRES_SECONDS = 15 * 60
# Tolerated clock skew for a token dated in the future.
CLOCK_SKEW_SECONDS = 5 * 60
_REQUIRED = (
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
)


class TokenRejected(Exception):
    """The bearer token is missing, malformed or expired; the message says which (the server answers 401)."""


@dataclass(frozen=True)
class Caller:
    """Who a verified token says the caller is."""

    access_key_id: str
    region: str
    expires_at: dt.datetime
    # Signed with temporary credentials (X-Amz-Security-Token), as an assumed role such as a Lambda function's is.
    temporary: bool = False


def verify_authorization(header: str | None, now: dt.datetime | None = None) -> Caller:
    """Check an ``Authorization`` header carrying an EKS bearer token.

    Returns the caller's access key and region; raises TokenRejected naming
    what is wrong.
    """
    if not header:
        raise TokenRejected("no Authorization header")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise TokenRejected("the Authorization header is not a bearer token")
    return verify_token(token.strip(), now)


def verify_token(token: str, now: dt.datetime | None = None) -> Caller:
    """Check one ``k8s-aws-v1.`` token (see the module docstring); raises TokenRejected."""
    if not token.startswith(TOKEN_PREFIX):
        raise TokenRejected(f"the token does not start with {TOKEN_PREFIX!r}")
    encoded = token[len(TOKEN_PREFIX) :]
    if "=" in encoded:
        raise TokenRejected("the token is padded base64; EKS tokens are unpadded base64url")
    try:
        url = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise TokenRejected(f"the token is not base64url of a URL: {exc}") from exc
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.netloc:
        raise TokenRejected("the token does not decode to an STS URL")
    query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    if query.get("Action") != "GetCallerIdentity":
        raise TokenRejected("the presigned URL is not an STS GetCallerIdentity request")
    missing = [name for name in _REQUIRED if not query.get(name)]
    if missing:
        raise TokenRejected(f"the presigned URL lacks {', '.join(missing)}")
    if query["X-Amz-Algorithm"] != "AWS4-HMAC-SHA256":
        raise TokenRejected("the presigned URL is not signed with AWS4-HMAC-SHA256")
    signed = [h.strip().lower() for h in query["X-Amz-SignedHeaders"].split(";")]
    if "x-k8s-aws-id" not in signed:
        raise TokenRejected("the presigned URL does not sign the x-k8s-aws-id header")
    credential = query["X-Amz-Credential"].split("/")
    if len(credential) != 5 or credential[3] != "sts" or credential[4] != "aws4_request":
        raise TokenRejected("the presigned URL's X-Amz-Credential is not an STS credential scope")
    try:
        signed_at = dt.datetime.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)
        expires = int(query["X-Amz-Expires"])
    except ValueError as exc:
        raise TokenRejected(f"the presigned URL's X-Amz-Date or X-Amz-Expires is malformed: {exc}") from exc
    if not 0 < expires <= MAX_EXPIRES_SECONDS:
        raise TokenRejected(f"X-Amz-Expires={expires} is outside 1..{MAX_EXPIRES_SECONDS} seconds")
    now = now or dt.datetime.now(dt.UTC)
    expires_at = signed_at + dt.timedelta(seconds=expires)
    if signed_at - now > dt.timedelta(seconds=CLOCK_SKEW_SECONDS):
        raise TokenRejected("the token is dated in the future")
    if now > expires_at:
        raise TokenRejected(f"the token expired at {expires_at.isoformat()}")
    return Caller(
        access_key_id=credential[0],
        region=credential[2],
        expires_at=expires_at,
        temporary=bool(query.get("X-Amz-Security-Token")),
    )
