"""Geometry of the SeDAX overlay: coordinate space, geographic hash, Delaunay/Voronoi, N_j(c), greedy routing.

Pure functions over coordinates; no I/O, no clocks.  The broker uses the same functions on the nodes it knows
(itself, its Delaunay neighbours and their neighbours); the simulator uses them on the whole node set.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from scipy.spatial import cKDTree

Coord = tuple[float, float]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
K = TypeVar("K")

# Two coordinates closer than this are "the same place": the overlay refuses a second broker there, because
# greedy forwarding and the Voronoi partition both need distinct sites.
MIN_SITE_SEPARATION: Final = 1e-9

# Relative tolerance for collinearity tests; coordinates are doubles in a space of order 1.
_COLLINEAR_EPS: Final = 1e-12


class BadCoordinate(ValueError):
    """A coordinate is not a finite point inside the configured space."""


@dataclass(frozen=True, slots=True)
class Space:
    """The rectangle [xmin, xmax] x [ymin, ymax] that holds node and topic coordinates (default: unit square)."""

    xmin: float = 0.0
    ymin: float = 0.0
    xmax: float = 1.0
    ymax: float = 1.0

    def __post_init__(self) -> None:
        vals = (self.xmin, self.ymin, self.xmax, self.ymax)
        if not all(math.isfinite(v) for v in vals):
            raise BadCoordinate(f"space bounds must be finite, got {vals}")
        if not (self.xmax > self.xmin and self.ymax > self.ymin):
            raise BadCoordinate(f"space must have positive width and height, got {vals}")

    @property
    def area(self) -> float:
        """Area of the rectangle."""
        return (self.xmax - self.xmin) * (self.ymax - self.ymin)

    @property
    def corners(self) -> list[Coord]:
        """The four corners, counter-clockwise from (xmin, ymin)."""
        return [
            (self.xmin, self.ymin),
            (self.xmax, self.ymin),
            (self.xmax, self.ymax),
            (self.xmin, self.ymax),
        ]

    def contains(self, c: Sequence[float]) -> bool:
        """True if c is a finite point of the closed rectangle."""
        if len(c) != 2:
            return False
        x, y = float(c[0]), float(c[1])
        return math.isfinite(x) and math.isfinite(y) and self.xmin <= x <= self.xmax and self.ymin <= y <= self.ymax

    def validate(self, c: Sequence[float], what: str = "coordinate") -> Coord:
        """Return c as a float pair, or raise BadCoordinate saying what is wrong with it."""
        try:
            x, y = float(c[0]), float(c[1])
            if len(c) != 2:
                raise BadCoordinate(f"{what} must have exactly two components, got {len(c)}")
        except (TypeError, IndexError, ValueError) as exc:
            raise BadCoordinate(f"{what} must be a pair of numbers, got {c!r}") from exc
        if not self.contains((x, y)):
            raise BadCoordinate(
                f"{what} ({x}, {y}) is outside the space "
                f"[{self.xmin}, {self.xmax}] x [{self.ymin}, {self.ymax}] or not finite"
            )
        return (x, y)

    def uniform(self, rng: np.random.Generator, n: int) -> FloatArray:
        """n coordinates drawn uniformly from the rectangle, shape (n, 2)."""
        pts = rng.random((n, 2))
        pts[:, 0] = self.xmin + pts[:, 0] * (self.xmax - self.xmin)
        pts[:, 1] = self.ymin + pts[:, 1] * (self.ymax - self.ymin)
        return pts

    def to_list(self) -> list[float]:
        """The bounds as [xmin, ymin, xmax, ymax] (the wire and config form)."""
        return [self.xmin, self.ymin, self.xmax, self.ymax]


UNIT_SQUARE: Final = Space()


def parse_coord(text: str, space: Space = UNIT_SQUARE) -> Coord:
    """Parse "X,Y" into a coordinate inside space, raising BadCoordinate with the reason."""
    parts = text.split(",")
    if len(parts) != 2:
        raise BadCoordinate(f"coordinate must be written X,Y, got {text!r}")
    try:
        c = (float(parts[0]), float(parts[1]))
    except ValueError as exc:
        raise BadCoordinate(f"coordinate must be two numbers X,Y, got {text!r}") from exc
    return space.validate(c)


def geohash(topic: str, space: Space = UNIT_SQUARE) -> Coord:
    """The geographic hash h(t) of a topic name: SHA-256 mapped uniformly into the space (Sec. I-A).

    The first two 64-bit words of the digest give x and y; 53 bits of each make a uniform double in [0, 1),
    so every broker and every client computes the same coordinate for the same name.
    """
    digest = hashlib.sha256(topic.encode("utf-8")).digest()
    ux = (int.from_bytes(digest[0:8], "big") >> 11) / float(1 << 53)
    uy = (int.from_bytes(digest[8:16], "big") >> 11) / float(1 << 53)
    return (space.xmin + ux * (space.xmax - space.xmin), space.ymin + uy * (space.ymax - space.ymin))


def distance(a: Sequence[float], b: Sequence[float]) -> float:
    """Euclidean distance d(a, b)."""
    return math.hypot(a[0] - b[0], a[1] - b[1])


def _order_key(d: float, key: object) -> tuple[float, str]:
    # Ties in distance are broken by the node key's text so every node, with the same view, picks the same one.
    return (d, str(key))


def closest(nodes: Mapping[K, Sequence[float]], c: Sequence[float], k: int = 1) -> list[K]:
    """N_1(c) .. N_k(c) among nodes: their keys ordered by distance to c, ties broken by key."""
    ranked = sorted(nodes.items(), key=lambda kv: _order_key(distance(kv[1], c), kv[0]))
    return [key for key, _ in ranked[:k]]


# Above this many nodes `NearestNodes` pre-selects each coordinate's candidates with numpy; at or below it, sorting
# them all per coordinate is as fast (measured per coordinate, k = 3: 125.6 against 33.3 µs at 100 nodes, 33.2
# against 26.5 at 32, 17.2 against 32.3 at 16).
NEAREST_NUMPY_NODES: Final = 32
# The relative margin of that pre-selection: a few ulps of rounding in a squared distance are far below it.
_NEAREST_MARGIN: Final = 1e-9
_NEAREST_CHUNK: Final = 256  # coordinates per numpy pass (a chunk x nodes matrix of squared distances)


class NearestNodes(Generic[K]):
    """N_1(c) .. N_k(c) among one set of nodes, for many coordinates: exactly what `closest` answers (the same
    distances, the same tie-break), without sorting every node per coordinate.

    A broker re-ranks every topic it holds, and every topic its sessions subscribe, when its view of the overlay
    changes; with a hundred brokers known, `closest` per topic cost ~0.1 ms, so a thousand topics held up the
    event loop (and a take-over behind it) for ~0.1 s.  Here numpy computes the squared distances of a chunk of
    coordinates to every node at once and keeps, per coordinate, the nodes no farther than its k-th smallest
    plus a relative margin (1e-9); `closest` orders those few exactly.  A node outside the margin has k nodes
    truly closer than it by far more than rounding moves a distance, so it is not among the first k whichever
    way `closest`'s own arithmetic rounds.  (`nearest_k`, the simulator's query, breaks ties in
    distance its own way; brokers must all pick the same N_1, so they rank with `closest`'s order.)"""

    def __init__(self, nodes: Mapping[K, Sequence[float]]) -> None:
        self._nodes = dict(nodes)
        self._keys = list(self._nodes)
        self._xy: FloatArray | None = None
        if len(self._keys) > NEAREST_NUMPY_NODES:
            self._xy = np.array([self._nodes[key] for key in self._keys], dtype=np.float64).reshape(-1, 2)

    def __call__(self, coords: Sequence[Sequence[float]], k: int = 1) -> list[list[K]]:
        """N_1 .. N_k of each coordinate, in the order given."""
        xy, nodes, keys = self._xy, self._nodes, self._keys
        if xy is None or not 0 < k < len(keys):
            return [closest(nodes, c, k) for c in coords]
        out: list[list[K]] = []
        for start in range(0, len(coords), _NEAREST_CHUNK):
            chunk = coords[start : start + _NEAREST_CHUNK]
            cs = np.array(chunk, dtype=np.float64).reshape(-1, 2)
            d2 = (cs[:, 0:1] - xy[:, 0]) ** 2 + (cs[:, 1:2] - xy[:, 1]) ** 2
            kth = np.partition(d2, k - 1, axis=1)[:, k - 1]
            # (+ the smallest normal double: a node exactly at the coordinate, kth 0, keeps its candidates)
            within = d2 <= (kth * (1.0 + _NEAREST_MARGIN))[:, None] + np.finfo(np.float64).tiny
            rows, cols = np.nonzero(within)  # (row by row: each coordinate's candidates are one stretch)
            ends = np.searchsorted(rows, np.arange(1, len(chunk) + 1)).tolist()
            picked = cols.tolist()
            begin = 0
            for c, end in zip(chunk, ends, strict=True):
                out.append(closest({keys[i]: nodes[keys[i]] for i in picked[begin:end]}, c, k))
                begin = end
        return out


