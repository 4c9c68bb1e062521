"""``carl-data`` and data fetched on first use (envs/data.py): the real download path (pooch, HTTP) against a local
server on 127.0.0.1 that serves the development copy ``../shared/data`` laid out as a mirror (``<root>/<name>``)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from envs import data

LOCAL = data.local_root()  # taken before any test hides it
pytestmark = pytest.mark.skipif(LOCAL is None, reason="the development copy ../shared/data is not here")
COUNTS = {"carla-maps": 8, "longest6-v2": 37, "longest6-v1": 37, "val14": 3}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Mirror:
    """A mirror site in ``folder`` (links to the development copy) served over HTTP on 127.0.0.1."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.truncate = folder, set()
        for ds in data.datasets():
            for f in data.files(ds):
                (folder / f.path).parent.mkdir(parents=True, exist_ok=True)
                (folder / f.path).symlink_to(LOCAL / f.path)
        mirror = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def copyfile(self, source, outputfile) -> None:
                if self.path.lstrip("/") in mirror.truncate:  # the full Content-Length is sent, half the body
                    outputfile.write(source.read()[: os.fstat(source.fileno()).st_size // 2])
                    return
                super().copyfile(source, outputfile)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(Handler, directory=str(folder)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def corrupt(self, path: str) -> None:
        """Replace the served file by a copy with one byte changed."""
        raw = bytearray((LOCAL / path).read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        (self.folder / path).unlink()
        (self.folder / path).write_bytes(bytes(raw))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache, no mirror, no config file, no CARL_CARLA_MAPS and no development copy; returns the cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(data.ENV_DIR, str(cache))
    monkeypatch.delenv(data.ENV_MIRROR, raising=False)
    monkeypatch.delenv("CARL_CARLA_MAPS", raising=False)
    monkeypatch.setenv(data.ENV_CONFIG, str(tmp_path / "no-config.toml"))
    monkeypatch.setattr(data, "_overrides", {"dir": None, "mirror": None})
    monkeypatch.setattr(data, "local_root", lambda: None)
    return cache


@pytest.fixture
def mirror(tmp_path: Path, request: pytest.FixtureRequest) -> Mirror:
    site = Mirror(tmp_path / "site")
    request.addfinalizer(site.stop)
    return site


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_files(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------------------------ registry
def test_registry_names_public_sources_and_matches_the_development_copy() -> None:
    assert {ds: len(data.files(ds)) for ds in data.datasets()} == COUNTS
    for ds in data.datasets():
        for f in data.files(ds):
            assert re.fullmatch(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/\S+", f.url), f.url
            local = LOCAL / f.path
            assert local.stat().st_size == f.size and sha256(local) == f.sha256, f.path
    assert data.entry("carla-maps", "Town10HD.xodr").path == "carla/maps/Town10HD.xodr"
    with pytest.raises(data.DataError, match="did you mean carla-maps"):
        data.files("carla-map")
    with pytest.raises(data.DataError, match="a data reference is data:<dataset>/<file>"):
        data.data_path("data:val14")
    assert data.data_path("../some/route.xml") == "../some/route.xml"  # explicit paths are left as they are


# ------------------------------------------------------------------------------------------------------ fetching
def test_carl_data_fetch_carla_maps_through_the_mirror(isolated: Path, mirror: Mirror) -> None:
    """The console script, as a user runs it: 8 maps downloaded over HTTP and verified; a second run fetches nothing."""
    exe = Path(sys.executable).with_name("carl-data")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "envs.data"]
    env = {**os.environ, data.ENV_MIRROR: mirror.url}
    out = subprocess.run([*cmd, "fetch", "carla-maps"], check=False, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"from mirror {mirror.url} (CARL_DATA_MIRROR)" in out.stdout
    assert out.stdout.count("sha256 ok") == 8 and "ready (8 fetched, 0 already cached)" in out.stdout
    maps = data.files("carla-maps")
    assert cache_files(isolated) == {f.path for f in maps}  # no temporary files left
    for f in maps:
        assert sha256(isolated / f.path) == f.sha256 == sha256(LOCAL / f.path)
    again = subprocess.run([*cmd, "fetch", "carla-maps"], check=False, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "ready (0 fetched, 8 already cached)" in again.stdout


def test_corrupted_file_on_the_server_is_refused(isolated: Path, mirror: Mirror, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(data.ENV_MIRROR, mirror.url)
    assert data.main(["fetch", "val14", "--no-progress"]) == 0
    good = isolated / "nuplan/val14_split.yaml"
    expected = data.entry("val14", "val14_split.yaml").sha256
    assert sha256(good) == expected
    mirror.corrupt("nuplan/val14_split.yaml")
    capsys.readouterr()
    assert data.main(["fetch", "val14", "--force", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "val14/val14_split.yaml" in err and f"{mirror.url}/nuplan/val14_split.yaml" in err
    assert f"mirror {mirror.url} (set by CARL_DATA_MIRROR)" in err and "refused" in err and "Fix:" in err
    assert sha256(good) == expected  # the good cached copy is kept
    assert cache_files(isolated) == {f.path for f in data.files("val14")}  # no staging or temporary files left
    # a damaged cached file is not replaced by a damaged download either, and is repaired once the mirror is
    good.write_bytes(good.read_bytes()[:100])
    with pytest.raises(data.DataError, match="sha256"):
        data.data_file("val14", "val14_split.yaml", progress=False)
    assert good.stat().st_size == 100
    (mirror.folder / "nuplan/val14_split.yaml").write_bytes((LOCAL / "nuplan/val14_split.yaml").read_bytes())
    assert sha256(data.data_file("val14", "val14_split.yaml", progress=False)) == expected


def test_partial_download_never_replaces_a_good_file(isolated: Path, mirror: Mirror,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(data.ENV_MIRROR, mirror.url)
    f = data.entry("carla-maps", "Town02.xodr")
    good = data.fetch_file(f, progress=False)
    mirror.truncate.add(f.path)  # the connection closes half-way through the body
    with pytest.raises(data.DataError) as exc:
        data.fetch_file(f, force=True, progress=False)
    assert "carla-maps/Town02.xodr: cannot fetch" in str(exc.value) and f"{mirror.url}/{f.path}" in str(exc.value)
    assert sha256(good) == f.sha256 and cache_files(isolated) == {f.path}


def test_unreachable_url(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv(data.ENV_MIRROR, url)
    with pytest.raises(data.DataError) as exc:
        data.data_file("longest6-v2", "longest6_v2.xml", progress=False)
    msg = str(exc.value)
    assert msg.startswith("longest6-v2/longest6_v2.xml: cannot fetch")
    assert f"{url}/carla/routes/longest6_v2.xml: connection refused" in msg
    assert "set by CARL_DATA_MIRROR" in msg and "Fix: check that the mirror is reachable" in msg
    # without a mirror: the public URL and how to set one
    monkeypatch.delenv(data.ENV_MIRROR)
    f = dataclasses.replace(data.entry("val14", "val14_split.yaml"), url=f"{url}/tuplan/val14_split.yaml")
    with pytest.raises(data.DataError) as exc:
        data.fetch_file(f, progress=False)
    msg = str(exc.value)
    assert f"cannot fetch {f.url}: connection refused" in msg and "no mirror set (CARL_DATA_MIRROR" in msg
    assert "carl-data fetch val14` on a machine with internet access" in msg
    assert not isolated.exists() or cache_files(isolated) == set()


def test_mirror_folder_and_config_file(isolated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The config file's keys (dir relative to the file), overridden by the environment and by flags; a mirror may be
    a local folder laid out like the cache."""
    cfg = tmp_path / "conf" / "data.toml"
    cfg.parent.mkdir()
    cfg.write_text(f'dir = "../from-config"\nmirror = "{LOCAL}"\n')
    monkeypatch.setenv(data.ENV_CONFIG, str(cfg))
    monkeypatch.delenv(data.ENV_DIR)
    assert data.cache_dir() == tmp_path / "conf" / ".." / "from-config"
    assert data.mirror() == (str(LOCAL), f"'mirror' in {cfg}")
    assert data.main(["fetch", "val14", "--no-progress"]) == 0
    assert "from mirror" in capsys.readouterr().out
    assert sha256(tmp_path / "from-config/nuplan/val14_split.yaml") == data.entry("val14", "val14_split.yaml").sha256
    monkeypatch.setenv(data.ENV_DIR, str(isolated))
    assert data.cache_dir() == isolated
    assert data.main(["list", "--dir", str(tmp_path / "from-config")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"val14\s+3\s+0\.8 MB\s+cached", out) and re.search(r"carla-maps\s+8\s+17\.5 MB\s+fetched on", out)
    assert data.cache_dir() == isolated  # the flag held for that command only
    cfg.write_text('mirrors = "x"\n')
    with pytest.raises(data.DataError, match="unknown key"):
        data.mirror()


# --------------------------------------------------------------------------------------------------- first use
def test_first_use_fetches_maps_routes_and_splits(isolated: Path, mirror: Mirror, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """With ../shared/data hidden, the readers fetch what they open: a town map, the longest6 route file of the
    benchmark config, the Val14 split yaml; only those files."""
    from carl.eval.benchmarks import resolve_benchmark
    from carl.cli import load_config
    from envs.maps import opendrive
    from envs.nuplan.reader import load_split_yaml

    monkeypatch.setenv(data.ENV_MIRROR, mirror.url)
    assert opendrive.default_maps_dir() is None and "Town10HD" in opendrive.available_towns()

    class Opened(Exception):
        pass

    def stop_at_compile(path: Path, name: str | None = None, **_: object) -> None:
        raise Opened(str(path))

    monkeypatch.setattr(opendrive, "load_opendrive", stop_at_compile)  # the file is what matters, not compiling it
    with pytest.raises(Opened) as opened:
        opendrive.load_town("Town02", cache_dir=tmp_path / "npz")
    assert opened.value.args[0] == str(isolated / "carla/maps/Town02.xodr")
    with pytest.raises(opendrive.MapError, match="unknown town 'Town99'.*Town01"):
        opendrive.load_town("Town99")

    bench = resolve_benchmark(load_config("eval", ["benchmark=longest6"])["benchmark"])
    assert bench.num_routes == 36
    assert bench.groups[0].options["route_file"] == str(isolated / "carla/routes/longest6_v2.xml")
    assert len(load_split_yaml("data:val14/val14_split.yaml")["scenario_tokens"]) == 1118
    assert cache_files(isolated) == {"carla/maps/Town02.xodr", "carla/routes/longest6_v2.xml",
                                     "nuplan/val14_split.yaml"}
    err = capsys.readouterr().err
    assert err.count("carl-data: first use of") == 3 and "first use of carla-maps/Town02.xodr" in err
    # the second use reads the cache: nothing is fetched, even with the server gone
    mirror.stop()
    assert data.data_path("data:longest6-v2/longest6_v2.xml") == str(isolated / "carla/routes/longest6_v2.xml")
    assert "first use" not in capsys.readouterr().err


def test_development_copy_is_used_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(data.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(data.ENV_CONFIG, str(tmp_path / "no-config.toml"))
    monkeypatch.setattr(data, "_overrides", {"dir": None, "mirror": None})
    monkeypatch.setenv(data.ENV_MIRROR, f"http://127.0.0.1:{closed_port()}")  # nothing may be fetched
    assert data.data_file("carla-maps", "Town01.xodr") == LOCAL / "carla/maps/Town01.xodr"
    assert data.dataset_dir("longest6-v1") == LOCAL / "carla/routes"
    assert not (tmp_path / "cache").exists()
