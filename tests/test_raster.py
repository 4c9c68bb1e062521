"""Map raster compilation and batched BEV drawing on a hand-made straight two-lane road."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from envs.maps.lanegraph import MARK_BROKEN, MARK_SOLID, Lane, LaneGraph
from envs.maps.rasterize import (LAYER_CROSSWALK, LAYER_JUNCTION, LAYER_MARKINGS, LAYER_ROAD, LAYER_SHOULDER,
                              LAYER_SPEED_SIGNS, MapRaster, compile_raster, load_or_compile_raster, speed_encoding)
from envs.sim import bev_draw
from envs.sim.bev_draw import (BevConfig, box_fraction_on, crop_static, draw_boxes, draw_discs, draw_segments,
                             world_to_bev)
from envs.sim.render import bev_to_rgb, overlay_text, write_frames

LENGTH, WIDTH = 100.0, 3.5


def two_lane_graph() -> LaneGraph:
    """Two same-direction lanes along +x: lane 0 centred on y=0, lane 1 (its left neighbour) on y=3.5."""
    right = Lane(points=np.array([[0.0, 0.0], [LENGTH, 0.0]]), width=WIDTH, left=1,
                 left_marking=MARK_BROKEN, right_marking=MARK_SOLID)
    left = Lane(points=np.array([[0.0, WIDTH], [LENGTH, WIDTH]]), width=WIDTH, right=0,
                left_marking=MARK_SOLID, right_marking=MARK_BROKEN)
    junction = Lane(points=np.array([[LENGTH, 0.0], [LENGTH + 10.0, 0.0]]), width=WIDTH, is_junction=True)
    crosswalk = np.array([[[60, -1.75], [64, -1.75], [64, 5.25], [60, 5.25]]], np.float32)
    signs = np.array([[30.0, -5.0, 13.89]], np.float32)
    shoulder = [(np.array([[0.0, -3.0], [LENGTH, -3.0]]), 1.0)]
    return LaneGraph.build("straight", [right, left, junction], crosswalks=crosswalk, shoulders=shoulder,
                           speed_signs=signs)


@pytest.fixture(scope="module")
def graph() -> LaneGraph:
    return two_lane_graph()


@pytest.fixture(scope="module")
def raster(graph: LaneGraph) -> MapRaster:
    return compile_raster(graph, ppm=4.0)


def _at(raster: MapRaster, x: float, y: float, layer: int | None = None) -> int:
    """Value of a layer (or the seg_id when ``layer`` is None) at a world point."""
    c, r = raster.world_to_pixel(torch.tensor([x, y])).floor().long().tolist()
    return int(raster.seg_id[r, c] if layer is None else raster.layers[layer, r, c])


# ---------------------------------------------------------------------------------------------------- compile
def test_road_covers_the_lanes(raster: MapRaster) -> None:
    road = raster.layers[LAYER_ROAD]
    ppm2 = raster.ppm ** 2
    expected = (2 * LENGTH * WIDTH + 10.0 * WIDTH) * ppm2
    assert abs(int((road > 0).sum()) - expected) < 0.02 * expected
    assert _at(raster, 50, 0, LAYER_ROAD) == 255 and _at(raster, 50, 5.0, LAYER_ROAD) == 255
    assert _at(raster, 50, -2.2, LAYER_ROAD) == 0 and _at(raster, 50, 5.7, LAYER_ROAD) == 0
    assert _at(raster, -1.0, 0, LAYER_ROAD) == 0
    assert _at(raster, 105, 0, LAYER_JUNCTION) == 255 and _at(raster, 50, 0, LAYER_JUNCTION) == 0


def test_seg_id_picks_the_right_lane(graph: LaneGraph, raster: MapRaster) -> None:
    lane1_first = int(graph.offsets[1])
    assert _at(raster, 50.3, -1.0) == 50  # lane 0, segment 50 -> 51
    assert _at(raster, 50.3, 0.6) == 50
    assert _at(raster, 50.3, 2.9) == lane1_first + 50
    assert _at(raster, 50.3, 4.5) == lane1_first + 50
    assert _at(raster, 50.3, -2.5) == 50  # inside the 1 m margin
    assert _at(raster, 50.3, -4.0) == -1
    # junction lane only where no ordinary lane covers the pixel
    assert _at(raster, 99.7, 0.3) == 99
    assert _at(raster, 104.3, 0.3) == int(graph.offsets[2]) + 4
    covered = raster.seg_id[raster.layers[LAYER_ROAD] > 0]
    assert bool((covered >= 0).all()), "road pixels without a lane segment"


def test_markings_and_other_layers(raster: MapRaster) -> None:
    assert _at(raster, 50, -1.75, LAYER_MARKINGS) == 255
    assert _at(raster, 50, 5.25, LAYER_MARKINGS) == 255
    # the shared boundary is broken: value 127, with gaps
    row = int(raster.world_to_pixel(torch.tensor([0.0, 1.75])).floor()[1])
    c0, c1 = raster.world_to_pixel(torch.tensor([[5.0, 0.0], [95.0, 0.0]])).floor()[:, 0].long().tolist()
    line = raster.layers[LAYER_MARKINGS, row - 1:row + 2, c0:c1].amax(0)
    assert int(line.max()) == 127 and 0.3 < float((line > 0).float().mean()) < 0.7
    assert _at(raster, 50, 0.0, LAYER_MARKINGS) == 0 and _at(raster, 105, 1.75, LAYER_MARKINGS) == 0
    assert _at(raster, 62, 1.0, LAYER_CROSSWALK) == 255 and _at(raster, 58, 1.0, LAYER_CROSSWALK) == 0
    assert _at(raster, 30.5, -5.5, LAYER_SPEED_SIGNS) == int(speed_encoding(13.89))
    assert _at(raster, 50, -3.0, LAYER_SHOULDER) == 255 and _at(raster, 50, -4.0, LAYER_SHOULDER) == 0


def test_compile_is_deterministic_and_cached(graph: LaneGraph, raster: MapRaster, tmp_path) -> None:
    again = compile_raster(graph, ppm=4.0)
    assert torch.equal(again.layers, raster.layers) and torch.equal(again.seg_id, raster.seg_id)
    first = load_or_compile_raster(graph, 4.0, tmp_path)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    loaded = load_or_compile_raster(graph, 4.0, tmp_path)
    assert torch.equal(loaded.layers, first.layers) and torch.equal(loaded.seg_id, first.seg_id)
    assert loaded.origin == first.origin and loaded.ppm == first.ppm
    load_or_compile_raster(graph, 2.0, tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 2


# ---------------------------------------------------------------------------------------------------- BEV
CFG = BevConfig()


def test_crop_static_geometry(raster: MapRaster) -> None:
    ego = torch.tensor([[20.13, 0.21]])
    bev = crop_static(raster, [LAYER_ROAD, LAYER_MARKINGS], ego, torch.zeros(1), CFG)
    assert bev.shape == (1, 2, 256, 256) and bev.dtype == torch.uint8
    road = bev[0, 0] > 0
    c0, r0 = CFG.ego_col, CFG.ego_row
    assert c0 == 128 and r0 == 155
    # straight ahead (up) the road reaches the top edge; behind it ends 20 m (40 px) back
    assert bool(road[: r0 + 1, c0].all())
    assert bool(road[r0 + 38, c0]) and not bool(road[r0 + 43, c0])
    # the road spans y in [-1.75, 5.25]: 3.5 m + 0.21 to the right, 5.04 m to the left, 2 px per metre
    cols = torch.nonzero(road[100]).flatten()
    assert abs(int(cols.min()) - (c0 - 5.04 * 2)) <= 1.5 and abs(int(cols.max()) - (c0 + 1.96 * 2)) <= 1.5
    # the solid right boundary appears as a vertical line right of the ego
    mark = bev[0, 1]
    right_col = int(round(c0 + 1.96 * 2))
    assert int(mark[50:150, right_col - 1:right_col + 2].amax(1).min()) == 255
    # off the map everything is 0
    far = crop_static(raster, [LAYER_ROAD], torch.tensor([[5000.0, 5000.0]]), torch.zeros(1), CFG)
    assert int(far.sum()) == 0


def test_crop_static_rotation(raster: MapRaster) -> None:
    ego = torch.tensor([[20.13, 0.21], [20.13, 0.21]])
    yaw = torch.tensor([0.0, math.pi / 2])
    bev = crop_static(raster, [LAYER_ROAD], ego, yaw, CFG)[:, 0]
    r0, c0 = CFG.ego_row, CFG.ego_col
    a = torch.arange(-60, 61)
    # a world offset (dx, dy) = (a, b) / ppm appears at (r0 - a, c0 - b) heading +x and at (r0 - b, c0 + a) heading +y
    aa, bb = torch.meshgrid(a, a, indexing="ij")
    same = bev[1][r0 - bb, c0 + aa] == bev[0][r0 - aa, c0 - bb]
    assert float(same.float().mean()) > 0.99
    # heading +y, the road runs left-right through the ego
    assert bool(bev[1][r0, c0 - 30:c0 + 100].all()) and not bool(bev[1][r0 - 40, c0])


def test_crop_static_deterministic(raster: MapRaster) -> None:
    g = torch.Generator().manual_seed(0)
    ego = torch.rand(16, 2, generator=g) * 100
    yaw = torch.rand(16, generator=g) * 6.28
    a = crop_static(raster, [0, 1, 2, 3, 4], ego, yaw, BevConfig(size=128))
    b = crop_static(raster, [0, 1, 2, 3, 4], ego, yaw, BevConfig(size=128))
    assert torch.equal(a, b)
    # each batch element matches its single-element crop (no cross-talk between chunks)
    c = crop_static(raster, [0, 1, 2, 3, 4], ego[5:6], yaw[5:6], BevConfig(size=128))
    assert torch.equal(a[5:6], c)


def test_world_to_bev() -> None:
    ego, yaw = torch.tensor([[10.0, 5.0]]), torch.tensor([math.pi / 2])
    px = world_to_bev(torch.tensor([[[10.0, 15.0], [12.0, 5.0]]]), ego, yaw, CFG)[0]
    assert torch.allclose(px[0], torch.tensor([128.0, 155.0 - 20.0]), atol=1e-4)  # 10 m ahead
    assert torch.allclose(px[1], torch.tensor([128.0 + 4.0, 155.0]), atol=1e-4)  # 2 m to the right


@pytest.fixture(params=["valid objects only", "fixed shapes"])
def draw_path(request, monkeypatch) -> None:
    """Both drawing paths: CPU's (only the valid objects) and CUDA's (every object, fixed shapes), on CPU."""
    monkeypatch.setattr(bev_draw, "COMPACT_DEVICES", ("cpu",) if request.param == "valid objects only" else ())


def _ego0() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, 2), torch.zeros(2)


@pytest.mark.usefixtures("draw_path")
def test_draw_boxes_area_location_max_and_valid() -> None:
    ego, eyaw = _ego0()
    canvas = torch.zeros(2, 256, 256, dtype=torch.uint8)
    # centre at BEV (col, row) = (127.5, 134.5): 10.25 m ahead, 0.25 m left
    # boxes: 4 m x 2 m, 2 m x 2 m at the same place, one far outside the view, one in view but invalid
    center = torch.tensor([[[10.25, 0.25], [10.25, 0.25], [500.0, 50.0], [30.0, 0.0]]]).expand(2, 4, 2)
    yaw = torch.zeros(2, 4)
    he = torch.tensor([[[2.0, 1.0], [1.0, 1.0], [2.0, 1.0], [2.0, 1.0]]]).expand(2, 4, 2)
    value = torch.tensor([[200, 100, 255, 255], [100, 200, 255, 255]], dtype=torch.uint8)
    valid = torch.tensor([[True, True, False, False], [True, True, True, False]])
    draw_boxes(canvas, center, yaw, he, value, valid, ego, eyaw, CFG, max_extent_m=3.0)
    assert int((canvas[0] > 0).sum()) == 32  # 4 m x 2 m at 2 px/m
    rows, cols = torch.nonzero(canvas[0], as_tuple=True)
    assert (int(rows.min()), int(rows.max()), int(cols.min()), int(cols.max())) == (131, 138, 126, 129)
    assert int(canvas[0].max()) == 200 and int(canvas[0, 134, 127]) == 200
    # element 1: the smaller box carries 200 over the larger one's 100; the third box is far outside the view
    assert int(canvas[1, 134, 127]) == 200 and int(canvas[1, 132, 127]) == 100
    assert int((canvas[1] > 0).sum()) == 32
    # rotated by 90 degrees the box lies across
    canvas2 = torch.zeros(1, 256, 256, dtype=torch.uint8)
    draw_boxes(canvas2, center[:1, :1], torch.full((1, 1), math.pi / 2), he[:1, :1], 255,
               torch.ones(1, 1, dtype=torch.bool), ego[:1], eyaw[:1], CFG, 3.0)
    rows, cols = torch.nonzero(canvas2[0], as_tuple=True)
    assert int(rows.max() - rows.min()) == 3 and int(cols.max() - cols.min()) == 7


@pytest.mark.usefixtures("draw_path")
def test_draw_into_channel_slice_and_primitives() -> None:
    ego, eyaw = _ego0()
    obs = torch.zeros(2, 3, 64, 64, dtype=torch.uint8)
    cfg = BevConfig(size=64, ppm=2.0, ego_from_bottom=20)
    valid = torch.ones(2, 1, dtype=torch.bool)
    draw_boxes(obs[:, 1], torch.tensor([[[5.0, 0.0]]]).expand(2, 1, 2), torch.zeros(2, 1),
               torch.tensor([[[1.0, 1.0]]]).expand(2, 1, 2), 99, valid, ego, eyaw, cfg, 2.0)
    assert int(obs[:, 0].sum()) == 0 and int(obs[:, 2].sum()) == 0 and int((obs[:, 1] == 99).sum()) > 0
    draw_discs(obs[:, 2], torch.zeros(2, 1, 2), 3, 255, valid, ego, eyaw, cfg)
    disc = obs[0, 2] > 0
    assert bool(disc[cfg.ego_row, cfg.ego_col]) and 25 <= int(disc.sum()) <= 40
    canvas = torch.zeros(2, 64, 64, dtype=torch.uint8)
    draw_segments(canvas, torch.zeros(2, 1, 2), torch.tensor([[[5.0, 0.0]]]).expand(2, 1, 2), 0.1, 255, valid,
                  ego, eyaw, cfg, max_length_m=10.0)
    on = torch.nonzero(canvas[0])
    assert int(on[:, 1].unique().numel()) == 1 and 9 <= on.shape[0] <= 12  # 1 px wide, 5 m = 10 px long
    # a 3 px thick line 5 m to the left, and a diagonal one without gaps
    canvas.zero_()
    draw_segments(canvas, torch.zeros(2, 1, 2), torch.tensor([[[0.0, 5.0]], [[4.0, 4.0]]]), 1.5, 255, valid,
                  ego, eyaw, cfg, max_length_m=10.0)
    on = torch.nonzero(canvas[0])
    assert int(on[:, 0].unique().numel()) == 3 and 30 <= on.shape[0] <= 36
    rows = torch.nonzero(canvas[1])[:, 0]
    assert int(rows.unique().numel()) == int(rows.max() - rows.min()) + 1 >= 11
    # objects not valid draw nothing: a disc and a segment 10 m ahead, valid on the first row only
    canvas.zero_()
    ahead = torch.tensor([[[10.0, 0.0]]]).expand(2, 1, 2)
    first = torch.tensor([[True], [False]])
    draw_discs(canvas, ahead, 2, 255, first, ego, eyaw, cfg)
    draw_segments(canvas, ahead, ahead + torch.tensor([0.0, 3.0]), 0.5, 255, first, ego, eyaw, cfg)
    assert int(canvas[0, cfg.ego_row - 20, cfg.ego_col]) == 255 and int(canvas[1].sum()) == 0


def test_box_fraction_on(raster: MapRaster) -> None:
    center = torch.tensor([[50.0, 0.0], [500.0, 500.0], [50.0, -2.0]])
    yaw = torch.tensor([0.3 * 0, 0.0, 0.0])
    he = torch.tensor([[2.4, 1.0]]).expand(3, 2)
    frac = box_fraction_on(raster, [LAYER_ROAD, LAYER_SHOULDER], center, yaw, he)
    assert frac[0] == 1.0 and frac[1] == 0.0 and 0.2 < float(frac[2]) < 0.8


# ---------------------------------------------------------------------------------------------------- render
def test_render(raster: MapRaster, tmp_path) -> None:
    bev = torch.zeros(10, 256, 256, dtype=torch.uint8)
    bev[[0, 2, 9]] = crop_static(raster, [LAYER_ROAD, LAYER_MARKINGS, LAYER_SHOULDER], torch.tensor([[20.0, 0.0]]),
                                 torch.zeros(1))[0]
    img = overlay_text(bev_to_rgb(bev), ["step 3", "reward 0.5"])
    assert img.shape == (256, 256, 3) and img.dtype == np.uint8
    assert tuple(img[CFG.ego_row, CFG.ego_col]) == (250, 220, 0)
    assert write_frames([img], tmp_path / "a.png").exists()
    out = write_frames([img, img], tmp_path / "b.mp4", fps=5)
    assert out.exists() and out.suffix in (".mp4", ".gif")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(raster: MapRaster) -> None:
    g = torch.Generator().manual_seed(1)
    ego = torch.rand(8, 2, generator=g) * 100
    yaw = torch.rand(8, generator=g) * 6.28
    cpu = crop_static(raster, [0, 2], ego, yaw)
    gpu = crop_static(raster.to("cuda"), [0, 2], ego.cuda(), yaw.cuda())
    assert float((cpu == gpu.cpu()).float().mean()) > 0.999
    canvas = torch.zeros(8, 256, 256, dtype=torch.uint8)
    center = ego[:, None] + torch.randn(8, 5, 2, generator=g) * 10
    args = (torch.rand(8, 5, generator=g), torch.tensor([2.0, 1.0]).expand(8, 5, 2), 200,
            torch.ones(8, 5, dtype=torch.bool))
    draw_boxes(canvas, center, *args, ego, yaw)
    cg = canvas.cuda().zero_()
    draw_boxes(cg, center.cuda(), *[a.cuda() if isinstance(a, torch.Tensor) else a for a in args], ego.cuda(),
               yaw.cuda())
    assert float((canvas == cg.cpu()).float().mean()) > 0.999


def test_crop_static_into_out(raster: MapRaster) -> None:
    ego, yaw = torch.tensor([[20.0, 1.0], [40.0, 2.0]]), torch.tensor([0.1, 2.0])
    ref = crop_static(raster, [LAYER_ROAD, LAYER_MARKINGS, LAYER_SHOULDER], ego, yaw, CFG)
    obs = torch.zeros(2, 10, 256, 256, dtype=torch.uint8)
    got = crop_static(raster, [LAYER_ROAD, LAYER_MARKINGS, LAYER_SHOULDER], ego, yaw, CFG, out=obs,
                      out_channels=[0, 2, 9])
    assert got is obs and torch.equal(obs[:, [0, 2, 9]], ref) and int(obs[:, [1, 3, 4, 5, 6, 7, 8]].sum()) == 0
