"""Writes the three small OpenDRIVE test maps of this folder (run it to regenerate them; the .xodr files are kept).

    python tests/data/xodr/make_maps.py

* ``roundabout_no_signals.xodr`` - a one-lane roundabout (lane centre radius 30 m) with four two-way approach roads
  of 120 m, each closed by a keyhole turnaround, so every lane can reach every other; no signals, no stop lines.
* ``whole_length_junction.xodr`` - a four-way junction whose approach roads are exactly 600, 100, 200 and 100 m long
  and whose straight connecting roads are exactly 20 m long (whole multiples of the 1 m / 2 m / 5 m waypoint
  spacing), with keyhole turnarounds at the far ends. carla's ``next_until_lane_end`` raises "distance > 0.0" on
  the 600 m road at 1 m spacing (and on the 100/200 m ones at 5 m).
* ``width_taper.xodr`` - a two-way oval (150 m straights, 40 m radius ends, no junction) whose lane -1 on the first
  straight widens 3.0 -> 4.5 m along a cubic width polynomial, stays 4.5 m, and narrows back, all inside one lane
  section (three ``<width>`` records).

Everything is built from lines and arcs in the OpenDRIVE frame (right-handed, right-hand traffic: lane -1 drives
with s). Junction connecting roads carry one lane (-1) whose centre is the connecting curve; their reference line
is that curve offset half a lane to the left.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
W = 3.5  # approach lane width (m)

Pose = tuple[float, float, float]  # x, y, hdg


def advance(p: Pose, prim: tuple) -> Pose:
    """End pose of a ("line", L) or ("arc", L, k) primitive started at ``p``."""
    x, y, h = p
    if prim[0] == "line":
        return x + prim[1] * math.cos(h), y + prim[1] * math.sin(h), h
    _, length, k = prim
    h2 = h + k * length
    return x + (math.sin(h2) - math.sin(h)) / k, y + (math.cos(h) - math.cos(h2)) / k, h2


def left_of(p: Pose, d: float) -> Pose:
    return p[0] - d * math.sin(p[2]), p[1] + d * math.cos(p[2]), p[2]


def offset_left(prims: list[tuple], d: float) -> list[tuple]:
    """The primitives of the curve offset ``d`` to the left (arcs change radius, lines keep their length)."""
    out = []
    for prim in prims:
        if prim[0] == "line":
            out.append(prim)
            continue
        _, length, k = prim
        r = 1.0 / abs(k)
        sweep = length / r
        r2 = r - d * math.copysign(1.0, k)
        out.append(("arc", r2 * sweep, math.copysign(1.0 / r2, k)))
    return out


def connect(a: Pose, b: Pose) -> list[tuple]:
    """Line-arc-line from pose ``a`` to pose ``b`` (tangent at both ends)."""
    dh = math.atan2(math.sin(b[2] - a[2]), math.cos(b[2] - a[2]))
    ua, ub = (math.cos(a[2]), math.sin(a[2])), (math.cos(b[2]), math.sin(b[2]))
    if abs(dh) < 1e-9:
        return [("line", math.dist(a[:2], b[:2]))]
    # a + t ua = b - u ub  <=>  t ua + u ub = b - a
    det = ua[0] * ub[1] - ua[1] * ub[0]
    rx, ry = b[0] - a[0], b[1] - a[1]
    t = (rx * ub[1] - ry * ub[0]) / det
    u = (ua[0] * ry - ua[1] * rx) / det
    assert t > 0 and u > 0, (a, b, t, u)
    tan_len = min(t, u)
    r = tan_len / math.tan(abs(dh) / 2)
    prims = []
    if t - tan_len > 1e-6:
        prims.append(("line", t - tan_len))
    prims.append(("arc", r * abs(dh), math.copysign(1.0 / r, dh)))
    if u - tan_len > 1e-6:
        prims.append(("line", u - tan_len))
    return prims


@dataclass
class Road:
    id: int
    start: Pose  # reference line start
    prims: list[tuple]
    right: list[tuple[int, list[tuple[float, float, float, float, float]]]]  # (lane id, width records)
    left: list[tuple[int, list[tuple[float, float, float, float, float]]]] = field(default_factory=list)
    junction: int = -1
    pred: tuple | None = None  # ("road", id, contact) or ("junction", id)
    succ: tuple | None = None
    lane_links: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)  # lane -> (pred, succ)
    speed_kmh: float | None = None

    @property
    def length(self) -> float:
        return sum(p[1] for p in self.prims)

    def end(self) -> Pose:
        p = self.start
        for prim in self.prims:
            p = advance(p, prim)
        return p

    def xml(self) -> str:
        def link(tag: str, v: tuple | None) -> str:
            if v is None:
                return ""
            if v[0] == "junction":
                return f'<{tag} elementType="junction" elementId="{v[1]}"/>'
            return f'<{tag} elementType="road" elementId="{v[1]}" contactPoint="{v[2]}"/>'

        out = [f'  <road name="Road {self.id}" length="{self.length:.12g}" id="{self.id}" junction="{self.junction}">',
               f"    <link>{link('predecessor', self.pred)}{link('successor', self.succ)}</link>"]
        if self.speed_kmh:
            out.append(f'    <type s="0" type="town"><speed max="{self.speed_kmh:g}" unit="km/h"/></type>')
        out.append("    <planView>")
        s, p = 0.0, self.start
        for prim in self.prims:
            body = "<line/>" if prim[0] == "line" else f'<arc curvature="{prim[2]:.15g}"/>'
            out.append(f'      <geometry s="{s:.12g}" x="{p[0]:.12g}" y="{p[1]:.12g}" hdg="{p[2]:.15g}" '
                       f'length="{prim[1]:.12g}">{body}</geometry>')
            s += prim[1]
            p = advance(p, prim)
        out.append("    </planView>")
        out.append('    <lanes>\n      <laneSection s="0">')

        def lanes(side: str, items: list) -> None:
            if not items:
                return
            out.append(f"        <{side}>")
            for lid, widths in items:
                pred, succ = self.lane_links.get(lid, (None, None))
                ln = ""
                if pred is not None or succ is not None:
                    ln = "<link>" + (f'<predecessor id="{pred}"/>' if pred is not None else "") + \
                         (f'<successor id="{succ}"/>' if succ is not None else "") + "</link>"
                ws = "".join(f'<width sOffset="{w[0]:.12g}" a="{w[1]:.12g}" b="{w[2]:.12g}" c="{w[3]:.12g}" '
                             f'd="{w[4]:.12g}"/>' for w in widths)
                mark = "solid" if (side == "left" or len(items) == 1) else "broken"
                out.append(f'          <lane id="{lid}" type="driving" level="false">{ln}{ws}'
                           f'<roadMark sOffset="0" type="{mark}" weight="standard" color="standard" width="0.15" '
                           f'laneChange="none"/></lane>')
            out.append(f"        </{side}>")

        lanes("left", self.left)
        out.append('        <center><lane id="0" type="driving" level="false">'
                   '<roadMark sOffset="0" type="solid" weight="standard" color="standard" width="0.15" '
                   'laneChange="none"/></lane></center>')
        lanes("right", self.right)
        out.append("      </laneSection>\n    </lanes>\n  </road>")
        return "\n".join(out)


def const(w: float) -> list[tuple[float, float, float, float, float]]:
    return [(0.0, w, 0.0, 0.0, 0.0)]


def connector(rid: int, junction: int, a: Pose, b: Pose, pred: tuple, succ: tuple, pred_lane: int,
              succ_lane: int, width: float = W) -> Road:
    """A one-lane junction connecting road whose lane centre runs from lane-centre pose a to b."""
    prims = connect(a, b)
    return Road(rid, left_of(a, width / 2), offset_left(prims, width / 2), right=[(-1, const(width))],
                junction=junction, pred=pred, succ=succ, lane_links={-1: (pred_lane, succ_lane)})


def keyhole(rid: int, arm: Road) -> Road:
    """Turnaround closing a two-way road at its end: lane -1 of ``arm`` -> this road -> lane 1 of ``arm``."""
    alpha, r1 = math.radians(60.0), 8.0
    r2 = (W / 2 + r1 * (1 - math.cos(alpha))) / math.cos(alpha)
    centre = [("arc", r1 * alpha, -1 / r1), ("arc", r2 * (math.pi + 2 * alpha), 1 / r2), ("arc", r1 * alpha, -1 / r1)]
    return Road(rid, arm.end(), offset_left(centre, W / 2), right=[(-1, const(W))],
                pred=("road", arm.id, "end"), succ=("road", arm.id, "end"), lane_links={-1: (-1, 1)})


def two_way(rid: int, start: Pose, prims: list[tuple], pred: tuple | None, succ: tuple | None,
            right_w=None, left_w=None, links: dict | None = None) -> Road:
    return Road(rid, start, prims, right=[(-1, right_w or const(W))], left=[(1, left_w or const(W))],
                pred=pred, succ=succ, lane_links=links or {}, speed_kmh=40)


def document(name: str, roads: list[Road], junctions: list[tuple[int, list[tuple[int, int, int, str, int, int]]]]
             ) -> str:
    out = ['<?xml version="1.0" encoding="UTF-8"?>', "<OpenDRIVE>",
           f'  <header revMajor="1" revMinor="4" name="{name}" version="1" vendor="carl tests">',
           "    <geoReference><![CDATA[+lat_0=4.9000000000000000e+1 +lon_0=8.0000000000000000e+0]]></geoReference>",
           "  </header>"]
    out += [r.xml() for r in roads]
    for jid, conns in junctions:
        out.append(f'  <junction id="{jid}" name="junction {jid}">')
        for cid, incoming, connecting, contact, lf, lt in conns:
            out.append(f'    <connection id="{cid}" incomingRoad="{incoming}" connectingRoad="{connecting}" '
                       f'contactPoint="{contact}"><laneLink from="{lf}" to="{lt}"/></connection>')
        out.append("  </junction>")
    out.append("</OpenDRIVE>\n")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ the maps
def roundabout() -> str:
    rc, wr = 30.0, 4.0  # ring lane centre radius and width
    rref = rc - wr / 2
    beta = math.radians(25.0)  # half the angular span of each junction on the ring
    r0, arm_len = 45.0, 120.0
    angles = [math.radians(a) for a in (0.0, 90.0, 180.0, 270.0)]
    n = len(angles)
    roads: list[Road] = []
    junctions = []
    arm = {k: 10 + k for k in range(n)}
    ring = {k: 20 + k for k in range(n)}  # ring segment after junction k
    loop = {k: 30 + k for k in range(n)}

    def ring_pose(angle: float, radius: float) -> Pose:
        return radius * math.cos(angle), radius * math.sin(angle), angle + math.pi / 2

    for k, phi in enumerate(angles):
        jk = 100 + k
        a = two_way(arm[k], (r0 * math.cos(phi), r0 * math.sin(phi), phi), [("line", arm_len)],
                    pred=("junction", jk), succ=("road", loop[k], "start"), links={-1: (None, -1), 1: (None, -1)})
        roads += [a, keyhole(loop[k], a)]
        nxt = angles[(k + 1) % n] + (2 * math.pi if k + 1 == n else 0.0)
        sweep = (nxt - beta) - (phi + beta)
        roads.append(Road(ring[k], ring_pose(phi + beta, rref), [("arc", rref * sweep, 1 / rref)],
                          right=[(-1, const(wr))], pred=("junction", jk), succ=("junction", 100 + (k + 1) % n),
                          speed_kmh=30))
    for k, phi in enumerate(angles):
        jk, prev = 100 + k, ring[(k - 1) % n]
        base = 200 + 10 * k
        # through the junction on the ring
        thru = Road(base, ring_pose(phi - beta, rref), [("arc", rref * 2 * beta, 1 / rref)], right=[(-1, const(wr))],
                    junction=jk, pred=("road", prev, "end"), succ=("road", ring[k], "start"),
                    lane_links={-1: (-1, -1)})
        u = (math.cos(phi), math.sin(phi))
        # inbound lane (id 1) centre: left of the outward axis; outbound lane (-1): right of it
        left_n = (-u[1], u[0])
        p_in = (r0 * u[0] + W / 2 * left_n[0], r0 * u[1] + W / 2 * left_n[1], phi + math.pi)
        p_out = (r0 * u[0] - W / 2 * left_n[0], r0 * u[1] - W / 2 * left_n[1], phi)
        entry = connector(base + 1, jk, p_in, ring_pose(phi + beta, rc), pred=("road", arm[k], "start"),
                          succ=("road", ring[k], "start"), pred_lane=1, succ_lane=-1)
        exit_ = connector(base + 2, jk, ring_pose(phi - beta, rc), p_out, pred=("road", prev, "end"),
                          succ=("road", arm[k], "start"), pred_lane=-1, succ_lane=-1)
        roads += [thru, entry, exit_]
        junctions.append((jk, [(0, prev, thru.id, "start", -1, -1), (1, prev, exit_.id, "start", -1, -1),
                               (2, arm[k], entry.id, "start", 1, -1)]))
    return document("roundabout_no_signals", roads, junctions)


def cross() -> str:
    half = 10.0
    arm_lens = (600.0, 100.0, 200.0, 100.0)  # carla's next_until_lane_end fails on the 600 m one at 1 m spacing
    roads: list[Road] = []
    conns = []
    jid = 100
    dirs = [0.0, math.pi / 2, math.pi, 3 * math.pi / 2]
    for k, phi in enumerate(dirs):
        a = two_way(10 + k, (half * math.cos(phi), half * math.sin(phi), phi), [("line", arm_lens[k])],
                    pred=("junction", jid), succ=("road", 30 + k, "start"), links={-1: (None, -1), 1: (None, -1)})
        roads += [a, keyhole(30 + k, a)]

    def lane_pose(k: int, inbound: bool) -> Pose:
        phi = dirs[k]
        u, ln = (math.cos(phi), math.sin(phi)), (-math.sin(phi), math.cos(phi))
        side = 1.0 if inbound else -1.0
        return (half * u[0] + side * W / 2 * ln[0], half * u[1] + side * W / 2 * ln[1],
                phi + (math.pi if inbound else 0.0))

    cid = 0
    for k in range(4):
        for turn in (1, 2, 3):  # to the arm 90, 180, 270 degrees counter-clockwise: right turn, straight, left turn
            m = (k + turn) % 4
            rid = 200 + 10 * k + turn
            c = connector(rid, jid, lane_pose(k, True), lane_pose(m, False), pred=("road", 10 + k, "start"),
                          succ=("road", 10 + m, "start"), pred_lane=1, succ_lane=-1)
            roads.append(c)
            conns.append((cid, 10 + k, rid, "start", 1, -1))
            cid += 1
    return document("whole_length_junction", roads, [(jid, conns)])


def taper_records(w0: float, w1: float, length: float, s_off: float) -> tuple[float, float, float, float, float]:
    """Cubic width record from w0 to w1 over ``length`` with zero slope at both ends."""
    dw = w1 - w0
    return (s_off, w0, 0.0, 3 * dw / length ** 2, -2 * dw / length ** 3)


TAPER = [taper_records(3.0, 4.5, 60.0, 0.0), (60.0, 4.5, 0.0, 0.0, 0.0), taper_records(4.5, 3.0, 60.0, 90.0)]


def oval() -> str:
    straight, radius, w = 150.0, 40.0, 3.0
    arc = ("arc", math.pi * radius, 1 / radius)
    p0: Pose = (0.0, 0.0, 0.0)
    p1 = advance(p0, ("line", straight))
    p2 = advance(p1, arc)
    p3 = advance(p2, ("line", straight))
    links = {-1: (-1, -1), 1: (1, 1)}
    ids = [1, 2, 3, 4]
    starts = [p0, p1, p2, p3]
    prims = [[("line", straight)], [arc], [("line", straight)], [arc]]
    roads = []
    for i in range(4):
        roads.append(two_way(ids[i], starts[i], prims[i], pred=("road", ids[i - 1], "end"),
                             succ=("road", ids[(i + 1) % 4], "start"), right_w=TAPER if i == 0 else const(w),
                             left_w=const(w), links=links))
    return document("width_taper", roads, [])


def main() -> None:
    for name, text in (("roundabout_no_signals", roundabout()), ("whole_length_junction", cross()),
                       ("width_taper", oval())):
        (HERE / f"{name}.xodr").write_text(text)
        print(HERE / f"{name}.xodr")


if __name__ == "__main__":
    main()
