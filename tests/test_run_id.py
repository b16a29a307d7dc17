"""resolve_run_id: argument > COMMSPAN_RUN_ID > TORCHELASTIC_RUN_ID > broadcast > random.

One process only; agreement across real gloo ranks is tested in test_multiprocess.py.
"""

from __future__ import annotations

import re

import pytest

import commspan.session.run_id as run_id_mod
from commspan.session.run_id import resolve_run_id

_ENV = ("COMMSPAN_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No run id in the environment; the broadcast is faked and records what it was offered."""
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    offered: list[str] = []

    def agree(local: str) -> str | None:
        offered.append(local)
        return "agreed-by-broadcast"

    monkeypatch.setattr(run_id_mod, "_agree", agree)
    return offered


def test_argument_wins_over_everything(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit run id is used as is; nothing is read or broadcast."""
    monkeypatch.setenv("COMMSPAN_RUN_ID", "from-commspan-env")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "from-torchrun")
    assert resolve_run_id("explicit") == "explicit"
    assert calls == []


def test_commspan_env_beats_torchelastic(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """COMMSPAN_RUN_ID is preferred to TORCHELASTIC_RUN_ID, and no broadcast happens."""
    monkeypatch.setenv("COMMSPAN_RUN_ID", "from-commspan-env")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "from-torchrun")
    assert resolve_run_id() == "from-commspan-env"
    assert calls == []


def test_torchelastic_env_with_an_attempt_agreed_by_broadcast(
    calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set) its id names the run, with 8 hex digits
    of this attempt agreed by the broadcast: every rank of one attempt alike, each
    restarted attempt a run of its own (torchrun's restart counts differ by node)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "from-torchrun")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert resolve_run_id() == "from-torchrun-agreed-b"
    assert len(calls) == 1


@pytest.mark.parametrize(("count", "expected"), [
    ("0", "from-torchrun"), ("2", "from-torchrun-restart2"), ("x", "from-torchrun")])
def test_each_elastic_restart_is_a_run_of_its_own(
    calls: list[str], monkeypatch: pytest.MonkeyPatch, count: str, expected: str
) -> None:
    """One process (no broadcast to agree through): the restart count tells the
    attempts apart."""
    monkeypatch.setattr(run_id_mod, "_agree", lambda local: None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "from-torchrun")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
    assert resolve_run_id() == expected


def test_a_repeated_step_number_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    """mode.step(0) again (an epoch-local counter) shares step 0's trace: the log says so."""
    from commspan import CommSpanMode

    mode = CommSpanMode()
    with caplog.at_level("WARNING", logger="commspan"), mode:
        for _epoch in range(2):
            for i in range(3):
                with mode.step(i):
                    pass
    warnings = [r for r in caplog.records if "mode.step(0) after mode.step(2)" in r.message]
    assert len(warnings) == 1
    assert "epoch * steps_per_epoch + i" in warnings[0].message


@pytest.mark.parametrize("value", ["", "   ", "none"])
def test_blank_or_none_env_is_ignored(
    calls: list[str], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Empty values and torchrun's "none" placeholder fall through to the next source."""
    monkeypatch.setenv("COMMSPAN_RUN_ID", value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", value)
    assert resolve_run_id() == "agreed-by-broadcast"


def test_env_value_is_stripped(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Surrounding whitespace in the variable is not part of the id."""
    monkeypatch.setenv("COMMSPAN_RUN_ID", "  run-7 \n")
    assert resolve_run_id() == "run-7"


def test_broadcast_beats_random(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without variables, rank 0's random id is offered to the broadcast and its result used."""
    assert resolve_run_id() == "agreed-by-broadcast"
    (offered,) = calls
    assert re.fullmatch(r"[0-9a-f]{32}", offered)


def test_random_without_process_group(calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """When there is nothing to agree with, each call makes a fresh random 32-hex id."""
    monkeypatch.setattr(run_id_mod, "_agree", lambda local: None)
    first, second = resolve_run_id(), resolve_run_id()
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second


def test_agree_is_none_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """_agree does not broadcast (returns None) when torch.distributed is not initialised."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert run_id_mod._agree("00" * 16) is None


class _Dist:
    """What _by_store uses of torch.distributed, for one simulated rank."""

    def __init__(self, store: object, rank: int) -> None:
        import torch.distributed as dist

        self.DistStoreError = dist.DistStoreError
        self._rank = rank
        self.distributed_c10d = type("c10d", (), {"_get_default_store": staticmethod(
            lambda: store)})

    def get_rank(self) -> int:
        return self._rank


def test_the_store_carries_rank_0s_id_and_rank_0_waits_for_nobody(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 0 writes its id in the process group's store and goes on at once (a mode
    entered on rank 0 alone issues no collective that the other ranks would have to
    join: a broadcast hung them); another rank waits for it and reads it; one that
    waits in vain gets no id (its own is used) and says so. A store that cannot do
    that (the fake process group's) hands over to the broadcast."""
    import itertools
    import threading

    import torch.distributed as dist

    store = dist.HashStore()
    mine, theirs = "ab" * 16, "cd" * 16
    got: dict[str, object] = {}
    monkeypatch.setattr(run_id_mod, "_AGREEMENTS", itertools.count())
    waiter = threading.Thread(target=lambda: got.update(
        one=run_id_mod._by_store(_Dist(store, 1), theirs)))
    waiter.start()  # rank 1 waits for key 0
    monkeypatch.setattr(run_id_mod, "_AGREEMENTS", itertools.count())
    assert run_id_mod._by_store(_Dist(store, 0), mine) == (True, mine)  # no wait
    waiter.join(10)
    assert got["one"] == (True, mine)
    # rank 1 alone: rank 0 never writes key 5
    monkeypatch.setattr(run_id_mod, "_AGREEMENTS", itertools.count(5))
    monkeypatch.setattr(run_id_mod, "_WAIT_S", 0.2)
    assert run_id_mod._by_store(_Dist(store, 1), theirs) == (True, None)
    assert "waited 0 s for rank 0's run id" in caplog.text
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert run_id_mod._by_store(_Dist(FakeStore(), 0), mine) == (False, None)
    assert run_id_mod._by_store(_Dist(FakeStore(), 1), mine) == (False, None)


@pytest.mark.parametrize("var", ["COMMSPAN_RUN_ID", "TORCHELASTIC_RUN_ID"])
def test_a_variable_holding_bytes_that_are_not_utf8_gives_an_escaped_run_id(
    calls: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    var: str,
) -> None:
    """os.environ decodes a byte that is not UTF-8 to a lone surrogate: the run id keeps
    it as a ``\\xff`` escape, and the warning names the variable."""
    monkeypatch.setattr(run_id_mod, "_agree", lambda local: None)
    monkeypatch.setenv(var, "run\udcff")  # the bytes b"run\xff"
    with caplog.at_level("WARNING", logger="commspan"):
        assert resolve_run_id() == "run\\xff"
    assert var in caplog.text and "not UTF-8" in caplog.text


def test_a_run_id_argument_utf8_cannot_encode_is_refused_when_the_mode_is_made() -> None:
    """run_id= with a lone surrogate: a ValueError naming the argument and a fix, before
    any training step."""
    from commspan import CommSpanMode

    with pytest.raises(ValueError, match=r"run_id='r\\udcff' is not valid.*run_id='r\\\\xff'"):
        CommSpanMode(run_id="r\udcff")


def test_steps_run_and_export_under_a_run_id_variable_that_is_not_utf8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """COMMSPAN_RUN_ID=$'run\\xff': every step runs (it raised UnicodeEncodeError into the
    loop) and its spans carry the escaped run id."""
    import torch
    from _tracing import attrs, traced_mode
    from torch import nn

    from commspan import semconv

    monkeypatch.setenv("COMMSPAN_RUN_ID", "run\udcff")
    mode, exporter = traced_mode()
    model = nn.Linear(2, 2)
    with mode:
        for i in range(2):
            with mode.step(i):
                model(torch.randn(2, 2)).sum().backward()
    steps = [s for s in exporter.get_finished_spans() if s.name == semconv.SPAN_STEP]
    assert [attrs(s)[semconv.RUN_ID] for s in steps] == ["run\\xff", "run\\xff"]


def test_derive_ids_of_a_run_id_with_a_lone_surrogate() -> None:
    """derive_ids never raises: a lone surrogate is hashed as its UTF-8 sequence."""
    import hashlib

    from commspan.spans import derive_ids

    digest = hashlib.blake2b(b"r\xed\xb3\xbf/step/0", digest_size=24).digest()
    expected = (int.from_bytes(digest[:16], "big"), int.from_bytes(digest[16:], "big"))
    assert derive_ids("r\udcff", "step/0") == expected
