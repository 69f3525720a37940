"""Geometry: hash, space validation, Delaunay/Voronoi, N_j(c) and greedy forwarding."""

from __future__ import annotations

import math

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
