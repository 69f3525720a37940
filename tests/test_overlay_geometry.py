"""Geometry: hash, space validation, Delaunay/Voronoi, N_j(c) and greedy forwarding."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlay.geometry import (
    NEAREST_NUMPY_NODES,
    UNIT_SQUARE,
    BadCoordinate,
    NearestNodes,
    Space,
    closest,
    delaunay_neighbour_map,
    delaunay_neighbours,
    delaunay_neighbours_of,
    geohash,
    greedy_next_hop,
    nearest_k,
    parse_coord,
    polygon_area,
    sample_in_polygon,
    voronoi_cell,
    voronoi_cells,
)


def test_geohash_is_stable_uniform_and_in_space() -> None:
    assert geohash("grid/a/voltage") == geohash("grid/a/voltage")
    assert geohash("grid/a/voltage") != geohash("grid/b/voltage")
    pts = np.array([geohash(f"t{i}") for i in range(20000)])
    assert pts.min() >= 0.0 and pts.max() < 1.0
    # uniform: each quarter of the square holds about a quarter of the topics
    quarter = ((pts[:, 0] < 0.5) & (pts[:, 1] < 0.5)).mean()
    assert abs(quarter - 0.25) < 0.02
    space = Space(10.0, -5.0, 20.0, 5.0)
    x, y = geohash("grid/a/voltage", space)
    assert 10.0 <= x < 20.0 and -5.0 <= y < 5.0


def test_space_and_coordinate_validation() -> None:
    assert UNIT_SQUARE.validate((0.5, 1.0)) == (0.5, 1.0)
    for bad in [(1.5, 0.2), (math.nan, 0.1), (math.inf, 0.0), (-0.1, 0.5)]:
        with pytest.raises(BadCoordinate, match="outside the space"):
            UNIT_SQUARE.validate(bad)
    with pytest.raises(BadCoordinate, match="pair of numbers"):
        UNIT_SQUARE.validate(("a", 1))  # type: ignore[arg-type]
    with pytest.raises(BadCoordinate, match="X,Y"):
        parse_coord("0.5")
    with pytest.raises(BadCoordinate, match="two numbers"):
        parse_coord("x,1")
    assert parse_coord("0.25,0.75") == (0.25, 0.75)
    with pytest.raises(BadCoordinate):
        Space(0, 0, 0, 1)


def test_delaunay_degenerate_cases() -> None:
    assert delaunay_neighbours(np.empty((0, 2))) == []
    assert delaunay_neighbours(np.array([[0.5, 0.5]])) == [set()]
    assert delaunay_neighbours(np.array([[0.1, 0.1], [0.9, 0.9]])) == [{1}, {0}]
    line = np.array([[0.1, 0.5], [0.9, 0.5], [0.5, 0.5], [0.3, 0.5]])
    assert delaunay_neighbours(line) == [{3}, {2}, {1, 3}, {0, 2}]
    square = delaunay_neighbour_map({"a": (0.2, 0.2), "b": (0.8, 0.2), "c": (0.5, 0.9)})
    assert square == {"a": {"b", "c"}, "b": {"a", "c"}, "c": {"a", "b"}}


def test_voronoi_cells_partition_the_space() -> None:
    rng = np.random.default_rng(3)
    pts = UNIT_SQUARE.uniform(rng, 50)
    cells = voronoi_cells(pts)
    assert sum(polygon_area(c) for c in cells) == pytest.approx(1.0, abs=1e-9)
    # sampled candidates of a cell have the cell's site as their closest node (N_1)
    for i in (0, 7, 33):
        s = sample_in_polygon(cells[i], 200, rng)
        assert (nearest_k(pts, s, 1)[:, 0] == i).mean() > 0.99
    one = voronoi_cell((0.5, 0.5), [])
    assert polygon_area(one) == pytest.approx(1.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 60), st.integers(0, 2**31))
def test_greedy_forwarding_on_delaunay_reaches_the_closest_node(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pts = UNIT_SQUARE.uniform(rng, n)
    nbrs = delaunay_neighbours(pts)
    sites = {i: (float(p[0]), float(p[1])) for i, p in enumerate(pts)}
    for _ in range(20):
        target = tuple(rng.random(2))
        cur = int(rng.integers(n))
        for _hop in range(n):
            nxt = greedy_next_hop(cur, sites[cur], {j: sites[j] for j in nbrs[cur]}, target)
            if nxt is None:
                break
            cur = nxt
        assert cur == closest(sites, target)[0]


def _exact_neighbours(me: int, sites: Mapping[int, Sequence[float]]) -> set[int]:
    """Delaunay neighbours by definition, in exact rational arithmetic: j is one if some triangle (me, j, k) has
    no site strictly inside its circumcircle (with cocircular sites: every triangulation's edges)."""
    pts = {k: (Fraction(v[0]), Fraction(v[1])) for k, v in sites.items()}

    def orient(a: tuple[Fraction, Fraction], b: tuple[Fraction, Fraction], c: tuple[Fraction, Fraction]) -> Fraction:
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    def inside(a: tuple[Fraction, Fraction], b: tuple[Fraction, Fraction], c: tuple[Fraction, Fraction],
               d: tuple[Fraction, Fraction]) -> bool:  # fmt: skip
        ax, ay, bx, by, cx, cy = a[0] - d[0], a[1] - d[1], b[0] - d[0], b[1] - d[1], c[0] - d[0], c[1] - d[1]
        det = (
            (ax * ax + ay * ay) * (bx * cy - cx * by)
            - (bx * bx + by * by) * (ax * cy - cx * ay)
            + (cx * cx + cy * cy) * (ax * by - bx * ay)
        )
        return det > 0

    out = set()
    for j in pts:
        for k in pts:
            if len({me, j, k}) < 3 or orient(pts[me], pts[j], pts[k]) == 0:
                continue
            a, b, c = (pts[me], pts[j], pts[k]) if orient(pts[me], pts[j], pts[k]) > 0 else (pts[me], pts[k], pts[j])
            if not any(inside(a, b, c, pts[m]) for m in pts if m not in (me, j, k)):
                out.add(j)
                break
    return out


def test_one_sites_delaunay_neighbours_are_qhulls_for_sites_in_general_position() -> None:
    # What a broker computes for its own links (without scipy), against the whole triangulation's.
    rng = np.random.default_rng(11)
    for _ in range(400):
        n = int(rng.integers(2, 60))
        pts = rng.random((n, 2))
        sites = {i: (float(x), float(y)) for i, (x, y) in enumerate(pts)}
        truth = delaunay_neighbours(pts)  # Qhull's triangulation
        for me in range(min(n, 4)):
            assert delaunay_neighbours_of(me, sites) == truth[me], (n, me)
        assert delaunay_neighbour_map(sites) == dict(enumerate(truth))


def test_one_sites_delaunay_neighbours_are_exact_where_sites_are_a_million_times_closer_than_the_spread() -> None:
    # Half the sites in a cluster 1e-6 wide inside a unit spread (scipy's answer, on these, was off by 62 edges
    # of 30 sets: not the reference here).  Every exact neighbour is found; an extra one is allowed only within
    # the cocircularity tolerance, and here there is none of either.
    rng = np.random.default_rng(2)
    for _ in range(20):
        n = int(rng.integers(3, 20))
        pts = rng.random((n, 2))
        pts[: n // 2] = 0.5 + (pts[: n // 2] - 0.5) * 1e-6
        sites = {i: (float(x), float(y)) for i, (x, y) in enumerate(pts)}
        for me in sites:
            assert delaunay_neighbours_of(me, sites) == _exact_neighbours(me, sites), (n, me)


def test_one_sites_delaunay_neighbours_on_a_grid_circle_and_line() -> None:
    # A grid: every 4 neighbouring sites are cocircular, no triangulation is the one; both diagonals are
    # neighbours, from both ends (a superset of any triangulation, and symmetric).
    grid = {(i, j): (i / 4, j / 4) for i in range(5) for j in range(5)}
    nbrs = {k: delaunay_neighbours_of(k, grid) for k in grid}
    assert nbrs[(2, 2)] == {(i, j) for i in (1, 2, 3) for j in (1, 2, 3)} - {(2, 2)}
    assert nbrs[(0, 0)] == {(0, 1), (1, 0), (1, 1)}
    assert all(a in nbrs[b] for a in grid for b in nbrs[a])
    keys = list(grid)
    qhull = delaunay_neighbours(np.array([grid[k] for k in keys]))  # one of the grid's triangulations
    assert all(nbrs[keys[i]] >= {keys[j] for j in qhull[i]} for i in range(len(keys)))
    assert delaunay_neighbour_map(grid) == nbrs  # what the overlay checks expect: the brokers' links
    assert all(nbrs[k] == _exact_neighbours(k, grid) for k in [(0, 0), (1, 2), (4, 3)])
    # Eight sites on a circle and its centre: the centre is everyone's neighbour, and each the next one's.
    ring = {i: (0.5 + 0.3 * math.cos(i * math.pi / 4), 0.5 + 0.3 * math.sin(i * math.pi / 4)) for i in range(8)}
    ring[8] = (0.5, 0.5)
    assert delaunay_neighbours_of(8, ring) == set(range(8))
    assert delaunay_neighbours_of(0, ring) == {1, 7, 8}
    # Collinear sites: each linked to its predecessor and successor, as delaunay_neighbours does.
    line = {i: (0.1 * i, 0.3 + 0.05 * i) for i in range(6)}
    assert [delaunay_neighbours_of(i, line) for i in line] == [{1}, {0, 2}, {1, 3}, {2, 4}, {3, 5}, {4}]
    assert delaunay_neighbours_of("a", {"a": (0.1, 0.2), "b": (0.9, 0.1)}) == {"b"}
    assert delaunay_neighbours_of("a", {"a": (0.1, 0.2)}) == set()
    assert delaunay_neighbours_of("a", {"a": (0.1, 0.2), "b": (0.1, 0.2), "c": (0.5, 0.5)}) == {"c"}


def test_a_broker_does_not_load_scipy() -> None:
    # scipy's import was a third of a broker's start-up and ~35 MiB of its memory; a broker ranks, routes,
    # balances and computes its links without it.
    code = (
        "import sys, numpy as np; import broker.main; from overlay.candidates import triples_for; "
        "from overlay.geometry import delaunay_neighbours_of; rng = np.random.default_rng(1); "
        "triples_for(rng.random((60, 2)), rng.random((200, 2))); "
        "delaunay_neighbours_of(0, dict(enumerate(map(tuple, rng.random((40, 2)).tolist())))); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_nearest_k_orders_by_distance() -> None:
    pts = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.4, 0.4]])
    assert nearest_k(pts, np.array([[0.1, 0.0]]), 3).tolist() == [[0, 3, 1]]
    assert closest({"a": (0.0, 0.0), "b": (1.0, 0.0)}, (0.5, 0.0), 2) == ["a", "b"]  # tie broken by key


