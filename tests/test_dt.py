"""NeighbourView against scipy: 2-hop knowledge gives the true Delaunay neighbours, and holes fill."""

from __future__ import annotations

import numpy as np
import pytest

from overlay.dt import ROUTE_CACHE, NeighbourView
from overlay.geometry import delaunay_neighbour_map, greedy_next_hop
from overlay.protocol import NodeInfo


def _infos(points: np.ndarray) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", (float(x), float(y)), f"127.0.0.1:{10000 + i}") for i, (x, y) in enumerate(points)]


def _view_from_truth(me: NodeInfo, infos: dict[str, NodeInfo], truth: dict[str, set[str]]) -> NeighbourView:
    """The view a node holds once the overlay is consistent: links to its neighbours and their adverts."""
    view = NeighbourView(me)
    for nid in sorted(truth[me.id]):
        view.link_up(infos[nid])
    for nid in sorted(truth[me.id]):
        view.learn(nid, [infos[k] for k in sorted(truth[nid])])
    return view


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [3, 4, 12, 60])
def test_two_hop_view_desires_exactly_the_delaunay_neighbours(seed: int, n: int) -> None:
    pts = np.random.default_rng(seed).random((n, 2))
    infos = {i.id: i for i in _infos(pts)}
    truth = delaunay_neighbour_map({k: v.coord for k, v in infos.items()})
    for me in infos.values():
        assert _view_from_truth(me, infos, truth).desired() == truth[me.id]


