"""Shared test set-up. No process left behind: every process this test session starts carries an environment tag
(``CARL_PROCESS_TAG``, inherited by children and grandchildren, also after they are re-parented to init), and for
every test module with tests marked ``carla`` an autouse fixture checks at the end of the module that no process
started during the module is still alive: neither a descendant of this process nor a tagged process anywhere (a CARLA
server or stand-in that lost its owner). Survivors fail the module (error at teardown) and are killed.

With several pytest processes (``make test``: pytest-xdist, ``--dist loadfile``) a module runs whole in one of them,
so each module's census sees only its own processes (the tag names the pytest process); modules that start CARLA
stand-in servers use port blocks of their own (23000-23999, 24300, 24700, 24800, 25300-25499)."""
from __future__ import annotations

import os
import uuid

import pytest

from tests.support.processes import TAG_VAR, describe, kill_all, survivors, tagged, descendants, wait_for

SESSION_TAG = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ[TAG_VAR] = SESSION_TAG  # inherited by every process this session starts
LEFTOVER_TIMEOUT_S = 10.0  # servers get SIGTERM then SIGKILL after a 5 s grace: give them that long to go


@pytest.fixture(scope="session", autouse=True)
def temp_files_of_started_processes(tmp_path_factory: pytest.TempPathFactory):
    """The processes tests start write their temporary files (torchrun's ``torchelastic_*`` log folders, which it
    does not remove) under this session's pytest folder, not in the machine's /tmp."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmpdir"))
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind(request: pytest.FixtureRequest):
    """For modules with ``carla`` tests: no process started during the module survives it."""
    module = request.module
    if not any(getattr(item, "module", None) is module and item.get_closest_marker("carla")
               for item in request.session.items):
        yield
        return
    before = descendants(os.getpid()) | tagged(SESSION_TAG)
    yield
    left = wait_for(lambda: survivors(before, SESSION_TAG), LEFTOVER_TIMEOUT_S)
    if left:
        kill_all(left)
        pytest.fail(f"{len(left)} process(es) started by {module.__name__} outlived it:\n{describe(left)}",
                    pytrace=False)



# modules of 30 s and more on a 2-core Zen 3, longest first: with several pytest processes (--dist loadfile) they
# start first, so that no long module is left running alone at the end
LONG_MODULES = ("test_sweeps", "test_parallel_launch", "test_carla_worker", "test_train_cli", "test_carla_lifetime",
                "test_parallel_sync", "test_eval_carla", "test_config", "test_nuplan_score", "test_carla_train")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long modules first (in :data:`LONG_MODULES` order), then the rest as collected; tests keep their order."""
    def rank(item: pytest.Item) -> int:
        name = item.module.__name__.split(".")[-1] if item.module is not None else ""
        return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)  # stable
