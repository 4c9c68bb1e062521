"""Benchmark data that fetches itself: the CARLA town maps, the Longest6 route files and the nuPlan Val14 splits.

``envs/data_registry.json`` names the datasets (``carla-maps``, ``longest6-v2``, ``longest6-v1``, ``val14``) and,
per file, its public source (a ``raw.githubusercontent.com`` URL at a fixed commit) and its sha256. A file has one
place in the data layout, ``<root>/<name>`` (e.g. ``carla/maps/Town01.xodr``): the same under the development copy
``<repo>/../shared/data``, the cache and a mirror.

:func:`data_file` is the one lookup the readers use (``load_town``, benchmark route files, split yamls): the
development copy when present, else the verified cached file, else a download (with a progress bar) into the cache.
Config values such as ``route_file: data:longest6-v2/longest6_v2.xml`` name a registry file; :func:`data_path`
resolves them and returns any other path unchanged.

Settings (a ``configure()`` call or a ``carl-data --dir/--mirror`` flag first, then the environment variable, then the
key in the config file ``$CARL_DATA_CONFIG`` or ``~/.config/carl/data.toml``, then the default):

* cache folder: ``CARL_DATA_DIR`` / key ``dir``; default ``~/.cache/carl/data``;
* mirror: ``CARL_DATA_MIRROR`` / key ``mirror``: a base URL (``https://host/carl-data``) or a local folder laid out
  like the cache; it replaces the public host for every file (offline sites).

Downloads go through pooch: into a temporary file beside the target, checked against the sha256, then renamed, so
a partial or corrupted download never replaces a good file. ``carl-data`` (:func:`main`) fetches, lists and locates
datasets. Errors are :class:`DataError`, naming the file, the URL, the mirror setting and the fix.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DataError", "DataFile", "cache_dir", "configure", "data_file", "data_path", "dataset_dir", "datasets",
           "fetch", "files", "local_root", "main", "mirror"]

REGISTRY_FILE = Path(__file__).with_name("data_registry.json")
DATA_PREFIX = "data:"  # config values "data:<dataset>/<name>" name a registry file
ENV_DIR, ENV_MIRROR, ENV_CONFIG = "CARL_DATA_DIR", "CARL_DATA_MIRROR", "CARL_DATA_CONFIG"
CONFIG_KEYS = ("dir", "mirror")
DEFAULT_DIR = Path.home() / ".cache" / "carl" / "data"
TIMEOUT_S = 60.0  # per HTTP request (connect and each read)
_overrides: dict[str, str | None] = {"dir": None, "mirror": None}  # configure() / command-line flags
_verified: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256 already checked this process


class DataError(RuntimeError):
    """A dataset file that cannot be found, fetched or verified; the message says which and how to fix it."""


@dataclass(frozen=True)
class DataFile:
    dataset: str
    name: str  # inside the dataset, e.g. "Town01.xodr" or "longest6_v2_split/00.xml"
    path: str  # in the data layout (development copy, cache, mirror): "<root>/<name>"
    url: str  # the public source
    sha256: str
    size: int


# ------------------------------------------------------------------------------------------------------ registry
@functools.cache
def _registry() -> dict[str, list[DataFile]]:
    raw = json.loads(REGISTRY_FILE.read_text())["datasets"]
    return {ds: [DataFile(ds, name, f"{spec['root']}/{name}", e["url"], e["sha256"], int(e["size"]))
                 for name, e in spec["files"].items()] for ds, spec in raw.items()}


@functools.cache
def _descriptions() -> dict[str, str]:
    return {ds: spec.get("description", "") for ds, spec in json.loads(REGISTRY_FILE.read_text())["datasets"].items()}


def datasets() -> list[str]:
    """The registry's dataset names."""
    return list(_registry())


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f"did you mean {close[0]}? " if close else ""


