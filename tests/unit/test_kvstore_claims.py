"""Claims (services/kvstore/claims.py) without transport: the metadata both ends agree on,
expiry, the size cap, and whose claim is whose."""
from __future__ import annotations

from services.kvstore.claims import CLAIM_HEADER, CLIENT_HEADER, WAIT_HEADER, Claims, ProbeOptions


def test_probe_options_round_trip_and_bad_headers_read_as_absent():
    opts = ProbeOptions("c1", 0.25, 3)
    assert ProbeOptions.from_metadata(opts.metadata()) == opts
    assert ProbeOptions("c1").metadata() == ()  # a plain probe sends nothing
    bad = ((CLIENT_HEADER, "c1"), (WAIT_HEADER, "soon"), (CLAIM_HEADER, "x"))
    assert ProbeOptions.from_metadata(bad) == ProbeOptions("c1")
    assert ProbeOptions.from_metadata(((WAIT_HEADER, "100"),)) == ProbeOptions()  # no client id: no wait
    assert ProbeOptions.from_metadata(None) == ProbeOptions()


def test_claims_expire_are_capped_and_never_held_against_their_owner():
    now = [0.0]
    claims = Claims(ttl_s=10, max_keys=3, clock=lambda: now[0])
    claims.claim([b"a", b"b"], "c1")
    assert claims.held_by_other(b"a", "c2") == 10 and claims.held_by_other(b"a", "c1") == 0
    now[0] = 4.0
    claims.claim([b"c", b"d"], "c2")  # over the cap: the oldest claim goes
    assert len(claims) == 3 and claims.held_by_other(b"a", "c2") == 0
    assert claims.held_by_other(b"b", "c2") == 6
    claims.landed([b"b"])
    assert claims.held_by_other(b"b", "c2") == 0
    now[0] = 14.0
    claims.claim([], "c3")  # any claim sweeps the expired ones
    assert len(claims) == 0
