"""Each routing policy on plain candidate lists, and the circuit breaker on a fake clock."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from services.router.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from services.router.config import RouterConfig
from services.router.policies import BY_LOAD, BY_MATCH, POLICIES, Candidate, make_policy


def fleet(*loads: int) -> list[Candidate]:
    return [Candidate(f"r{i}", load) for i, load in enumerate(loads)]


@dataclass
class Thresholds:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1000


def test_registry_builds_every_policy_and_refuses_unknown_names():
    for name in POLICIES:
        assert make_policy(name, Thresholds(), seed=0).name == name
    with pytest.raises(ValueError, match="known: cache_aware"):
        make_policy("nope")
    assert RouterConfig().policy == "cache_aware"


def test_round_robin_cycles_in_order():
    p = make_policy("round_robin")
    assert [p.choose("k", fleet(9, 0, 0)).address for _ in range(6)] == ["r0", "r1", "r2"] * 2


def test_random_is_seeded_and_covers_all():
    picks = [make_policy("random", seed=1).choose("k", fleet(0, 0, 0)).address for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first pick
    p = make_policy("random", seed=2)
    assert set(p.choose("k", fleet(0, 0, 0)).address for _ in range(100)) == {"r0", "r1", "r2"}


def test_power_of_two_never_picks_the_most_loaded_of_three():
    p = make_policy("power_of_two", seed=3)
    counts = Counter(p.choose("k", fleet(1, 5, 9)).address for _ in range(300))
    assert counts["r2"] == 0 and counts["r0"] > counts["r1"] > 0
    assert make_policy("power_of_two", seed=0).choose("k", fleet(7)).address == "r0"


def test_least_load_picks_the_minimum_and_rotates_ties():
    p = make_policy("least_load")
    assert p.choose("k", fleet(3, 1, 2)).address == "r1"
    assert {p.choose("k", fleet(0, 0, 5)).address for _ in range(4)} == {"r0", "r1"}
    assert p.choose("k", fleet(0)).reason == BY_LOAD


def test_cache_aware_follows_the_prefix_once_routed():
    p = make_policy("cache_aware", Thresholds())
    key = "S" * 100 + "question one"
    first = p.choose(key, fleet(0, 0, 0))
    assert first.reason == BY_LOAD  # nothing cached anywhere yet
    p.routed(key, first.address)
    again = p.choose("S" * 100 + "question two", fleet(2, 2, 2))
    assert again == type(again)(first.address, BY_MATCH)


def test_cache_aware_new_prefix_goes_to_least_loaded_then_smallest_tree():
    p = make_policy("cache_aware", Thresholds())
    p.routed("x" * 50, "r0")
    assert p.choose("y" * 50, fleet(3, 1, 2)).address == "r1"
    assert p.choose("y" * 50, fleet(1, 1, 5)).address == "r1"  # tie on load: r1 holds less


def test_cache_aware_match_below_threshold_is_by_load():
    p = make_policy("cache_aware", Thresholds(cache_threshold=0.8))
    p.routed("S" * 50 + "a" * 50, "r0")
    c = p.choose("S" * 50 + "b" * 50, fleet(1, 0))  # 50 % match < 80 %
    assert c.address == "r1" and c.reason == BY_LOAD


def test_cache_aware_overflows_only_past_both_thresholds():
    p = make_policy("cache_aware", Thresholds(balance_abs_threshold=4, balance_rel_threshold=1.5))
    key = "hot" * 40
    p.routed(key, "r0")
    assert p.choose(key, fleet(4, 0)).address == "r0"  # diff 4: not > 4
    assert p.choose(key, fleet(5, 0)) == type(p.choose(key, fleet(5, 0)))("r1", BY_LOAD)
    assert p.choose(key, fleet(15, 10)).address == "r0"  # diff 5 but 15 = 1.5 x 10, not more
    assert p.choose(key, fleet(15, 10, 0)).address == "r2"


def test_cache_aware_simulated_hot_prefix_stays_within_thresholds():
    """Route 60 concurrent requests of one prefix: the hot replica takes them until both
    thresholds are crossed, then the others fill; none gets past its share plus the thresholds."""
    p = make_policy("cache_aware", Thresholds(balance_abs_threshold=4, balance_rel_threshold=1.5))
    loads = {"r0": 0, "r1": 0, "r2": 0}
    for i in range(60):
        c = p.choose("hot" * 40 + str(i), [Candidate(a, n) for a, n in sorted(loads.items())])
        p.routed("hot" * 40 + str(i), c.address)
        loads[c.address] += 1
        low = min(loads.values())
        assert max(loads.values()) <= max(low + 4, 1.5 * low) + 1
    assert min(loads.values()) > 0


def test_cache_aware_forget_and_maintain_bound_the_tree():
    p = make_policy("cache_aware", Thresholds(max_tree_chars=100))
    for i in range(10):
        p.routed(f"{i}" * 50, "r0")
    p.maintain()
    assert p.tree.sizes["r0"] <= 100
    p.forget("r0")
    assert p.tree.match("0" * 50) == {}


def test_breaker_opens_half_opens_and_closes():
    now = [0.0]
    b = Breaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    b.failure()
    assert b.state == CLOSED and b.available()
    b.failure()
    assert b.state == OPEN and not b.available() and b.opened == 1
    now[0] = 5.0
    assert b.state == HALF_OPEN and b.available()
    b.attempt()
    assert not b.available()  # one trial at a time
    b.failure()
    assert b.state == OPEN and b.opened == 2
    now[0] = 10.0
    b.attempt()
    b.success()
    assert b.state == CLOSED and b.available()


def test_a_half_open_trial_that_ends_without_a_verdict_lets_the_next_one_try():
    now = [0.0]
    b = Breaker(failures=1, cooldown_s=5.0, clock=lambda: now[0])
    b.failure()
    now[0] = 5.0
    b.attempt()
    assert not b.available()
    b.abandoned()  # the client of the trial went away: nothing was learnt about the replica
    assert b.state == HALF_OPEN and b.available()
    b.attempt()
    b.success()
    assert b.state == CLOSED


def test_router_config_validates():
    with pytest.raises(ValueError, match="cache-threshold"):
        RouterConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="replica-addrs"):
        RouterConfig(replica_addrs=["nope"])
