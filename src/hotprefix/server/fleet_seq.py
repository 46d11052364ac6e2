"""The fleet's request number on a forwarded request: ``x-hotprefix-fleet-seq``.

The fleet's front end (``hotprefix.fleet.frontend``) numbers the generation requests it routes and
sends each replica the number in this header, always replacing whatever a client sent under that
name. A replica's server (``create_app(..., fleet_clock=True)``, set by ``hotprefix.fleet.replica``)
reads it and hands it to the engine as ``fleet_seq``, so the eviction policy's clock advances by
the fleet's requests since this replica's previous one (``CacheRequest.fleet_seq``). A standalone
server never reads it: a client could send it and move the clock.

The value is parsed strictly (decimal digits only, at most ``MAX_DIGITS``); anything else is
ignored, never an error: the request runs with one tick, as on a standalone server.

Knows nothing about Ray or the engine's internals. Imports no torch.
"""

from __future__ import annotations

from typing import Mapping

FLEET_SEQ_HEADER = "x-hotprefix-fleet-seq"
"""Request header: the front end's count of the generation requests it had routed, this one
included (set by the front end only; a client's is replaced)."""
MAX_DIGITS = 19
"""Longest value read (19 digits stay below 2**63)."""


def parse_fleet_seq(value: str | None) -> int | None:
    """The header's value as a non-negative int; None when absent or malformed (signs, spaces,
    non-ASCII digits, more than ``MAX_DIGITS`` digits)."""
    if value is None or not 0 < len(value) <= MAX_DIGITS:
        return None
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value)


def fleet_seq(reads_fleet_seq: bool, headers: Mapping[str, str]) -> int | None:
    """The request's fleet number, when this server runs as a fleet replica (``reads_fleet_seq``);
    None on a standalone server, whatever the client sent."""
    if not reads_fleet_seq:
        return None
    return parse_fleet_seq(headers.get(FLEET_SEQ_HEADER))