def greedy_next_hop(
    self_key: K, self_coord: Sequence[float], neighbours: Mapping[K, Sequence[float]], target: Sequence[float]
) -> K | None:
    """Greedy geographic forwarding: the neighbour strictly closer to target than this node, closest first.

    Returns None when no neighbour is closer, i.e. this node is N_1(target).  On a Delaunay triangulation
    greedy forwarding always ends at the closest node (Lee & Lam, ICDCS 2007), so None means "deliver here".
    Ties between this node and a neighbour are broken by key, as in `closest`, so all nodes agree on N_1.
    """
    best_key: K | None = None
    best = _order_key(distance(self_coord, target), self_key)
    for key, coord in neighbours.items():
        cand = _order_key(distance(coord, target), key)
        if cand < best:
            best, best_key = cand, key
    return best_key


def _collinear(points: FloatArray) -> bool:
    if len(points) < 3:
        return True
    centred = points - points.mean(axis=0)
    sv = np.linalg.svd(centred, compute_uv=False)
    scale = max(float(sv[0]), 1e-300)
    return float(sv[1]) <= _COLLINEAR_EPS * scale * max(1.0, float(np.abs(points).max()))


def delaunay_neighbours(points: FloatArray) -> list[set[int]]:
    """Delaunay neighbour sets of points (shape (n, 2)), by index.

    Degenerate inputs have a defined answer too: one point has no neighbours, and points on one line are
    linked to their predecessor and successor along it (the limit of a triangulation of a flat point set),
    so a 2-node or collinear overlay is still connected and greedy routing still reaches the closest node.
    """
    n = len(points)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    if n <= 1:
        return nbrs
    if n == 2 or _collinear(points):
        centred = points - points.mean(axis=0)
        direction = np.linalg.svd(centred)[2][0]
        order = np.argsort(centred @ direction, kind="stable")
        for a, b in itertools.pairwise(order):
            nbrs[int(a)].add(int(b))
            nbrs[int(b)].add(int(a))
        return nbrs
    # scipy on demand: a broker needs only delaunay_neighbours_of, and scipy's import is a third of its start-up.
    from scipy.spatial import Delaunay, QhullError

    try:
        tri = Delaunay(points)
    except QhullError:
        # Nearly-flat sets that passed the collinearity test: joggle the input (Qhull's QJ) to get a valid
        # triangulation of the perturbed points, which is a triangulation of the originals up to ties.
        tri = Delaunay(points, qhull_options="QJ")
    indptr, indices = tri.vertex_neighbor_vertices
    for i in range(n):
        nbrs[i].update(int(j) for j in indices[indptr[i] : indptr[i + 1]])
    return nbrs