@pytest.mark.parametrize("seed", range(8))
def test_forgetting_failed_nodes_fills_the_hole(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    pts = rng.random((40, 2))
    infos = {i.id: i for i in _infos(pts)}
    truth = delaunay_neighbour_map({k: v.coord for k, v in infos.items()})
    # Non-adjacent failures heal in one step from local knowledge; adjacent ones take further advert rounds,
    # which the process tests cover.
    dead: set[str] = set()
    for i in rng.permutation(40):
        nid = f"n{int(i)}"
        if len(dead) < 3 and not truth[nid] & dead:
            dead.add(nid)
    survivors = {k: v.coord for k, v in infos.items() if k not in dead}
    after = delaunay_neighbour_map(survivors)
    changed = 0
    for me_id in survivors:
        view = _view_from_truth(infos[me_id], infos, truth)
        # Dead neighbours are detected by their links; dead 2-hop nodes vanish from the neighbours' adverts.
        for d in sorted(dead & set(view.known())):
            view.forget(d, now=0.0, ttl=5.0)
        assert not dead & set(view.known())
        if view.desired() != truth[me_id] - dead:
            changed += 1
        # The survivor's knowledge (2-hop + the dead's neighbours as candidates) is a superset of its new
        # neighbours, so it can compute them at once, before anyone re-advertises.
        assert view.desired() == after[me_id], me_id
    assert changed > 0  # the failures did open holes that needed new edges


def test_forget_keeps_former_neighbours_as_candidates_and_tombstones_expire() -> None:
    infos = {i.id: i for i in _infos(np.array([[0.5, 0.5], [0.1, 0.1], [0.9, 0.1], [0.5, 0.95]]))}
    view = NeighbourView(infos["n0"])
    view.link_up(infos["n1"])
    view.learn("n1", [infos["n0"], infos["n2"], infos["n3"]])
    assert view.desired() == {"n1", "n2", "n3"}
    view.forget("n1", now=10.0, ttl=2.0)
    assert view.candidates == {"n2", "n3"}
    assert view.desired() == {"n2", "n3"}
    view.link_up(infos["n2"])
    view.learn("n2", [infos["n0"], infos["n1"], infos["n3"]])  # stale: still lists n1
    assert "n1" not in view.known()
    assert not view.expire(11.0)
    assert view.expire(12.5)
    view.learn("n2", [infos["n0"], infos["n1"], infos["n3"]])
    assert "n1" in view.known()


def test_prune_drops_unwanted_candidates_and_unreferenced_nodes() -> None:
    infos = {i.id: i for i in _infos(np.array([[0.5, 0.5], [0.4, 0.5], [0.6, 0.5], [0.9, 0.5]]))}
    view = NeighbourView(infos["n0"])
    view.add_candidates(infos.values())
    assert view.candidates == {"n1", "n2", "n3"}
    desired = view.desired()
    assert desired == {"n1", "n2"}  # collinear: predecessor and successor only
    view.prune(desired)
    assert view.candidates == {"n1", "n2"}
    assert "n3" not in view.nodes


def test_single_and_pair() -> None:
    a, b = _infos(np.array([[0.2, 0.2], [0.8, 0.8]]))
    view = NeighbourView(a)
    assert view.desired() == set()
    assert view.next_hop(0.9, 0.9) is None
    view.link_up(b)
    assert view.desired() == {"n1"}
    assert view.next_hop(0.9, 0.9) == "n1"
    view.unlink("n1")
    assert view.next_hop(0.9, 0.9) is None


@pytest.mark.parametrize("seed", range(4))
def test_next_hop_matches_geometry_greedy_including_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # A coarse grid makes exact distance ties common.
    pts = rng.integers(0, 5, size=(25, 2)) / 4.0
    pts = np.unique(pts, axis=0)
    infos = _infos(pts)
    me, others = infos[0], infos[1:]
    view = NeighbourView(me)
    for o in others:
        view.link_up(o)
    nbrs = {o.id: o.coord for o in others}
    for tx, ty in rng.integers(0, 9, size=(200, 2)) / 8.0:
        assert view.next_hop(float(tx), float(ty)) == greedy_next_hop(me.id, me.coord, nbrs, (tx, ty))


@pytest.mark.parametrize("seed", range(3))
def test_remembered_answers_follow_every_change_of_the_view(seed: int) -> None:
    # route() and knows_closer() remember their answers per destination: links coming up, closing and failing,
    # adverts, candidates, tombstones lapsing, pruning and detours must each be seen by the next question about a
    # destination asked before (greedy over the linked nodes; brute force over known(), with route's tie-break).
    rng = np.random.default_rng(seed)
    pts = np.unique(rng.integers(0, 5, size=(20, 2)) / 4.0, axis=0)
    infos = _infos(pts)
    me, others = infos[0], infos[1:]
    view = NeighbourView(me)
    targets = [(float(x), float(y)) for x, y in rng.integers(0, 9, size=(40, 2)) / 8.0]
    for step in range(80):
        o = others[int(rng.integers(len(others)))]
        action = int(rng.integers(7))
        if action == 0:
            view.link_up(o)
        elif action == 1:
            view.unlink(o.id)
        elif action == 2 and view.linked:
            via = sorted(view.linked)[int(rng.integers(len(view.linked)))]
            view.learn(via, [others[int(i)] for i in rng.integers(len(others), size=3)])
        elif action == 3:
            view.add_candidates([o])
        elif action == 4:
            view.forget(o.id, now=float(step), ttl=0.5)
        elif action == 5:
            view.expire(float(step))
        else:
            view.prune(view.desired())
        linked = {k: view.nodes[k].coord for k in view.linked}
        known = view.known()
        for t in targets:
            assert view.next_hop(*t) == greedy_next_hop(me.id, me.coord, linked, t), (step, t)
            me_key = (float(np.hypot(me.coord[0] - t[0], me.coord[1] - t[1])), me.id)
            closer = any(
                (float(np.hypot(c[0] - t[0], c[1] - t[1])), k) < me_key for k, c in known.items() if k != me.id
            )
            assert view.knows_closer(*t) == closer, (step, t)
    # A detour: an alive node whose link broke is reached through the neighbour that still hears it.
    a, b = others[0], others[1]
    view.link_up(a)
    view.link_up(b)
    assert view.next_hop(*b.coord) == b.id
    view.unlink(b.id)
    assert view.next_hop(*b.coord) != b.id
    view.detour(b.id, a.id)
    assert view.next_hop(*b.coord) == a.id


@pytest.mark.parametrize("seed", range(4))
def test_a_settled_view_knows_no_closer_node_that_no_link_leads_toward(seed: int) -> None:
    # Routing skips `knows_closer` while the view is settled (every Delaunay neighbour linked): sound only if no
    # point then has a known node closer than self with no linked neighbour closer.  Checked on 2-hop views of
    # random overlays, for grid points and every node's own coordinate.
    pts = np.random.default_rng(seed).random((40, 2))
    infos = _infos(pts)
    by_id = {i.id: i for i in infos}
    truth = delaunay_neighbour_map({i.id: i.coord for i in infos})
    targets = [(float(x), float(y)) for x in np.linspace(0, 1, 15) for y in np.linspace(0, 1, 15)]
    targets += [i.coord for i in infos]
    for me in infos[:10]:
        view = _view_from_truth(me, by_id, truth)
        view.settle(view.desired())
        assert view.settled
        for t in targets:
            assert not (view.next_hop(*t) is None and view.knows_closer(*t)), (me.id, t)
        # One neighbour's link not up yet: not settled.
        view.unlink(sorted(view.linked)[0])
        assert not view.settled
        view.settle(view.desired())
        assert not view.settled


def test_remembered_routes_are_bounded() -> None:
    view = NeighbourView(NodeInfo("me", (0.5, 0.5), "127.0.0.1:1"))
    view.link_up(NodeInfo("n1", (0.9, 0.9), "127.0.0.1:2"))
    for i in range(ROUTE_CACHE + 10):
        assert view.next_hop(i / (ROUTE_CACHE + 10), 0.95) in (None, "n1")
        assert len(view._routes) <= ROUTE_CACHE


def _compose_quad() -> tuple[NodeInfo, NodeInfo, NodeInfo, NodeInfo]:
    """b2, b3, b5, b6 of docker-compose.yml: b2 - b6 is a Delaunay edge only while b3 is not known."""
    coords = {"b2": (0.52, 0.13), "b3": (0.86, 0.19), "b5": (0.49, 0.47), "b6": (0.83, 0.55)}
    b2, b3, b5, b6 = (NodeInfo(n, c, f"{n}:7000") for n, c in coords.items())
    return b2, b3, b5, b6


def test_a_node_advertised_while_tombstoned_is_known_once_the_tombstone_lapses() -> None:
    # The compose cluster's b2, b3, b5, b6 (docker-compose.yml).  In a full restart b6 dialled b3 while b3 was
    # down and tombstoned it; b5's advert listing b3 came meanwhile.  b5 sends no new advert later (its own
    # neighbours do not change), so b6 must keep what b5 said and see b3 once the tombstone lapses; a view
    # that dropped b3 from the advert kept b2 instead of b3 as a neighbour for good (the links were not
    # the Delaunay triangulation 300 s after the restart).
    b2, b3, b5, b6 = _compose_quad()
    view = NeighbourView(b6)
    view.link_up(b5)
    view.forget("b3", now=10.0, ttl=2.0)  # the dial to b3 failed: gone for 2 s
    view.learn("b5", [b2, b3, b6])
    assert "b3" not in view.known()  # within the tombstone, the advert does not bring it back
    assert view.desired() == {"b2", "b5"}
    assert view.expire(12.5)
    assert set(view.known()) == {"b2", "b3", "b5", "b6"}
    assert view.desired() == {"b3", "b5"}  # b2 - b6 crosses b3 - b5: not a Delaunay edge with b3 known


def test_a_forgotten_node_comes_back_after_its_tombstone_only_while_an_advert_lists_it() -> None:
    b2, b3, b5, b6 = _compose_quad()
    # The other order: b5's advert came first, then the dial to b3 failed.
    view = NeighbourView(b6)
    view.link_up(b5)
    view.learn("b5", [b2, b3, b6])
    assert view.desired() == {"b3", "b5"}
    view.forget("b3", now=10.0, ttl=2.0)
    assert view.desired() == {"b2", "b5"}
    assert not view.expire(11.0)
    assert "b3" not in view.known()
    assert view.expire(12.0)
    assert view.desired() == {"b3", "b5"}
    # b3 really is gone: b5 advertises without it before the tombstone lapses, and it stays gone.
    view.forget("b3", now=20.0, ttl=2.0)
    view.learn("b5", [b2, b6])
    assert view.expire(22.0)
    assert "b3" not in view.known() and not view.withheld
    # A link from b3 (it is back) needs no tombstone to lapse.
    view.forget("b3", now=30.0, ttl=2.0)
    view.link_up(b3)
    assert "b3" in view.known() and not view.withheld and not view.tombstones
