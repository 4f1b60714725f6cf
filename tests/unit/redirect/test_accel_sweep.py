"""The sweep's decisions (agent.redirect.accel_sweep rules 1 and 2), without maps."""

from __future__ import annotations

from agent.redirect.accel_sweep import EndView, Sweep, peer_of

X = (7, 0x0100007F, 0x0100007F, 40000, 4140)  # the app's end, app -> 127.0.0.1:4140
Y = peer_of(X)  # the proxy's accepted end


def view(cookie, *, off=False, sent=False):
    return EndView(cookie=cookie, off=off, sent=sent)


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


def test_a_peer_that_redirected_keeps_the_end_for_good():
    s = Sweep()
    assert s.step([X], {X: view(1, off=True), Y: view(2, sent=True)}).switch_off == ()
    assert not s.waiting
    # even if its record were gone later, the decision stands for this socket
    assert s.step([X], {X: view(1, off=True), Y: view(2, off=True)}).remove == ()


def test_a_peer_that_redirected_between_the_ticks_stops_the_removal():
    s = Sweep()
    assert s.step([X], {X: view(1, off=True), Y: view(2)}).switch_off == (Y,)
    second = s.step([X], {X: view(1, off=True), Y: view(2, off=True, sent=True)})
    assert second.remove == ()


def test_an_end_without_a_peer_in_the_sockhash_stays():
    s = Sweep()
    d = s.step([X], {X: view(1, off=True), Y: view(None)})
    assert (d.switch_off, d.remove) == ((), ())


def test_a_new_peer_socket_on_the_same_addresses_starts_over():
    s = Sweep()
    s.step([X], {X: view(1, off=True), Y: view(2, off=True)})
    again = s.step([X], {X: view(1, off=True), Y: view(3, off=True)})
    assert again.remove == ()
    assert s.step([X], {X: view(1, off=True), Y: view(3, off=True)}).remove == (X,)


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