def delaunay_neighbour_map(sites: Mapping[K, Sequence[float]]) -> dict[K, set[K]]:
    """Delaunay neighbours keyed like sites (a mapping key -> coordinate), as brokers link them.

    Each site's set is `delaunay_neighbours_of`, what the brokers compute: the overlay checks (`cluster up`,
    `sedax brokers`, the tests) expect exactly the links the brokers make, on cocircular sites too, where a
    triangulation (`delaunay_neighbours`, Qhull's) would pick one diagonal.  For a broker cluster's sizes; the
    simulator's thousands of nodes use `delaunay_neighbours`.
    """
    return {k: delaunay_neighbours_of(k, sites) for k in sites}


# delaunay_neighbours_of: the enclosing square's half-side, in units of the sites' spread around the site.  An
# edge of the site's Voronoi cell that lies wholly farther out than this is missed: that takes three sites
# collinear to within ~1e-6 of their spread (a sliver that flat is a detour of nothing).
_CELL_BOX: Final = 1e6
# ... and how close to a site's bisector (relative to the vertex's own distance) a cell vertex must be to count
# as touching that site: four cocircular sites (a grid) have no unique triangulation, and a Voronoi vertex
# shared by four cells makes both diagonals neighbours rather than neither.
_TOUCH: Final = 1e-9

# A line a*x + b*y = c (the cell lies on its side a*x + b*y <= c), and whose it is: a site's bisector or None (the
# enclosing square's side).
_Line = tuple[float, float, float, object]


