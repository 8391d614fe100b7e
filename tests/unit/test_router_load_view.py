"""The load view (services/router/load_view.py): admission reads the router as a whole the same
way with one process (LocalLoad) and with several (SharedLoad, two views of one state file
standing for two processes), and the view each process gets is chosen from its settings once."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from services.common.config import RouterSettings
from services.router.admission import Admission
from services.router.errors import APIError
from services.router.load_view import LOCAL, LocalLoad, SharedLoad, load_view
from services.router.shared_state import SharedState, state_path, worker_key
from services.router.sibling_metrics import OwnMetrics, SiblingMetrics

pytestmark = pytest.mark.timeout(30)


def _refused(admission: Admission, cost: int) -> int:
    with pytest.raises(APIError) as e:
        admission.admit(cost)
    return e.value.status


def test_one_process_admits_up_to_the_limit():
    admission = Admission(3, LOCAL)
    held = [admission.admit(2)]
    admission.check_capacity()  # 2 of 3 taken: the body may be read
    assert _refused(admission, 2) == 429
    held.append(admission.admit(1))
    with pytest.raises(APIError):
        admission.check_capacity()
    held[0].release()
    assert admission.active == 1
    admission.admit(2)
    assert _refused(admission, 4) == 400  # more than the whole budget


@pytest.fixture
def two_processes(tmp_path):
    path = state_path(str(tmp_path))
    SharedState.create(path, 2)
    states = [SharedState(path, 2, i) for i in range(2)]
    for s in states:
        s.claim()
    yield [SharedLoad(s, str(tmp_path)) for s in states]
    for s in states:
        s.close()


def test_processes_admit_within_one_limit(two_processes):
    a, b = (Admission(3, view) for view in two_processes)
    first = a.admit(2)
    b.check_capacity()  # 2 of 3 taken between them
    assert _refused(b, 2) == 429
    second = b.admit(1)
    for admission in (a, b):
        with pytest.raises(APIError):
            admission.check_capacity()
    first.release()  # a's count drops in the shared row at once
    assert two_processes[1].others_active() == 0
    b.admit(2)
    assert _refused(a, 1) == 429
    second.release()
    assert two_processes[0].others_active() == 2


class _Counted:
    def __init__(self, key: int, inflight: int, ejections: int):
        self.key, self.inflight, self.ejections = key, inflight, ejections


def test_the_local_view_has_no_peers_and_the_shared_one_exchanges(two_processes):
    w = _Counted(worker_key("decode", "x:1"), inflight=3, ejections=1)
    assert LOCAL.exchange([w]) == {} and LOCAL.others_active() == 0
    asyncio.run(LOCAL.run(lambda: pytest.fail("one process has nobody to exchange with")))
    a, b = two_processes
    a.exchange([w])
    seen = b.exchange([])[w.key]
    assert (seen.inflight, seen.ejections) == (3, 1)
    a.retire(w)  # left a's pool: its requests no longer count, its ejections still do
    seen = b.exchange([])[w.key]
    assert (seen.inflight, seen.ejections) == (0, 1)


def test_the_view_is_chosen_from_the_settings(tmp_path):
    one = RouterSettings()
    assert isinstance(load_view(one), LocalLoad) and load_view(one).label == ""
    assert isinstance(LOCAL.metrics(lambda: b""), OwnMetrics)
    SharedState.create(state_path(str(tmp_path)), 2)
    view = load_view(replace(one, processes=2, shared_dir=str(tmp_path), process_index=1))
    try:
        assert isinstance(view, SharedLoad) and view.label == "-p1"
        assert isinstance(view.metrics(lambda: b""), SiblingMetrics)
    finally:
        view.state.close()