def files(dataset: str) -> list[DataFile]:
    """The files of ``dataset``; :class:`DataError` for an unknown name."""
    reg = _registry()
    if dataset not in reg:
        raise DataError(f"unknown dataset {dataset!r}; {_did_you_mean(dataset, list(reg))}"
                        f"the datasets are {', '.join(reg)} (carl-data list)")
    return reg[dataset]


def entry(dataset: str, name: str) -> DataFile:
    """The registry entry of file ``name`` of ``dataset``."""
    by_name = {f.name: f for f in files(dataset)}
    if name not in by_name:
        raise DataError(f"dataset {dataset} has no file {name!r}; {_did_you_mean(name, list(by_name))}"
                        f"it has {', '.join(list(by_name)[:8])}{' ...' if len(by_name) > 8 else ''}")
    return by_name[name]


# ------------------------------------------------------------------------------------------------------ settings
def configure(data_dir: str | Path | None = None, mirror: str | Path | None = None) -> None:
    """Set the cache folder and the mirror for this process (before the environment variables and the config
    file); ``None`` leaves a setting to them."""
    _overrides["dir"] = None if data_dir is None else str(data_dir)
    _overrides["mirror"] = None if mirror is None else str(mirror)


def config_file() -> Path:
    """``$CARL_DATA_CONFIG``, else ``$XDG_CONFIG_HOME/carl/data.toml`` (``~/.config/carl/data.toml``)."""
    if os.environ.get(ENV_CONFIG):
        return Path(os.environ[ENV_CONFIG]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "carl" / "data.toml"


def _config() -> dict[str, Any]:
    path = config_file()
    if not path.is_file():
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        cfg = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"data config file {path} cannot be read: {exc}; fix or remove it") from None
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise DataError(f"data config file {path}: unknown key(s) {', '.join(unknown)}; the keys are "
                        f"{', '.join(CONFIG_KEYS)}")
    if "dir" in cfg:  # relative to the config file's folder
        cfg["dir"] = str(path.parent / Path(str(cfg["dir"])).expanduser())
    return cfg


def _setting(key: str, env: str) -> tuple[str | None, str]:
    """(value, where it was set) for ``key``: configure()/flag, environment variable, config file key, unset."""
    if _overrides[key]:
        return _overrides[key], f"--{key}"
    if os.environ.get(env):
        return os.environ[env], env
    value = _config().get(key)
    if value:
        return str(value), f"'{key}' in {config_file()}"
    return None, ""


def cache_dir() -> Path:
    """Where fetched files live: ``CARL_DATA_DIR`` / config key ``dir``, default ``~/.cache/carl/data``."""
    value, _ = _setting("dir", ENV_DIR)
    return Path(value).expanduser() if value else DEFAULT_DIR


def mirror() -> tuple[str | None, str]:
    """(the mirror, where it was set), ``(None, "")`` when files come from their public sources."""
    return _setting("mirror", ENV_MIRROR)


def _mirror_folder(value: str) -> Path | None:
    """The local folder a mirror value names, None for a URL."""
    if value.startswith("file://"):
        return Path(value[len("file://"):])
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", value):
        return None
    return Path(value).expanduser()


def _mirror_note() -> str:
    value, where = mirror()
    if value:
        return f"mirror {value} (set by {where})"
    return (f"no mirror set ({ENV_MIRROR} or key 'mirror' in {config_file()}: a base URL or a folder laid out as "
            "<root>/<name>, e.g. carla/maps/Town01.xodr)")


def source(f: DataFile) -> str:
    """Where ``f`` is fetched from: ``<mirror>/<path>`` with a mirror set, else its public URL."""
    value, _ = mirror()
    if not value:
        return f.url
    folder = _mirror_folder(value)
    return str(folder / f.path) if folder is not None else f"{value.rstrip('/')}/{f.path}"


# ---------------------------------------------------------------------------------------------------- locations
def local_root() -> Path | None:
    """The development copy ``<repo>/../shared/data`` if it exists (a source checkout), else None."""
    d = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return d if d.is_dir() else None