@pytest.mark.parametrize("n", [5, NEAREST_NUMPY_NODES, NEAREST_NUMPY_NODES + 1, 100, 300])
def test_nearest_nodes_answers_what_closest_answers(n: int) -> None:
    # The broker ranks many coordinates at once after a view change (numpy pre-selection above
    # NEAREST_NUMPY_NODES): the answer must be closest()'s exactly, ties included, or brokers would disagree
    # on a topic's N_1.
    rng = np.random.default_rng(n)
    nodes = {f"n{i}": (float(x), float(y)) for i, (x, y) in enumerate(rng.random((n, 2)))}
    coords = [(float(x), float(y)) for x, y in rng.random((600, 2))]
    coords += list(nodes.values())[:20]  # a coordinate exactly at a node
    # exact ties: two nodes mirrored about a coordinate, and the coordinate between them
    nodes["tie-b"], nodes["tie-a"] = (0.25, 0.5), (0.75, 0.5)
    coords.append((0.5, 0.5))
    near = NearestNodes(nodes)
    for k in (1, 3, 4):
        assert near(coords, k) == [closest(nodes, c, k) for c in coords]
    assert near([(0.5, 0.5)], n + 2) == [closest(nodes, (0.5, 0.5), n + 2)]  # k beyond the node count
    assert near([], 3) == []
    pair = NearestNodes({"b": (0.0, 0.0), "a": (1.0, 0.0)})
    assert pair([(0.5, 0.0)], 2) == [["a", "b"]]  # tie broken by key, as closest does
