"""Peak-EWMA + power-of-two-choices balancing with failure accrual."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from agent.proxy.accrual import AccrualPolicy, FailureAccrual, State
from agent.proxy.balance import DEFAULT_RTT_S, Balancer, EndpointStats
from agent.proxy.model import Endpoint


def ep(port, weight=10_000):
    return Endpoint(addr=("10.0.0.1", port), weight=weight)


class SeqRng:
    """Returns the given values in turn (then repeats them)."""

    def __init__(self, *values):
        self.values = values
        self.i = 0

    def random(self):
        v = self.values[self.i % len(self.values)]
        self.i += 1
        return v


def test_empty_balancer_picks_nothing():
    assert Balancer().pick(0.0, random.Random(1)) is None


def test_single_endpoint_is_always_picked():
    bal = Balancer([ep(1)])
    handle = bal.pick(0.0, random.Random(1))
    assert handle.endpoint == ep(1)
    assert bal.stats(("10.0.0.1", 1)).pending == 1
    handle.done(0.01)
    assert bal.stats(("10.0.0.1", 1)).pending == 0


def test_peak_sensitive_update_jumps_up_and_decays_down():
    stats = EndpointStats(ep(1), DEFAULT_RTT_S, FailureAccrual())
    stats.updated_at = 0.0
    stats.observe(1.0, 0.5, 10.0)
    assert stats.rtt == 0.5  # a slower sample is taken at once
    stats.observe(11.0, 0.1, 10.0)  # 10 s later, a faster one moves it by 1 - e^-1
    decay = math.exp(-1.0)
    assert stats.rtt == pytest.approx(0.5 * decay + 0.1 * (1 - decay))


def test_cost_decays_toward_zero_and_counts_pending_and_weight():
    stats = EndpointStats(ep(1, weight=2), 1.0, FailureAccrual())
    assert stats.cost(0.0, 10.0) == pytest.approx(0.5)  # first read starts the clock
    stats.pending = 3
    assert stats.cost(10.0, 10.0) == pytest.approx(math.exp(-1) * 4 / 2)
    assert stats.cost(5.0, 10.0) == pytest.approx(math.exp(-1) * 4 / 2)  # time never runs back
    assert EndpointStats(ep(2, weight=0), 1.0, FailureAccrual()).cost(0.0, 10.0) == math.inf


def test_p2c_picks_the_cheaper_of_two_distinct_endpoints():
    bal = Balancer([ep(1), ep(2), ep(3)])
    slow = bal.stats(("10.0.0.1", 1))
    slow.rtt = 1.0
    # rng picks index 0 then index 0 of the remaining two (-> index 1): compares ports 1 and 2.
    handle = bal.pick(0.0, SeqRng(0.0, 0.0))
    assert handle.endpoint.addr[1] == 2
    # index 2 then index 1: compares ports 3 and 2 at equal cost: the first drawn wins.
    assert bal.pick(0.0, SeqRng(0.9, 0.6)).endpoint.addr[1] == 3


def test_pending_requests_steer_traffic_away():
    bal = Balancer([ep(1), ep(2)])
    held = [bal.pick(0.0, SeqRng(0.0, 0.0)) for _ in range(3)]
    assert [h.endpoint.addr[1] for h in held] == [1, 2, 1]
    for h in held:
        h.done(0.01)


def test_slow_endpoint_gets_less_traffic_with_a_seeded_rng():
    bal = Balancer([ep(1), ep(2), ep(3)])
    rng = random.Random(42)
    now, counts = 0.0, Counter()
    for _ in range(3000):
        handle = bal.pick(now, rng)
        port = handle.endpoint.addr[1]
        counts[port] += 1
        now += 0.001
        handle.done(now + (0.2 if port == 1 else 0.005))
    assert counts[1] < counts[2] / 5
    assert counts[1] < counts[3] / 5


def test_picks_are_reproducible_with_the_same_seed():
    def run(seed):
        bal = Balancer([ep(p) for p in range(1, 6)])
        rng = random.Random(seed)
        out = []
        for i in range(200):
            h = bal.pick(i * 0.01, rng)
            out.append(h.endpoint.addr[1])
            h.done(i * 0.01 + 0.001 * (h.endpoint.addr[1]))
        return out

    assert run(3) == run(3)


def test_update_keeps_stats_of_endpoints_that_stay_and_drops_removed_ones():
    bal = Balancer([ep(1), ep(2)])
    kept = bal.stats(("10.0.0.1", 1))
    kept.rtt = 0.7
    removed_handle = bal.pick(0.0, SeqRng(0.9, 0.0))
    assert removed_handle.endpoint.addr[1] == 2
    bal.update([ep(1, weight=5), ep(3), ep(3)])
    assert bal.stats(("10.0.0.1", 1)) is kept
    assert kept.endpoint.weight == 5
    assert bal.stats(("10.0.0.1", 2)) is None
    assert len(bal) == 2
    assert {e.addr[1] for e in bal.endpoints} == {1, 3}
    removed_handle.done(0.1, ok=False)  # in-flight to a removed endpoint finishes fine
    assert removed_handle.stats.pending == 0
    for _ in range(50):
        assert bal.pick(0.2, random.Random(1)).endpoint.addr[1] != 2


def test_ejected_endpoints_are_skipped_until_their_probe_is_due():
    bal = Balancer([ep(1), ep(2)], accrual=AccrualPolicy(max_failures=1, jitter=0.0))
    bad = bal.pick(0.0, SeqRng(0.0, 0.0))
    assert bad.endpoint.addr[1] == 1
    bad.done(0.0, ok=False)
    assert bal.stats(("10.0.0.1", 1)).accrual.state is State.EJECTED
    for _ in range(20):
        h = bal.pick(0.5, random.Random(1))
        assert h.endpoint.addr[1] == 2
        h.done(0.5)
    # After the 1 s backoff the endpoint is a candidate again and its pick is the probe.
    bal.stats(("10.0.0.1", 2)).rtt = 10.0
    probe = bal.pick(1.0, SeqRng(0.0, 0.0))
    assert probe.endpoint.addr[1] == 1
    assert probe.probe is True
    assert bal.pick(1.0, SeqRng(0.0, 0.0)).endpoint.addr[1] == 2  # one probe at a time
    probe.done(1.1, ok=True)
    assert bal.stats(("10.0.0.1", 1)).accrual.state is State.HEALTHY


def test_all_ejected_endpoints_are_still_picked():
    bal = Balancer([ep(1), ep(2)], accrual=AccrualPolicy(max_failures=1, jitter=0.0))
    for port_rng in (SeqRng(0.0, 0.0), SeqRng(0.9, 0.0)):
        bal.stats(("10.0.0.1", 1)).rtt = 0.001 if port_rng.values[0] == 0.0 else 9.0
        h = bal.pick(0.0, port_rng)
        h.done(0.0, ok=False)
    states = {bal.stats(("10.0.0.1", p)).accrual.state for p in (1, 2)}
    assert states == {State.EJECTED}
    assert bal.pick(0.1, random.Random(1)) is not None


def test_cancelled_probe_releases_the_endpoint_for_the_next_probe():
    bal = Balancer([ep(1)], accrual=AccrualPolicy(max_failures=1, jitter=0.0))
    bal.pick(0.0, random.Random(1)).done(0.0, ok=False)
    probe = bal.pick(2.0, random.Random(1))
    assert probe.probe
    probe.cancel()
    probe.cancel()
    probe.done(3.0)  # ignored after cancel
    assert bal.stats(("10.0.0.1", 1)).pending == 0
    assert bal.pick(2.0, random.Random(1)).probe


def test_done_twice_counts_once():
    bal = Balancer([ep(1)])
    h = bal.pick(0.0, random.Random(1))
    h.done(0.1)
    h.done(0.2, ok=False)
    assert bal.stats(("10.0.0.1", 1)).pending == 0
    plain = bal.pick(0.3, random.Random(1))
    plain.cancel()
    assert bal.stats(("10.0.0.1", 1)).pending == 0


def test_removed_unhealthy_endpoint_does_not_count_as_ejected():
    bal = Balancer([ep(1), ep(2)], accrual=AccrualPolicy(max_failures=1, jitter=0.0))
    bal.pick(0.0, SeqRng(0.0, 0.0)).done(0.0, ok=False)
    bal.update([ep(2)])
    assert bal._unhealthy == 0
    late = bal.pick(0.0, random.Random(1))
    bal.update([ep(3)])
    late.done(0.1, ok=False)  # accrual change on a removed endpoint is not counted
    assert bal._unhealthy == 0


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError):
        Balancer(decay_s=0)


def test_pick_avoids_endpoints_this_request_already_tried():
    # A fast-failing endpoint has the lowest latency cost; a retry must still go elsewhere.
    bal = Balancer([Endpoint(addr=("10.0.0.1", 80)), Endpoint(addr=("10.0.0.2", 80))])
    rng = random.Random(1)
    for _ in range(50):
        h = bal.pick(0.0, rng, avoid=[("10.0.0.1", 80)])
        assert h is not None
        assert h.endpoint.addr == ("10.0.0.2", 80)
        h.cancel()
    only = bal.pick(0.0, rng, avoid=[("10.0.0.1", 80), ("10.0.0.2", 80)])
    assert only is not None  # everything tried: still pick one rather than fail
    only.cancel()