def delaunay_neighbours_of(me: K, sites: Mapping[K, Sequence[float]]) -> set[K]:
    """The Delaunay neighbours of sites[me] among sites: the sites whose Voronoi cell touches its own.

    What a broker needs of the triangulation (its own links), computed in pure Python from its Voronoi cell:
    a large square around the site clipped by each site's bisector, nearest first, until no farther bisector can
    reach the cell.  Each vertex is computed as the intersection of its two lines (not along an edge whose far end
    may be a million times farther out), so cells of closely spaced sites are as precise as any.  It spares a
    broker scipy (a third of its start-up, ~35 MiB of its memory).  Sites on one line are linked to their
    predecessor and successor, as in `delaunay_neighbours`.  Where the triangulation is not unique (cocircular
    sites) both choices are neighbours: the answer is then a superset of every Delaunay triangulation's, and
    the two ends of an edge agree.
    """
    px, py = (float(v) for v in sites[me])
    others = sorted(
        ((float(c[0]) - px, float(c[1]) - py, k) for k, c in sites.items() if k != me),
        key=lambda o: o[0] * o[0] + o[1] * o[1],
    )
    others = [o for o in others if o[0] or o[1]]  # (a second site at the same place has no bisector)
    if not others:
        return set()
    h = _CELL_BOX * math.sqrt(others[-1][0] ** 2 + others[-1][1] ** 2)
    sides: list[_Line] = [(0.0, -1.0, h, None), (1.0, 0.0, h, None), (0.0, 1.0, h, None), (-1.0, 0.0, h, None)]
    # The cell relative to the site, counter-clockwise: each vertex with the line of the edge that leaves it.
    cell: list[tuple[float, float, _Line]] = [
        (-h, -h, sides[0]),
        (h, -h, sides[1]),
        (h, h, sides[2]),
        (-h, h, sides[3]),
    ]
    reach2 = 2.0 * h * h  # the farthest vertex's squared distance from the site
    for dx, dy, key in others:
        d2 = dx * dx + dy * dy
        if d2 > 4.0 * reach2:
            break  # this bisector, and every later one, passes beyond the cell
        cell = _clip_cell(cell, (dx, dy, d2 / 2.0, key))  # closer to the site: (x, y) . (dx, dy) <= |d|^2 / 2
        reach2 = max(x * x + y * y for x, y, _ in cell)
    out: set[K] = set()
    # Vertices on a bisector (the square's own corners are not), with their tolerance.
    real = [
        (x, y, _TOUCH * math.sqrt(x * x + y * y))
        for i, (x, y, line) in enumerate(cell)
        if line[3] is not None or cell[i - 1][2][3] is not None
    ]
    for dx, dy, key in others:
        d2 = dx * dx + dy * dy
        if d2 > 4.0 * reach2 * (1.0 + _TOUCH):
            break
        d = math.sqrt(d2)
        half = d / 2.0
        # Touching: some vertex is (to the tolerance) on this site's bisector, i.e. as close to it as to the site.
        if any((x * dx + y * dy) / d - half >= -tol for x, y, tol in real):
            out.add(key)
    return out


def _clip_cell(cell: list[tuple[float, float, _Line]], cut: _Line) -> list[tuple[float, float, _Line]]:
    # Sutherland-Hodgman against cut's half-plane, as _clip; but a vertex where an edge crosses it is the
    # intersection of the edge's line with cut's, and the edge from there on lies on cut.  (_clip, which
    # interpolates along the edge, stays for voronoi_cell: the simulator's candidates are drawn from its
    # polygons, and the paper's tables are reproduced from them bit for bit.)
    a, b, c, _ = cut
    out: list[tuple[float, float, _Line]] = []
    n = len(cell)
    for i in range(n):
        x, y, line = cell[i]
        nx, ny, _ = cell[(i + 1) % n]
        fp = a * x + b * y - c
        fq = a * nx + b * ny - c
        if fp <= 0:
            out.append((x, y, line))
        if fp < 0 < fq:  # leaving: the edge goes on along cut
            ix, iy = _meet(line, cut)
            out.append((ix, iy, cut))
        elif fq < 0 < fp:  # entering: from the crossing on, the edge's own line
            ix, iy = _meet(line, cut)
            out.append((ix, iy, line))
    return out


def _meet(l1: _Line, l2: _Line) -> tuple[float, float]:
    # Cramer's rule; the two lines cross (an edge crossing cut is not parallel to it).
    a1, b1, c1, _ = l1
    a2, b2, c2, _ = l2
    det = a1 * b2 - a2 * b1
    return (c1 * b2 - c2 * b1) / det, (a1 * c2 - a2 * c1) / det


def hop_distances(neighbours: Sequence[Iterable[int]], source: int, max_hops: int) -> dict[int, int]:
    """Breadth-first hop counts from source up to max_hops in a neighbour graph given by index."""
    seen = {source: 0}
    frontier = [source]
    for h in range(1, max_hops + 1):
        nxt: list[int] = []
        for u in frontier:
            for w in neighbours[u]:
                if w not in seen:
                    seen[w] = h
                    nxt.append(w)
        frontier = nxt
    return seen


