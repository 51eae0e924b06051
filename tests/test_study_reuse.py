"""A search never adopts a stored study of its name that is not its own: another direction, another
problem or arch, or a study someone else made raises and leaves the study as it was."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from fa4tune.environment import kernel_fingerprint
from fa4tune.progress import Progress
from fa4tune.inputs.space import load_space
from fa4tune.searches.storage import open_storage
from fa4tune.searches.study import StudyMismatchError, open_study
from test_cli import fake_gpu, invoke  # noqa: F401  (fake_gpu: the fixture)
from test_search import MISSION

HOW = "choose another --study name or another --storage"


def _open(storage, name, problem=MISSION, arch="sm90"):
    return open_study(storage, name, arch, problem, load_space(arch), kernel_fingerprint(arch, "test_search_fakes"),
                      optuna.samplers.RandomSampler, Progress(quiet=True), "Fake H200")


def _snapshot(storage, name):
    study = optuna.load_study(study_name=name, storage=storage)
    return study.directions, study.user_attrs, [(t.number, t.state, t.params) for t in study.trials]


def test_a_study_with_another_direction_is_refused(tmp_path):
    storage = open_storage(tmp_path / "s.journal")
    optuna.create_study(study_name="mine", storage=storage, direction="maximize")
    before = _snapshot(storage, "mine")
    with pytest.raises(StudyMismatchError, match=f"study 'mine' exists with direction maximize.*{HOW}"):
        _open(storage, "mine")
    assert _snapshot(storage, "mine") == before
    optuna.create_study(study_name="two", storage=storage, directions=["minimize", "minimize"])
    with pytest.raises(StudyMismatchError, match="direction minimize, minimize"):
        _open(storage, "two")


def test_a_study_someone_else_made_is_refused(tmp_path):
    storage = open_storage(tmp_path / "s.journal")
    optuna.create_study(study_name="theirs", storage=storage).optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    before = _snapshot(storage, "theirs")
    with pytest.raises(StudyMismatchError, match=f"'theirs' exists with 2 trial.*not a study of fa4tune search; {HOW}"):
        _open(storage, "theirs")
    assert _snapshot(storage, "theirs") == before
    # an empty study of the name (a process sharing the storage may be writing its facts) is continued
    optuna.create_study(study_name="empty", storage=storage)
    assert _open(storage, "empty").study_name == "empty"


def test_a_study_of_another_problem_or_arch_is_refused_naming_what_differs(tmp_path):
    storage = open_storage(tmp_path / "s.journal")
    mine = _open(storage, "mine")
    mine.set_user_attr("arch", "sm90")
    mine.set_user_attr("problem", MISSION.to_dict())
    assert _open(storage, "mine").study_name == "mine"      # the same problem: continued
    longer = replace(MISSION, seqlen_q=2048, seqlen_k=2048)
    with pytest.raises(StudyMismatchError, match=r"study 'mine' holds another problem: seqlen_q 1024 \(this search: "
                                                 rf"2048\), seqlen_k 1024 \(this search: 2048\); {HOW}"):
        _open(storage, "mine", problem=longer)
    with pytest.raises(StudyMismatchError, match=r"arch 'sm90' \(this search: 'sm100'\)"):
        _open(storage, "mine", arch="sm100")


def test_fa4tune_search_with_a_study_of_another_direction_is_a_one_line_error(tmp_path, fake_gpu):
    path = tmp_path / "s.journal"
    storage = open_storage(path)
    optuna.create_study(study_name="mine", storage=storage, direction="maximize")
    result = invoke("search", "--seqlen", "1024", "--gqa", "4", "--causal", "--trials", "2", "--storage", str(path),
                    "--study", "mine", "--no-db", "--no-peers", "--retime", "0")
    assert result.exit_code == 1
    assert f"Error: study 'mine' exists with direction maximize, but a search minimises the kernel time; {HOW}" \
        in result.stderr
    assert optuna.load_study(study_name="mine", storage=open_storage(path)).trials == []