def local_file(f: DataFile) -> Path | None:
    """``f`` in the development copy, used as it is; None without one."""
    root = local_root()
    p = root / f.path if root is not None else None
    return p if p is not None and p.is_file() else None


def cached_file(f: DataFile) -> Path:
    return cache_dir() / f.path


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _verified:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        _verified[key] = h.hexdigest()
    return _verified[key]


def is_cached(f: DataFile) -> bool:
    """``f`` is in the cache with the registry's sha256."""
    p = cached_file(f)
    return p.is_file() and _sha256(p) == f.sha256


# ------------------------------------------------------------------------------------------------------ fetching
def _copy_downloader(url: str, output_file: str, pooch: Any, check_only: bool = False,
                     progressbar: Any = None) -> bool | None:
    """pooch downloader for a mirror folder: ``url`` is the path of the file there."""
    src = Path(url)
    if check_only:
        return src.is_file()
    if not src.is_file():
        raise FileNotFoundError(f"no such file {src}")
    with open(src, "rb") as fin, open(output_file, "wb") as fout:
        for block in iter(lambda: fin.read(1 << 16), b""):
            fout.write(block)
            if progressbar is not None:
                progressbar.update(len(block))
    if progressbar is not None:
        progressbar.close()
    return None


def _reason(exc: BaseException) -> str:
    """A short reason for a failed download (requests' messages run to several nested exceptions)."""
    import requests

    text = str(exc)
    if isinstance(exc, requests.HTTPError) and exc.response is not None:
        return f"HTTP {exc.response.status_code} {exc.response.reason}"
    if isinstance(exc, requests.Timeout):
        return f"no answer within {TIMEOUT_S:.0f} s"
    if isinstance(exc, requests.ConnectionError):
        for pattern, says in (("refused", "connection refused"), ("resolve|Name or service|getaddrinfo",
                                                                  "host name not resolved"),
                              ("unreachable", "network unreachable")):
            if re.search(pattern, text):
                return says
        return "cannot connect"
    return text[:300]


@contextlib.contextmanager
def _quiet_pooch() -> Iterator[None]:
    """pooch logs every download at INFO; carl-data prints its own lines."""
    import pooch

    logger = pooch.get_logger()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def fetch_file(f: DataFile, force: bool = False, progress: bool = True) -> Path:
    """Download ``f`` into the cache (unless it is there, verified, and not ``force``) and return its path.

    pooch downloads into a temporary file beside the target, checks the sha256 and only then renames it; with
    ``force`` the file is fetched into a staging folder first, so a good cached copy stays if the download fails.
    """
    import pooch
    import requests
    from tqdm.auto import tqdm

    dest = cached_file(f)
    if not force and is_cached(f):
        return dest
    url = source(f)
    bar = tqdm(total=f.size, desc=f.path, unit="B", unit_scale=True, leave=False,
               disable=None if progress else True)  # None: shown on a terminal only
    value, where = mirror()
    if value and _mirror_folder(value) is not None:
        downloader: Callable = functools.partial(_copy_downloader, progressbar=bar)
    else:
        downloader = pooch.HTTPDownloader(progressbar=bar, chunk_size=1 << 16, timeout=TIMEOUT_S)
    root = cache_dir()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        bar.close()
        raise DataError(f"{f.dataset}/{f.name}: cannot create the cache folder {dest.parent} ({exc.strerror}); set "
                        f"{ENV_DIR} (or key 'dir' in {config_file()}) to a writable folder") from None
    try:
        staging = tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") if force else contextlib.nullcontext()
        with _quiet_pooch(), staging as folder:
            got = pooch.retrieve(url, known_hash=f"sha256:{f.sha256}", fname=f.path, path=folder or root,
                                 downloader=downloader)
            if force:
                os.replace(got, dest)
    except ValueError as exc:  # pooch: the hash of the download does not match
        m = re.search(r"but got ([0-9a-f]+)", str(exc))
        kept = "the cached file is unchanged" if dest.is_file() else "nothing was saved"
        raise DataError(
            f"{f.dataset}/{f.name}: the file from {url} has sha256 {m.group(1) if m else '(other)'}, expected "
            f"{f.sha256}; refused ({kept}: {dest}). Source: {_mirror_note()}. Fix: "
            + (f"the mirror holds a different or damaged copy: replace its {f.path} with the verified file (run "
               f"`carl-data fetch {f.dataset}` on a machine with internet access and copy its cache folder), or "
               f"unset the mirror ({where}) to fetch from the public source" if value else
               f"retry (a damaged transfer), or point {ENV_MIRROR} at a copy that matches")) from None
    except (requests.RequestException, OSError) as exc:
        raise DataError(
            f"{f.dataset}/{f.name}: cannot fetch {url}: {_reason(exc)}. Source: {_mirror_note()}. Fix: "
            + (f"check that the mirror is reachable and holds {f.path}, or unset the mirror ({where}) to use the "
               "public source" if value else
               f"check the network (and proxy); offline, run `carl-data fetch {f.dataset}` on a machine with "
               f"internet access and set {ENV_MIRROR} to a copy of its cache folder (or copy that folder to "
               f"{root} here)")) from None
    finally:
        bar.close()
    _verified[(str(dest), dest.stat().st_size, dest.stat().st_mtime_ns)] = f.sha256
    return dest


