"""The sweep's decisions (agent.redirect.accel_sweep rules 1 and 2), without maps."""

from __future__ import annotations

from agent.redirect.accel_sweep import QUEUE_TRIES, EndView, Sweep, peer_of

X = (7, 0x0100007F, 0x0100007F, 40000, 4140)  # the app's end, app -> 127.0.0.1:4140
Y = peer_of(X)  # the proxy's accepted end


def view(cookie, *, off=False, sent=False, queued=None):
    return EndView(cookie=cookie, off=off, sent=sent, queued=queued)


def test_peer_of_swaps_addresses_and_ports_in_the_same_netns():
    assert Y == (7, 0x0100007F, 0x0100007F, 4140, 40000)
    assert peer_of(Y) == X


def test_an_end_whose_peer_never_sent_is_taken_out_at_the_second_tick():
    s = Sweep()
    first = s.step([X], {X: view(1, off=True), Y: view(2)})
    assert (first.switch_off, first.remove) == ((Y,), ())
    assert s.waiting
    second = s.step([X, Y], {X: view(1, off=True), Y: view(2, off=True)})
    assert second.remove == (X,)
    assert second.switch_off == ()
    # the peer's turn: its own peer is gone from the sockhash now, so it stays
    third = s.step([X, Y], {X: view(None, off=True), Y: view(2, off=True)})
    assert (third.switch_off, third.remove) == ((), ())
    assert not s.waiting


def test_a_peer_already_switched_off_still_waits_one_tick():
    s = Sweep()
    views = {X: view(1, off=True), Y: view(2, off=True)}
    assert s.step([X], views).remove == ()
    assert s.step([X], views).remove == (X,)


def test_a_peer_that_redirected_between_the_looks_needs_the_queue():
    s = Sweep()
    assert s.step([X], {X: view(1, off=True), Y: view(2)}).switch_off == (Y,)
    second = s.step([X], {X: view(1, off=True), Y: view(2, off=True, sent=True)})
    assert second.remove == ()
    assert not s.waiting  # no queue read (None): left alone


def test_an_end_without_a_peer_in_the_sockhash_waits_for_its_queue():
    s = Sweep()
    d = s.step([X], {X: view(1, off=True), Y: view(None)})
    assert (d.switch_off, d.remove) == ((), ())
    assert s.step([X], {X: view(1, off=True, queued=0), Y: view(None)}).remove == (X,)


def test_another_socket_on_the_peer_addresses_leaves_the_end_for_good():
    s = Sweep()
    s.step([X], {X: view(1, off=True), Y: view(2, off=True)})
    assert s.step([X], {X: view(1, off=True), Y: view(3, off=True)}).remove == ()
    assert s.step([X], {X: view(1, off=True), Y: view(3, off=True)}).remove == ()
    assert not s.waiting


def test_a_peer_that_sent_needs_an_empty_queue():
    s = Sweep()
    assert s.step([X], {X: view(1, off=True), Y: view(2, sent=True)}).switch_off == (Y,)
    peer = view(2, off=True, sent=True)
    assert s.wants_queue(view(1, off=True), peer)
    assert not s.wants_queue(view(1, off=True), view(2, off=True))  # never sent: no need
    assert s.step([X], {X: view(1, off=True, queued=5), Y: peer}).remove == ()
    assert s.waiting  # bytes waiting: its owner reads them, the sweep looks again
    assert s.step([X], {X: view(1, off=True, queued=0), Y: peer}).remove == (X,)


def test_an_unreadable_queue_leaves_the_end_for_good():
    s = Sweep()
    s.step([X], {X: view(1, off=True), Y: view(2, off=True, sent=True)})
    assert s.step([X], {X: view(1, off=True), Y: view(2, off=True, sent=True)}).remove == ()
    assert not s.waiting


def test_a_queue_that_never_empties_is_given_up_after_its_tries():
    s = Sweep()
    peer = view(2, off=True, sent=True)
    s.step([X], {X: view(1, off=True), Y: peer})
    for _ in range(QUEUE_TRIES):
        assert s.step([X], {X: view(1, off=True, queued=9), Y: peer}).remove == ()
    assert not s.waiting
    assert s.step([X], {X: view(1, off=True, queued=0), Y: peer}).remove == ()


def test_a_peer_gone_since_the_first_look_leaves_the_decision_to_the_queue():
    """The download: the proxy's end went first; the app's end, switched off by the sweep,
    follows once its queue is read."""
    s = Sweep()
    s.step([Y], {Y: view(2, off=True), X: view(1, off=True, sent=True)})
    assert s.step([Y], {Y: view(2, off=True, queued=0), X: view(None)}).remove == (Y,)


def test_ends_gone_from_the_sockhash_are_forgotten():
    s = Sweep()
    s.step([X], {X: view(1, off=True), Y: view(2)})
    assert s.waiting
    s.step([X], {X: view(None, off=True), Y: view(2, off=True)})
    assert not s.waiting


def test_both_ends_that_never_sent_both_go_at_the_second_tick():
    s = Sweep()
    views = {X: view(1, off=True), Y: view(2, off=True)}
    assert s.step([X, Y], views).remove == ()
    assert set(s.step([X, Y], views).remove) == {X, Y}