def _clip(poly: list[Coord], a: float, b: float, c: float) -> list[Coord]:
    # Sutherland-Hodgman against the half-plane a*x + b*y <= c.
    out: list[Coord] = []
    n = len(poly)
    for i in range(n):
        p, q = poly[i], poly[(i + 1) % n]
        fp = a * p[0] + b * p[1] - c
        fq = a * q[0] + b * q[1] - c
        if fp <= 0:
            out.append(p)
        if (fp < 0 < fq) or (fq < 0 < fp):
            t = fp / (fp - fq)
            out.append((p[0] + t * (q[0] - p[0]), p[1] + t * (q[1] - p[1])))
    return out


def voronoi_cell(site: Sequence[float], others: Iterable[Sequence[float]], space: Space = UNIT_SQUARE) -> list[Coord]:
    """Voronoi(v) clipped to the space: the convex polygon of points closer to site than to any of others.

    Passing only the Delaunay neighbours of the site gives the exact cell, since only they bound it.
    Vertices come counter-clockwise; an empty list means the cell has no area inside the space.
    """
    poly: list[Coord] = list(space.corners)
    sx, sy = float(site[0]), float(site[1])
    for o in others:
        ox, oy = float(o[0]), float(o[1])
        # |p - s|^2 <= |p - o|^2  <=>  2 (o - s) . p <= |o|^2 - |s|^2
        poly = _clip(poly, 2 * (ox - sx), 2 * (oy - sy), ox * ox + oy * oy - sx * sx - sy * sy)
        if not poly:
            break
    return poly


def polygon_area(poly: Sequence[Sequence[float]]) -> float:
    """Area of a simple polygon (shoelace formula)."""
    n = len(poly)
    if n < 3:
        return 0.0
    s = 0.0
    for i in range(n):
        x0, y0 = poly[i]
        x1, y1 = poly[(i + 1) % n]
        s += x0 * y1 - x1 * y0
    return abs(s) / 2.0


def voronoi_cells(points: FloatArray, space: Space = UNIT_SQUARE) -> list[list[Coord]]:
    """Voronoi cells of all points clipped to the space, by index."""
    nbrs = delaunay_neighbours(points)
    return [voronoi_cell(points[i], (points[j] for j in sorted(nbrs[i])), space) for i in range(len(points))]


def sample_in_polygon(poly: Sequence[Sequence[float]], n: int, rng: np.random.Generator) -> FloatArray:
    """n points uniform in a convex polygon (fan triangulation, area-weighted, then uniform in a triangle)."""
    if len(poly) < 3 or n <= 0:
        return np.empty((0, 2))
    p = np.asarray(poly, dtype=np.float64)
    a, b, c = p[0], p[1:-1], p[2:]
    areas = np.abs((b[:, 0] - a[0]) * (c[:, 1] - a[1]) - (c[:, 0] - a[0]) * (b[:, 1] - a[1])) / 2.0
    total = float(areas.sum())
    if total <= 0.0:
        return np.repeat(p[:1], n, axis=0)
    tri = rng.choice(len(areas), size=n, p=areas / total)
    r1 = rng.random(n)
    r2 = rng.random(n)
    flip = r1 + r2 > 1.0
    r1[flip], r2[flip] = 1.0 - r1[flip], 1.0 - r2[flip]
    out: FloatArray = a + r1[:, None] * (b[tri] - a) + r2[:, None] * (c[tri] - a)
    return out


# nearest_k computes every distance (no k-d tree) up to this many (point, query) pairs: ~2 ms in numpy.
_BRUTE_FORCE_PAIRS: Final = 100_000


def nearest_k(points: FloatArray, queries: FloatArray, k: int, tree: cKDTree | None = None) -> IntArray:
    """Indices of the k closest points for each query, shape (m, k): column j-1 is N_j(c)."""
    k_eff = min(k, len(points))
    if tree is None and len(points) * len(queries) <= _BRUTE_FORCE_PAIRS:
        # A broker's region (tens of sites, 200 candidates): every distance at once, without loading scipy.
        d2 = ((queries[:, None, :] - points[None, :, :]) ** 2).sum(axis=2)
        near: IntArray = np.argsort(d2, axis=1, kind="stable")[:, :k_eff].astype(np.int64)
        return near
    if tree is None:
        from scipy.spatial import cKDTree

        tree = cKDTree(points)
    _, idx = tree.query(queries, k=k_eff)
    out: IntArray = np.asarray(idx, dtype=np.int64).reshape(len(queries), k_eff)
    return out