def fetch(dataset: str, force: bool = False, progress: bool = True,
          log: Callable[[str], None] | None = print) -> list[Path]:
    """Put every file of ``dataset`` in the cache (verified); return their paths. Cached files are kept unless
    ``force``."""
    fs = files(dataset)
    if log:
        log(f"{dataset}: {len(fs)} files, {_size(sum(f.size for f in fs))}, from {_from()} into "
            f"{cache_dir() / _common_root(fs)}")
    out, new = [], 0
    for f in fs:
        had = not force and is_cached(f)
        out.append(fetch_file(f, force=force, progress=progress))
        new += not had
        if log:
            log(f"  {f.name:<40} {_size(f.size):>9}  sha256 ok{'  (already cached)' if had else ''}")
    if log:
        log(f"{dataset}: ready ({new} fetched, {len(fs) - new} already cached)")
    return out


def _from() -> str:
    value, where = mirror()
    return f"mirror {value} ({where})" if value else "the public sources (raw.githubusercontent.com)"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _common_root(fs: list[DataFile]) -> str:
    return os.path.commonpath([str(Path(f.path).parent) for f in fs])


# ---------------------------------------------------------------------------------------------------- resolving
def data_file(dataset: str, name: str, progress: bool = True) -> Path:
    """File ``name`` of ``dataset``: the development copy when present, else the verified cached file, else
    fetched now (first use) into the cache."""
    f = entry(dataset, name)
    local = local_file(f)
    if local is not None:
        return local
    if is_cached(f):
        return cached_file(f)
    print(f"carl-data: first use of {dataset}/{name}: fetching {_size(f.size)} from {source(f)} into {cache_dir()} "
          f"(`carl-data fetch {dataset}` prepares it in advance)", file=sys.stderr)
    return fetch_file(f, progress=progress)


def parse_ref(ref: str) -> tuple[str, str]:
    """``"data:<dataset>/<name>"`` (or without the prefix) -> ``(dataset, name)``."""
    body = ref.removeprefix(DATA_PREFIX)
    dataset, _, name = body.partition("/")
    if not dataset or not name:
        raise DataError(f"{ref!r}: a data reference is {DATA_PREFIX}<dataset>/<file>, e.g. "
                        f"{DATA_PREFIX}longest6-v2/longest6_v2.xml (carl-data list)")
    return dataset, name


def data_path(value: str | Path) -> str:
    """A config path: ``data:<dataset>/<file>`` -> the local file (:func:`data_file`); any other path unchanged."""
    if isinstance(value, str) and value.startswith(DATA_PREFIX):
        return str(data_file(*parse_ref(value)))
    return str(value)


def dataset_dir(dataset: str, progress: bool = True) -> Path:
    """The folder holding every file of ``dataset`` as ``<folder>/<name>``: the development copy if it has them
    all, else the cache (missing files fetched)."""
    fs = files(dataset)
    sub = _common_root(fs)
    if all(local_file(f) is not None for f in fs):
        return local_root() / sub  # type: ignore[operator]
    for f in fs:
        fetch_file(f, progress=progress)
    return cache_dir() / sub


# ------------------------------------------------------------------------------------------------------ carl-data
def _state(dataset: str) -> str:
    fs = files(dataset)
    if all(local_file(f) is not None for f in fs):
        return "development copy"
    n = sum(is_cached(f) for f in fs)
    return "cached" if n == len(fs) else f"cached {n}/{len(fs)}" if n else "fetched on first use"


def _cmd_list(_: argparse.Namespace) -> None:
    value, where = mirror()
    _, dir_from = _setting("dir", ENV_DIR)
    print(f"cache:  {cache_dir()}" + (f"  (set by {dir_from})" if dir_from else f"  (default; {ENV_DIR} to change)"))
    print(f"mirror: {value} (set by {where})" if value else f"mirror: none, public sources ({ENV_MIRROR} to set)")
    root = local_root()
    print(f"development copy: {root if root is not None else 'none'}")
    print(f"{'dataset':<12} {'files':>5} {'size':>9}  {'state':<21} description")
    for ds in datasets():
        fs = files(ds)
        print(f"{ds:<12} {len(fs):>5} {_size(sum(f.size for f in fs)):>9}  {_state(ds):<21} {_descriptions()[ds]}")


def _cmd_fetch(args: argparse.Namespace) -> None:
    names = datasets() if args.names == ["all"] else args.names
    for ds in names:
        files(ds)  # every name is checked before anything is fetched
    for ds in names:
        fetch(ds, force=args.force, progress=not args.no_progress)


def _cmd_path(args: argparse.Namespace) -> None:
    if "/" in args.name:
        print(data_file(*parse_ref(args.name), progress=not args.no_progress))
    else:
        print(dataset_dir(args.name, progress=not args.no_progress))


def main(argv: list[str] | None = None) -> int:
    """``carl-data list | fetch NAME... | path NAME[/FILE]``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", help=f"cache folder (default: ${ENV_DIR}, key 'dir' in the config file, "
                                      f"{DEFAULT_DIR})")
    common.add_argument("--mirror", help=f"base URL or local folder replacing the public sources (default: "
                                         f"${ENV_MIRROR}, key 'mirror' in the config file)")
    common.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap = argparse.ArgumentParser(prog="carl-data", description="Benchmark data: CARLA maps, Longest6 routes, "
                                 "nuPlan Val14 splits; fetched on first use, or in advance with `carl-data fetch`.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", parents=[common], help="the datasets and where they are").set_defaults(run=_cmd_list)
    p = sub.add_parser("fetch", parents=[common], help="download datasets into the cache, verified by sha256")
    p.add_argument("names", nargs="+", metavar="NAME", help="dataset names (carl-data list), or 'all'")
    p.add_argument("--force", action="store_true", help="download again even if cached (a good copy stays if "
                                                        "the download fails)")
    p.set_defaults(run=_cmd_fetch)
    p = sub.add_parser("path", parents=[common], help="print the folder of a dataset (or DATASET/FILE: the file), "
                                                      "fetching what is missing")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(run=_cmd_path)
    args = ap.parse_args(argv)
    saved = dict(_overrides)
    configure(args.dir or _overrides["dir"], args.mirror or _overrides["mirror"])
    try:
        args.run(args)
    except DataError as exc:
        print(f"carl-data: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _overrides.update(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
